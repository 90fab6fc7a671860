"""Stop, Clear and sessions in the app's handlers, on tiny random models: Stop before the first
token and while waiting for the models, the notice a Stop leaves, Stop per tab, Clear waiting
for the running answer, two sessions sharing one model, a preset switch while generating, and
rejected drafts shown, hidden and cleared. Anything logged at ERROR fails a test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from app_helpers import HISTORY, final, is_skip, settings

from localspec.engine.engine import StepEvent
from localspec.ui.app import CHAT_OUTPUTS, RACE_OUTPUTS, SWITCH_OUTPUTS, ChatApp

pytestmark = pytest.mark.usefixtures("no_errors_logged")


def test_stop_before_the_first_token_leaves_no_empty_turn(tiny: ChatApp) -> None:
    """Stop as the generation starts: the engine ends with no token; no empty turn stays."""
    pipe = tiny.host.pipeline
    real = pipe.stream

    def stopped_at_once(*args: object, **kwargs: object) -> Iterator[StepEvent]:
        assert "Stopping" in tiny.turns.stop("s")
        return real(*args, **kwargs)

    pipe.stream = stopped_at_once
    try:
        stream = tiny.chat.send("hello", HISTORY, settings(), session="s")
        first = dict(zip(CHAT_OUTPUTS, next(stream), strict=True))
        assert first["history"][-1] == {"role": "user", "content": "hello"}
        assert "is answering" in first["chat"]
        out = final(list(stream))
    finally:
        del pipe.stream
    assert out["history"] == HISTORY and out["message"] == "hello"
    assert "Stopped before the first token" in out["notice"]
    assert "stopped: cancelled" in out["summary"]


def test_stop_while_waiting_for_the_models(tiny: ChatApp) -> None:
    stream = tiny.chat.send("hello", HISTORY, settings(), session="s")
    next(stream)
    assert "Stopping" in tiny.turns.stop("s")
    out = final(list(stream))
    assert out["history"] == HISTORY and out["message"] == "hello"
    assert "Stopped while waiting" in out["notice"]


def test_draft_rejections_are_shown_and_hidden(tiny: ChatApp,
                                               tiny_presets: dict[str, str]) -> None:
    """A random draft model against the target: rejected drafts certainly occur."""
    assert tiny.host.load(tiny_presets["draft"])
    out = final(list(tiny.chat.send("def add(a, b):", [], settings(k=4))))
    spans = out["spans"]
    rejected = [s for s in spans if s.kind == "rejected"]
    assert rejected, [s.kind for s in spans]
    assert "ls-rejected" in out["tokens"]
    shown = tiny.chat.rerender(spans, True)
    assert shown.count("ls-tok ls-rejected") == len(rejected)
    hidden = tiny.chat.rerender(spans, False)
    assert "ls-rejected" not in hidden
    assert hidden.count("ls-tok ") == len(spans) - len(rejected)
    cleared = dict(zip(CHAT_OUTPUTS, tiny.chat.clear(), strict=True))
    assert cleared["history"] == [] and cleared["spans"] == []
    assert "No messages yet" in cleared["chat"]


def test_two_sessions_and_stop_while_waiting(tiny: ChatApp) -> None:
    first = tiny.chat.send("def add", [], settings(method="none"), session="a")
    next(first), next(first)  # "a" now generates and holds the lock
    second = tiny.chat.send("hello", HISTORY, settings(), session="b")
    next(second)
    waiting = dict(zip(CHAT_OUTPUTS, next(second), strict=True))
    assert "another tab is generating" in waiting["notice"]
    assert tiny.turns.stop("b").count("Stopping") == 1
    out_b = final(list(second))
    assert "Stopped while waiting" in out_b["notice"] and out_b["message"] == "hello"
    assert out_b["history"] == HISTORY
    third = tiny.chat.send("hello", [], settings(max_new_tokens=12), session="c")
    next(third), next(third)  # "c" waits its turn
    out_a = final(list(first))  # "a" was not disturbed
    assert out_a["history"][-1]["role"] == "assistant" and out_a["notice"] == ""
    out_c = final(list(third))  # ... and "c" then answers, as it would alone
    pipe = tiny.host.pipeline
    alone = pipe.run(pipe.request(pipe.encode_chat([{"role": "user", "content": "hello"}]),
                                  max_new_tokens=12, temperature=0.0))
    assert out_c["history"][-1] == {"role": "assistant", "content": alone.text}
    assert not tiny.host.generation_lock.locked() and tiny.host.status().waiting == 0


def test_stop_leaves_the_notice_to_the_answers_last_update(tiny: ChatApp) -> None:
    """Stop's reply and the answer's last update reach the page in either order; a Stop that
    sees the answer end within its wait sends nothing, so "Stopped." is what stays."""
    tiny.turns.stop_wait_s = 30.0
    updates: list[tuple] = []
    stepping = threading.Event()

    def consume() -> None:
        for update in tiny.chat.send("def add", [], settings(method="none", max_new_tokens=400),
                                session="s"):
            updates.append(update)
            if len(updates) >= 3:
                stepping.set()

    answering = threading.Thread(target=consume)
    answering.start()
    assert stepping.wait(60)
    assert is_skip(tiny.turns.stop("s"))
    answering.join(10)
    assert not answering.is_alive()
    out = final(updates)
    assert "Stopped." in out["notice"] and "stopped: cancelled" in out["summary"]
    assert "Nothing to stop" in tiny.turns.stop("s")


def test_stop_is_per_tab_and_clear_waits_for_the_answer(tiny: ChatApp) -> None:
    """The race tab's Stop leaves the chat alone; Clear stops the chat and returns only after
    its last update, so that update cannot bring the old conversation back."""
    chat = tiny.chat.send("def add", [], settings(method="none", max_new_tokens=200), session="s")
    next(chat), next(chat)
    race = tiny.race.run("hello", settings(), session="s")
    next(race)  # waits for the chat
    assert "Stopping" in tiny.turns.stop("s", "race")
    assert "Stopped while waiting" in final(list(race), RACE_OUTPUTS)["notice"]
    order: list[str] = []
    cleared: list[tuple] = []

    def clear() -> None:
        cleared.append(tiny.chat.clear("s"))
        order.append("cleared")

    clearing = threading.Thread(target=clear)
    clearing.start()
    clearing.join(0.3)
    assert clearing.is_alive()  # waits for the running answer ...
    rest = []
    for update in chat:
        rest.append(update)
        order.append("update")
    clearing.join(10)
    assert order[-1] == "cleared" and order.count("update") >= 1  # ... which ended first
    assert "Stopped" in final(rest)["notice"]
    assert dict(zip(CHAT_OUTPUTS, cleared[0], strict=True))["history"] == []
    assert "Nothing to stop" in tiny.turns.stop("s")


def test_preset_switch_while_generating(tiny: ChatApp, tiny_presets: dict[str, str]) -> None:
    """The switch waits for the running answer, which ends complete and unchanged."""
    pipe = tiny.host.pipeline
    ids = pipe.encode_chat([{"role": "user", "content": "def add"}])
    expected = pipe.run(pipe.request(ids, max_new_tokens=12, temperature=0.0), "ngram").text
    stream = tiny.chat.send("def add", [], settings(max_new_tokens=12, method="ngram"))
    next(stream), next(stream)
    switched: list[dict[str, object]] = []
    switch = threading.Thread(target=lambda: switched.append(final(list(
        tiny.presets.switch(tiny_presets["plain"])), SWITCH_OUTPUTS)))
    switch.start()
    out = final(list(stream))
    switch.join(60)
    assert not switch.is_alive() and "tiny none" in switched[0]["status"]
    assert out["history"][-1] == {"role": "assistant", "content": expected}
    assert tiny.host.status().active == tiny_presets["plain"]
    assert "tiny none" in tiny.presets.status()


def test_every_answer_runs_on_the_hosts_engine_thread(tiny: ChatApp,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat and race, asked from different threads (as Gradio's workers ask), all generate on
    the host's one engine thread: no second OpenMP pool (``ModelHost.on_engine``)."""
    pipe, seen = tiny.host.pipeline, []
    real = pipe.stream

    def stream(*args: object, **kwargs: object) -> Iterator[StepEvent]:
        for event in real(*args, **kwargs):
            seen.append(threading.current_thread())
            yield event

    monkeypatch.setattr(pipe, "stream", stream)
    work = [lambda: list(tiny.chat.send("def add", [], settings(), session="a")),
            lambda: list(tiny.chat.send("hello", [], settings(), session="b")),
            lambda: list(tiny.race.run("hello", settings(method="ngram"), session="c"))]
    for job in work:
        thread = threading.Thread(target=job)
        thread.start()
        thread.join(60)
    assert seen and len(set(seen)) == 1 and seen[0].name.startswith("localspec-engine")
