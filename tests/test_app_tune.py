"""The app's "Tune for this machine" on the tiny n-gram preset: progress while it runs, its
tables at the end, the tuned preset in the dropdown, and a refusal that leaves a user's own
preset of that name alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from localspec.presets import load_preset, user_presets_root
from localspec.training import tuning
from localspec.ui import tuning_view
from localspec.ui.app import ChatApp

pytestmark = pytest.mark.usefixtures("no_errors_logged")

PROMPTS = [{"prompt": "ab ab ab ab", "category": "", "where": "test"},
           {"prompt": "the cat the cat", "category": "", "where": "test"}]


@pytest.fixture(autouse=True)
def small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(tuning_view, "load_prompts", lambda _path: PROMPTS)
    monkeypatch.setattr(tuning_view, "TUNE_TOKENS", 4)
    monkeypatch.setattr(tuning_view, "TUNE_REPEATS", 1)
    monkeypatch.setattr(tuning_view, "POLL_S", 0.01)


def test_tune_shows_progress_then_adds_the_tuned_preset(tiny: ChatApp) -> None:
    updates = list(tuning_view.tune_here(tiny.turns, tiny.presets, "s"))
    key = tiny.host.status().active
    name = tuning.tuned_name(key)
    assert "Tuning" in updates[0][0]
    text, dropdown = updates[-1]
    assert "saved as preset" in text and name in text and "before" in text
    assert name in [value for _, value in dropdown["choices"]]
    assert tuning.settings_of(load_preset(name)).method in tuning.runnable_methods(
        load_preset(key))
    assert not tiny.host.generation_lock.locked()  # a chat may run again


def test_a_name_held_by_the_users_own_preset_is_refused(tiny: ChatApp) -> None:
    name = tuning.tuned_name(tiny.host.status().active)
    mine = user_presets_root() / f"{name}.toml"
    mine.parent.mkdir(parents=True)
    mine.write_text("# mine\n", encoding="utf-8")
    text, dropdown = list(tuning_view.tune_here(tiny.turns, tiny.presets, "s"))[-1]
    assert "already exists" in text and dropdown == {"__type__": "update"}
    assert mine.read_text(encoding="utf-8") == "# mine\n"
    assert not tiny.host.generation_lock.locked()


def test_stop_tuning_saves_nothing(tiny: ChatApp) -> None:
    """Stop tuning (the session's "tune" flag) ends it before its next run: a notice says
    so, no preset is saved and a chat may run again."""
    updates = tuning_view.tune_here(tiny.turns, tiny.presets, "s")
    assert "Tuning" in next(updates)[0]
    assert tiny.host.cancel("s/tune")
    text, dropdown = list(updates)[-1]
    assert "tuning stopped: nothing was saved" in text and dropdown == {"__type__": "update"}
    name = tuning.tuned_name(tiny.host.status().active)
    assert not (user_presets_root() / f"{name}.toml").exists()
    assert not tiny.host.generation_lock.locked()


def test_no_loaded_preset_is_a_notice(tiny: ChatApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start whose preset failed to load: a notice, and the turn is handed back."""
    status = tiny.host.status()
    monkeypatch.setattr(tiny.host, "status", lambda: dataclasses.replace(status, active=None))
    text, dropdown = list(tuning_view.tune_here(tiny.turns, tiny.presets, "s"))[-1]
    assert "No preset is loaded." in text and dropdown == {"__type__": "update"}
    assert not tiny.host.generation_lock.locked()
