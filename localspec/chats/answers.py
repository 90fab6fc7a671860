"""Saving an answer as it streams, cheaply: one row, rewritten now and then, completed at the end.

An answer is a row appended with ``complete`` false when its first token is on the way; its text
is rewritten after every ``CHAT_SAVE_EVERY_TOKENS`` new tokens or ``CHAT_SAVE_EVERY_S`` seconds,
whichever comes first (a write is one short transaction, so a 100-token/s answer costs a few
writes a second, not a hundred); ``finish`` writes the whole text, how it ended and its summary.
A process killed in between leaves the text of the last write, still marked incomplete: the
readers show it as cut.

What an answer keeps beside its text is built here once for the app and the API server:
``answer_settings`` (from the generation's request) and ``answer_summary`` (its speculation
statistics). They read the engine's ``GenerationRequest`` and ``GenerationStats`` by attribute:
this package sits below the engine and imports nothing of it. ``SavedRequest`` is an API
request saved as a conversation of its own (``localspec serve --save-chats``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from localspec.chats.store import ChatStore, Message
from localspec.errors import ChatStoreError

logger = logging.getLogger(__name__)
# A streaming answer is saved after this many new tokens or seconds, whichever first, and at its end
CHAT_SAVE_EVERY_TOKENS, CHAT_SAVE_EVERY_S = 32, 0.5


def answer_settings(request: Any, method: str, system: str | None = None) -> dict[str, Any]:
    """The settings an answer was made with: its method and a ``GenerationRequest``'s validated
    values (and the system prompt the app added, if any)."""
    s = request.sampling
    settings = {"method": method, "temperature": s.temperature, "top_p": s.top_p,
                "top_k": s.top_k, "max_new_tokens": request.max_new_tokens,
                "num_speculative_tokens": request.num_speculative_tokens,
                "adaptive": request.adaptive, "seed": request.seed}
    return settings if system is None else {**settings, "system": system}


def answer_summary(method: str, stats: Any) -> dict[str, Any]:
    """An answer's speculation summary from its ``GenerationStats`` (the keys the exports
    show: method, tokens_per_second, acceptance_rate, tokens_per_pass)."""
    return {"method": method, "new_tokens": stats.new_tokens,
            "tokens_per_second": round(stats.tokens_per_second, 3),
            "acceptance_rate": round(stats.acceptance_rate, 4) if stats.drafted else None,
            "tokens_per_pass": round(stats.mean_accepted_length, 3), "drafted": stats.drafted,
            "accepted": stats.accepted, "target_passes": stats.target_forward_passes,
            "wall_time_s": round(stats.wall_time, 3)}


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


class SavedRequest:
    """An API chat request saved as a conversation of its own: the messages it sent, then its
    answer as it streams. The store's failures are logged, never raised: the request is answered
    all the same."""

    def __init__(self, store: ChatStore, messages: Sequence[dict[str, str]], *,
                 preset: str | None, settings: dict[str, Any]) -> None:
        self.text = ""
        self.tokens = 0
        self._saver: AnswerSaver | None = None
        self._guard(self._start, store, messages, preset, settings)

    def _guard(self, action: Callable[..., None], *args: Any) -> None:
        try:
            action(*args)
        except ChatStoreError as exc:
            logger.warning("an API request could not be saved: %s", exc)
            self._saver = None

    def _start(self, store: ChatStore, messages: Sequence[dict[str, str]], preset: str | None,
               settings: dict[str, Any]) -> None:
        conversation, _ = store.create([Message(m["role"], m["content"]) for m in messages])
        self._saver = AnswerSaver(store, conversation, preset=preset, settings=settings)

    def add(self, text_delta: str, tokens: int) -> None:
        """A step of the answer: its text and its number of tokens."""
        self.text += text_delta
        self.tokens += tokens
        if self._saver is not None:
            self._guard(self._saver.update, self.text, self.tokens)

    def finish(self, finish_reason: str | None, stats: dict[str, Any]) -> None:
        if self._saver is not None:
            self._guard(self._saver.finish, self.text, finish_reason, stats)
