"""What one chat turn writes to the saved conversations, as it happens.

A ``TurnSaver`` is made when a message is sent (or an answer regenerated): it saves the user's
message at once (a new conversation, titled from it, when the tab has none or its own was
deleted elsewhere), then the answer as it streams (``localspec.chats.answers``: a row rewritten
every few tokens or half a second, not every token), then the answer's end: its text, how it
ended, its preset and settings, and its speculation summary. A turn taken back (refused before
any token, or nothing said) removes what it saved, as the chat puts the message back in the
box; a regenerated answer replaces the old one only once it has said something.

Saving never stops the chat: a store that fails mid-turn is logged, and ``problem`` says so for
the notice under the chat. With no store (the folder cannot be written) nothing is saved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from localspec.chats.answers import AnswerSaver, answer_settings, answer_summary
from localspec.chats.store import ChatStore, Message
from localspec.errors import ChatStoreError
from localspec.ui.streaming import Answer
from localspec.ui.views import Turn

logger = logging.getLogger(__name__)
__all__ = ["TurnSaver", "answer_settings", "answer_stats"]


def answer_stats(answer: Answer) -> dict[str, Any]:
    """An answer's speculation summary (``localspec.chats.answers.answer_summary``)."""
    return answer_summary(answer.live.method, answer.live.stats)


class TurnSaver:
    """Saves one turn of conversation ``conversation`` (None: a new one) in ``store``."""

    def __init__(self, store: ChatStore | None, conversation: int | None, turn: Turn) -> None:
        self.store = store
        self.conversation = conversation
        self.problem = ""  # why the turn is not (fully) saved, for the user
        self._turn = turn
        self._ids: list[int] = []  # the rows this turn added
        self._created = False
        self._answer: AnswerSaver | None = None
        self._try(self._question)

    def _try(self, action: Callable[..., None], *args: Any) -> None:
        if self.store is None or self.problem:
            return
        try:
            action(*args)
        except ChatStoreError as exc:
            logger.warning("a conversation could not be saved: %s", exc)
            self.problem = f"⚠ Not saved: {exc}"

    def _question(self) -> None:
        store, turn = self.store, self._turn
        if self.conversation is not None and store.exists(self.conversation):
            if turn.message is not None:
                self._ids.append(store.append(self.conversation,
                                              Message("user", turn.messages[-1]["content"])))
            return
        # the whole conversation so far: a regenerated answer's is in ``before``
        said = turn.messages if turn.message is not None else turn.before
        self.conversation, ids = store.create([Message(m["role"], m["content"]) for m in said])
        self._created = True
        self._ids += ids[-1:] if turn.message is not None else []

    def started(self, preset: str | None, settings: dict[str, Any]) -> None:
        """The answer's first token is on the way: its row, incomplete until ``finished``."""
        self._try(self._start, preset, settings)

    def _start(self, preset: str | None, settings: dict[str, Any]) -> None:
        self._answer = AnswerSaver(self.store, self.conversation, preset=preset,
                                   settings=settings)
        self._ids.append(self._answer.id)

    def progress(self, answer: Answer) -> None:
        """The answer so far (written now and then, not at every call)."""
        if self._answer is not None:
            self._try(self._answer.update, answer.text, len(answer.token_ids))

    def finished(self, answer: Answer) -> None:
        """The answer has ended having said something: all of it, how it ended, its summary;
        it replaces the old answer when it was a regeneration."""
        if self._answer is not None:
            finish = "error" if answer.error else answer.live.finish_reason
            self._try(self._answer.finish, answer.text, finish, answer_stats(answer),
                      self._turn.message is None)

    def undo(self) -> None:
        """Take the turn back: remove what it saved (and the conversation, if it was made for
        this turn and holds nothing else)."""
        self._try(self._undo)

    def _undo(self) -> None:
        self.store.remove(self._ids)
        self._ids = []
        if self._created and self.store.remove_if_empty(self.conversation):
            self.conversation = None

    def notice(self, text: str) -> str:
        """``text`` with why the turn was not saved, if it was not."""
        return " ".join(part for part in (text, self.problem) if part)
