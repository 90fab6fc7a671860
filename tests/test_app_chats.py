"""The app saves each conversation as it happens (``localspec.ui.saving``), on tiny random models,
in-process: the question when it is sent, the answer as it streams and when it ends (preset,
settings, speculation summary), a turn taken back removed again, a regenerated answer replacing
the old one, two tabs saving at once, and a store that fails mid-turn leaving the chat working.
The side panel's handlers: tests/test_app_conversations.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from app_helpers import HISTORY, ended, failing_stream, scripted_stream, settings

from localspec.chats.answers import CHAT_SAVE_EVERY_TOKENS
from localspec.chats.store import ChatStore
from localspec.errors import ChatStoreError
from localspec.ui.app import CHAT_OUTPUTS, ChatApp

pytestmark = pytest.mark.usefixtures("no_errors_logged")
LONG = "word " * (3 * CHAT_SAVE_EVERY_TOKENS)


@pytest.fixture
def app(tiny: ChatApp, tmp_path: Path) -> Iterator[ChatApp]:
    """The tiny app saving into a store of the test's own."""
    with ChatStore(tmp_path / "chats.db") as store:
        tiny.chat.store = store
        yield tiny


def saved(app: ChatApp, conversation: int) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.complete) for m in app.chat.store.get(conversation).messages]


def test_a_turn_is_saved_as_it_happens(app: ChatApp) -> None:
    pipe = app.host.pipeline
    pipe.stream = scripted_stream(pipe, LONG)
    try:
        stream = app.chat.send("Tell me words", [], settings(), session="s")
        first = dict(zip(CHAT_OUTPUTS, next(stream), strict=True))
        conversation = first["conversation"]
        assert isinstance(conversation, int)  # the tab learns its id with the first view
        assert saved(app, conversation) == [("user", "Tell me words", True)]
        assert app.chat.store.get(conversation).title == "Tell me words"
        midway = None
        for update in stream:
            history = dict(zip(CHAT_OUTPUTS, update, strict=True))["history"]
            said = history[-1]["content"] if history[-1]["role"] == "assistant" else ""
            if len(said.split()) > 2 * CHAT_SAVE_EVERY_TOKENS and midway is None:
                midway = saved(app, conversation)  # saved while it streams, marked incomplete
    finally:
        del pipe.stream
    assert midway is not None and midway[1][0] == "assistant" and midway[1][2] is False
    assert midway[1][1].startswith("word word") and len(midway[1][1]) < len(LONG)
    (question, answer) = app.chat.store.get(conversation).messages
    assert question.content == "Tell me words"
    expected = pipe.tokenizer.decode(pipe.tokenizer.encode(LONG, add_special_tokens=False))
    assert answer.content == expected and answer.complete and answer.finish_reason == "length"
    assert answer.preset == app.host.status().active  # the preset's key, as --preset takes it
    assert answer.settings["temperature"] == 0.0 and answer.settings["method"] == "ngram"
    assert answer.settings["max_new_tokens"] == 48 and answer.settings["system"] == ""
    stats = answer.stats
    assert stats["method"] == "ngram" and stats["new_tokens"] == answer.stats["new_tokens"] > 0
    assert stats["tokens_per_second"] > 0 and stats["tokens_per_pass"] >= 1.0
    assert set(stats) >= {"acceptance_rate", "drafted", "accepted", "target_passes"}


def test_the_next_message_continues_the_same_conversation(app: ChatApp) -> None:
    first = ended(app.chat.send("def add", [], settings(method="none")))
    conversation = first["conversation"]
    second = ended(app.chat.send("and sub?", first["history"], settings(), "local",
                                 conversation))
    assert second["history"][-2] == {"role": "user", "content": "and sub?"}
    messages = app.chat.store.get(conversation).messages
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m.content for m in messages] == [m["content"] for m in second["history"]]
    assert [s.id for s in app.chat.store.list()] == [conversation]  # one conversation, not two
    assert messages[1].stats["method"] == "none" and messages[3].stats["method"] == "ngram"


def test_a_refused_turn_is_taken_back_from_the_store(app: ChatApp) -> None:
    out = ended(app.chat.send("hello", [], settings(temperature=math.nan)))
    assert out["message"] == "hello" and out["conversation"] is None
    assert app.chat.store.list() == []  # the conversation made for it went with it
    done = ended(app.chat.send("def add", [], settings()))
    conversation = done["conversation"]
    before = saved(app, conversation)
    out = ended(app.chat.send("again", done["history"], settings(seed=math.nan), "local",
                              conversation))
    assert out["conversation"] == conversation and saved(app, conversation) == before


def test_an_empty_or_stopped_answer_leaves_nothing(app: ChatApp) -> None:
    pipe = app.host.pipeline
    pipe.stream = scripted_stream(pipe, "")
    try:
        out = ended(app.chat.send("hello", [], settings()))
    finally:
        del pipe.stream
    assert "empty" in out["notice"] and app.chat.store.list() == []


def test_a_failure_mid_answer_is_saved_as_it_ended(app: ChatApp, expects_bug: None) -> None:
    pipe = app.host.pipeline
    pipe.stream = failing_stream(pipe, 3, RuntimeError("boom"))
    try:
        out = ended(app.chat.send("def add", [], settings(method="none")))
    finally:
        del pipe.stream
    answer = app.chat.store.get(out["conversation"]).messages[-1]
    assert answer.content == out["history"][-1]["content"] and answer.complete
    assert answer.finish_reason == "error"


def test_a_regenerated_answer_replaces_the_old_one(app: ChatApp) -> None:
    first = ended(app.chat.send("def add", [], settings(method="none")))
    conversation = first["conversation"]
    pipe = app.host.pipeline
    pipe.stream = scripted_stream(pipe, "another answer")
    try:
        out = ended(app.chat.regenerate(first["history"], settings(), "local", conversation))
    finally:
        del pipe.stream
    assert saved(app, conversation) == [("user", "def add", True),
                                        ("assistant", out["history"][-1]["content"], True)]
    refused = ended(app.chat.regenerate(out["history"], settings(top_p=0.0), "local",
                                        conversation))
    assert refused["history"] == out["history"]  # the old answer back, and still saved
    assert saved(app, conversation)[-1][1] == out["history"][-1]["content"]


def test_a_conversation_without_an_id_is_saved_whole(app: ChatApp) -> None:
    """A tab whose conversation is not saved (or was deleted in another tab) starts a saved
    one holding everything it shows."""
    out = ended(app.chat.send("more", HISTORY, settings()))
    assert [m["content"] for m in out["history"]] == \
        [c for _, c, _ in saved(app, out["conversation"])]
    app.chat.store.delete(out["conversation"])
    again = ended(app.chat.send("still here?", out["history"], settings(), "local",
                                out["conversation"]))
    assert again["conversation"] != out["conversation"]
    assert len(saved(app, again["conversation"])) == len(again["history"]) == 6


def test_two_tabs_at_once_lose_nothing(app: ChatApp) -> None:
    """Two tabs send at once (the second waits for the first's answer): each question is saved
    when sent, each answer when it comes, each in its own tab's conversation."""
    one = app.chat.send("def add", [], settings(method="none"), session="a")
    two = app.chat.send("hello", [], settings(), session="b")
    outputs = {"a": [next(one), next(one)], "b": [next(two)]}  # a generates, b's is saved
    outputs["b"].append(next(two))
    assert "another tab is generating" in outputs["b"][-1][CHAT_OUTPUTS.index("notice")]
    outputs["a"] += list(one)
    outputs["b"] += list(two)
    done = {name: ended(out) for name, out in outputs.items()}
    assert done["a"]["conversation"] != done["b"]["conversation"]
    for name, question in (("a", "def add"), ("b", "hello")):
        messages = saved(app, done[name]["conversation"])
        assert messages[0] == ("user", question, True)
        assert messages[1] == ("assistant", done[name]["history"][-1]["content"], True)
    assert len(app.chat.store.list()) == 2


def test_a_store_that_fails_leaves_the_chat_working(app: ChatApp,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise ChatStoreError("chats.db: the conversations could not be saved: disk is full")

    monkeypatch.setattr(app.chat.store, "update", broken)
    out = ended(app.chat.send("def add", [], settings(method="none")))
    assert out["history"][-1]["role"] == "assistant"  # answered all the same
    assert "Not saved" in out["notice"] and "disk is full" in out["notice"]
    assert "could not be saved" in caplog.text  # a warning, not an error with a traceback


def test_with_no_store_nothing_is_saved_and_nothing_breaks(tiny: ChatApp) -> None:
    assert tiny.chat.store is None
    out = ended(tiny.chat.send("def add", [], settings()))
    assert out["conversation"] is None and out["history"][-1]["role"] == "assistant"
