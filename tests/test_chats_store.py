"""The saved conversations' store (``localspec.chats``): the file (WAL, schema version,
migrations from version 1), conversations (newest first, rename, delete and undo, purge,
search), answers saved as they stream, two threads and two processes writing at once, and a
process killed mid-answer. Damaged files: tests/test_chats_damage.py."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from chats_worker import QUESTION, WORD

from localspec.chats import schema
from localspec.chats.answers import AnswerSaver
from localspec.chats.store import (
    CHAT_TITLE_FROM_MESSAGE_CHARS,
    MAX_CHAT_TITLE_CHARS,
    ChatStore,
    Message,
    title_from,
)
from localspec.errors import ChatNotFoundError, ChatStoreError

WORKER = Path(__file__).resolve().parent / "chats_worker.py"


class Clock:
    """A clock the test moves (seconds)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def user(text: str) -> Message:
    return Message("user", text)


def test_a_new_file_is_wal_at_the_latest_version(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "folder" / "chats.db"
    with ChatStore(path) as store:
        assert store.set_aside_to is None
        conn = store._conn
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION >= 1
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        store.create([user("hi")])
    assert Path(f"{path}-wal").exists() or path.stat().st_size > 0


def test_a_version_1_file_migrates_step_by_step(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of the first release (version 1, with data) opened by a release with one more
    migration is brought to the new version with its data; a migration that fails leaves the
    file at its version, whole, set aside (a fresh file fails too: no saving, said so)."""
    path = tmp_path / "chats.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(conn, upto=1) == 0
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    conn.close()
    with ChatStore(path) as store:
        conversation, _ = store.create([user("from the first release")])
    second = ("ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",
              "UPDATE conversations SET pinned = 1")
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS[:1], second))
    with ChatStore(path) as store:
        conn = store._conn
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        assert conn.execute("SELECT pinned FROM conversations").fetchall() == [(1,)]
        assert store.get(conversation).messages[0].content == "from the first release"

    broken = ("ALTER TABLE conversations ADD COLUMN starred INTEGER",
              "UPDATE no_such_table SET x = 1")
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS[:2], broken))
    with pytest.raises(ChatStoreError, match="fresh database fails too"):
        ChatStore(path)  # the migration fails on the file, and on a fresh one: no saving
    (aside,) = tmp_path.glob("chats.db.damaged-*[0-9]")
    kept = sqlite3.connect(aside)
    assert kept.execute("PRAGMA user_version").fetchone()[0] == 2  # rolled back as a whole
    columns = {row[1] for row in kept.execute("PRAGMA table_info(conversations)")}
    assert "starred" not in columns and "pinned" in columns
    assert kept.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 1
    kept.close()


def test_conversations_newest_first_rename_delete_undo(tmp_path: Path) -> None:
    clock = Clock()
    with ChatStore(tmp_path / "chats.db", clock=clock) as store:
        first, _ = store.create([user("First question\nmore")])
        clock.now += 1
        second, _ = store.create([user("  Second   question  ")])
        assert [s.title for s in store.list()] == ["Second question", "First question"]
        clock.now += 1
        store.append(first, Message("assistant", "an answer"))
        assert [s.id for s in store.list()] == [first, second]  # the last message counts
        assert store.list()[0].messages == 2
        assert store.rename(second, "  My\n title ") == "My title"
        assert store.get(second).title == "My title"
        store.delete(first)
        assert [s.id for s in store.list()] == [second]
        assert not store.exists(first)
        with pytest.raises(ChatNotFoundError, match="deleted"):
            store.get(first)
        with pytest.raises(ChatNotFoundError):
            store.append(first, user("into a deleted one"))
        store.restore(first)
        assert store.get(first).messages[1].content == "an answer"
        store.delete(first)
        assert store.purge(store._now() - 1) == 0  # deleted just now: kept
        assert store.purge(store._now() + 1) == 1
        with pytest.raises(ChatNotFoundError):
            store.restore(first)
        remaining = store._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        assert remaining == 1  # the purged one's messages went with it


def test_deleted_conversations_are_purged_a_week_later(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "chats.db"
    with ChatStore(path, clock=clock) as store:
        gone, _ = store.create([user("old")])
        store.delete(gone)
    clock.now += 6 * 24 * 3600
    with ChatStore(path, clock=clock) as store:
        store.restore(gone)
        store.delete(gone)
    clock.now += 8 * 24 * 3600
    with ChatStore(path, clock=clock) as store, pytest.raises(ChatNotFoundError):
        store.restore(gone)


def test_titles_and_messages_are_checked(tmp_path: Path) -> None:
    with ChatStore(tmp_path / "chats.db") as store:
        conversation, _ = store.create([user("x")])
        for bad, why in (("   ", "empty"), ("x" * (MAX_CHAT_TITLE_CHARS + 1), "200 characters"),
                         ("bad \udc80", "not UTF-8")):
            with pytest.raises(ChatStoreError, match=why):
                store.rename(conversation, bad)
        with pytest.raises(ChatStoreError, match="role"):
            store.append(conversation, Message("tool", "x"))
        with pytest.raises(ChatStoreError, match="lone surrogate"):
            store.append(conversation, user("\ud800"))
        assert len(store.get(conversation).messages) == 1  # nothing half-written
    long = "word " * 100
    assert len(title_from([user(long)])) == CHAT_TITLE_FROM_MESSAGE_CHARS
    assert title_from([Message("assistant", "a"), user("\n\n  the second line\nthird")]) == \
        "the second line"
    assert title_from([]) == "New conversation"


def test_search_is_a_substring_in_any_case(tmp_path: Path) -> None:
    with ChatStore(tmp_path / "chats.db") as store:
        german, _ = store.create([user("Die STRASSE"), Message("assistant", "ok")])
        percent, _ = store.create([user("100% sure"), Message("assistant", "Ünïcode ÉTÉ")])
        store.create([user("nothing here")])
        assert [s.id for s in store.list("straße")] == [german]  # casefold: ß = ss
        assert [s.id for s in store.list("%")] == [percent]  # no LIKE wildcards
        assert [s.id for s in store.list("été")] == [percent]  # in an answer
        assert [s.id for s in store.list("die s")] == [german]  # in a title, across words
        assert len(store.list("")) == 3 and store.list("absent") == []


def test_an_answer_is_saved_as_it_streams(tmp_path: Path) -> None:
    clock = Clock(0.0)
    with ChatStore(tmp_path / "chats.db") as store:
        conversation, _ = store.create([user("q")])
        saver = AnswerSaver(store, conversation, preset="p", settings={"temperature": 0.0},
                            clock=clock, every_tokens=4, every_s=0.5)
        saved = lambda: store.get(conversation).messages[-1]  # noqa: E731
        assert saved().content == "" and not saved().complete
        assert not saver.update("a", 1) and saved().content == ""  # not due yet
        assert saver.update("a b c d", 4) and saved().content == "a b c d"
        clock.now += 0.6
        assert saver.update("a b c d e", 5) and saved().content == "a b c d e"  # time's up
        assert not saver.update("a b c d e f", 6)
        saver.finish("a b c d e f g", "length", {"method": "ngram", "acceptance_rate": 0.5})
        answer = saved()
        assert (answer.content, answer.complete, answer.finish_reason) == \
            ("a b c d e f g", True, "length")
        assert answer.preset == "p" and answer.settings == {"temperature": 0.0}
        assert answer.stats == {"method": "ngram", "acceptance_rate": 0.5}


def test_a_regenerated_answer_replaces_the_old_one(tmp_path: Path) -> None:
    with ChatStore(tmp_path / "chats.db") as store:
        conversation, _ = store.create([user("q1"), Message("assistant", "a1"), user("q2"),
                                        Message("assistant", "old a2")])
        saver = AnswerSaver(store, conversation, preset=None, settings=None)
        saver.update("new", 100)
        assert [m.content for m in store.get(conversation).messages][-2:] == ["old a2", "new"]
        saver.finish("new a2", "stop", None, replaces_earlier=True)
        assert [m.content for m in store.get(conversation).messages] == \
            ["q1", "a1", "q2", "new a2"]


def test_two_threads_and_two_stores_lose_nothing(tmp_path: Path) -> None:
    """Two threads on one store and two on a second store (another connection) append to one
    conversation at once: every message is there, numbered one after the other."""
    path = tmp_path / "chats.db"
    count = 100
    with ChatStore(path) as one, ChatStore(path) as two:
        conversation, _ = one.create()

        def write(store: ChatStore, tag: str) -> None:
            for i in range(count):
                store.append(conversation, user(f"{tag} {i}"))

        threads = [threading.Thread(target=write, args=(store, tag))
                   for store, tag in ((one, "a"), (one, "b"), (two, "c"), (two, "d"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        messages = two.get(conversation).messages
    assert len(messages) == 4 * count
    for tag in "abcd":
        mine = [m.content for m in messages if m.content.startswith(f"{tag} ")]
        assert mine == [f"{tag} {i}" for i in range(count)]  # all there, in order


def test_two_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    count = 150
    with ChatStore(path) as store:
        conversation, _ = store.create([user("start")])
    workers = [subprocess.Popen([sys.executable, str(WORKER), "append", str(path),
                                 str(conversation), str(count), tag], stderr=subprocess.PIPE)
               for tag in ("left", "right")]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err.decode()
    with ChatStore(path) as store:
        messages = store.get(conversation).messages
        positions = [row[0] for row in store._conn.execute(
            "SELECT position FROM messages ORDER BY position")]
    assert len(messages) == 1 + 2 * count
    assert positions == list(range(1 + 2 * count))
    for tag in ("left", "right"):
        assert [m.content for m in messages if m.content.startswith(tag)] == \
            [f"{tag} {i}" for i in range(count)]


def test_a_process_killed_mid_answer_leaves_the_question_and_a_cut_answer(
        tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    worker = subprocess.Popen([sys.executable, str(WORKER), "stream", str(path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "ready", worker.stderr.read()
        with ChatStore(path) as store:  # a reader beside the writer sees the answer grow
            first = store.get(store.list()[0].id).messages[-1].content
            deadline = 200
            while store.get(store.list()[0].id).messages[-1].content == first and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
    finally:
        worker.kill()  # SIGKILL: no handler, no flush, no close
        worker.wait(timeout=30)
    assert worker.returncode == -9
    with ChatStore(path) as store:
        (summary,) = store.list()
        question, answer = store.get(summary.id).messages
    assert question.content == QUESTION and question.complete
    assert answer.role == "assistant" and not answer.complete and answer.finish_reason is None
    assert answer.content.startswith(WORD) and len(answer.content) > len(first)
    assert answer.content == WORD * (len(answer.content) // len(WORD))  # whole writes only
    assert answer.preset == "tiny" and answer.settings == {"temperature": 0.0}
