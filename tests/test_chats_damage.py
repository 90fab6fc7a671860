"""A conversations database that cannot be used: a damaged file (random bytes, a text file,
truncated, another program's database, our tables with columns missing, a newer schema) is set
aside with its -wal and -shm files and a logged message, and a fresh database starts; a folder
that cannot be written, or a file another process holds, is a clear error and sets nothing
aside. Also where the data folder is."""

from __future__ import annotations

import logging
import os
import random
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from localspec.chats import schema
from localspec.chats.schema import chats_path
from localspec.chats.store import ChatStore, Message
from localspec.config import DATA_ENV, data_root
from localspec.errors import ChatStoreError


def _saved(path: Path) -> None:
    """A real conversations file with enough in it to span many pages, closed cleanly."""
    with ChatStore(path) as store:
        for i in range(40):
            store.create([Message("user", f"question {i} " + "x" * 2000)])


def random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(16384))


def text_file(path: Path) -> None:
    path.write_text("these are my notes\n", encoding="utf-8")


def truncated(path: Path) -> None:
    _saved(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def header_only(path: Path) -> None:
    _saved(path)
    path.write_bytes(path.read_bytes()[:100])


def another_programs(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    conn.execute("INSERT INTO notes (body) VALUES ('keep me')")
    conn.commit()
    conn.close()


def columns_missing(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT)")
    conn.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, content TEXT)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()


def newer_schema(path: Path) -> None:
    _saved(path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "random bytes": (random_bytes, "not a database"),
    "a text file": (text_file, "not a database"),
    "truncated": (truncated, "malformed|damaged"),
    "cut after the header": (header_only, "malformed|damaged"),
    "another program's": (another_programs, "not a LocalSpec conversations database"),
    "columns missing": (columns_missing, "lacks the columns"),
    "a newer schema": (newer_schema, "newer LocalSpec .schema version 99"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_file_is_set_aside_and_a_fresh_one_started(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make, why = DAMAGE[kind]
    path = tmp_path / "chats.db"
    make(path)
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="localspec.chats"), ChatStore(path) as store:
        aside = store.set_aside_to
        assert aside is not None and aside.name.startswith("chats.db.damaged-")
        assert store.list() == []
        conversation, _ = store.create([Message("user", "a fresh start")])
        assert store.get(conversation).messages[0].content == "a fresh start"
    assert aside.read_bytes() == before  # kept as it was, for the user
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    assert str(aside) in message and "fresh database" in message
    assert re.search(why, message), message
    with ChatStore(path) as store:  # the fresh file is sound: nothing set aside again
        assert store.set_aside_to is None and len(store.list()) == 1


def test_the_wal_and_shm_files_go_with_it(tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    random_bytes(path)
    beside = {suffix: random.Random(suffix).randbytes(4096) for suffix in ("-wal", "-shm")}
    for suffix, data in beside.items():
        Path(f"{path}{suffix}").write_bytes(data)
    with ChatStore(path) as store:
        aside = store.set_aside_to
    # the -wal file holds the last transactions: kept as it was; -shm is SQLite's scratch index
    assert Path(f"{aside}-wal").read_bytes() == beside["-wal"]
    assert Path(f"{aside}-shm").exists()


def test_a_file_another_process_set_aside_meanwhile_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes find the same damaged file; the other one sets it aside and starts a fresh
    database first: this one opens that fresh database instead of moving it aside too."""
    path = tmp_path / "chats.db"
    random_bytes(path)
    real = schema._connect
    calls = []

    def racing(where: Path, busy_timeout_s: float) -> sqlite3.Connection:
        calls.append(where)
        if len(calls) > 1:
            return real(where, busy_timeout_s)
        with pytest.raises(sqlite3.DatabaseError, match="not a database"):
            real(where, busy_timeout_s)  # found damaged here...
        schema.set_aside(where)  # ...and meanwhile the other process moves it, starts afresh
        other, _ = schema.connect(where)
        other.execute("INSERT INTO conversations (uid, title, created_ms, updated_ms) VALUES "
                      "('theirs', 'the other process', 1, 1)")
        other.close()
        raise schema.DamagedDatabase("SQLite found it damaged")

    monkeypatch.setattr(schema, "_connect", racing)
    with ChatStore(path) as store:
        assert store.set_aside_to is None  # this process moved nothing
        assert [s.title for s in store.list()] == ["the other process"]
    assert len(list(tmp_path.glob("chats.db.damaged-*[0-9]"))) == 1


def test_set_aside_twice_keeps_both(tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    asides = []
    for _ in range(2):
        random_bytes(path)
        with ChatStore(path) as store:
            asides.append(store.set_aside_to)
    assert asides[0] != asides[1] and all(a.exists() for a in asides)


def test_a_folder_that_cannot_be_made_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    with pytest.raises(ChatStoreError, match=f"cannot create the folder .*{DATA_ENV}"):
        ChatStore(blocker / "data" / "chats.db")


def test_a_database_that_is_a_folder_is_an_error_and_stays(tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    path.mkdir()
    with pytest.raises(ChatStoreError, match="cannot be saved"):
        ChatStore(path)
    assert path.is_dir() and list(tmp_path.iterdir()) == [path]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_a_read_only_folder_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ChatStoreError, match="cannot be saved"):
            ChatStore(folder / "chats.db")
    finally:
        folder.chmod(0o700)


def test_a_lock_held_too_long_is_no_damage(tmp_path: Path) -> None:
    """Another process in the middle of a long write: the open waits its busy timeout, then
    says so; the file is not set aside."""
    path = tmp_path / "chats.db"
    _saved(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(ChatStoreError, match="locked"):
            ChatStore(path, busy_timeout_s=0.2)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert not list(tmp_path.glob("*damaged*"))
    with ChatStore(path) as store:
        assert len(store.list()) == 40


def test_the_data_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "mine"))
    assert data_root() == tmp_path / "mine" and chats_path() == tmp_path / "mine" / "chats.db"
    monkeypatch.delenv(DATA_ENV)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    if os.name == "posix" and "darwin" not in os.sys.platform:
        assert data_root() == tmp_path / "xdg" / "localspec"
    assert "cache" not in str(data_root()).lower()
