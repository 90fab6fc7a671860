"""The saved conversations' database file: its schema, its migrations, and what happens to a
file that is not one.

Version: ``PRAGMA user_version`` holds the number of migrations applied. ``MIGRATIONS[i]`` takes
a database from version i to i + 1, so a file of any earlier release is brought up to date step
by step, all in one transaction (a failure leaves it as it was). Version 1 is the first
release's schema; migrations are only ever appended, never edited.

Opening (``connect``): the folder is created; the file is opened in WAL mode (readers never
block the writer, and a process killed mid-write leaves the last committed state) with a busy
timeout (a second process's write waits for the first instead of failing), then checked:
SQLite's ``quick_check``, the version, the tables and their columns. A file that fails (not
SQLite at all, truncated, damaged pages, another program's database, a version newer than this
release reads) is renamed ``chats.db.damaged-<time>`` together with its -wal and -shm files, a
warning is logged, and a fresh database starts in its place: the old one is kept for the user,
and the app keeps going. A folder that cannot be written, or a file another process holds, is
not damage: that is a ``ChatStoreError`` saying so, and the caller goes on without saving.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from localspec.config import CHATS_FILE, DATA_ENV, data_root
from localspec.errors import ChatStoreError

logger = logging.getLogger(__name__)
CHATS_BUSY_TIMEOUT_S = 10.0  # how long a write waits for another process's transaction

# Each entry: the statements that take a database from version i to i + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: conversations and their messages
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            uid TEXT NOT NULL UNIQUE,           -- kept by export and import
            title TEXT NOT NULL,
            created_ms INTEGER NOT NULL,        -- milliseconds since the epoch, UTC
            updated_ms INTEGER NOT NULL,        -- the last message's time: the list's order
            deleted_ms INTEGER                  -- set by delete (restorable), NULL otherwise
        )""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            complete INTEGER NOT NULL DEFAULT 1, -- 0: streaming, or cut by a crash
            finish_reason TEXT,                 -- an answer's: stop, length, cancelled, error
            preset TEXT,                        -- an answer's preset (a name or a file)
            settings TEXT,                      -- an answer's settings, JSON
            stats TEXT,                         -- an answer's speculation summary, JSON
            created_ms INTEGER NOT NULL,
            updated_ms INTEGER NOT NULL,
            UNIQUE (conversation_id, position)
        )""",
        "CREATE INDEX conversations_by_time ON conversations (deleted_ms, updated_ms)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
# What this release reads and writes: each table's columns.
COLUMNS = {
    "conversations": {"id", "uid", "title", "created_ms", "updated_ms", "deleted_ms"},
    "messages": {"id", "conversation_id", "position", "role", "content", "complete",
                 "finish_reason", "preset", "settings", "stats", "created_ms", "updated_ms"},
}
# SQLite's primary result codes that mean the file itself is bad (not the folder, not a lock).
_DAMAGE_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


class DamagedDatabase(Exception):
    """The file is not a conversations database this release can use; the message says why."""


def chats_path() -> Path:
    """The saved conversations' database file, in the user's data folder."""
    return data_root() / CHATS_FILE


def _judge(version: int, tables: list[str]) -> None:
    """``DamagedDatabase`` if a file of schema ``version`` holding ``tables`` is newer than
    this release reads, or is some other program's database."""
    latest = len(MIGRATIONS)
    if version > latest:
        raise DamagedDatabase(f"it was written by a newer LocalSpec (schema version {version}; "
                              f"this one reads up to {latest})")
    if version == 0 and tables:
        raise DamagedDatabase("it is not a LocalSpec conversations database (it holds tables "
                              f"{', '.join(sorted(tables))})")


def _tables(conn: sqlite3.Connection) -> list[str]:
    return [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]


def migrate(conn: sqlite3.Connection, upto: int | None = None) -> int:
    """Apply the migrations from the file's version to ``upto`` (default: all of them) in one
    transaction; the version it was at. A statement that fails on the file's tables means they
    are not ours: ``DamagedDatabase``, and the file is left as it was."""
    upto = len(MIGRATIONS) if upto is None else upto
    conn.execute("BEGIN IMMEDIATE")
    version = 0
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        _judge(version, _tables(conn))  # again: another process may have got here first
        for step in range(version, upto):
            for statement in MIGRATIONS[step]:
                conn.execute(statement)
        if upto > version:
            conn.execute(f"PRAGMA user_version = {int(upto)}")
    except BaseException as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error) and _primary(exc) == sqlite3.SQLITE_ERROR:
            # "no such table", "duplicate column name": the tables are not ours
            raise DamagedDatabase(f"its tables are not those of schema version {version}: "
                                  f"{exc}") from exc
        raise
    conn.execute("COMMIT")
    return version


def _primary(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _check_columns(conn: sqlite3.Connection) -> None:
    for table, columns in COLUMNS.items():
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if not columns <= have:
            missing = ", ".join(sorted(columns - have))
            raise DamagedDatabase(f"its table '{table}' lacks the columns {missing}")


def _inspect(conn: sqlite3.Connection) -> None:
    """``DamagedDatabase`` unless SQLite finds the file sound and it is a conversations
    database this release reads. ``conn`` is read-only, so a file set aside is kept as it was,
    its -wal file (the last transactions) included."""
    found = [row[0] for row in conn.execute("PRAGMA quick_check")]
    if found != ["ok"]:
        raise DamagedDatabase(f"SQLite found it damaged ({'; '.join(found[:3])})")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    _judge(version, _tables(conn))
    if version == len(MIGRATIONS):
        _check_columns(conn)


def _connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """The file opened for this store: autocommit (transactions are explicit), usable from
    any thread (the store serialises its use with a lock), checked, then WAL, migrated, with
    foreign keys on."""
    if path.exists():  # read-only: closing it never checkpoints, or removes the -wal file
        reader = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                 timeout=busy_timeout_s)
        try:
            _inspect(reader)
        finally:
            reader.close()
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None,
                           check_same_thread=False)
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ChatStoreError(f"{path}: SQLite could not switch the file to WAL mode (it "
                                 f"says '{mode}'); is the folder on a network file system?")
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable across a process kill
        migrate(conn)
        _check_columns(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def set_aside(path: Path) -> Path:
    """Rename ``path`` (and its -wal and -shm files) to ``<name>.damaged-<time>``, never over
    an earlier one; the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{number}")
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{path}{suffix}")
        if source.exists():
            os.replace(source, Path(f"{target}{suffix}"))
    return target


def _unavailable(path: Path, why: object) -> ChatStoreError:
    return ChatStoreError(f"{path}: conversations cannot be saved: {why} (set {DATA_ENV} to a "
                          "folder you can write)")


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file ``path`` is (inode, size, modification time); None if there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def connect(path: Path, busy_timeout_s: float = CHATS_BUSY_TIMEOUT_S
            ) -> tuple[sqlite3.Connection, Path | None]:
    """The database at ``path``, created, migrated and checked; and where a damaged file was
    moved (None if there was none). ``ChatStoreError`` when the folder cannot be written or the
    file cannot be opened for a reason that is not damage (a lock held past the timeout).

    Two processes may find the same damaged file at once: a file is set aside only if it is
    still the one found damaged, so the second never moves the first one's fresh database."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unavailable(path, f"cannot create the folder {path.parent} "
                                 f"({exc.strerror or exc})") from exc
    aside: Path | None = None
    for _ in range(3):
        found = _identity(path)
        try:
            return _connect(path, busy_timeout_s), aside
        except DamagedDatabase as exc:
            reason = str(exc)
        except sqlite3.Error as exc:
            if _primary(exc) not in _DAMAGE_CODES:
                raise _unavailable(path, exc) from exc
            reason = str(exc)
        if aside is not None:  # a fresh file failing too is no damage of the file's own
            raise _unavailable(path, f"a fresh database fails too: {reason}")
        if _identity(path) != found:  # another process set it aside (or replaced it): look again
            continue
        try:
            aside = set_aside(path)
        except OSError as exc:
            raise _unavailable(path, f"the file is damaged ({reason}) and cannot be moved "
                                     f"aside ({exc.strerror or exc})") from exc
        logger.warning("%s: %s; moved it to %s and started a fresh database", path, reason,
                       aside)
    raise _unavailable(path, "the file keeps changing while it is checked")
