"""The chat tab's handlers: send, regenerate, clear, and the token view's redraw. Plain
generators over ``Turns``: tests call them directly, as Gradio would, without a browser.

Every view they yield is built by the pure renderers (``render``, ``chat_view``); the one
streaming loop is ``streaming.follow``; the settings of a generation arrive as one ``Settings``
(``layout`` builds it from the controls). Values are not cast or checked here:
``Pipeline.request`` validates them against ``localspec.config`` and its ``RequestError`` names
the bad one, which the user reads in the notice under the chat.

What the user sees when things go wrong: a refusal before any token (a bad setting, an
over-long prompt, a method the preset cannot run) takes the user's turn back and puts the
message back into the box; a failure mid-answer keeps the partial answer; there is never an
empty assistant turn. Text that is not valid Unicode (lone surrogates: a page can send them, no
tokenizer or page takes them) is refused before anything is shown; a message comes back into
the box with U+FFFD in their place, to edit or send as is.

Saving: given a ``ChatStore``, each turn is saved as it happens (``saving.TurnSaver``) in the
tab's conversation (``conversation``: its id, None for a new one), and every view of the turn
carries that id back to the tab; the side panel's handlers are in ``conversations``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import gradio as gr

from localspec.chats.store import ChatStore
from localspec.engine.spans import TokenSpan
from localspec.files import replace_lone_surrogates
from localspec.pipeline import Pipeline
from localspec.ui.chat_view import chat_html, notice_html
from localspec.ui.render import spans_html, stats_html, summary_html
from localspec.ui.saving import TurnSaver, answer_settings
from localspec.ui.streaming import follow
from localspec.ui.turns import Turns
from localspec.ui.views import ChatView, Messages, Settings, Turn, not_unicode, plain_history, view

CLEAR_WAIT_S = 30.0  # the longest Clear waits for a running answer to stop (one step)


class ChatHandlers:
    """The chat tab's handlers over ``turns``, saving in ``store`` (None: nowhere)."""

    def __init__(self, turns: Turns, store: ChatStore | None = None) -> None:
        self.turns = turns
        self.store = store

    def send(self, message: str | None, history: Sequence[dict] | None, settings: Settings,
             session: str = "local", conversation: int | None = None) -> Iterator[ChatView]:
        """Send ``message``; stream the conversation, token view and readout as tokens arrive."""
        before = plain_history(history)
        text = (message or "").strip()
        refused = not_unicode(before, settings, message=message or "")
        if refused is not None:  # a message that held any comes back shown as it would be sent
            shown = replace_lone_surrogates(message or "")
            yield view(ChatView, notice=notice_html(refused),
                       message=shown if shown != (message or "") else gr.skip())
            return
        if not text:
            yield view(ChatView, notice=notice_html(
                "Type a message first: an empty message has nothing to answer."))
            return
        turn = Turn([*before, {"role": "user", "content": text}], before, message or "")
        yield from self._answer(turn, settings, session, conversation)

    def regenerate(self, history: Sequence[dict] | None, settings: Settings,
                   session: str = "local", conversation: int | None = None
                   ) -> Iterator[ChatView]:
        """Answer the last user message again (the old answer comes back if this one fails)."""
        before = plain_history(history)
        refused = not_unicode(before, settings)
        if refused is not None:
            yield view(ChatView, notice=notice_html(refused))
            return
        messages = list(before)
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            yield view(ChatView, notice=notice_html("Nothing to regenerate yet."))
            return
        yield from self._answer(Turn(messages, before, None), settings, session, conversation)

    def clear(self, session: str = "local") -> ChatView:
        """A new conversation. An answer still running is stopped first, and waited for, so
        that its last update cannot bring the old conversation back after this one."""
        host = self.turns.host
        if host.cancel(f"{session}/chat"):
            host.wait_ended(f"{session}/chat", CLEAR_WAIT_S)
        return ChatView([], chat_html([]), "", spans_html([]), "", "", "", [], None)

    @staticmethod
    def rerender(spans: list[TokenSpan] | None, show_rejected: bool) -> str:
        """The last answer's token view again, with or without the rejected drafts."""
        return spans_html(spans or [], show_rejected)

    def _answer(self, turn: Turn, s: Settings, session: str,
                conversation: int | None) -> Iterator[ChatView]:
        host = self.turns.host
        session = f"{session}/chat"
        cancel = host.begin(session)
        try:
            saver = TurnSaver(self.store, conversation, turn)
            yield view(ChatView, history=turn.messages, chat=chat_html(turn.messages, True),
                       message="" if turn.message is not None else gr.skip(),
                       tokens=spans_html([]), summary="", notice="", spans=[],
                       conversation=saver.conversation)
            why_not = yield from self.turns.wait_turn(
                cancel, lambda text: view(ChatView, notice=notice_html(text)))
            if why_not is not None:
                yield self._restore(turn, why_not, saver)
                return
            try:
                yield from self._stream_chat(host.pipeline, turn, s, cancel, saver)
            finally:
                host.generation_lock.release()
        finally:
            host.end(session, cancel)

    def _stream_chat(self, pipe: Pipeline, turn: Turn, s: Settings, cancel: threading.Event,
                     saver: TurnSaver) -> Iterator[ChatView]:
        """Generate (the lock is held) and show the answer as it comes; see the module doc for
        what a refusal, a failure, a Stop or an empty answer leave behind."""
        turns = self.turns
        method = turns.method(pipe, s)
        started = turns.start(pipe, turns.with_system(turn.messages, s), s, method, cancel, True)
        if isinstance(started, str):  # refused before any token
            yield self._restore(turn, started, saver)
            return
        saver.started(turns.host.status().active, answer_settings(started[0], method, s.system))
        answer = turns.new_answer(pipe, method)
        for _ in follow(started[1], answer, turns.clock, turns.min_update_interval):
            if answer.done:
                break
            saver.progress(answer)
            history = self._with_answer(turn.messages, answer.text)
            yield view(ChatView, history=history,
                       chat=chat_html(history, history is turn.messages, streaming=True),
                       tokens=spans_html(answer.spans, s.show_rejected),
                       stats=stats_html(answer.live), spans=list(answer.spans))
        shown = {"tokens": spans_html(answer.spans, s.show_rejected),
                 "stats": stats_html(answer.live), "summary": summary_html(answer.live),
                 "spans": list(answer.spans)}
        if not answer.text.strip():  # nothing said: no empty turn, the conversation as it was
            yield self._restore(turn, answer.error or (
                "Stopped before the first token." if answer.stopped
                else "The model's answer was empty."), saver, **shown)
            return
        saver.finished(answer)
        if saver.store is not None and not saver.problem:  # saved: the history learns it too
            turns.host.remember_answer(pipe, answer.token_ids, started[0].prompt_ids)
        history = self._with_answer(turn.messages, answer.text)
        notice = answer.error or ("Stopped." if answer.stopped else "")
        yield view(ChatView, history=history, chat=chat_html(history),
                   notice=notice_html(saver.notice(notice)), **shown)

    @staticmethod
    def _restore(turn: Turn, why: str, saver: TurnSaver, **shown: Any) -> ChatView:
        """No answer: the conversation as it was (saved as it was), the message back in the
        box, and why."""
        saver.undo()
        if turn.message is not None:
            why += " Your message is back in the box."
        return view(ChatView, history=turn.before, chat=chat_html(turn.before),
                    message=turn.message if turn.message is not None else gr.skip(),
                    notice=notice_html(saver.notice(why)), conversation=saver.conversation,
                    **shown)

    @staticmethod
    def _with_answer(messages: Messages, text: str) -> Messages:
        """The conversation with the answer so far; no assistant turn while it says nothing."""
        return [*messages, {"role": "assistant", "content": text}] if text.strip() else messages
