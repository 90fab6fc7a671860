"""The saved conversations' side panel (``localspec.ui.conversations``), in-process on tiny random
models: the list newest first and its search, open and continue, new, rename, delete and undo,
export one or all as Markdown and JSON, import (a good file, a bad one), what the page says about
a damaged database or a store it could not open, and the panel on the page."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pytest
from app_helpers import ended, is_skip, settings

from localspec.chats.store import ChatStore, Message
from localspec.ui.app import CHAT_OUTPUTS, ChatApp
from localspec.ui.chat_handlers import ChatHandlers
from localspec.ui.conversations import Conversations
from localspec.ui.layout import build
from localspec.ui.views import PanelView

pytestmark = pytest.mark.usefixtures("no_errors_logged")
PANEL = PanelView._fields


@pytest.fixture
def panel(tiny: ChatApp, tmp_path: Path) -> Iterator[Conversations]:
    with ChatStore(tmp_path / "chats.db") as store:
        tiny.chat.store = store
        yield Conversations(tiny.chat)


def split(outputs: tuple) -> tuple[dict[str, object], dict[str, object]]:
    """A handler's (chat, panel) outputs by name."""
    chat = dict(zip(CHAT_OUTPUTS, outputs[: len(CHAT_OUTPUTS)], strict=True))
    return chat, dict(zip(PANEL, outputs[len(CHAT_OUTPUTS):], strict=True))


def choices(view: PanelView | dict) -> list[tuple[str, int]]:
    radio = view.chats if isinstance(view, PanelView) else view["chats"]
    return [(str(label), value) for label, value in radio.choices]


def two_conversations(panel: Conversations) -> tuple[int, int]:
    chat = panel.chat
    first = ended(chat.send("def add", [], settings(method="none")))["conversation"]
    second = ended(chat.send("hello world", [], settings()))["conversation"]
    return first, second


def test_the_list_newest_first_and_search(panel: Conversations) -> None:
    first, second = two_conversations(panel)
    listed = panel.listing("", second)
    assert [value for _, value in choices(listed)] == [second, first]
    assert choices(listed)[0][0].startswith("hello world · ") and listed.chats.value == second
    assert listed.title == "hello world"
    assert is_skip(panel.listing("", second, retitle=False).title)  # what is typed there stays
    assert [value for _, value in choices(panel.listing("DEF ADD", second))] == [first]
    found = panel.listing("DEF ADD", second)
    assert found.chats.value is None  # the open one is not among those found
    assert choices(panel.listing("no such text")) == []
    page = panel.page()
    assert "Saved on this computer in" in page.status and str(panel.store.path) in page.status


def test_open_and_continue(panel: Conversations) -> None:
    first, second = two_conversations(panel)
    chat, side = split(panel.open(first, "s"))
    history = chat["history"]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[0]["content"] == "def add" and "def add" in chat["chat"]
    assert chat["conversation"] == first and chat["spans"] == [] and is_skip(chat["message"])
    assert "Opened 'def add' (2 messages; answered with" in side["status"]
    assert side["title"] == "def add"
    out = ended(panel.chat.send("more please", history, settings(), "s", first))
    assert out["conversation"] == first
    assert len(panel.store.get(first).messages) == 4
    assert [value for _, value in choices(panel.listing("", first))] == [first, second]


def test_open_says_when_an_answer_was_cut(panel: Conversations) -> None:
    conversation, _ = panel.store.create([Message("user", "q"),
                                          Message("assistant", "half an ans", complete=False)])
    _, side = split(panel.open(conversation))
    assert "1 answer cut short" in side["status"]


def test_new_rename_delete_and_undo(panel: Conversations) -> None:
    first, second = two_conversations(panel)
    chat, side = split(panel.new("s"))
    assert chat["history"] == [] and chat["conversation"] is None and side["chats"].value is None
    renamed = panel.rename(first, "  Adding   numbers ")
    assert "Renamed to 'Adding numbers'" in renamed.status
    assert choices(renamed)[1][0].startswith("Adding numbers · ")
    assert "⚠" in panel.rename(first, "   ").status  # refused, said
    assert "Open a saved conversation" in panel.rename(None, "x").status

    chat, side = split(panel.delete(first, "s"))
    assert chat["history"] == [] and chat["conversation"] is None
    assert "Deleted 'Adding numbers'." in side["status"] and side["deleted"] == first
    assert side["undo"]["visible"] is True
    assert [value for _, value in choices(side)] == [second]
    chat, side = split(panel.undo(first, "s"))
    assert chat["conversation"] == first and len(chat["history"]) == 2
    assert "Restored 'Adding numbers'." in side["status"] and side["undo"]["visible"] is False
    assert side["deleted"] is None
    assert [value for _, value in choices(side)] == [second, first]  # back in its place
    panel.store.delete(second)  # in another tab
    chat, side = split(panel.open(second, "s"))
    assert "⚠ no conversation" in side["status"] and chat["conversation"] is None
    assert "nothing to delete" in split(panel.delete(None))[1]["status"]


def test_export_one_and_all(panel: Conversations) -> None:
    first, _ = two_conversations(panel)
    one = panel.export(first, "md", every=False)
    text = Path(one.file).read_text(encoding="utf-8")
    assert Path(one.file).name == f"localspec-chat-{first}.md"
    assert text.startswith("# def add") and "hello world" not in text
    assert "Exported 1 conversation as Markdown" in one.status
    every = panel.export(None, "json", every=True)
    data = json.loads(Path(every.file).read_text(encoding="utf-8"))
    assert [c["title"] for c in data["conversations"]] == ["def add", "hello world"]
    assert data["conversations"][1]["messages"][1]["stats"]["method"] == "ngram"
    assert "Open a saved conversation" in panel.export(None, "md", every=False).status


def test_import(panel: Conversations, tmp_path: Path) -> None:
    two_conversations(panel)
    exported = panel.export(None, "json", every=True).file
    with ChatStore(tmp_path / "other.db") as other:
        elsewhere = Conversations(ChatHandlers(panel.chat.turns, other))
        view = elsewhere.import_file(exported)
        assert "Imported 2 conversations from localspec-chats.json." in view.status
        assert [label.split(" · ")[0] for label, _ in choices(view)] == \
            ["hello world", "def add"]
        again = elsewhere.import_file(exported)
        assert "Imported 0 conversations" in again.status and "2 already saved" in again.status
    bad = tmp_path / "upload" / "mine.json"
    bad.parent.mkdir()
    bad.write_text('{"format": "localspec-chats", "version": 1, "conversations": '
                   '[{"title": "t", "messages": [{"role": "robot", "content": "x"}]}]}',
                   encoding="utf-8")
    view = panel.import_file(str(bad))
    assert view.status.startswith('<div class="ls-chats-status ls-error">⚠ mine.json: ')
    assert "conversations[0].messages[0].role" in view.status
    assert str(bad.parent) not in view.status  # the upload's temporary folder is no news
    assert is_skip(view.chats) and len(panel.store.list()) == 2


def test_what_the_status_line_escapes(panel: Conversations) -> None:
    conversation, _ = panel.store.create([Message("user", "<img src=x onerror=alert(1)>")])
    _, side = split(panel.open(conversation))
    assert "<img" not in side["status"] and "&lt;img" in side["status"]


def test_a_damaged_database_is_said_on_the_page(tiny: ChatApp, tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    path.write_bytes(b"definitely not SQLite" * 100)
    with ChatStore(path) as store:
        tiny.chat.store = store
        status = Conversations(tiny.chat).page().status
    assert "could not be read; it was kept as" in status and "chats.db.damaged-" in status


def test_no_store_says_why_and_the_panel_still_answers(tiny: ChatApp) -> None:
    conversations = Conversations(tiny.chat, "/x/chats.db: conversations cannot be saved: denied")
    page = conversations.page()
    assert "⚠ Conversations are not being saved: /x/chats.db" in page.status
    assert page.chats.choices == []
    assert "not being saved" in conversations.export(None, "md", every=True).status
    assert "not being saved" in conversations.import_file("/nowhere.json").status
    assert "Open a saved conversation" in conversations.rename(None, "t").status
    chat, _ = split(conversations.open(3))
    assert is_skip(chat["history"])


def test_the_panel_is_on_the_page(tiny: ChatApp, panel: Conversations) -> None:
    demo = build(tiny, conversations=panel)
    ids = {c.elem_id for c in demo.blocks.values()}
    assert {"ls-chats", "ls-chat-search", "ls-chat-new", "ls-chat-title", "ls-chat-rename",
            "ls-chat-delete", "ls-chat-undo", "ls-chat-export", "ls-chat-export-all",
            "ls-chat-import", "ls-chat-file", "ls-chats-status"} <= ids
    radio = next(c for c in demo.blocks.values() if c.elem_id == "ls-chats")
    assert isinstance(radio, gr.Radio)


def test_the_app_starts_without_saving_when_the_folder_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``app.py`` over a data folder it cannot make: no store, the reason handed to the page
    (whose status line says it, as above), a warning in the log, and the app still served."""
    from localspec.host import ModelHost
    from localspec.ui import app as app_module
    from localspec.ui.launch import main

    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    monkeypatch.setenv("LOCALSPEC_DATA", str(blocker / "data"))
    monkeypatch.setattr(ModelHost, "load_async", lambda self, key: None)
    given: dict[str, object] = {}
    launched: list[gr.Blocks] = []

    def build_app(*args: object, **kwargs: object) -> gr.Blocks:
        given.update(kwargs)
        return gr.Blocks()

    monkeypatch.setattr(app_module, "build_app", build_app)
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **_kwargs: launched.append(self))
    main(["--no-browser"])
    assert launched and given["store"] is None
    assert "cannot create the folder" in str(given["store_problem"])
    assert "conversations cannot be saved" in caplog.text


def test_build_app_wires_the_whole_page(tiny_presets: dict[str, str]) -> None:
    """``build_app``, as ``app.py`` calls it, makes the page with every panel wired (the
    launch test above stands it in; this one builds it)."""
    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.app import build_app

    page = build_app(ModelHost(warm_up=False, audit=False), detect_hardware(),
                     tiny_presets["ngram"], store=None, store_problem="nowhere to save")
    assert isinstance(page, gr.Blocks)
