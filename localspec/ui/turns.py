"""What every generating handler shares (the chat, the race, tuning): a session's turn at the
model, and starting, reading and stopping a generation in it.

A handler registers its running generation under ``<session>/<tab>`` with the host, then
``wait_turn`` waits for loaded models and the host's generation lock (Gradio may run several
sessions' handlers at once: one generates, the others say that they are waiting and can be
stopped while they wait). ``start`` validates and starts a generation on the host's engine
thread, or says why not for the user; ``new_answer`` is what ``streaming.follow`` fills in as
its events arrive; ``stop`` cancels a tab's generation. The name of the method a generation
runs is resolved in one place, ``method``.

Expected failures are ``LocalSpecError`` and reach the user as their message; anything else
is a bug, logged with its traceback and shown as a short message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import gradio as gr

from localspec.engine.engine import GenerationRequest, StepEvent
from localspec.engine.spans import TokenTexts
from localspec.errors import LocalSpecError
from localspec.host import ModelHost
from localspec.pipeline import Pipeline
from localspec.ui.chat_view import notice_html
from localspec.ui.render import LiveStats
from localspec.ui.streaming import Answer
from localspec.ui.views import Messages, Settings, View

logger = logging.getLogger(__name__)
STOP_WAIT_S = 2.0  # how long Stop waits for the answer's own "Stopped." before saying "Stopping…"
FAILED_TO_START = ("⚠ The generation could not start (an internal error; the details are in "
                   "the server log).")


class Turns:
    """Turns at the model over a ``ModelHost``: what the chat, race and tuning handlers share.

    ``clock`` and ``min_update_interval`` pace the streamed views (``streaming.follow``);
    ``stop_wait_s`` is how long Stop waits for an answer to end (see ``stop``)."""

    def __init__(self, host: ModelHost, min_update_interval: float = 0.08,
                 clock: Callable[[], float] = time.perf_counter,
                 stop_wait_s: float = STOP_WAIT_S) -> None:
        self.host = host
        self.min_update_interval = min_update_interval
        self.clock = clock
        self.stop_wait_s = stop_wait_s

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

    def stop(self, session: str = "local", tab: str = "chat") -> str | dict[str, Any]:
        """Stop ``session``'s running (or waiting) generations in ``tab`` ("chat", "race" or
        "tune").

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

    @staticmethod
    def method(pipe: Pipeline, s: Settings) -> str:
        """The method a generation runs: the one the side panel picked, or the preset's."""
        return pipe.preset.speculative_config.method if s.method == "preset" else s.method

    @staticmethod
    def with_system(messages: Messages, s: Settings) -> Messages:
        """``messages`` after the side panel's system prompt, if it says anything."""
        system = [{"role": "system", "content": s.system}] if (s.system or "").strip() else []
        return [*system, *messages]

    def start(self, pipe: Pipeline, messages: Messages, s: Settings, method: str,
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

    def new_answer(self, pipe: Pipeline, method: str) -> Answer:
        """An empty answer of ``method``, its tokens read with ``pipe``'s tokenizer."""
        decode = pipe.tokenizer.decode
        return Answer(LiveStats(method, clock=self.clock),
                      TokenTexts(lambda ids: decode(ids, skip_special_tokens=True)))
