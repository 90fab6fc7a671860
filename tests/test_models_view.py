"""The app's Models tab without a browser: its renderers escape what the user named, and its
handlers add a path or a Hub repo, find drafters and make a preset that the preset dropdown
then lists; the page builds with the tab in it."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pytest
from hub_server import FakeHub, Repo, serve
from library_files import write_gguf
from test_hub_download import point_at

from localspec.models.describe import describe
from localspec.models.library import LibraryEntry
from localspec.presets import list_preset_names, load_preset
from localspec.ui import models_view


@pytest.fixture(autouse=True)
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setenv("LOCALSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr("localspec.models.library.builtin_entries", list)
    return tmp_path


def test_names_and_reasons_are_escaped(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "<b>bold<i>.gguf")
    entry = LibraryEntry(path.name, "added", str(path), path, describe(path))
    broken = LibraryEntry("<script>x</script>", "added", "x", path, error="<img src=x>")
    page = models_view.library_html([entry, broken])
    assert "<b>bold" not in page and "&lt;b&gt;bold&lt;i&gt;.gguf" in page
    assert "<script>" not in page and "<img" not in page and "&lt;img src=x&gt;" in page


def test_add_find_and_make_a_preset_the_dropdown_lists(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "target.gguf", layers=2, hidden=64)
    draft = write_gguf(tmp_path / "draft.gguf")
    for path in (target, draft):
        notice, table, targets = models_view.add(str(path), "")
        assert notice.startswith("added") and path.name in table
    assert targets["choices"] == ["target.gguf", "draft.gguf"]
    notice, _, _ = models_view.add(str(tmp_path / "nowhere"), "")
    assert notice.startswith("⚠") and "no such file" in notice
    found, drafter, notice = models_view.find("target.gguf")
    assert notice == "" and drafter["choices"] == ["draft.gguf", "ngram"]
    assert drafter["value"] == "draft.gguf" and "draft.gguf" in found
    notice, dropdown = models_view.make("target.gguf", "draft.gguf", "from-the-app",
                                        lambda: [(n, n) for n in list_preset_names()])
    assert "saved preset from-the-app" in notice
    assert ("from-the-app", "from-the-app") in dropdown["choices"]
    assert load_preset("from-the-app").speculative_config.model == str(draft)
    notice, dropdown = models_view.make("target.gguf", "draft.gguf", "from-the-app", list)
    assert "already exists" in notice and dropdown == gr.update()


def test_a_hub_repo_is_downloaded_from_the_tab(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_gguf(tmp_path / "q.gguf").read_bytes()
    with serve(FakeHub({"org/tiny-GGUF": Repo({"tiny-F32.gguf": data})})) as hub:
        point_at(monkeypatch, hub.url)
        notice, table, _ = models_view.add("org/tiny-GGUF", "*.gguf")
    assert notice.startswith("added") and "org/tiny-GGUF/tiny-F32.gguf" in table
    notice, _, _ = models_view.add("org/tiny-GGUF", "*.gguf")  # the Hub gone: still there
    assert notice.startswith("⚠") and "cannot reach the Hub" in notice


def test_the_page_has_the_models_tab(tiny_presets: dict[str, str]) -> None:
    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.handlers import ChatApp
    from localspec.ui.layout import build

    app = ChatApp(ModelHost(warm_up=False), detect_hardware(), tiny_presets["ngram"])
    demo = build(app)
    ids = {c.elem_id for c in demo.blocks.values()}
    assert {"ls-models", "ls-models-add", "ls-models-find", "ls-models-make"} <= ids


def test_the_table_shows_what_the_cache_holds(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As `models list` does: a model served once holds packs in the cache."""
    from localspec.config import ModelSpec
    from localspec.models.loading import load_model

    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "served.gguf")
    models_view.add(str(path), "")
    assert "<td>-</td>" in models_view.refresh()[0]
    load_model(ModelSpec(str(path), dtype="float32", quantization="w8a8"))
    table, _ = models_view.refresh()
    assert "packs" in table and "<th>cache</th>" in table
