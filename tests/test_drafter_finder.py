"""Compatible drafters, found for a target: draft models whose tokenizer is the target's token
for token (GGUF and folders alike; one token of difference is enough to be refused), heads
trained for it, n-gram, each with its memory; and the user presets made from them, which
``--preset NAME``, ``localspec presets`` and the app's dropdown find after the shipped ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli
from library_files import copy_with_changed_token, one_token_changed, tiny_tokens, write_gguf

from localspec.models.describe import describe
from localspec.models.drafter_finder import find_drafters, vocabulary, vocabulary_difference
from localspec.models.hardware import GIB, Hardware, survey_presets
from localspec.models.library import LibraryEntry, add_path
from localspec.presets import list_preset_names, load_preset, shipped_preset_names

BIG = Hardware(2, 64 * GIB, 32 * GIB)


@pytest.fixture(autouse=True)
def library(own_folders: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty library and cache of this test's own (no built-in models listed)."""
    monkeypatch.setattr("localspec.models.library.builtin_entries", list)
    return own_folders


@pytest.fixture
def models(tmp_path: Path, tiny_folders: dict[str, Path]) -> dict[str, Path]:
    """A GGUF target; a smaller GGUF and a folder with its tokenizer; a GGUF and a folder
    whose tokenizers differ from it in one token (id 100), and a GGUF with padding rows after
    its tokens (which the loader's check counts); all added to the library."""
    tokens, _ = tiny_tokens()
    found = {
        "target": write_gguf(tmp_path / "target.gguf", layers=2, hidden=64),
        "draft": write_gguf(tmp_path / "draft.gguf"),
        "padded": write_gguf(tmp_path / "padded.gguf", padding=4),  # as llama.cpp pads
        "other": write_gguf(tmp_path / "other.gguf", tokens=one_token_changed(tokens)),
        "folder": tiny_folders["draft"],
        "folder-x": copy_with_changed_token(tiny_folders["draft"], tmp_path / "folder-x",
                                            tokens[100]),
    }
    for path in found.values():
        add_path(str(path))
    return found


def test_only_the_same_tokenizer_is_offered(models: dict[str, Path]) -> None:
    report = find_drafters("target.gguf", hardware=BIG)
    offered = {c.key: c for c in report.choices}
    assert set(offered) == {"draft.gguf", "draft", "ngram"}
    refused = dict(report.refused)
    assert set(refused) == {"other.gguf", "folder-x", "padded.gguf"}
    for name in ("other.gguf", "folder-x"):
        assert "a different tokenizer: 1 token id(s) differ, first id 100" in refused[name]
    assert f"4 token id(s) differ, first id {len(tiny_tokens()[0])}" in refused["padded.gguf"]
    draft = offered["draft.gguf"]
    assert draft.method == "draft_model" and draft.model == str(models["draft"])
    assert draft.quantization == "requant-q4k" and report.quantization == "w4a8"
    assert offered["draft"].quantization == "requant-q4k"  # a folder of a native architecture
    assert all(c.estimate is not None and c.fits for c in report.choices)
    small = find_drafters("target.gguf", hardware=Hardware(2, 2**20, 2**20))
    assert not any(c.fits for c in small.choices) and "needs ~" in small.choices[0].reason


def test_the_check_is_token_by_token(models: dict[str, Path]) -> None:
    """Negative control: the same file is the same tokenizer; one renamed token is not, and
    the difference names its id and both texts."""
    entry = LibraryEntry("t", "added", "t", models["target"], describe(models["target"]))
    same = vocabulary(entry)
    assert vocabulary_difference(same, vocabulary(entry)) is None
    other = vocabulary(LibraryEntry("o", "added", "o", models["other"]))
    message = vocabulary_difference(same, other)
    assert "first id 100" in message and "\u00a7" in message
    folder = vocabulary(LibraryEntry("f", "added", "f", models["folder"]))
    assert vocabulary_difference(same, folder) is None  # GGUF and folder compare


def test_a_draft_must_be_smaller_than_its_target(models: dict[str, Path]) -> None:
    report = find_drafters("draft.gguf", hardware=BIG)
    assert "target.gguf" not in {c.key for c in report.choices}
    assert dict(report.refused)["target.gguf"] == "not smaller than the target"


def test_heads_trained_for_the_target_are_offered(models: dict[str, Path], tmp_path: Path
                                                  ) -> None:
    """The built-in heads of the built-in 1.5B; a head of the library whose config names the
    target; not a head made for another target."""
    target = LibraryEntry("qwen2.5-coder-1.5b-instruct", "built-in",
                          "qwen2.5-coder-1.5b-instruct", models["target"],
                          describe(models["target"]))
    for name, base in (("mine-eagle3", "qwen2.5-coder-1.5b-instruct"), ("theirs", "x/y")):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(
            {"architectures": ["LlamaForCausalLMEagle3"], "base_model_name_or_path": base}))
    from localspec.models.library import models_folder_entries

    report = find_drafters(target.name, BIG, [target, *models_folder_entries()])
    methods = {c.key: c.method for c in report.choices}
    assert methods == {"qwen2.5-coder-1.5b-eagle3": "eagle3",
                       "qwen2.5-coder-1.5b-medusa": "medusa", "mine-eagle3": "eagle3",
                       "ngram": "ngram"}
    head = next(c for c in report.choices if c.key == "qwen2.5-coder-1.5b-medusa")
    assert head.estimate is not None and head.estimate.draft_weights > 0


def test_make_preset_writes_a_preset_the_app_and_generate_find(
        models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "models", "drafters", "target.gguf")
    assert code == 0 and "draft.gguf" in out and "not offered: other.gguf" in out, err
    code, out, err = run_cli(capsys, "models", "drafters", "target.gguf", "--make-preset",
                             "tiny-found", "--drafter", "draft.gguf")
    assert code == 0, err
    assert list_preset_names()[-1] == "tiny-found"
    assert list_preset_names()[:-1] == shipped_preset_names()
    preset = load_preset("tiny-found")
    assert preset.target.model == str(models["target"])
    assert preset.speculative_config.model == str(models["draft"])
    assert [r.key for r in survey_presets(BIG)][-1] == "tiny-found"  # the app's dropdown: last
    outputs = []
    for method in ("draft_model", "none"):
        code, out, err = run_cli(capsys, "generate", "--preset", "tiny-found", "--raw",
                                 "--prompt", "def add(a, b):", "--max-new-tokens", "10",
                                 "--method", method, "--json")
        assert code == 0, err
        outputs.append(json.loads(out)["samples"][0]["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 10  # greedy: exactly the target's


@pytest.mark.parametrize(("name", "drafter", "needle"), [
    ("cpu-qwen-coder-draft", None, "shipped preset's name"),
    ("../escape", None, "use letters, digits"),
    ("fine", "other.gguf", "not a drafter offered"),
])
def test_make_preset_refuses_what_it_must(models: dict[str, Path],
                                          capsys: pytest.CaptureFixture[str], name: str,
                                          drafter: str | None, needle: str) -> None:
    args = ["models", "drafters", "target.gguf", "--make-preset", name]
    assert_user_error(run_cli(capsys, *args, *(["--drafter", drafter] if drafter else [])),
                      needle)
    assert list_preset_names() == shipped_preset_names()


def test_a_preset_name_is_taken_once(models: dict[str, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    args = ("models", "drafters", "target.gguf", "--make-preset", "mine")
    assert run_cli(capsys, *args)[0] == 0
    assert_user_error(run_cli(capsys, *args), "already exists")


def test_a_user_file_never_shadows_a_shipped_preset(library: Path) -> None:
    """A file put in the user's presets folder under a shipped name by hand is not listed,
    and that name still loads the shipped preset."""
    folder = library / "data" / "presets"
    folder.mkdir(parents=True)
    (folder / "cpu-qwen-coder-draft.toml").write_text("not toml = [", encoding="utf-8")
    assert list_preset_names() == shipped_preset_names()
    assert load_preset("cpu-qwen-coder-draft").target.model == "qwen2.5-coder-1.5b-instruct"
