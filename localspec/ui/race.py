"""The race tab's handler: the same prompt through plain decoding, then through the chosen
speculative method, one after the other on this machine, shown side by side as they run
(``render.race_html``: at the end, the speed-up and whether both said the same).

A plain generator over ``Turns``, called by tests as Gradio calls it. A refusal (a bad
setting, an over-long prompt, no speculative method) is said before anything runs; a failure
or a Stop in either run ends the race and is said under it. A race starts cold: it reuses no
conversation's cached tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from localspec.pipeline import Pipeline
from localspec.ui.chat_view import notice_html
from localspec.ui.render import RaceSide, race_html
from localspec.ui.streaming import follow
from localspec.ui.turns import Turns
from localspec.ui.views import RaceView, Settings, not_unicode, view


class RaceHandlers:
    """The race tab's handler over ``turns``."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns

    def run(self, prompt: str | None, settings: Settings,
            session: str = "local") -> Iterator[RaceView]:
        """The same prompt through plain decoding, then through speculation; side by side."""
        text = (prompt or "").strip()
        refused = not_unicode([], settings, prompt=text)
        if refused is not None or not text:
            yield view(RaceView, notice=notice_html(refused or "Type a prompt to race."))
            return
        host = self.turns.host
        session = f"{session}/race"
        cancel = host.begin(session)
        try:
            why_not = yield from self.turns.wait_turn(
                cancel, lambda notice: view(RaceView, notice=notice_html(notice)))
            if why_not is not None:
                yield view(RaceView, notice=notice_html(why_not))
                return
            try:
                yield from self._race(host.pipeline, text, settings, cancel)
            finally:
                host.generation_lock.release()
        finally:
            host.end(session, cancel)

    def _race(self, pipe: Pipeline, prompt: str, s: Settings,
              cancel: threading.Event) -> Iterator[RaceView]:
        turns = self.turns
        method = turns.method(pipe, s)
        if method == "none":
            yield view(RaceView, notice=notice_html(
                "Pick a speculative method (draft model or n-gram) to race against plain "
                "decoding."))
            return
        messages = turns.with_system([{"role": "user", "content": prompt}], s)
        sides = [RaceSide("plain decoding (none)", (), None, (), False),
                 RaceSide(f"speculative ({method})", (), None, (), False)]
        greedy = True
        for index, m in enumerate(("none", method)):
            started = turns.start(pipe, messages, s, m, cancel)
            if isinstance(started, str):
                yield RaceView(race_html(sides[0], sides[1], greedy), notice_html(started))
                return
            greedy = started[0].sampling.greedy
            for answer in follow(started[1], turns.new_answer(pipe, m), turns.clock,
                                 turns.min_update_interval):
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
