"""The one streaming loop of the app: a generation's StepEvents in, throttled snapshots out.

Chat and race both show a generation as it happens: coloured spans, a live readout, the text so
far. ``follow`` feeds the events into an ``Answer`` and yields it at most every
``min_interval`` seconds (a browser cannot usefully repaint faster, and each update costs a
round trip), and always once more at the end with ``done`` set. A failure mid-answer ends the
stream there and keeps what was said: an expected one (``LocalSpecError``) with its message, a
bug with its traceback in the server log and a short message for the user.

No Gradio here: views are built by the caller from the snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from localspec.engine.engine import StepEvent
from localspec.engine.spans import TokenSpan, TokenTexts, event_spans
from localspec.errors import LocalSpecError
from localspec.ui.render import (
    LiveStats,
)

logger = logging.getLogger(__name__)

FAILED_MID_ANSWER = ("⚠ The generation failed (an internal error; the details are in the "
                     "server log). What was said so far is kept.")


@dataclass
class Answer:
    """A generation as far as it has got: what every view of it renders."""

    live: LiveStats
    texts: TokenTexts
    spans: list[TokenSpan] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False
    error: str = ""  # why it ended early, for the user ("" if it did not)

    @property
    def stopped(self) -> bool:
        """Ended by the user's Stop."""
        return self.live.finish_reason == "cancelled"

    def add(self, event: StepEvent) -> None:
        self.live.add(event)
        self.spans.extend(event_spans(event, self.texts))
        self.token_ids.extend(event.tokens)
        self.text += event.text_delta


def follow(events: Iterable[StepEvent], answer: Answer, clock: Callable[[], float],
           min_interval: float) -> Iterator[Answer]:
    """Feed ``events`` into ``answer``; yield it after a step when ``min_interval`` s have
    passed since the last yield (and on the last step), then once more with ``done`` set."""
    last = float("-inf")
    try:
        for event in events:
            answer.add(event)
            now = clock()
            if event.finish_reason is None and now - last < min_interval:
                continue
            last = now
            yield answer
    except LocalSpecError as exc:  # expected (e.g. a model file gone bad): the user is told
        logger.warning("generation stopped: %s", exc)
        answer.error = f"⚠ {exc}"
    except Exception:  # a bug below the UI: keep the partial answer, log the traceback
        logger.exception("generation failed mid-answer")
        answer.error = FAILED_MID_ANSWER
    answer.done = True
    yield answer
