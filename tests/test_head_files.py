"""Draft head files that cannot be read, and heads by name and by preset: pickles that need more
than tensors are refused without running them, absent, empty, truncated or malformed heads
get a message that says which and why; a built-in head is read from the package (and an
install that lacks it says so); a preset naming a head generates plain decoding's text with
each method, and one for another target is one line of error, exit status 2."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, run_cli, write_preset
from head_models import (
    DRAFT_VOCAB,
    HIDDEN,
    VOCAB,
    eagle1_tensors,
    eagle3_tensors,
    llama_config,
    medusa_config,
    medusa_tensors,
    write_head,
)

from localspec.cli.export import export_vllm
from localspec.config import BUILTIN_HEADS
from localspec.drafters import head_files
from localspec.drafters.head_files import read_head
from localspec.errors import ModelLoadError, PresetError
from localspec.presets import builtin_head_folder, load_preset

# ----------------------------------------------------------------------------- reading head files


class _TouchesAFile:
    """Unpickling this calls Path.touch: code a checkpoint must never get to run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def test_a_pickle_that_needs_more_than_weights_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    tensors = {**eagle1_tensors(HIDDEN, VOCAB), "extra": _TouchesAFile(marker)}
    write_head(tmp_path / "head", llama_config(HIDDEN, VOCAB), tensors, "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as info:
        read_head(str(tmp_path / "head"))
    assert "needs more than tensors" in str(info.value) and "weights_only" in str(info.value)
    assert "Unsupported global" in str(info.value) and not marker.exists()
    # The control: a full unpickling does run it (so the marker above could have appeared).
    torch.load(tmp_path / "head" / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(("setup", "needle"), [
    ("absent", "not found"), ("a file", "is a file"), ("empty", "holds no weights"),
    ("truncated", "damaged or incomplete"), ("not a dict", "not a state dict"),
    ("bad json", "not JSON")])
def test_unreadable_heads_are_refused(tmp_path: Path, setup: str, needle: str) -> None:
    folder = tmp_path / "head"
    if setup == "a file":
        folder = write_head(folder, None, {"x": torch.zeros(1)}, "model.safetensors")
        folder = folder / "model.safetensors"
    elif setup != "absent":
        folder.mkdir()
    if setup == "truncated":
        write_head(folder, None, eagle1_tensors(HIDDEN, VOCAB), "model.safetensors")
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:500])
    if setup == "not a dict":
        torch.save([torch.zeros(2)], folder / "medusa_lm_head.pt")
    if setup == "bad json":
        write_head(folder, None, medusa_tensors(HIDDEN, VOCAB), "medusa_lm_head.pt")
        (folder / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=needle):
        read_head(str(folder))


def test_a_builtin_head_is_read_from_the_package(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in head's name reads the package's folder; an install that lacks it says so
    (and what to do) instead of trying the Hub; export-vllm gives vLLM the folder."""
    name = next(iter(BUILTIN_HEADS))
    folder = write_head(tmp_path / name, medusa_config(), medusa_tensors(HIDDEN, VOCAB),
                        "medusa_lm_head.safetensors")
    monkeypatch.setattr(head_files, "builtin_head_folder", lambda _: folder)
    files = read_head(name)
    assert files.folder == folder and "0.0.linear.weight" in files.tensors
    monkeypatch.setattr(head_files, "builtin_head_folder", lambda _: tmp_path / "gone")
    with pytest.raises(ModelLoadError, match=r"missing from this install.*reinstall"):
        read_head(name)
    for shipped in BUILTIN_HEADS:  # the real ones ship, each with a preset
        assert (builtin_head_folder(shipped) / "config.json").is_file()
    for preset_name, head in (("cpu-qwen-coder-eagle", name),
                              ("cpu-qwen-coder-medusa", "qwen2.5-coder-1.5b-medusa")):
        preset = load_preset(preset_name)
        assert preset.speculative_config.model == head
        export = export_vllm(preset)
        assert export.speculative_config["model"] == str(builtin_head_folder(head))
        assert any("vLLM cannot load" in note for note in export.notes) == ("medusa" in head)


# ----------------------------------------------------------------------------- end to end


def test_presets_with_heads_end_to_end(tmp_path: Path, tiny_folders: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset naming a head folder: `generate` with each method, alone or behind n-gram
    lookup, prints the plain greedy text; a head for another target is one line of error,
    exit status 2."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    vocab = 300  # tiny_folders' target: a 2-layer Qwen2 with a 300-token tokenizer
    heads = {
        "eagle": write_head(tmp_path / "eagle", llama_config(HIDDEN, vocab),
                            eagle1_tensors(HIDDEN, vocab), "pytorch_model.bin"),
        "eagle3": write_head(tmp_path / "eagle3", llama_config(
            HIDDEN, vocab, draft_vocab_size=DRAFT_VOCAB,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}),
            eagle3_tensors(HIDDEN, vocab, DRAFT_VOCAB), "model.safetensors"),
        "medusa": write_head(tmp_path / "medusa", medusa_config(), medusa_tensors(HIDDEN, vocab),
                             "medusa_lm_head.pt"),
    }
    plain = run_cli(capsys, "generate", "--preset", write_preset(
        tmp_path, tiny_folders["target"], method="none", max_new_tokens=12), "--prompt", "hi")
    assert plain[0] == 0, plain[2]
    for (method, folder), lookup_first in itertools.product(heads.items(), (False, True)):
        preset = write_preset(tmp_path, tiny_folders["target"], folder, method=method,
                              max_new_tokens=12, adaptive=False, lookup_first=lookup_first)
        code, out, err = run_cli(capsys, "generate", "--preset", preset, "--prompt", "hi")
        assert code == 0 and out == plain[1], (method, lookup_first, err)
        assert f"[{method}] 12 tokens" in err
    prompts = tmp_path / "prompts.jsonl"  # the built-in ones overflow the tiny model's context
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "add two numbers"}\n', encoding="utf-8")
    code, out, err = run_cli(capsys, "verify", "--preset", preset, "--prompts", str(prompts))
    assert code == 0 and "PASSED" in out and f" {method} " in out, err  # the head is checked
    wrong = write_head(tmp_path / "wrong", medusa_config(), medusa_tensors(48, vocab),
                       "medusa_lm_head.pt")
    preset = write_preset(tmp_path, tiny_folders["target"], wrong, method="medusa")
    assert_user_error(run_cli(capsys, "generate", "--preset", preset, "--prompt", "hi"),
                      "hidden size 48", str(wrong))


def test_a_head_method_in_a_preset(tmp_path: Path, tiny_folders: dict[str, Path]) -> None:
    """``model`` names the head, not a draft model to load; the method is available only in a
    preset set up for it; export-vllm passes it on as vLLM's speculative_config."""
    head = tmp_path / "some-head"
    preset = load_preset(write_preset(tmp_path, tiny_folders["target"], head, method="eagle3"))
    assert preset.draft_spec() is None
    preset.drafter_set("eagle3")
    with pytest.raises(PresetError, match="set up for method 'eagle3'"):
        preset.drafter_set("medusa")
    drafting = load_preset(write_preset(tmp_path, tiny_folders["target"], tiny_folders["draft"]))
    with pytest.raises(PresetError, match="method 'eagle' needs a head"):
        drafting.drafter_set("eagle")
    assert export_vllm(preset).speculative_config == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": str(head)}
