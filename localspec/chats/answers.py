"""Saving an answer as it streams, cheaply: one row, rewritten now and then, completed at the end.

An answer is a row appended with ``complete`` false when its first token is on the way; its text
is rewritten after every ``CHAT_SAVE_EVERY_TOKENS`` new tokens or ``CHAT_SAVE_EVERY_S`` seconds,
whichever comes first (a write is one short transaction, so a 100-token/s answer costs a few
writes a second, not a hundred); ``finish`` writes the whole text, how it ended and its summary.
A process killed in between leaves the text of the last write, still marked incomplete: the
readers show it as cut.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from localspec.chats.store import ChatStore, Message
from localspec.config import CHAT_SAVE_EVERY_S, CHAT_SAVE_EVERY_TOKENS


class AnswerSaver:
    """One answer of ``conversation`` being saved; the row is appended when this is made."""

    def __init__(self, store: ChatStore, conversation: int, *, preset: str | None,
                 settings: dict[str, Any] | None,
                 clock: Callable[[], float] = time.monotonic,
                 every_tokens: int = CHAT_SAVE_EVERY_TOKENS,
                 every_s: float = CHAT_SAVE_EVERY_S) -> None:
        self.store = store
        self.clock = clock
        self.every_tokens = every_tokens
        self.every_s = every_s
        self.id = store.append(conversation, Message("assistant", "", complete=False,
                                                     preset=preset, settings=settings))
        self.writes = 0  # rewrites of the text while streaming (the final one not counted)
        self._saved_text = ""
        self._saved_tokens = 0
        self._saved_at = clock()

    def update(self, text: str, tokens: int) -> bool:
        """The answer so far (``tokens`` generated); written if enough has come or enough
        time has passed since the last write. Whether it was written."""
        due = (tokens - self._saved_tokens >= self.every_tokens
               or self.clock() - self._saved_at >= self.every_s)
        if not due or text == self._saved_text:
            return False
        self.store.update(self.id, text)
        self.writes += 1
        self._saved_text, self._saved_tokens, self._saved_at = text, tokens, self.clock()
        return True

    def finish(self, text: str, finish_reason: str | None, stats: dict[str, Any] | None,
               replaces_earlier: bool = False) -> None:
        """The answer has ended: its whole text, how it ended and its summary (``stats``);
        ``replaces_earlier``: it replaces the answers to the same message before it."""
        self.store.update(self.id, text, complete=True, finish_reason=finish_reason,
                          stats=stats, replaces_earlier=replaces_earlier)
