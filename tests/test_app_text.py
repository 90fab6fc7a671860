"""Bad text in the app's handlers, on tiny random models: a message, system prompt, conversation
or preset path holding lone surrogates (what a browser can send) is refused with a notice that
says so, the message comes back with U+FFFD in their place, and every view still serializes as
Gradio sends it. Anything logged at ERROR fails a test.
"""

from __future__ import annotations

import orjson
import pytest
from app_helpers import HISTORY, final, is_skip, settings

from localspec.ui.app import RACE_OUTPUTS, SWITCH_OUTPUTS, ChatApp

pytestmark = pytest.mark.usefixtures("no_errors_logged")


def sendable(outputs: list[tuple]) -> None:
    """Every view serializes as Gradio sends it (orjson: UTF-8, no lone surrogates)."""
    for output in outputs:
        orjson.dumps([value for value in output if not is_skip(value)], default=str)


NOT_UNICODE = "hi \ud800 there \udcff"  # lone surrogates: what a browser can send for bad text


def test_message_that_is_not_unicode_is_refused_and_shown_replaced(tiny: ChatApp) -> None:
    """The message comes back into the box with U+FFFD where it held lone surrogates, and a
    notice says so; nothing is sent to the model, and every view can be sent to the page."""
    outputs = list(tiny.chat.send(NOT_UNICODE, HISTORY, settings()))
    sendable(outputs)
    out = final(outputs)
    assert out["message"] == "hi \ufffd there \ufffd"
    assert "2 characters that are not valid Unicode" in out["notice"]
    assert "⚠" in out["notice"] and is_skip(out["history"])


@pytest.mark.parametrize("where", ["system", "history"])
def test_system_prompt_or_history_that_is_not_unicode_is_refused(tiny: ChatApp,
                                                                 where: str) -> None:
    history = [{"role": "user", "content": NOT_UNICODE}] if where == "history" else HISTORY
    system = NOT_UNICODE if where == "system" else ""
    for outputs in (list(tiny.chat.send("hello", history, settings(system=system))),
                    list(tiny.chat.regenerate(history, settings(system=system)))):
        sendable(outputs)
        out = final(outputs)
        needle = "system prompt" if where == "system" else "conversation"
        assert needle in out["notice"] and "not valid Unicode" in out["notice"], out["notice"]
        assert is_skip(out["message"])  # the box keeps what the user typed
    race = list(tiny.race.run(NOT_UNICODE, settings(system=system)))
    sendable(race)
    assert "not valid Unicode" in final(race, RACE_OUTPUTS)["notice"]


def test_preset_path_that_is_not_unicode_is_a_failed_switch(tiny: ChatApp) -> None:
    active = tiny.host.status().active
    outputs = list(tiny.presets.switch("my\udcffpreset.toml"))
    sendable(outputs)
    assert "my\ufffdpreset.toml: no such file" in final(outputs, SWITCH_OUTPUTS)["status"]
    assert tiny.host.status().active == active
