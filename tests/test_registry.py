"""The drafter registry: one entry describes a method, and whatever offers, checks, builds,
exports or sizes a method reads it.

The proof of the goal is a toy drafter defined in this file and registered as an entry added to
``localspec/registry.py`` would be (the test replaces the registry's tuple, nothing else): with
no other change, presets accept it, the app offers it, ``Pipeline.engine`` builds and runs it
with the plain greedy output, and export, verify, bench, ``generate --method`` and the memory
estimate take it up.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, run_cli, write_preset
from test_packaging import REPO, _floor

from localspec import registry
from localspec.cli.bench import check_methods, default_methods
from localspec.cli.check import greedy_methods
from localspec.cli.export import export_vllm
from localspec.config import Preset, parse_preset
from localspec.drafters.base import BuildContext
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.errors import PresetError
from localspec.models.hardware import architecture, estimate_preset, weight_bytes
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.registry import DrafterSpec, drafter_spec, method_names, methods_needing
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams
from localspec.ui.layout import method_choices

# ----------------------------------------------------------------------------- a toy drafter


class RecomputeDrafter(Drafter):
    """The draft model's greedy guesses, recomputed from an empty cache at every step: slow,
    and in step with the context without any bookkeeping. Deterministic (q is None)."""

    traits = DrafterTraits("recompute")

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner, self.vocab_size = runner, vocab_size

    def reset(self, keep_cache: bool = False) -> None:
        self.runner.reset()

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        self.runner.reset()
        tokens: list[int] = []
        feed = context
        for _ in range(k):
            logits = self.runner.forward(feed, logits_to_keep=1)[-1][: self.vocab_size]
            tokens.append(int(logits.argmax()))
            feed = tokens[-1:]
        self.runner.reset()
        return Proposal(tokens, None, tuple(1.0 for _ in tokens))


def build_recompute(ctx: BuildContext) -> RecomputeDrafter:
    """The toy's registered build: the preset's draft model, guessing in the target's ids."""
    return RecomputeDrafter(ctx.draft_runner(), ctx.target_runner().vocab_size)


TOY = DrafterSpec("recompute", "draft model, recomputed (test)", f"{__name__}:build_recompute",
                  needs="draft_model", vllm_method="draft_model")
# A head method vLLM lacks, sized by its own estimate (never built here: no head files).
TOY_HEAD = DrafterSpec("toy-head", "toy head (test)", f"{__name__}:build_recompute",
                       needs="head", weight_bytes=lambda target: 1000 * target.hidden_size)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two toys registered: the one change a new drafter makes outside its own file."""
    monkeypatch.setattr(registry, "DRAFTERS", (*registry.DRAFTERS, TOY, TOY_HEAD))


def toy_preset(tmp_path: Path, folders: dict[str, Path], lookup_first: bool = False) -> Preset:
    return load_preset(write_preset(tmp_path, folders["target"], folders["draft"],
                                    method="recompute", k=3, max_new_tokens=24, adaptive=False,
                                    lookup_first=lookup_first))


def head_preset(folders: dict[str, Path], method: str = "toy-head") -> dict:
    return {"name": "toy head", "description": "a head method", "hardware": "cpu",
            "target": {"model": str(folders["target"]), "dtype": "float32"},
            "speculative_config": {"method": method, "model": "someone/toy-head"}}


# ----------------------------------------------------------------------------- the shipped registry


def test_the_shipped_methods_and_their_labels() -> None:
    """The app's method switch offers what it always has, under the same labels."""
    assert method_names() == ("none", "draft_model", "ngram", "suffix", "eagle3", "eagle",
                              "medusa", "auto")
    assert method_choices() == [
        ("preset's method", "preset"), ("none (plain decoding)", "none"),
        ("draft model", "draft_model"), ("n-gram lookup", "ngram"),
        ("suffix tree (this chat and your history)", "suffix"), ("EAGLE-3 head", "eagle3"),
        ("EAGLE head", "eagle"), ("Medusa heads", "medusa"),
        ("Auto: best drafter each step", "auto")]
    assert methods_needing("head") == registry.trainable_methods() == ("eagle3", "eagle", "medusa")
    assert methods_needing("draft_model") == ("draft_model",)
    assert [spec.name for spec in registry.drafters() if not spec.speculative] == ["none"]


def test_every_build_is_a_function_the_pipeline_may_import() -> None:
    """Each lazy reference names a function in a module on a floor below the pipeline (the
    layer order of test_packaging), and every head method can be sized."""
    for spec in registry.drafters():
        if spec.build is None:
            continue
        module, _, function = spec.build.partition(":")
        assert _floor(module) < _floor("localspec.pipeline"), spec.name
        assert callable(getattr(importlib.import_module(module), function)), spec.name
        assert spec.needs != "head" or spec.weight_bytes is not None, spec.name


def test_the_registry_and_config_import_no_torch() -> None:
    """Reading a preset stays cheap: the registry names its builds, it never imports them."""
    code = ("import sys, localspec.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('localspec.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == ("['localspec.config', 'localspec.drafter_set', 'localspec.errors', "
                           "'localspec.registry']")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "x@1"}, "reserves"), ({"name": "hf-x"}, "reserves"),
    ({"build": "module_without_function"}, "module:function"),
    ({"needs": "gpu"}, "needs must be"),
    ({"build": None, "needs": "head"}, "plain decoding")])
def test_a_malformed_entry_is_refused(kwargs: dict, message: str) -> None:
    fields = {"name": "x", "label": "x", "build": "localspec.drafters.ngram:build", **kwargs}
    with pytest.raises(ValueError, match=message):
        DrafterSpec(**fields)


# ----------------------------------------------------------------------------- a new drafter


def test_a_method_is_unknown_until_registered(tmp_path: Path, tiny_folders: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: without its entry the toy is refused by presets and pipeline."""
    with pytest.raises(PresetError, match="method = 'recompute' is not one of"):
        toy_preset(tmp_path, tiny_folders)
    with pytest.raises(PresetError, match="unknown method 'recompute'"):
        drafter_spec("recompute")
    monkeypatch.setattr(registry, "DRAFTERS", (*registry.DRAFTERS, TOY))
    assert toy_preset(tmp_path, tiny_folders).speculative_config.method == "recompute"


@pytest.mark.usefixtures("toy")
def test_a_registered_drafter_is_offered_checked_exported_and_sized(
        tmp_path: Path, tiny_folders: dict[str, Path]) -> None:
    preset = toy_preset(tmp_path, tiny_folders)
    bare = head_preset(tiny_folders, "recompute")
    del bare["speculative_config"]["model"]
    with pytest.raises(PresetError, match=r"method 'recompute' needs 'model' \(the draft model"):
        parse_preset(bare)
    assert ("draft model, recomputed (test)", "recompute") in method_choices()
    assert preset.draft_spec() is not None
    assert export_vllm(preset).speculative_config == {
        "method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_folders["draft"])}
    draft = weight_bytes(architecture(str(tiny_folders["draft"])), "none", "float32")
    assert estimate_preset(preset).draft_weights == draft > 0
    assert "recompute" in default_methods(preset)
    assert check_methods(preset, ["recompute"]) == ["none", "recompute"]


@pytest.mark.usefixtures("toy")
def test_a_registered_head_method_is_checked_exported_and_sized(
        tmp_path: Path, tiny_folders: dict[str, Path]) -> None:
    preset = parse_preset(head_preset(tiny_folders))
    assert preset.draft_spec() is None  # its model is a head, not a model to load
    assert estimate_preset(preset).draft_weights == 1000 * 32  # the tiny target's hidden size
    bare = head_preset(tiny_folders)
    del bare["speculative_config"]["model"]
    with pytest.raises(PresetError, match=r"method 'toy-head' needs 'model' \(the draft head"):
        parse_preset(bare)
    export = export_vllm(preset)
    assert export.speculative_config is None and "--speculative-config" not in export.command
    assert any("'toy-head' has no vLLM equivalent" in note for note in export.notes)
    with pytest.raises(PresetError, match="needs a head made for this target"):
        toy_preset(tmp_path, tiny_folders).drafter_set("toy-head")


@pytest.mark.usefixtures("toy")
def test_a_registered_drafter_runs_with_the_plain_greedy_output(
        tmp_path: Path, tiny_folders: dict[str, Path]) -> None:
    """``Pipeline.engine`` builds it through its registered build; its drafts are verified like
    any other's, so the output is plain decoding's, token for token, in fewer target passes.
    Verify lists it, and lookup-first puts n-gram lookup in front of it as of any model."""
    pipe = Pipeline.load(toy_preset(tmp_path, tiny_folders))
    assert [type(d) for d in pipe.engine("recompute").drafters] == [RecomputeDrafter]
    ids = pipe.encode_prompt("def add(a, b): return a + b\ndef add(", raw=True)
    request = pipe.request(ids)
    plain, toy = pipe.run(request, "none"), pipe.run(request, "recompute")
    assert len(plain.token_ids) == 24
    assert toy.token_ids == plain.token_ids and toy.text == plain.text
    assert toy.stats.accepted > 0 and toy.stats.target_forward_passes < 24
    assert greedy_methods(pipe) == ["draft_model", "ngram", "suffix", "auto", "recompute"]
    lookup = Pipeline(toy_preset(tmp_path, tiny_folders, lookup_first=True), pipe.target,
                      pipe.draft).engine("recompute").drafters
    assert [type(member) for member in lookup] == [NgramDrafter, RecomputeDrafter]


@pytest.mark.usefixtures("toy")
def test_generate_takes_a_registered_method(capsys: pytest.CaptureFixture[str],
                                            presets: dict[str, str]) -> None:
    """``--method`` offers it, and a preset that names none of the draft model it needs is
    refused with exit 2 before anything loads."""
    code, out, err = run_cli(capsys, "generate", "--preset", presets["draft"], "--method",
                             "recompute", "--prompt", "def add", "--raw", "--json")
    assert code == 0, err
    assert json.loads(out)["method"] == "recompute"
    assert_user_error(run_cli(capsys, "generate", "--preset", presets["ngram"], "--method",
                              "recompute", "--prompt", "hi"),
                      "method 'recompute' needs a draft model")
