"""``ChatStore``: the saved conversations, read and written through one SQLite file.

A conversation is a title and its messages in order; an answer also keeps the preset and the
settings it was made with, its speculation summary (``stats``: method, acceptance, tokens/s,
tokens per target pass), how it ended (``finish_reason``) and whether it is ``complete``. An
answer is saved as it streams (``append`` a row with ``complete=False``, ``update`` it, ``finish``
it): one killed mid-answer stays with its text so far and ``complete`` false, which every
reader shows as cut.

Many writers, no loss: every change is one short transaction that takes the write lock at once
(``BEGIN IMMEDIATE``), so two tabs or two processes appending to one conversation queue behind
SQLite's busy timeout and number their messages one after the other; within a process one
connection is shared under a lock (Gradio calls from many threads). Delete is undoable:
``delete`` marks a conversation, ``restore`` unmarks it, and ``purge`` (run at every open)
removes those deleted more than ``CHATS_PURGE_AFTER_S`` ago. Search is a substring match,
case-insensitive for all of Unicode (``str.casefold``), over titles and messages; no index is
kept for it (an FTS5 index would match whole words only, and would make a file that SQLite
builds without FTS5 cannot write).

Every failure a user can meet is a ``ChatStoreError`` naming the file; ``schema`` says how a
damaged file is set aside when the store opens.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localspec.chats.schema import CHATS_BUSY_TIMEOUT_S, chats_path, connect
from localspec.errors import ChatNotFoundError, ChatStoreError
from localspec.files import check_unicode

logger = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant")
UNTITLED = "New conversation"
MAX_CHAT_TITLE_CHARS = 200  # a title the user gives (rename, import)
CHAT_TITLE_FROM_MESSAGE_CHARS = 60  # a new conversation's title: its first message, cut here
# The most one message holds: far past an answer or a pasted file; bounds what an import stores
MAX_CHAT_MESSAGE_CHARS = 4 * 2**20
MAX_CHATS_LISTED = 500  # the newest conversations the side list and `chats list` show
CHATS_PURGE_AFTER_S = 7 * 24 * 3600  # a deleted conversation can be restored for a week


@dataclass(frozen=True)
class Message:
    """One message; the fields after ``content`` are an answer's (None for the user's)."""

    role: str
    content: str
    complete: bool = True  # False: still streaming, or cut by a crash
    finish_reason: str | None = None
    preset: str | None = None
    settings: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    created_ms: int = 0
    updated_ms: int = 0
    id: int | None = None


@dataclass(frozen=True)
class Summary:
    """One line of the list of conversations."""

    id: int
    title: str
    created_ms: int
    updated_ms: int
    messages: int


@dataclass(frozen=True)
class Conversation:
    """A conversation and its messages, in order."""

    title: str
    messages: tuple[Message, ...] = ()
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_ms: int = 0
    updated_ms: int = 0
    id: int | None = None


def clean_title(title: str) -> str:
    """``title`` on one line (runs of whitespace made one space); ``ChatStoreError`` if it is
    empty, longer than ``MAX_CHAT_TITLE_CHARS`` or not valid Unicode."""
    if not isinstance(title, str):
        raise ChatStoreError(f"a title is text, not {type(title).__name__}")
    text = " ".join(check_unicode(title, "the title", ChatStoreError).split())
    if not text:
        raise ChatStoreError("a title cannot be empty")
    if len(text) > MAX_CHAT_TITLE_CHARS:
        raise ChatStoreError(f"a title may be {MAX_CHAT_TITLE_CHARS} characters long, not "
                             f"{len(text)}")
    return text


def title_from(messages: Sequence[Message]) -> str:
    """A new conversation's title: its first user message's first line, cut short."""
    for message in messages:
        lines = [line for line in message.content.splitlines() if line.strip()]
        text = " ".join(lines[0].split()) if message.role == "user" and lines else ""
        if text:
            cut = CHAT_TITLE_FROM_MESSAGE_CHARS
            return text if len(text) <= cut else text[: cut - 1].rstrip() + "…"
    return UNTITLED


def _checked(message: Message) -> Message:
    if message.role not in ROLES:
        raise ChatStoreError(f"a message's role is one of {', '.join(ROLES)}, not "
                             f"{message.role!r}")
    if not isinstance(message.content, str):
        raise ChatStoreError(f"a message is text, not {type(message.content).__name__}")
    if len(message.content) > MAX_CHAT_MESSAGE_CHARS:
        raise ChatStoreError(f"a message may hold {MAX_CHAT_MESSAGE_CHARS:,} characters, not "
                             f"{len(message.content):,}")
    check_unicode(message.content, "the message", ChatStoreError)
    return message


def _json(value: dict[str, Any] | None) -> str | None:
    if value is None:
        return None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ChatStoreError(f"an answer's settings or stats cannot be saved: {exc}") from exc


def _parsed(text: str | None, what: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        logger.warning("a saved answer's %s is not JSON; shown without them", what)
        return None
    return value if isinstance(value, dict) else None


def _casefold(text: object) -> object:
    return text.casefold() if isinstance(text, str) else text


_MESSAGE_COLUMNS = ("role, content, complete, finish_reason, preset, settings, stats, "
                    "created_ms, updated_ms, id")
_INSERT_MESSAGE = (
    "INSERT INTO messages (conversation_id, position, role, content, complete, finish_reason, "
    "preset, settings, stats, created_ms, updated_ms) VALUES (?, (SELECT COALESCE(MAX(position), "
    "-1) + 1 FROM messages WHERE conversation_id = ?), ?, ?, ?, ?, ?, ?, ?, ?, ?)")


class ChatStore:
    """The saved conversations in the SQLite file ``path`` (default: ``chats_path()``).

    Opening may set a damaged file aside (``set_aside_to`` says where) and raises
    ``ChatStoreError`` when the folder cannot be written. Safe to share between threads."""

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = CHATS_BUSY_TIMEOUT_S,
                 purge_after_s: float = CHATS_PURGE_AFTER_S) -> None:
        self.path = Path(path) if path is not None else chats_path()
        self._clock = clock
        self._lock = threading.Lock()
        conn, self.set_aside_to = connect(self.path, busy_timeout_s)
        conn.create_function("casefold", 1, _casefold, deterministic=True)
        self._conn: sqlite3.Connection | None = conn
        self.purge(self._now() - round(purge_after_s * 1000))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _now(self) -> int:
        return round(self._clock() * 1000)

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock; a write takes SQLite's write lock at once, so it
        waits (busy timeout) instead of failing halfway."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise ChatStoreError(f"{self.path}: the conversations store is closed")
            try:
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                doing = "saved" if write else "read"
                raise ChatStoreError(f"{self.path}: the conversations could not be {doing}: "
                                     f"{exc}") from exc

    @staticmethod
    def _insert(conn: sqlite3.Connection, conversation: int, m: Message, now: int) -> int:
        _checked(m)
        cursor = conn.execute(_INSERT_MESSAGE, (
            conversation, conversation, m.role, m.content, int(m.complete), m.finish_reason,
            m.preset, _json(m.settings), _json(m.stats), m.created_ms or now,
            m.updated_ms or m.created_ms or now))
        return int(cursor.lastrowid)

    @staticmethod
    def _live(conn: sqlite3.Connection, conversation: int) -> None:
        row = conn.execute("SELECT deleted_ms FROM conversations WHERE id = ?",
                           (conversation,)).fetchone()
        if row is None or row[0] is not None:
            raise ChatNotFoundError(f"no conversation {conversation}"
                                    f"{' (it was deleted)' if row else ''}")

    # ------------------------------------------------------------------ conversations

    def create(self, messages: Sequence[Message] = (), title: str | None = None
               ) -> tuple[int, list[int]]:
        """A new conversation holding ``messages`` (titled from its first user message unless
        ``title`` is given): its id and its messages' ids."""
        now = self._now()
        name = clean_title(title) if title is not None else title_from(messages)
        with self._transaction() as conn:
            conversation = int(conn.execute(
                "INSERT INTO conversations (uid, title, created_ms, updated_ms) "
                "VALUES (?, ?, ?, ?)", (uuid.uuid4().hex, name, now, now)).lastrowid)
            ids = [self._insert(conn, conversation, m, now) for m in messages]
        return conversation, ids

    def exists(self, conversation: int) -> bool:
        """Whether ``conversation`` is saved and not deleted."""
        with self._transaction(write=False) as conn:
            row = conn.execute("SELECT 1 FROM conversations WHERE id = ? AND deleted_ms IS "
                               "NULL", (conversation,)).fetchone()
        return row is not None

    def get(self, conversation: int) -> Conversation:
        """A conversation and its messages; ``ChatNotFoundError`` if it is not there."""
        with self._transaction(write=False) as conn:
            self._live(conn, conversation)
            uid, title, created, updated = conn.execute(
                "SELECT uid, title, created_ms, updated_ms FROM conversations WHERE id = ?",
                (conversation,)).fetchone()
            rows = conn.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE "
                                "conversation_id = ? ORDER BY position", (conversation,))
            messages = tuple(
                Message(role, content, bool(complete), finish, preset,
                        _parsed(settings, "settings"), _parsed(stats, "stats"), c_ms, u_ms, mid)
                for role, content, complete, finish, preset, settings, stats, c_ms, u_ms, mid
                in rows)
        return Conversation(title, messages, uid, created, updated, conversation)

    def list(self, text: str = "", limit: int | None = MAX_CHATS_LISTED) -> list[Summary]:
        """The conversations newest first (by their last message), at most ``limit`` (None: all);
        with ``text``, only those whose title or a message holds it (any case)."""
        where, args = "c.deleted_ms IS NULL", []
        if text.strip():
            needle = check_unicode(text.strip(), "the search", ChatStoreError).casefold()
            where += (" AND (instr(casefold(c.title), ?) > 0 OR EXISTS (SELECT 1 FROM messages "
                      "m WHERE m.conversation_id = c.id AND instr(casefold(m.content), ?) > 0))")
            args = [needle, needle]
        with self._transaction(write=False) as conn:
            rows = conn.execute(
                "SELECT c.id, c.title, c.created_ms, c.updated_ms, (SELECT COUNT(*) FROM "
                f"messages m WHERE m.conversation_id = c.id) FROM conversations c WHERE {where} "
                "ORDER BY c.updated_ms DESC, c.id DESC LIMIT ?",
                (*args, -1 if limit is None else limit)).fetchall()
        return [Summary(*row) for row in rows]

    def rename(self, conversation: int, title: str) -> str:
        """Give ``conversation`` a new title; the title as saved."""
        name = clean_title(title)
        with self._transaction() as conn:
            self._live(conn, conversation)
            conn.execute("UPDATE conversations SET title = ? WHERE id = ?", (name, conversation))
        return name

    def delete(self, conversation: int) -> None:
        """Mark ``conversation`` deleted: gone from the list, restorable until purged."""
        with self._transaction() as conn:
            self._live(conn, conversation)
            conn.execute("UPDATE conversations SET deleted_ms = ? WHERE id = ?",
                         (self._now(), conversation))

    def restore(self, conversation: int) -> None:
        """Undo ``delete``; ``ChatNotFoundError`` once it has been purged."""
        with self._transaction() as conn:
            found = conn.execute("UPDATE conversations SET deleted_ms = NULL WHERE id = ?",
                                 (conversation,)).rowcount
        if not found:
            raise ChatNotFoundError(f"no conversation {conversation} to restore")

    def purge(self, deleted_before_ms: int) -> int:
        """Remove for good the conversations deleted before ``deleted_before_ms``; how many."""
        with self._transaction() as conn:
            return conn.execute("DELETE FROM conversations WHERE deleted_ms < ?",
                                (deleted_before_ms,)).rowcount

    def add(self, conversations: Sequence[Conversation]) -> tuple[int, int]:
        """Add whole conversations (an import), keeping their ids (``uid``), titles and times,
        in one transaction: (added, skipped as already here)."""
        added = 0
        now = self._now()
        with self._transaction() as conn:
            for c in conversations:
                if conn.execute("SELECT 1 FROM conversations WHERE uid = ?",
                                (c.uid,)).fetchone():
                    continue
                conversation = int(conn.execute(
                    "INSERT INTO conversations (uid, title, created_ms, updated_ms) VALUES "
                    "(?, ?, ?, ?)", (c.uid, clean_title(c.title), c.created_ms or now,
                                     c.updated_ms or c.created_ms or now)).lastrowid)
                for m in c.messages:
                    self._insert(conn, conversation, m, now)
                added += 1
        return added, len(conversations) - added

    def answer_texts(self, max_chars: int) -> list[str]:
        """The newest complete answers of live conversations whose texts add up to at most
        ``max_chars`` characters, oldest first (what the suffix drafter learns at start)."""
        texts, total = [], 0
        with self._transaction(write=False) as conn:
            for (content,) in conn.execute(
                    "SELECT m.content FROM messages m JOIN conversations c ON c.id = "
                    "m.conversation_id WHERE c.deleted_ms IS NULL AND m.role = 'assistant' AND "
                    "m.complete = 1 AND m.content != '' ORDER BY m.updated_ms DESC, m.id DESC"):
                total += len(content)
                if total > max_chars:
                    break
                texts.append(content)
        return texts[::-1]

    # ------------------------------------------------------------------ messages

    def append(self, conversation: int, message: Message) -> int:
        """Add ``message`` at the end of ``conversation``; its id."""
        now = self._now()
        with self._transaction() as conn:
            self._live(conn, conversation)
            message_id = self._insert(conn, conversation, message, now)
            conn.execute("UPDATE conversations SET updated_ms = ? WHERE id = ?",
                         (now, conversation))
        return message_id

    def update(self, message_id: int, content: str, *, complete: bool = False,
               finish_reason: str | None = None, stats: dict[str, Any] | None = None,
               replaces_earlier: bool = False) -> None:
        """Rewrite a (streaming) answer's text; with ``complete``, it has ended, with its
        ``finish_reason`` and ``stats``. ``replaces_earlier``: the answers between the user's
        message before it and it are removed (a regenerated answer replaces the old one)."""
        _checked(Message("assistant", content))
        now = self._now()
        with self._transaction() as conn:
            row = conn.execute("SELECT conversation_id, position FROM messages WHERE id = ?",
                               (message_id,)).fetchone()
            if row is None:
                raise ChatNotFoundError(f"no message {message_id}")
            conn.execute("UPDATE messages SET content = ?, complete = ?, finish_reason = ?, "
                         "stats = COALESCE(?, stats), updated_ms = ? WHERE id = ?",
                         (content, int(complete), finish_reason, _json(stats), now, message_id))
            if complete:
                conn.execute("UPDATE conversations SET updated_ms = ? WHERE id = ?",
                             (now, row[0]))
            if replaces_earlier:
                conn.execute(
                    "DELETE FROM messages WHERE conversation_id = ? AND role = 'assistant' AND "
                    "position < ? AND position > (SELECT COALESCE(MAX(position), -1) FROM "
                    "messages WHERE conversation_id = ? AND role = 'user' AND position < ?)",
                    (row[0], row[1], row[0], row[1]))

    def remove(self, message_ids: Sequence[int]) -> None:
        """Remove messages for good (a turn taken back: the question came back to the box)."""
        with self._transaction() as conn:
            conn.executemany("DELETE FROM messages WHERE id = ?", [(i,) for i in message_ids])

    def remove_if_empty(self, conversation: int) -> bool:
        """Remove ``conversation`` for good if it holds no message; whether it did."""
        with self._transaction() as conn:
            return conn.execute(
                "DELETE FROM conversations WHERE id = ? AND NOT EXISTS (SELECT 1 FROM messages "
                "WHERE conversation_id = ?)", (conversation, conversation)).rowcount > 0
