"""The app's handlers: chat, regenerate, race, stop, preset switch. Plain generators over a
``ModelHost``: tests call them directly, as Gradio would, without a browser.

Every view they yield is built by the pure renderers (``render``, ``chat_view``,
``preset_view``); the one streaming loop is ``streaming.follow``; the settings of a generation
arrive as one ``Settings`` (``layout`` builds it from the controls). Values are not cast or
checked here: ``Pipeline.request`` validates them against ``localspec.config`` and its
``RequestError`` names the bad one, which the user reads in the notice under the chat.

What the user sees when things go wrong: a refusal before any token (a bad setting, an
over-long prompt, a method the preset cannot run) takes the user's turn back and puts the
message back into the box; a failure mid-answer keeps the partial answer; there is never an
empty assistant turn. Expected failures are ``LocalSpecError``; anything else is a bug, logged
with its traceback and shown as a short message. Text that is not valid Unicode (lone
surrogates: a page can send them, no tokenizer or page takes them) is refused before anything
is shown; a message comes back into the box with U+FFFD in their place, to edit or send as is.

Concurrency: Gradio may run several sessions' handlers at once; the host's generation lock lets
one generate, and the others say that they are waiting (and can be stopped while they wait).

Saving: given a ``ChatStore``, each turn is saved as it happens (``saving.TurnSaver``) in the
tab's conversation (``conversation``: its id, None for a new one), and every view of the turn
carries that id back to the tab; the side panel's handlers are in ``conversations``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import gradio as gr

from localspec.chats.store import ChatStore
from localspec.engine.engine import GenerationRequest, StepEvent
from localspec.engine.spans import TokenSpan, TokenTexts
from localspec.errors import LocalSpecError
from localspec.files import replace_lone_surrogates
from localspec.host import ModelHost
from localspec.models.hardware import Hardware, survey_presets
from localspec.pipeline import Pipeline
from localspec.presets import Preset, load_preset
from localspec.ui.chat_view import chat_html, notice_html
from localspec.ui.preset_view import preset_info_html, presets_html
from localspec.ui.render import (
    LiveStats,
    RaceSide,
    race_html,
    spans_html,
    stats_html,
    status_html,
    summary_html,
)
from localspec.ui.saving import TurnSaver, answer_settings
from localspec.ui.streaming import Answer, follow
from localspec.ui.views import (
    ChatView,
    Messages,
    RaceView,
    Settings,
    SwitchView,
    Turn,
    View,
    not_unicode,
    plain_history,
    view,
)

logger = logging.getLogger(__name__)
CLEAR_WAIT_S = 30.0  # the longest Clear waits for a running answer to stop (one step)
STOP_WAIT_S = 2.0  # how long Stop waits for the answer's own "Stopped." before saying "Stopping…"
FAILED_TO_START = ("⚠ The generation could not start (an internal error; the details are in "
                   "the server log).")


class ChatApp:
    """Handlers of the app, over a ModelHost and a description of this machine."""

    def __init__(self, host: ModelHost, hardware: Hardware, default_preset: str,
                 min_update_interval: float = 0.08,
                 clock: Callable[[], float] = time.perf_counter,
                 stop_wait_s: float = STOP_WAIT_S, store: ChatStore | None = None) -> None:
        self.host = host
        self.store = store  # where conversations are saved (None: nowhere)
        self.hardware = hardware
        self.default_preset = default_preset
        self.min_update_interval = min_update_interval
        self.clock = clock
        self.stop_wait_s = stop_wait_s

    # ------------------------------------------------------------------ status and presets

    def status(self) -> str:
        st = self.host.status()
        return status_html(st.active_title, st.active, st.loading, st.message, st.fraction,
                           st.error)

    def preset_choices(self) -> list[tuple[str, str]]:
        return [(row.title if row.fits else f"{row.title} — ✗ {row.reason}", row.key)
                for row in survey_presets(self.hardware)]

    def presets_html(self) -> str:
        return presets_html(survey_presets(self.hardware), self.hardware.describe())

    def switch_preset(self, key: str | None) -> Iterator[SwitchView]:
        """Load another preset (a name or a .toml path) with progress; keep the old on failure.
        A typed name's lone surrogates become U+FFFD: no preset has them, and its error is shown."""
        key = replace_lone_surrogates((key or "").strip())
        while self.host.is_loading():  # the start-up load, or another tab's switch
            yield view(SwitchView, status=self.status())
            self.host.wait_loaded(0.5)
        st = self.host.status()
        if not key or (key == st.active and st.error is None):
            yield view(SwitchView, status=self.status())
            return
        thread = self.host.load_async(key)
        while thread.is_alive():
            yield view(SwitchView, status=self.status())
            thread.join(0.5)
        st = self.host.status()
        pipe = self.host.pipeline
        if st.active != key or pipe is None:  # failed: the dropdown goes back to the active one
            yield view(SwitchView, status=self.status(), preset=st.active)
            return
        listed = {value for _, value in self.preset_choices()}
        yield self._controls(pipe.preset, status=self.status(),
                             preset=key if key in listed else None, method="preset")

    def initial_controls(self) -> SwitchView:
        """The sampling controls from the active (or the default) preset when a page opens."""
        pipe = self.host.pipeline
        if pipe is not None:
            return self._controls(pipe.preset)
        try:
            return self._controls(load_preset(self.default_preset))
        except LocalSpecError:  # no such preset: the page opens with the config's defaults
            return view(SwitchView)

    @staticmethod
    def _controls(p: Preset, **fields: Any) -> SwitchView:
        """The controls set to preset ``p``'s values (and any other ``fields``)."""
        s = p.sampling
        return view(SwitchView, info=preset_info_html(p), temperature=s.temperature,
                     top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                     k=p.speculative_config.num_speculative_tokens, seed=s.seed, **fields)

    # ------------------------------------------------------------------ chat

    def chat(self, message: str | None, history: Sequence[dict] | None, settings: Settings,
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

    def stop(self, session: str = "local", tab: str = "chat") -> str | dict[str, Any]:
        """Stop ``session``'s running (or waiting) generations in ``tab`` ("chat" or "race").

        The answer's last update says "Stopped." itself. This reply and that update reach the
        page by different connections, in either order, so a "Stopping…" sent here could land
        after it and stay. So Stop waits up to ``stop_wait_s`` for the answer to end and then
        leaves the notice alone; only a longer step (a long prompt's prefill) gets "Stopping…"."""
        where = f"{session}/{tab}"
        if not self.host.cancel(where):
            return notice_html("Nothing to stop.")
        if self.host.wait_ended(where, self.stop_wait_s):
            return gr.skip()
        return notice_html("Stopping after the current step…")

    def clear(self, session: str = "local") -> ChatView:
        """A new conversation. An answer still running is stopped first, and waited for, so
        that its last update cannot bring the old conversation back after this one."""
        if self.host.cancel(f"{session}/chat"):
            self.host.wait_ended(f"{session}/chat", CLEAR_WAIT_S)
        return ChatView([], chat_html([]), "", spans_html([]), "", "", "", [], None)

    @staticmethod
    def rerender(spans: list[TokenSpan] | None, show_rejected: bool) -> str:
        return spans_html(spans or [], show_rejected)

    def _answer(self, turn: Turn, s: Settings, session: str,
                conversation: int | None) -> Iterator[ChatView]:
        session = f"{session}/chat"
        cancel = self.host.begin(session)
        try:
            saver = TurnSaver(self.store, conversation, turn)
            yield view(ChatView, history=turn.messages, chat=chat_html(turn.messages, True),
                        message="" if turn.message is not None else gr.skip(),
                        tokens=spans_html([]), summary="", notice="", spans=[],
                        conversation=saver.conversation)
            why_not = yield from self.wait_turn(
                cancel, lambda text: view(ChatView, notice=notice_html(text)))
            if why_not is not None:
                yield self._restore(turn, why_not, saver)
                return
            try:
                yield from self._stream_chat(self.host.pipeline, turn, s, cancel, saver)
            finally:
                self.host.generation_lock.release()
        finally:
            self.host.end(session, cancel)

    def _stream_chat(self, pipe: Pipeline, turn: Turn, s: Settings, cancel: threading.Event,
                     saver: TurnSaver) -> Iterator[ChatView]:
        """Generate (the lock is held) and show the answer as it comes; see the module doc for
        what a refusal, a failure, a Stop or an empty answer leave behind."""
        method = self._method(pipe, s)
        started = self._start(pipe, self._with_system(turn.messages, s), s, method, cancel, True)
        if isinstance(started, str):  # refused before any token
            yield self._restore(turn, started, saver)
            return
        saver.started(self.host.status().active, answer_settings(started[0], method, s.system))
        answer = self._new_answer(pipe, method)
        for _ in follow(started[1], answer, self.clock, self.min_update_interval):
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

    # ------------------------------------------------------------------ race

    def race(self, prompt: str | None, settings: Settings,
             session: str = "local") -> Iterator[RaceView]:
        """The same prompt through plain decoding, then through speculation; side by side."""
        text = (prompt or "").strip()
        refused = not_unicode([], settings, prompt=text)
        if refused is not None or not text:
            yield view(RaceView, notice=notice_html(refused or "Type a prompt to race."))
            return
        session = f"{session}/race"
        cancel = self.host.begin(session)
        try:
            why_not = yield from self.wait_turn(
                cancel, lambda notice: view(RaceView, notice=notice_html(notice)))
            if why_not is not None:
                yield view(RaceView, notice=notice_html(why_not))
                return
            try:
                yield from self._race(self.host.pipeline, text, settings, cancel)
            finally:
                self.host.generation_lock.release()
        finally:
            self.host.end(session, cancel)

    def _race(self, pipe: Pipeline, prompt: str, s: Settings,
              cancel: threading.Event) -> Iterator[RaceView]:
        method = self._method(pipe, s)
        if method == "none":
            yield view(RaceView, notice=notice_html(
                "Pick a speculative method (draft model or n-gram) to race against plain "
                "decoding."))
            return
        messages = self._with_system([{"role": "user", "content": prompt}], s)
        sides = [RaceSide("plain decoding (none)", (), None, (), False),
                 RaceSide(f"speculative ({method})", (), None, (), False)]
        greedy = True
        for index, m in enumerate(("none", method)):
            started = self._start(pipe, messages, s, m, cancel)
            if isinstance(started, str):
                yield RaceView(race_html(sides[0], sides[1], greedy), notice_html(started))
                return
            greedy = started[0].sampling.greedy
            for answer in follow(started[1], self._new_answer(pipe, m), self.clock,
                                 self.min_update_interval):
                complete = answer.done and not (answer.error or answer.stopped)
                sides[index] = RaceSide(sides[index].title, tuple(answer.spans), answer.live,
                                        tuple(answer.token_ids), complete)
                if not answer.done:
                    yield RaceView(race_html(sides[0], sides[1], greedy), "")
            if answer.error or answer.stopped:
                yield RaceView(race_html(sides[0], sides[1], greedy),
                               notice_html(answer.error or "Stopped."))
                return
        yield RaceView(race_html(sides[0], sides[1], greedy), "")

    # ------------------------------------------------------------------ shared

    def wait_turn(self, cancel: threading.Event,
                   notice: Callable[[str], View]) -> Generator[View, None, str | None]:
        """Wait for loaded models and the generation lock, yielding notices. Returns None once
        the lock is held, else why not (stopped while waiting, no model)."""
        while self.host.is_loading():
            if cancel.is_set():
                return "Stopped while waiting for the models to load."
            st = self.host.status()
            yield notice(f"⏳ Waiting for the models to load: {st.message} ({st.fraction:.0%})")
            self.host.wait_loaded(0.5)
        if self.host.pipeline is None:
            error = self.host.status().error
            return (f"⚠ No model is loaded{': ' + error if error else ''}. "
                    "Pick a preset that fits this machine.")
        got = self.host.acquire(cancel, 0.0)
        if got:
            return None
        waiting = self.host.set_waiting(+1)
        try:
            while not got:
                if got is None:
                    return "Stopped while waiting for your turn."
                yield notice(f"⏳ Waiting: another tab is generating ({waiting} waiting). "
                             "Yours starts as soon as it finishes.")
                got = self.host.acquire(cancel, 0.5)
        finally:
            self.host.set_waiting(-1)
        return None

    @staticmethod
    def _method(pipe: Pipeline, s: Settings) -> str:
        return pipe.preset.speculative_config.method if s.method == "preset" else s.method

    @staticmethod
    def _with_system(messages: Messages, s: Settings) -> Messages:
        system = [{"role": "system", "content": s.system}] if (s.system or "").strip() else []
        return [*system, *messages]

    def _start(self, pipe: Pipeline, messages: Messages, s: Settings, method: str,
               cancel: threading.Event, reuse_prefix: bool = False
               ) -> tuple[GenerationRequest, Iterator[StepEvent]] | str:
        """Validate and start a generation (on the host's engine thread; a chat turn keeps the
        conversation's cached tokens, a race starts cold); or why not, for the user (a refused
        setting, an over-long prompt, a method this preset cannot run: all before any token)."""
        try:
            request = pipe.request(pipe.encode_chat(messages), reuse_prefix=reuse_prefix,
                                   **s.overrides())
            return request, self.host.on_engine(pipe.stream(request, method,
                                                            cancelled=cancel.is_set))
        except LocalSpecError as exc:
            return f"⚠ {exc}"
        except Exception:  # a bug: the traceback goes to the log, the user gets a short word
            logger.exception("could not start a generation")
            return FAILED_TO_START

    def _new_answer(self, pipe: Pipeline, method: str) -> Answer:
        decode = pipe.tokenizer.decode
        return Answer(LiveStats(method, clock=self.clock),
                      TokenTexts(lambda ids: decode(ids, skip_special_tokens=True)))
