"""The API server saves its chat requests only when asked (``localspec serve --save-chats``): each
one becomes a conversation of its own, its messages then its answer (saved as it streams), with
the preset, settings and speculation summary; completions are not saved; a store that fails
never fails a request; and a store that cannot be opened when saving is asked for is an error
before the server starts. A real uvicorn server over tiny random models, driven by the official
``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from api_helpers import serving
from conftest import assert_user_error, run_cli
from openai import OpenAI

from localspec.chats.store import ChatStore
from localspec.cli.main import build_parser
from localspec.config import DATA_ENV
from localspec.errors import ChatStoreError
from localspec.host import ModelHost

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "def add"}]


@pytest.fixture(scope="module")
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(tiny_presets["draft"]), host.status().error
    return host


@pytest.fixture
def saving(host: ModelHost, tmp_path: Path) -> Iterator[tuple[OpenAI, ChatStore]]:
    with ChatStore(tmp_path / "chats.db") as store, serving(host, store=store) as url:
        yield OpenAI(base_url=url, api_key="unused", max_retries=0), store


def test_saving_is_off_unless_asked() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.save_chats is False
    assert build_parser().parse_args(["serve", "--save-chats"]).save_chats is True


def test_a_chat_request_is_saved_with_its_answer(saving: tuple[OpenAI, ChatStore],
                                                 host: ModelHost) -> None:
    client, store = saving
    reply = client.chat.completions.create(model=host.pipeline.preset.name, messages=MESSAGES,
                                           max_tokens=10, temperature=0)
    (summary,) = store.list()
    messages = store.get(summary.id).messages
    assert summary.title == "hello"
    assert [(m.role, m.content) for m in messages[:-1]] == \
        [(m["role"], m["content"]) for m in MESSAGES]
    answer = messages[-1]
    assert answer.role == "assistant" and answer.content == reply.choices[0].message.content
    assert answer.complete and answer.finish_reason == "length"
    assert answer.preset == host.status().active
    assert answer.settings["max_new_tokens"] == 10 and answer.settings["method"] == "draft_model"
    assert "system" not in answer.settings  # the API's system prompt is a message of its own
    stats = answer.stats
    assert stats["method"] == "draft_model" and stats["new_tokens"] == 10
    assert stats["drafted"] == reply.speculation["drafted"]
    assert stats["tokens_per_pass"] == pytest.approx(reply.speculation["tokens_per_pass"],
                                                     abs=1e-3)


def test_a_streamed_request_is_saved_the_same(saving: tuple[OpenAI, ChatStore]) -> None:
    client, store = saving
    stream = client.chat.completions.create(model=None, messages=MESSAGES[1:2],
                                            max_tokens=8, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    (summary,) = store.list()
    answer = store.get(summary.id).messages[-1]
    assert answer.content == text and answer.complete and answer.stats["new_tokens"] == 8


def test_completions_are_not_saved(saving: tuple[OpenAI, ChatStore]) -> None:
    client, store = saving
    client.completions.create(model=None, prompt="def add", max_tokens=4)
    assert store.list() == []


def test_a_failing_store_fails_no_request(saving: tuple[OpenAI, ChatStore],
                                          monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    client, store = saving

    def broken(*_args: object, **_kwargs: object) -> None:
        raise ChatStoreError("chats.db: the conversations could not be saved: disk is full")

    monkeypatch.setattr(store, "update", broken)
    reply = client.chat.completions.create(model=None, messages=MESSAGES[1:2], max_tokens=6)
    assert reply.choices[0].message.content
    assert "an API request could not be saved" in caplog.text and "disk is full" in caplog.text
    (summary,) = store.list()  # the question and the empty answer row it started with
    assert not store.get(summary.id).messages[-1].complete


def test_a_store_that_cannot_be_opened_stops_serve_before_it_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tiny_presets: dict[str, str], no_loading: None) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    monkeypatch.setenv(DATA_ENV, str(blocker / "data"))

    def no_bind(*_args: object) -> None:
        raise AssertionError("the port was taken before the store was opened")

    monkeypatch.setattr("localspec.cli.serve.bind", no_bind)
    assert_user_error(run_cli(capsys, "serve", "--preset", tiny_presets["ngram"],
                              "--save-chats"), "cannot create the folder", DATA_ENV)
