"""``localspec quality`` on tiny saved models: teacher forcing matches a direct forward of the
Hugging Face model (chunk boundaries included), a model against itself agrees everywhere, a
different model does not, every bad flag or text file is one error line and exit 2, and the
shipped texts are long enough to score 2,000+ tokens with a real tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, run_cli, write_preset
from tolerance import forward_atol
from transformers import AutoModelForCausalLM

from localspec.cli.quality import (
    AGREEMENT_GOAL,
    Text,
    compare_row,
    read_texts,
    same_target,
    score_pipeline,
    score_preset,
)
from localspec.config import unquantized_target
from localspec.errors import InputFileError
from localspec.pipeline import Pipeline
from localspec.presets import load_preset

CODE = "def add(a, b):\n    return a + b\n\n\ndef hello():\n    print('hello world')\n" * 12


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crash logs (and anything else cached) go to this test's folder."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def code_file(tmp_path: Path) -> str:
    path = tmp_path / "code.py"
    path.write_text(CODE, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def other_preset(tiny_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> str:
    """A preset whose target is a perturbed copy of the tiny target (same tokenizer)."""
    return write_preset(tmp_path_factory.mktemp("other"), tiny_folders["draft"])


# ----------------------------------------------------------------------------- scoring


def test_teacher_forcing_matches_a_direct_forward(presets: dict[str, str],
                                                  tiny_folders: dict[str, Path]) -> None:
    """Chunked runner scores equal one full forward of the HF model: the KV cache carries the
    context across chunk boundaries (7 does not divide the length)."""
    pipe = Pipeline.load(load_preset(presets["ngram"]), load_draft=False)
    text = Text("code", CODE)
    (chunked,) = score_pipeline(pipe, [text], max_tokens=200, chunk_tokens=7)
    (whole,) = score_pipeline(pipe, [text], max_tokens=200, chunk_tokens=256)
    ids = chunked.token_ids
    assert len(ids) == 200 and chunked.logprob.shape == chunked.argmax.shape == (199,)

    model = AutoModelForCausalLM.from_pretrained(tiny_folders["target"], dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()  # [199, vocab]
    logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    # A log-probability z_i - logsumexp(z) moves by at most twice the logits' rounding.
    reduction = max(model.config.intermediate_size, len(ids), model.config.hidden_size)
    atol = 2 * forward_atol(logits, reduction)
    torch.testing.assert_close(chunked.logprob, logp, atol=atol, rtol=0)
    torch.testing.assert_close(whole.logprob, logp, atol=atol, rtol=0)
    # The tokenizer has fewer tokens than the LM head has rows: the argmax skips the padding.
    real = len(pipe.tokenizer)
    assert real < logits.shape[-1]
    assert torch.equal(chunked.argmax, logits[:, :real].argmax(dim=-1))
    row = compare_row("code", [chunked], [whole])
    assert math.isclose(row["perplexity_served"], math.exp(-logp.double().mean().item()),
                        rel_tol=2 * atol)  # exp(x + d) = exp(x) (1 + d + ...)


def test_a_model_against_itself_agrees_everywhere(presets: dict[str, str]) -> None:
    """Two separate loads of the same target: identical argmaxes and perplexities."""
    preset = load_preset(presets["ngram"])
    texts = [Text("code", CODE)]
    first = score_preset(preset, texts, max_tokens=120, chunk_tokens=32)
    second = score_preset(preset, texts, max_tokens=120, chunk_tokens=32)
    row = compare_row("code", first, second)
    assert row["agreement"] == 1.0 and row["tokens"] == 119
    assert row["perplexity_served"] == row["perplexity_reference"]
    assert row["perplexity_change_pct"] == 0.0 and row["meets_goal"]


def test_cli_against_itself_and_json(capsys: pytest.CaptureFixture[str],
                                     presets: dict[str, str], code_file: str) -> None:
    code, out, _ = run_cli(capsys, "quality",
                           "--preset", presets["ngram"], "--against", presets["draft"],
                           "--text", code_file, "--max-tokens", "64", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["same_model"] is True  # the same target file, dtype and quantization
    (row,) = report["texts"]
    assert row["text"] == "code.py" and row["tokens"] == 63
    assert row["agreement"] == 1.0 and row["meets_goal"] is True
    assert row["perplexity_served"] == row["perplexity_reference"]
    assert report["all"]["tokens"] == 63


def test_a_different_model_disagrees(capsys: pytest.CaptureFixture[str],
                                     presets: dict[str, str], other_preset: str,
                                     code_file: str) -> None:
    code, out, err = run_cli(capsys, "quality",
                             "--preset", other_preset, "--against", presets["ngram"],
                             "--text", code_file, code_file, "--max-tokens", "100", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["same_model"] is False and len(report["texts"]) == 2
    row = report["all"]
    assert row["tokens"] == 2 * 99
    assert row["agreement"] < 1.0 and not row["meets_goal"]
    assert row["perplexity_served"] != row["perplexity_reference"]
    assert "scoring code.py" in err


def test_default_reference_is_bfloat16_unquantized(capsys: pytest.CaptureFixture[str],
                                                   presets: dict[str, str]) -> None:
    """The tiny float32 preset against itself in bfloat16, on the shipped texts (cut to the
    tiny model's 256-token context): a table with one row per text, "all" and the goals."""
    preset = load_preset(presets["ngram"])
    reference = unquantized_target(preset)
    assert (reference.target.dtype, reference.target.quantization) == ("bfloat16", "none")
    assert reference.target.model == preset.target.model and not same_target(preset, reference)
    code, out, err = run_cli(capsys, "quality", "--preset", presets["ngram"])
    assert code == 0, err
    assert "each text is cut to 256" in err
    lines = out.splitlines()
    assert any("bfloat16, no quantization" in line for line in lines)
    rows = [line.split() for line in lines
            if line.startswith(("python_textwrap.py ", "prose_python_docs ", "all "))]
    assert [r[0] for r in rows] == ["python_textwrap.py", "prose_python_docs", "all"]
    assert [int(r[1]) for r in rows] == [255, 255, 510]
    assert all(r[-1] in ("yes", "NO") for r in rows)
    assert f"top-1 agreement >= {AGREEMENT_GOAL:.0%}" in out and "meets goal" in out


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> Pipeline:
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(Pipeline, "load", refuse)


@pytest.mark.usefixtures("no_loading")
def test_bad_text_files_are_exit_2_before_loading(capsys: pytest.CaptureFixture[str],
                                                  presets: dict[str, str],
                                                  tmp_path: Path, code_file: str) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n", encoding="utf-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    for path, needle in ((tmp_path / "gone.txt", "No such file"), (tmp_path, "cannot read"),
                         (empty, "empty"), (blank, "empty"), (latin, "not UTF-8")):
        assert_user_error(run_cli(capsys, "quality",
                                  "--preset", presets["ngram"], "--text", code_file,
                                  "--text", str(path)), str(path), needle)


@pytest.mark.usefixtures("no_loading")
def test_bad_flags_and_presets_are_exit_2_before_loading(capsys: pytest.CaptureFixture[str],
                                                         presets: dict[str, str]) -> None:
    assert_user_error(run_cli(capsys, "quality", "--preset", "no-such-preset"), "unknown preset")
    assert_user_error(run_cli(capsys, "quality", "--preset", presets["ngram"], "--against", "nope"),
                      "unknown preset 'nope'")
    for value in ("1", "0", "-5"):
        assert_user_error(run_cli(capsys, "quality",
                                  "--preset", presets["ngram"], "--max-tokens", value),
                          "--max-tokens must be between 2")


def test_text_of_one_token_is_exit_2(capsys: pytest.CaptureFixture[str],
                                     presets: dict[str, str], tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("a", encoding="utf-8")
    assert_user_error(run_cli(capsys, "quality",
                              "--preset", presets["ngram"], "--text", str(short)),
                      "short.txt", "at least 2")


def test_read_texts_names_files() -> None:
    with pytest.raises(InputFileError, match="cannot read"):
        read_texts(["/no/such/file.txt"])


# ----------------------------------------------------------------------------- shipped texts


def test_shipped_texts_are_long_enough() -> None:
    """Two texts, each ~2,500+ tokens for a Qwen-like BPE (>= 4 characters a token is
    generous for English and code): 2,047 positions scored each at the default --max-tokens."""
    texts = read_texts(None)
    assert [t.name for t in texts] == ["python_textwrap.py", "prose_python_docs"]
    assert all(len(t.content) >= 10_000 for t in texts)
    assert "Python Software Foundation" in texts[0].content[:300]
    assert "Python Software Foundation" in texts[1].content[:300]
    compile(texts[0].content, "textwrap.py", "exec")  # real Python source
