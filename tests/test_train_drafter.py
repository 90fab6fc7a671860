"""``localspec train-drafter`` on tiny targets: the loss falls for every method, the saved head
loads through the drafters' loaders and drafts losslessly, and on a target whose next token is
predictable the trained EAGLE heads are accepted (an off-by-one between the features, the
labels and the drafter would leave them at 1.0 token per pass); the feature cache spares the
target a second pass; an interrupted run resumed gives the uninterrupted run's head;
self-distilled answers are made once; ``--init`` trains a head further; the same command on a
GPU; bad input is one line and exit 2.

Training's parts on their own (corpus, answer cache, unroll, head sizes, gradients) are
``test_train_parts``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import (
    CHAT_TEMPLATE,
    TOKENIZER_TEXTS,
    assert_user_error,
    collect,
    run_cli,
    train_tokenizer,
)
from conftest import decode as toy_decode
from head_models import embeddings_through, llama_target, unit_embeddings
from safetensors.torch import load_file

from localspec.drafters.eagle import EagleDrafter
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_eagle_head, load_medusa_heads
from localspec.drafters.medusa import MedusaDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.runtime.runner import ModelRunner
from localspec.training import train as train_module
from localspec.training.answers import AnswerCache, SelfDistiller
from localspec.training.corpus import encoders, user_documents

METHODS = ("eagle", "eagle3", "medusa")
TINY = ["--tokens", "1024", "--seq-len", "64", "--batch", "4", "--eval-tokens", "16",
        "--eval-k", "4", "--checkpoint-every", "4", "--json"]
PRESET = """name = "{name}"
description = "tiny"
hardware = "cpu"
target = {{ model = "{folder}", dtype = "float32", device = "cpu", quantization = "{quant}" }}
"""


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Python functions with docstrings and a text file."""
    import shlex
    import textwrap

    folder = tmp_path_factory.mktemp("corpus")
    (folder / "textwrap_copy.py").write_text(Path(textwrap.__file__).read_text("utf-8"), "utf-8")
    (folder / "shlex_copy.py").write_text(Path(shlex.__file__).read_text("utf-8"), "utf-8")
    (folder / "notes.md").write_text("# Notes\n\nA line of prose.\n\nAnother one.\n", "utf-8")
    return folder


def _save_target(root: Path, name: str, model: torch.nn.Module) -> tuple[str, str]:
    """Presets of the saved model as it is (float32) and in w8a8 (the int8 CPU forward)."""
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(root / name)
    tokenizer.save_pretrained(root / name)
    presets = []
    for quant in ("none", "w8a8"):
        preset = root / f"{name}-{quant}.toml"
        preset.write_text(PRESET.format(name=name, folder=root / name, quant=quant),
                          encoding="utf-8")
        presets.append(str(preset))
    return presets[0], presets[1]


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, str]:
    """Presets of two 8-layer Llamas (deep enough for EAGLE-3) sharing a byte-level BPE:
    ``random`` (random weights), and ``cycle``, whose greedy next token after any of the
    corpus' 8 most frequent tokens is the next of them in a fixed cycle (every layer adds
    nothing, so its states are the current token's embedding)."""
    root = tmp_path_factory.mktemp("targets")
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = CHAT_TEMPLATE
    encode, _ = encoders(tokenizer, "chat")
    counts = Counter(t for d in user_documents([str(corpus)]) for t in encode(d))
    ring = [t for t, _ in counts.most_common(8)]
    cycle = llama_target(layers=8, vocab=300)
    unit = unit_embeddings(cycle)
    embeddings_through(cycle)
    with torch.no_grad():
        cycle.lm_head.weight.zero_()
        for current, following in zip(ring, ring[1:] + ring[:1], strict=True):
            cycle.lm_head.weight[following] = 20.0 * unit[current]
    random, _ = _save_target(root, "random", llama_target(layers=8, vocab=300))
    cycle_float, cycle_int8 = _save_target(root, "cycle", cycle)
    return {"random": random, "cycle": cycle_float, "cycle-w8a8": cycle_int8}


def train_cli(capsys: pytest.CaptureFixture[str], preset: str, method: str, out: Path,
              corpus: Path, *extra: str) -> dict[str, object]:
    code, stdout, err = run_cli(capsys, "train-drafter", "--method", method, "--preset", preset,
                                "--out", str(out), "--corpus", str(corpus), *TINY, *extra)
    assert code == 0, err
    return json.loads(stdout)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("method", METHODS)
def test_loss_falls_and_the_saved_head_drafts_losslessly(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, targets: dict[str, str],
        corpus: Path, method: str) -> None:
    report = train_cli(capsys, targets["random"], method, tmp_path / "head", corpus,
                       "--steps", "40", "--lr", "1e-2", "--eval-prompts", "2")
    losses = report["training"]["losses"]
    assert len(losses) == 40 and _mean(losses[-4:]) < 0.85 * _mean(losses[:4]), losses
    assert report["acceptance"]["prompts"] == 2 and report["acceptance"]["new_tokens"] == 32
    files = read_head(str(tmp_path / "head"))
    assert [p.name for p in files.files] == ["model.safetensors"]
    assert report["head_bytes"] == sum(t.numel() * t.element_size()
                                       for t in files.tensors.values())
    if method == "eagle3":  # EAGLE-3's published names and id maps
        assert {"midlayer.hidden_norm.weight", "d2t", "t2d", "lm_head.weight"} <= set(
            files.tensors)
        assert files.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    if method == "medusa":  # its training softmax's ids, as vLLM's truncated vocabulary
        token_map = files.tensors["token_map"]
        assert files.config["truncated_vocab_size"] == len(token_map) == report["draft_vocab"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(targets["random"]).parent / "random")
    runner = ModelRunner(model.eval())
    if method == "medusa":
        drafter = MedusaDrafter(load_medusa_heads(files, runner), runner)
    else:
        head, layers = load_eagle_head(files, method, runner)
        drafter = EagleDrafter(head, runner, layers)
    plain = SpeculativeEngine(runner, (), toy_decode, set())
    drafted = SpeculativeEngine(runner, (drafter,), toy_decode, set())
    for prompt in ([5, 17, 33, 2, 80, 41, 9], [60, 3, 91, 44, 12, 12, 70, 8, 25]):
        request = GenerationRequest(prompt, max_new_tokens=24, num_speculative_tokens=4,
                                    adaptive=False)
        tokens, events = collect(drafted, request)
        assert tokens == collect(plain, request)[0]
        assert all(e.drafted for e in events)


@pytest.mark.parametrize(("method", "target"), [("eagle", "cycle"), ("eagle3", "cycle"),
                                                ("eagle3", "cycle-w8a8")])
def test_heads_trained_on_a_predictable_target_are_accepted(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, targets: dict[str, str],
        corpus: Path, method: str, target: str) -> None:
    """The cycle target's drafts are learnable from the features and embeddings the drafter
    reads: the real engine accepts well over one token per pass (measured: 2.4 of 5; a
    head reading features one position off stays near 1.0), on the Hugging Face forward and
    on the int8 CPU one (the CPU presets' w8a8: features, LM head rows and final norm read
    from the int8 decoder)."""
    report = train_cli(capsys, targets[target], method, tmp_path / "head", corpus,
                       "--steps", "60", "--lr", "1e-2", "--eval-prompts", "2", "--tokens", "2048",
                       "--eval-tokens", "24")
    assert report["acceptance"]["mean_accepted_length"] >= 1.8, report["acceptance"]


def test_feature_cache_is_reused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 targets: dict[str, str], corpus: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run on the same target, corpus and layers never runs the target; Medusa
    reads the same layer as EAGLE, so it shares EAGLE's features."""
    first = train_cli(capsys, targets["random"], "eagle", tmp_path / "a", corpus,
                      "--steps", "2", "--eval-prompts", "0")
    assert first["features"] == {**first["features"], "computed": first["chunks"], "reused": 0}
    forwards = []
    original = ModelRunner.forward

    def counted(self: ModelRunner, *args: object, **kwargs: object) -> torch.Tensor:
        forwards.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    second = train_cli(capsys, targets["random"], "medusa", tmp_path / "b", corpus,
                       "--steps", "2", "--eval-prompts", "0")
    assert forwards == [] and second["features"]["computed"] == 0
    assert second["features"]["reused"] == second["chunks"] == first["chunks"]


def test_resume_gives_the_uninterrupted_result(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, targets: dict[str, str],
                                               corpus: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted after step 5 (Ctrl-C saves a checkpoint), resumed to step 8: the same
    head, bit for bit, as 8 steps in one go; the step count continues."""
    args = ["--steps", "8", "--lr", "3e-3", "--eval-prompts", "0"]
    whole = train_cli(capsys, targets["random"], "eagle3", tmp_path / "whole", corpus, *args)
    original = train_module._batch

    def interrupted(*a: object, **k: object) -> object:
        if a[3] == 5:  # the step about to run
            raise KeyboardInterrupt
        return original(*a, **k)

    monkeypatch.setattr(train_module, "_batch", interrupted)
    code, _, err = run_cli(capsys, "train-drafter", "--method", "eagle3", "--preset",
                           targets["random"], "--out", str(tmp_path / "parts"), "--corpus",
                           str(corpus), *TINY, *args)
    assert code == 130 and "checkpoint at step 5 saved" in err
    monkeypatch.setattr(train_module, "_batch", original)
    assert_user_error(run_cli(capsys, "train-drafter", "--method", "eagle3", "--preset",
                              targets["random"], "--out", str(tmp_path / "parts"), "--corpus",
                              str(corpus), *TINY, *args), "add --resume")
    resumed = train_cli(capsys, targets["random"], "eagle3", tmp_path / "parts", corpus,
                        *args, "--resume")
    assert (resumed["training"]["start_step"], resumed["training"]["end_step"]) == (5, 8)
    assert resumed["training"]["losses"] == whole["training"]["losses"][5:]
    a = load_file(tmp_path / "whole" / "model.safetensors")
    b = load_file(tmp_path / "parts" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_self_distillation_answers_with_the_target_once(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, targets: dict[str, str],
        corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--answers target``: each document's answer is the target's own greedy answer to its
    request (what ``Pipeline.run`` gives), made once: a second run reads them all from the
    cache and trains on the same chunks (their features reused too)."""
    args = ["--answers", "target", "--answer-tokens", "12", "--steps", "2",
            "--eval-prompts", "1", "--tokens", "512"]
    first = train_cli(capsys, targets["random"], "eagle3", tmp_path / "a", corpus, *args)
    answers = first["answers"]
    assert answers["made"] == first["documents"] and answers["reused"] == 0
    assert 0 < answers["tokens_made"] <= 12 * answers["made"]
    cached = [json.loads(line) for path in (tmp_path / "cache" / "answers").glob("*.jsonl")
              for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(cached) == answers["made"]
    pipe = Pipeline.load(load_preset(targets["random"]), load_draft=False)
    document = next(d for d in user_documents([str(corpus)])[1:]
                    if AnswerCache.key(d.prompt) == cached[0]["prompt_sha256"])
    alone = pipe.run(pipe.request(pipe.encode_prompt(document.prompt), max_new_tokens=12,
                                  temperature=0.0))
    assert cached[0]["answer"] == alone.text and alone.text != document.text

    def no_generation(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an answer was generated again")

    monkeypatch.setattr(SelfDistiller, "_generate", no_generation)
    second = train_cli(capsys, targets["random"], "eagle3", tmp_path / "b", corpus, *args)
    assert second["answers"]["made"] == 0
    assert second["answers"]["reused"] == answers["made"]
    assert second["features"]["computed"] == 0
    assert second["features"]["reused"] == second["chunks"] == first["chunks"]


def test_init_trains_a_head_further(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    targets: dict[str, str], corpus: Path) -> None:
    """``--init``: training starts from the trained head (its loss where that one ended, its
    draft vocabulary kept), not from new weights; a head of another method is refused."""
    args = ["--steps", "30", "--lr", "1e-2", "--eval-prompts", "0"]
    trained = train_cli(capsys, targets["random"], "eagle3", tmp_path / "a", corpus, *args)
    more = train_cli(capsys, targets["random"], "eagle3", tmp_path / "b", corpus,
                     "--init", str(tmp_path / "a"), "--steps", "4", "--lr", "1e-4",
                     "--eval-prompts", "0")
    first_losses = trained["training"]["losses"]
    assert _mean(more["training"]["losses"]) < 0.85 * _mean(first_losses[:4])
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert torch.equal(a["d2t"], b["d2t"]) and not torch.equal(a["fc.weight"], b["fc.weight"])
    assert_user_error(run_cli(capsys, "train-drafter", "--method", "eagle", "--preset",
                              targets["random"], "--out", str(tmp_path / "c"), "--corpus",
                              str(corpus), *TINY, "--init", str(tmp_path / "a")), "eagle")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
@pytest.mark.parametrize("method", METHODS)
def test_training_runs_unchanged_on_a_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          targets: dict[str, str], corpus: Path,
                                          method: str) -> None:
    """Same command, the target on CUDA: features, batches, generators and the head all on
    the target's device; the result resumes and measures like on the CPU."""
    preset = tmp_path / "cuda.toml"
    text = Path(targets["random"]).read_text("utf-8")
    preset.write_text(text.replace('device = "cpu"', 'device = "cuda"'), encoding="utf-8")
    report = train_cli(capsys, str(preset), method, tmp_path / "head", corpus, "--steps", "4",
                       "--lr", "1e-2", "--eval-prompts", "1")
    resumed = train_cli(capsys, str(preset), method, tmp_path / "head", corpus, "--steps", "6",
                        "--lr", "1e-2", "--eval-prompts", "1", "--resume")
    assert report["training"]["end_step"] == 4 and resumed["training"]["start_step"] == 4
    assert resumed["acceptance"]["new_tokens"] == 16


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("change", "needles"), [
    ({"--method": "eagle4"}, ["unknown --method 'eagle4'", "eagle3"]),
    ({"--corpus": "/nonexistent/texts"}, ["--corpus /nonexistent/texts: no such file"]),
    ({"--corpus": "/dev/zero"}, ["/dev/zero: cannot read the corpus file: it is not a regular"]),
    ({"--corpus": "{tmp}/empty"}, ["no text to train on"]),
    ({"--out": "{tmp}/file/sub"}, ["cannot write there"]),
    ({"--resume": ""}, ["holds no checkpoint to resume"]),
    ({"--preset": None}, ["needs the target: --target MODEL, or --preset"]),
    ({"--answers": "target", "--format": "raw"}, ["--answers target needs requests"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          targets: dict[str, str], corpus: Path,
                                          change: dict[str, str | None], needles: list[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Found before any model loads. ``change``: a flag's value ("" a bare flag, None
    left out)."""
    from localspec.pipeline import Pipeline

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(Pipeline, "load", refuse)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "file").write_text("", encoding="utf-8")
    settings: dict[str, str | None] = {"--method": "eagle3", "--preset": targets["random"],
                                       "--out": str(tmp_path / "out"), "--corpus": str(corpus)}
    settings.update(change)
    args = []
    for flag, value in settings.items():
        if value is not None:
            args += [flag, value.format(tmp=tmp_path)] if value else [flag]
    assert_user_error(run_cli(capsys, "train-drafter", *args), *needles)


def test_resume_with_other_settings_is_refused(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, targets: dict[str, str],
                                               corpus: Path) -> None:
    train_cli(capsys, targets["random"], "eagle", tmp_path / "head", corpus, "--steps", "2",
              "--eval-prompts", "0")
    base = ["train-drafter", "--preset", targets["random"], "--out", str(tmp_path / "head"),
            "--corpus", str(corpus), *TINY, "--steps", "4", "--resume"]
    assert_user_error(run_cli(capsys, *base, "--method", "medusa"),
                      "it trains a eagle head and this run asks for --method medusa")
    assert_user_error(run_cli(capsys, *base, "--method", "eagle", "--batch", "3"),
                      "it was trained with batch = 4 and this run asks for 3")
