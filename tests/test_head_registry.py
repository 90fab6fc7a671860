"""Head methods are described in the registry (``registry.HeadSpec``: label, loader, trainer,
config marks), and the finder, the head loader and ``train-drafter`` read it.

The proof is ``toy_head``: a head method whose head, drafter, loader and trainer live in that
one module, registered as an entry added to ``localspec/registry.py`` would be (the test
replaces the registry's tuple, nothing else). With no other change, a folder of its heads is
told apart as a head and offered for its target, ``train-drafter --method toy-residual``
trains and saves one, measures it through the pipeline, and ``head_layouts.load_head`` reads it
back into a drafter whose output is the plain greedy output. Without its entry, each of those
refuses it (the negative controls).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import toy_head
from conftest import (
    CHAT_TEMPLATE,
    TOKENIZER_TEXTS,
    assert_user_error,
    collect,
    decode,
    run_cli,
    train_tokenizer,
)
from head_models import llama_target
from library_files import write_gguf

from localspec import registry
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_head
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.errors import PresetError
from localspec.models.describe import describe
from localspec.models.drafter_finder import find_drafters
from localspec.models.hardware import GIB, Hardware
from localspec.models.library import LibraryEntry, add_path, models_folder_entries
from localspec.runtime.runner import ModelRunner
from localspec.training.heads import HeadTrainer, head_trainer

BIG = Hardware(2, 64 * GIB, 32 * GIB)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy's entry added: the one change a new head drafter makes outside its module."""
    monkeypatch.setattr(registry, "DRAFTERS", (*registry.DRAFTERS, toy_head.ENTRY))


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty library and cache of this test's own (no built-in models listed)."""
    from huggingface_hub import constants

    monkeypatch.setenv("LOCALSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr("localspec.models.library.builtin_entries", list)
    return tmp_path


# ----------------------------------------------------------------------------- the shipped heads


def _resolve(reference: str) -> object:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("method", ["eagle3", "eagle", "medusa"])
def test_every_shipped_head_is_described(method: str) -> None:
    """Each head method names a loader and a trainer that import, and its files' marks tell
    its folders apart (EAGLE-3's "Eagle3" over EAGLE's "Eagle", whatever the order)."""
    head = registry.head_spec(method)
    assert callable(_resolve(head.load))
    trainer = head_trainer(method)
    assert all(callable(getattr(trainer, name)) for name in (
        "feature_layers", "new_head", "trained_vocabulary", "loss", "published_tensors",
        "config")) and isinstance(trainer.vocabulary_role, str)
    marks = [{"architectures": [f"Llama{mark}"]} for mark in head.architectures]
    marks += [{key: 1} for key in head.config_keys]
    assert marks and all(registry.head_method(config) == method for config in marks)
    assert registry.head_method({"method": method}) == method


def test_head_marks() -> None:
    assert registry.head_method({"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    assert registry.head_method({"architectures": ["LlamaForCausalLM"]}) is None
    assert registry.head_method({"method": "ngram", "model_type": "llama"}) is None
    with pytest.raises(PresetError, match="drafts without a head"):
        registry.head_spec("ngram")
    with pytest.raises(ValueError, match="for needs='head'"):
        registry.DrafterSpec("x", "x", "m:f", head=toy_head.ENTRY.head)
    with pytest.raises(ValueError, match="module:attribute"):
        registry.HeadSpec("x", "no_function")


# ----------------------------------------------------------------------------- a new head method


def test_a_registered_head_is_told_apart_and_offered(library: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder marked as the toy's is a head for its target (``describe``), and the finder
    offers it with the toy's method and its registered size; unregistered, it is neither."""
    target_path = write_gguf(library / "target.gguf", layers=2, hidden=64)
    add_path(str(target_path))
    folder = library / "models" / "mine-toy"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": [toy_head.ARCHITECTURE], "base_model_name_or_path": "target.gguf"}))
    target = LibraryEntry("target.gguf", "added", str(target_path), target_path,
                          describe(target_path))

    def offered() -> dict[str, str]:
        report = find_drafters(target.name, BIG, [target, *models_folder_entries()])
        return {c.key: c.method for c in report.choices}

    assert "mine-toy" not in offered()
    monkeypatch.setattr(registry, "DRAFTERS", (*registry.DRAFTERS, toy_head.ENTRY))
    assert describe(folder).head_for == "target.gguf"
    assert offered()["mine-toy"] == toy_head.METHOD
    report = find_drafters(target.name, BIG, [target, *models_folder_entries()])
    choice = next(c for c in report.choices if c.key == "mine-toy")
    assert choice.estimate is not None and choice.estimate.draft_weights == 2 * 64**2


def _target_preset(root: Path) -> tuple[str, Path]:
    """A preset of a saved 4-layer random Llama with a chat template; its folder."""
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = CHAT_TEMPLATE
    folder = root / "target"
    llama_target(layers=4, vocab=300).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    preset = root / "target.toml"
    preset.write_text(f'name = "toy target"\ndescription = "tiny"\nhardware = "cpu"\n'
                      f'target = {{ model = "{folder}", dtype = "float32", device = "cpu", '
                      'quantization = "none" }\n', encoding="utf-8")
    return str(preset), folder


def test_train_drafter_trains_saves_and_loads_a_registered_head(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``train-drafter`` trains the toy through its registered trainer (the loss falls), saves
    it, measures it through the pipeline's registered build, and ``load_head`` reads it back
    into a drafter that drafts losslessly. Unregistered, ``--method`` refuses it."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    preset, folder = _target_preset(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text(Path(json.__file__).read_text("utf-8"), "utf-8")
    args = ["train-drafter", "--method", toy_head.METHOD, "--preset", preset, "--out",
            str(tmp_path / "head"), "--corpus", str(corpus), "--tokens", "1024", "--seq-len",
            "64", "--batch", "4", "--steps", "30", "--lr", "3e-2", "--eval-prompts", "1",
            "--eval-tokens", "16", "--eval-k", "2", "--json"]
    assert_user_error(run_cli(capsys, *args), f"unknown --method '{toy_head.METHOD}'")
    with pytest.raises(PresetError, match="unknown method"):
        head_trainer(toy_head.METHOD)

    monkeypatch.setattr(registry, "DRAFTERS", (*registry.DRAFTERS, toy_head.ENTRY))
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    losses = report["training"]["losses"]
    assert len(losses) == 30 and sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    assert report["acceptance"]["prompts"] == 1  # built by the pipeline from the registry
    files = read_head(str(tmp_path / "head"))
    assert files.config["architectures"] == [toy_head.ARCHITECTURE]
    assert registry.head_method(files.config) == toy_head.METHOD

    from transformers import AutoModelForCausalLM

    runner = ModelRunner(AutoModelForCausalLM.from_pretrained(folder).eval())
    head, layers = load_head(files, toy_head.METHOD, runner)
    assert isinstance(head, toy_head.ToyHead) and layers == (runner.num_layers,)
    assert head.proj.weight.abs().sum() > 0  # trained, not the zero start
    plain = SpeculativeEngine(runner, (), decode, set())
    drafted = SpeculativeEngine(runner, (toy_head.ToyDrafter(head, runner),), decode, set())
    request = GenerationRequest([5, 17, 33, 2, 80, 41, 9], max_new_tokens=16,
                                num_speculative_tokens=1, adaptive=False)
    tokens, events = collect(drafted, request)
    assert tokens == collect(plain, request)[0] and all(e.drafted for e in events)


def test_the_toy_trainer_has_the_protocols_methods() -> None:
    """The protocol ``train-drafter`` calls is all a trainer must have."""
    names = {name for name in dir(HeadTrainer) if not name.startswith("_")}
    assert names <= set(dir(toy_head.TRAINER)), names - set(dir(toy_head.TRAINER))
    assert torch.equal(toy_head.TRAINER.trained_vocabulary(
        toy_head.ToyHead(4, torch.tensor([1, 3])), torch.tensor([0])), torch.tensor([1, 3]))
