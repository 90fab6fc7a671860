"""Pipeline end to end on tiny saved models: a preset TOML naming local folders is loaded, and
every method (none, ngram, draft_model, lookup-first) gives the same greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TOKENIZER_TEXTS, make_tiny_model, perturbed_copy, train_tokenizer

from localspec.models.loading import ModelLoadError
from localspec.pipeline import Pipeline
from localspec.presets import PresetError, load_preset

PRESET = """\
name = "tiny"
description = "tiny random models"
hardware = "cpu"

[target]
model = "{target}"
dtype = "float32"
device = "cpu"

[speculative_config]
method = "draft_model"
model = "{draft}"
num_speculative_tokens = 4
prompt_lookup_max = 3
prompt_lookup_min = 1

[sampling]
max_new_tokens = 30

[localspec]
adaptive_k = false  # the tiny draft costs as much as the target: adaptive k would stop drafting
draft_dtype = "float32"
draft_confidence_threshold = 0.0
lookup_first = {lookup_first}
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Target, a close draft with the same tokenizer, and a draft with another tokenizer."""
    root = tmp_path_factory.mktemp("pipeline")
    target = make_tiny_model(seed=0, vocab_size=300)
    same = train_tokenizer(TOKENIZER_TEXTS)
    out = {}
    for name, model, tokenizer in (
        ("target", target, same),
        ("draft", perturbed_copy(target, seed=4, noise=0.3), same),
        ("foreign", perturbed_copy(target, seed=5, noise=0.3),
         train_tokenizer(["entirely other words", "qqq rrr"])),
    ):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = root / name
    return out


def write_preset(tmp_path: Path, folders: dict[str, Path], draft: str = "draft",
                 lookup_first: bool = False) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(PRESET.format(target=folders["target"], draft=folders[draft],
                                  lookup_first=str(lookup_first).lower()), encoding="utf-8")
    return path


@pytest.mark.parametrize("lookup_first", [False, True])
def test_all_methods_agree_greedy(tmp_path: Path, folders: dict[str, Path],
                                  lookup_first: bool) -> None:
    """Preset -> Pipeline.load -> run: every method yields the plain greedy tokens and text."""
    pipe = Pipeline.load(load_preset(str(write_preset(tmp_path, folders,
                                                      lookup_first=lookup_first))))
    assert pipe.draft is not None
    drafters = pipe.engine("draft_model").drafters
    assert [d.traits.name for d in drafters] == ["ngram", "draft_model"][not lookup_first:]
    ids = pipe.encode_prompt("def add(a, b): return a + b\ndef add(", raw=True)
    request = pipe.request(ids)
    assert request.max_new_tokens == 30 and request.num_speculative_tokens == 4
    results = {method: pipe.run(request, method) for method in ("none", "ngram", "draft_model")}
    plain = results["none"]
    assert len(plain.token_ids) == 30 and plain.finish_reason == "length"
    for method, result in results.items():
        assert result.token_ids == plain.token_ids, method
        assert result.text == pipe.tokenizer.decode(plain.token_ids, skip_special_tokens=True)
        assert result.stats.new_tokens == 30
    assert results["draft_model"].stats.accepted > 0
    assert results["draft_model"].stats.target_forward_passes < 30


def test_request_overrides(tmp_path: Path, folders: dict[str, Path]) -> None:
    """Keyword overrides replace preset values; None keeps them; unknown names are refused."""
    pipe = Pipeline.load(load_preset(str(write_preset(tmp_path, folders))), load_draft=False)
    request = pipe.request([1, 2, 3], temperature=0.5, top_k=None, stop_strings=("x",))
    assert request.sampling.temperature == 0.5 and request.sampling.top_k == 0
    assert request.stop_strings == ("x",)
    with pytest.raises(TypeError, match="unknown request settings: colour"):
        pipe.request([1, 2, 3], colour="blue")


def test_eos_ids_and_missing_draft(tmp_path: Path, folders: dict[str, Path]) -> None:
    """EOS ids come from the tokenizer; draft_model without a loaded draft is a PresetError;
    an unknown method is refused."""
    pipe = Pipeline.load(load_preset(str(write_preset(tmp_path, folders))), load_draft=False)
    assert pipe.tokenizer.eos_token_id in pipe.eos_token_ids()
    with pytest.raises(PresetError, match="needs a draft model"):
        pipe.engine("draft_model")
    with pytest.raises(PresetError, match="unknown method 'beam'"):
        pipe.engine("beam")
    assert pipe.engine("none") is pipe.engine("none")
    assert pipe.engine("none").target is pipe.engine("ngram").target


def test_draft_with_other_tokenizer_is_refused(tmp_path: Path, folders: dict[str, Path]) -> None:
    """Loading a preset whose draft uses another tokenizer fails before any generation."""
    with pytest.raises(ModelLoadError, match="different tokenizer"):
        Pipeline.load(load_preset(str(write_preset(tmp_path, folders, draft="foreign"))))
