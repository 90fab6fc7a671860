"""The app's handlers on tiny random models, in-process, called as Gradio calls them (no
browser): settings the pipeline refuses, failures before and in the middle of an answer, race
mode's refusals and failures, sliders whose ranges come from the config, a start with no model,
and the background audit of the model cache. Anything logged at ERROR fails a test unless it
expects a bug.
"""

from __future__ import annotations

import logging
import math

import gradio as gr
import pytest
from app_helpers import HISTORY, failing_stream, final, is_skip, scripted_stream, settings

from localspec.config import (
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_SPECULATIVE_TOKENS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
)
from localspec.host import ModelHost
from localspec.models.hardware import detect_hardware
from localspec.ui.app import CHAT_OUTPUTS, RACE_OUTPUTS, ChatApp
from localspec.ui.layout import SLIDER_MAX, SLIDERS, build, setting_range

pytestmark = pytest.mark.usefixtures("no_errors_logged")


def test_scripted_stream_says_its_text(tiny: ChatApp) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = scripted_stream(pipe, "def add(a, b):\n    return a + b\n")
    try:
        out = final(list(tiny.chat.send("hello", [], settings())))
    finally:
        del pipe.stream
    assert out["history"][-1] == {"role": "assistant",
                                  "content": "def add(a, b):\n    return a + b\n"}


@pytest.mark.parametrize(("overrides", "named"), [
    ({"temperature": math.nan}, "temperature"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": math.nan}, "seed"),
    ({"k": 0}, "num_speculative_tokens"),
    ({"k": math.nan}, "num_speculative_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
    ({"method": "telepathy"}, "unknown method"),
])
def test_refused_settings_give_the_message_back(tiny: ChatApp, overrides: dict,
                                                named: str) -> None:
    """A value the pipeline refuses: a notice naming it, the user's turn taken back, the text
    back in the box, no traceback (the autouse fixture checks the log)."""
    outputs = list(tiny.chat.send("hello <b>there</b>", HISTORY, settings(**overrides)))
    out = final(outputs)
    assert named in out["notice"] and "⚠" in out["notice"], out["notice"]
    assert out["history"] == HISTORY and out["message"] == "hello <b>there</b>"
    assert "back in the box" in out["notice"]
    assert "hello" not in out["chat"]  # the chat view shows the old conversation only


def test_failure_mid_answer_keeps_the_partial_answer(tiny: ChatApp, expects_bug: None,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 3, RuntimeError("boom"))
    try:
        outputs = list(tiny.chat.send("def add", HISTORY, settings(method="none")))
    finally:
        del pipe.stream
    out = final(outputs)
    history = out["history"]
    assert history[:3] == [*HISTORY, {"role": "user", "content": "def add"}]
    assert history[-1]["role"] == "assistant" and history[-1]["content"].strip()
    assert "The generation failed" in out["notice"] and "server log" in out["notice"]
    assert "boom" not in out["notice"]  # a bug's details go to the log, not to the user
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    # No output ever carried an empty assistant turn.
    for o in outputs:
        turns = dict(zip(CHAT_OUTPUTS, o, strict=True))["history"]
        if not is_skip(turns):
            assert all(m["content"] for m in turns if m["role"] == "assistant")


def test_failure_before_any_token_gives_the_message_back(tiny: ChatApp,
                                                        expects_bug: None) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 0, RuntimeError("boom"))
    try:
        out = final(list(tiny.chat.send("hello", HISTORY, settings())))
    finally:
        del pipe.stream
    assert out["history"] == HISTORY and out["message"] == "hello"
    assert "boom" not in out["notice"] and "server log" in out["notice"]


def test_expected_failure_mid_answer_is_shown_without_a_traceback(tiny: ChatApp) -> None:
    from localspec.errors import ModelLoadError

    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 3, ModelLoadError("the model file went away"))
    try:
        out = final(list(tiny.chat.send("def add", [], settings(method="none"))))
    finally:
        del pipe.stream
    assert "the model file went away" in out["notice"]
    assert out["history"][-1]["role"] == "assistant"


def test_regenerate_refused_brings_the_old_answer_back(tiny: ChatApp) -> None:
    out = final(list(tiny.chat.regenerate(HISTORY, settings(temperature=math.nan))))
    assert out["history"] == HISTORY and "temperature" in out["notice"]
    assert is_skip(out["message"])  # regenerate leaves the box alone


def test_race_refusals(tiny: ChatApp) -> None:
    out = final(list(tiny.race.run("def add", settings())), RACE_OUTPUTS)
    assert "identical: <b>yes</b>" in out["race"]  # greedy: the n-gram run matches plain
    refused = final(list(tiny.race.run("def add", settings(seed=-1))), RACE_OUTPUTS)
    assert "seed" in refused["notice"] and "⚠" in refused["notice"]
    assert "Type a prompt" in final(list(tiny.race.run(" ", settings())), RACE_OUTPUTS)["notice"]


def test_race_failure_mid_run_says_so(tiny: ChatApp, expects_bug: None) -> None:
    pipe = tiny.host.pipeline
    pipe.stream = failing_stream(pipe, 2, RuntimeError("boom"))
    try:
        out = final(list(tiny.race.run("def add", settings())), RACE_OUTPUTS)
    finally:
        del pipe.stream
    assert "The generation failed" in out["notice"] and "identical" not in out["race"]
    assert not tiny.host.generation_lock.locked()


def test_controls_come_from_the_config(tiny: ChatApp) -> None:
    """The sliders' ranges are the config's limits; the adapter builds one Settings."""
    assert setting_range("temperature", 0.05) == (0.0, SLIDER_MAX["temperature"])
    assert SLIDER_MAX["temperature"] < MAX_TEMPERATURE
    assert setting_range("top_k", 1) == (0, SLIDER_MAX["top_k"]) and SLIDER_MAX["top_k"] < MAX_TOP_K
    assert setting_range("max_new_tokens", 1) == (1, SLIDER_MAX["max_new_tokens"])
    assert SLIDER_MAX["max_new_tokens"] <= MAX_NEW_TOKENS
    assert setting_range("num_speculative_tokens", 1) == (1, MAX_SPECULATIVE_TOKENS)
    assert setting_range("top_p", 0.05) == (0.05, 1.0)
    demo = build(tiny)
    sliders = {c.elem_id: c for c in demo.blocks.values() if isinstance(c, gr.Slider)}
    for control, (setting, step, _) in SLIDERS.items():
        slider = sliders[f"ls-{control}"]
        assert (slider.minimum, slider.maximum) == setting_range(setting, step)
    seed = next(c for c in demo.blocks.values() if c.elem_id == "ls-seed")
    assert seed.precision is None  # Gradio's int(round(nan)) would be a traceback
    message = next(c for c in demo.blocks.values() if c.elem_id == "ls-message")
    assert message.lines == 1 and message.max_lines > 1  # Enter sends in Gradio 6.31


def test_no_model_loaded_says_so_and_keeps_the_message() -> None:
    """A start with a preset that cannot load: the page works and says what to do."""
    host = ModelHost()
    assert not host.load("no-such-preset")
    app = ChatApp(host, detect_hardware(), "no-such-preset")
    assert isinstance(build(app), gr.Blocks)
    assert "No model loaded" in app.presets.status() and "unknown preset" in app.presets.status()
    out = final(list(app.chat.send("hello", [], settings())))
    assert "No model is loaded" in out["notice"] and "unknown preset" in out["notice"]
    assert out["history"] == [] and out["message"] == "hello"


def test_background_cache_audit_reports_damage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached model that fails the full check after loading is named in the status line;
    one that passes leaves the status clean."""
    import localspec.host as host_module

    target, draft = (type("Loaded", (), {"name": n})() for n in ("the-target", "the-draft"))
    preset = type("Preset", (), {"name": "tiny"})()
    pipeline = type("Pipe", (), {"target": target, "draft": draft, "preset": preset})()
    found = {"the-target": None, "the-draft": "model.safetensors: SHA-256 differs"}
    monkeypatch.setattr(host_module, "audit_cache", lambda loaded: found[loaded.name])
    host = ModelHost()
    host._pipeline = pipeline
    host._audit_cache(pipeline)
    error = host.status().error
    assert error is not None and "the-draft" in error and "SHA-256 differs" in error
    assert "the-target" not in error
