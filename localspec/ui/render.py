"""Pure rendering: the engine's StepEvents in, HTML and text out. No Gradio, no tensors.

Token colours: an *accepted* draft token (green), the target's own token after a rejection
(*recovered*, orange) or after a fully accepted draft (*bonus*, blue), the target's token on a
step where nothing was drafted (*target*, uncoloured), and *rejected* draft tokens struck
through in place, right where the recovered token replaced them (their line breaks drawn as ↵,
so the answer keeps its layout).

Token text: each token's text is what it adds to the decoded text, found by decoding a short
window of the preceding tokens with and without it (so SentencePiece's leading spaces and
byte-level BPE both come out right). A character whose UTF-8 bytes are split over several tokens
is shown on the token that completes it; the earlier ones render empty (their hover still says
which step and probabilities they had). The copyable plain text is the engine's own
``text_delta`` stream, which is UTF-8 safe and honours stop strings.
"""

from __future__ import annotations

import html
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localspec.engine.engine import StepEvent
from localspec.engine.spans import KINDS, TokenSpan
from localspec.engine.stats import GenerationStats

KIND_LABELS = {
    "accepted": "accepted draft token",
    "recovered": "target's token after a rejection (recovered)",
    "bonus": "target's bonus token after a fully accepted draft",
    "target": "target's token, nothing drafted this step",
    "rejected": "rejected draft token",
}
CSS = """
.ls-tokens { white-space: pre-wrap; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
  font-size: 0.9em; line-height: 1.55; word-break: break-word; padding: 8px;
  border: 1px solid var(--border-color-primary); border-radius: 6px; min-height: 3em; }
.ls-tok { border-radius: 3px; box-shadow: inset -1px 0 0 rgba(0, 0, 0, 0.12); }
.ls-tok:hover { outline: 1px solid #475569; }
.ls-accepted { background: #bbf7d0; color: #14532d; }
.ls-recovered { background: #fed7aa; color: #7c2d12; }
.ls-bonus { background: #bfdbfe; color: #1e3a8a; }
.ls-target { background: transparent; }
.ls-rejected { background: #fecaca; color: #7f1d1d; text-decoration: line-through; opacity: 0.75; }
.ls-legend { display: flex; flex-wrap: wrap; gap: 10px; font-size: 0.85em; margin: 4px 0; }
.ls-legend .ls-tok { padding: 0 4px; }
.ls-by-ngram { text-decoration: underline dotted; }
.ls-by-suffix { text-decoration: underline dashed; }
.ls-stats table { width: 100%; font-size: 0.9em; border-collapse: collapse; }
.ls-stats td { padding: 2px 6px; border-bottom: 1px solid var(--border-color-primary); }
.ls-stats td.ls-num { text-align: right; font-variant-numeric: tabular-nums; }
.ls-chart { display: flex; align-items: flex-end; gap: 3px; height: 64px; margin-top: 6px; }
.ls-bar { width: 18px; background: #22c55e; position: relative; min-height: 1px; }
.ls-bar span { position: absolute; bottom: -16px; left: 0; right: 0; text-align: center;
  font-size: 10px; }
.ls-race { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
.ls-verdict { font-size: 1.1em; margin: 6px 0; }
"""


def span_title(span: TokenSpan) -> str:
    parts = [f"step {span.step}", KIND_LABELS[span.kind], f"token {span.token_id} {span.text!r}"]
    if span.drafter is not None:
        parts.insert(2, f"drafted by {span.drafter}")
    if span.p_target is not None:
        parts.append(f"p_target={span.p_target:.3f}")
    if span.q_draft is not None:
        parts.append(f"q_draft={span.q_draft:.3f}")
    return " · ".join(parts)


def _shown_text(span: TokenSpan) -> str:
    """Rejected drafts show their line breaks as ↵ so they never break the answer's layout."""
    return span.text.replace("\n", "↵") if span.kind == "rejected" else span.text


def _by(span: TokenSpan) -> str:
    """The class naming a drafted token's drafter (registry names: letters, digits, '_')."""
    name = span.drafter or ""
    return f" ls-by-{name}" if name.replace("_", "").isalnum() and name.isascii() else ""


def spans_html(spans: Sequence[TokenSpan], show_rejected: bool = True) -> str:
    """The coloured answer: one <span> per token, text escaped, whitespace kept (pre-wrap)."""
    body = "".join(
        f'<span class="ls-tok ls-{s.kind}{_by(s)}" '
        f'title="{html.escape(span_title(s), quote=True)}">{html.escape(_shown_text(s))}</span>'
        for s in spans
        if show_rejected or s.kind != "rejected"
    )
    return f'<div class="ls-tokens">{body}</div>'


def legend_html() -> str:
    items = "".join(f'<span class="ls-tok ls-{kind}">{html.escape(KIND_LABELS[kind])}</span>'
                    for kind in KINDS)
    lookup = ('<span class="ls-tok ls-by-ngram">dotted: guessed by n-gram lookup</span> '
              '<span class="ls-tok ls-by-suffix">dashed: by the suffix tree (this chat, your '
              "earlier answers)</span> (hover a token: which drafter guessed it)")
    return f'<div class="ls-legend">{items}{lookup}</div>'


# ----------------------------------------------------------------------------- statistics


class LiveStats:
    """GenerationStats plus a wall clock and a recent-rate window, fed one event at a time."""

    def __init__(self, method: str, clock: Callable[[], float] = time.perf_counter,
                 window_s: float = 1.0) -> None:
        self.method = method
        self.clock = clock
        self.window_s = window_s
        self.stats = GenerationStats()
        self.start = clock()
        self.k = 0
        self.finish_reason: str | None = None
        self._recent: deque[tuple[float, int]] = deque()

    def add(self, event: StepEvent) -> None:
        now = self.clock()
        self.stats.add(event)
        self.stats.wall_time = now - self.start
        if event.drafted or event.tokens:
            self.k = event.k
        self.finish_reason = event.finish_reason or self.finish_reason
        self._recent.append((now, len(event.tokens)))
        while len(self._recent) > 2 and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()

    @property
    def current_tokens_per_second(self) -> float:
        """Tokens per second over the last ``window_s`` (the first step includes prefill)."""
        if len(self._recent) < 2:
            return self.stats.tokens_per_second
        span = self._recent[-1][0] - self._recent[0][0]
        tokens = sum(n for _, n in list(self._recent)[1:])
        return tokens / span if span > 0 else 0.0


def acceptance_chart_html(stats: GenerationStats) -> str:
    """Acceptance rate per draft position (1st drafted token, 2nd, ...), as HTML bars."""
    if not stats.drafted_per_position:
        return '<div class="ls-chart-empty">no drafts yet</div>'
    bars = []
    for i, (acc, drafted) in enumerate(zip(stats.accepted_per_position,
                                           stats.drafted_per_position, strict=True)):
        rate = acc / drafted if drafted else 0.0
        bars.append(f'<div class="ls-bar" style="height:{max(1, round(rate * 100))}%" '
                    f'title="position {i + 1}: {acc}/{drafted} accepted ({rate:.0%})">'
                    f"<span>{i + 1}</span></div>")
    return ('<div>acceptance by draft position</div>'
            f'<div class="ls-chart">{"".join(bars)}</div><div style="height:16px"></div>')


def stats_html(live: LiveStats) -> str:
    """The live readout: speed, acceptance, counts, time split, k, each drafter's acceptance
    when several draft (an ``auto`` set), per-position chart."""
    s = live.stats
    rows = [
        ("method", live.method),
        ("tokens/s (current)", f"{live.current_tokens_per_second:.1f}"),
        ("tokens/s (average)", f"{s.tokens_per_second:.1f}"),
        ("acceptance rate", f"{s.acceptance_rate:.0%}" if s.drafted else "–"),
        ("tokens per target pass", f"{s.mean_accepted_length:.2f}"),
        ("drafted / accepted", f"{s.drafted} / {s.accepted}"),
        ("new tokens / target passes", f"{s.new_tokens} / {s.target_forward_passes}"),
        ("draft time / verify time", f"{s.draft_time:.2f} s / {s.verify_time:.2f} s"),
        ("current k", str(live.k)),
    ]
    if s.cached_tokens:  # a conversation's earlier turns, not read again
        rows.append(("prompt tokens kept from the last turn", str(s.cached_tokens)))
    counts = s.drafters()
    if len(counts) > 1 or (counts and live.method not in counts):  # an auto set: each member
        rows += [(f"{name}: steps, accepted / drafted",
                  f"{c['steps']}, {c['accepted']} / {c['drafted']} ({c['acceptance_rate']:.0%})")
                 for name, c in counts.items()]
    table = "".join(f'<tr><td>{html.escape(name)}</td><td class="ls-num">{html.escape(value)}'
                    "</td></tr>" for name, value in rows)
    return f'<div class="ls-stats"><table>{table}</table>{acceptance_chart_html(s)}</div>'


def summary_html(live: LiveStats) -> str:
    """The summary line as escaped HTML (it names the method and how the answer ended)."""
    return f'<div class="ls-summary">{html.escape(summary_line(live))}</div>'


def summary_line(live: LiveStats) -> str:
    """One line after an answer."""
    s = live.stats
    accept = f", acceptance {s.acceptance_rate:.0%}" if s.drafted else ""
    finish = f", stopped: {live.finish_reason}" if live.finish_reason else ""
    return (f"{live.method}: {s.new_tokens} tokens in {s.wall_time:.1f} s, "
            f"{s.tokens_per_second:.1f} tok/s{accept}, {s.mean_accepted_length:.2f} tokens per "
            f"target pass{finish}")


# ----------------------------------------------------------------------------- race


@dataclass(frozen=True)
class RaceSide:
    title: str
    spans: tuple[TokenSpan, ...]
    live: LiveStats | None
    token_ids: tuple[int, ...]
    done: bool


def race_html(plain: RaceSide, spec: RaceSide, greedy: bool) -> str:
    """Both runs side by side, then the verdict once both are done."""
    columns = []
    for side in (plain, spec):
        readout = (f"<div>{html.escape(summary_line(side.live))}</div>" if side.live is not None
                   else "<div>waiting…</div>")
        columns.append(f"<div><h3>{html.escape(side.title)}</h3>{readout}"
                       f"{spans_html(side.spans, show_rejected=True)}</div>")
    verdict = ""
    if plain.done and spec.done and plain.live is not None and spec.live is not None:
        identical = plain.token_ids == spec.token_ids
        base = plain.live.stats.tokens_per_second
        speedup = spec.live.stats.tokens_per_second / base if base > 0 else 0.0
        note = ""
        if not identical and not greedy:
            note = (" (expected when sampling: both follow the target's distribution, but draw "
                    "different samples)")
        elif not identical:
            note = (" (greedy outputs should match; a bf16 near-tie can differ: "
                    "`python -m localspec verify` checks)")
        verdict = (f'<div class="ls-verdict">identical: <b>{"yes" if identical else "no"}</b>'
                   f"{html.escape(note)} · speedup: <b>{speedup:.2f}×</b></div>")
    return f'{verdict}<div class="ls-race">{"".join(columns)}</div>'


# ----------------------------------------------------------------------------- status


def status_html(active_title: str | None, active_key: str | None, loading: str | None,
                message: str, fraction: float, error: str | None) -> str:
    """The status line: loading progress, the active preset, the last load error."""
    parts = []
    fraction = min(max(fraction, 0.0), 1.0) if math.isfinite(fraction) else 0.0
    if loading is not None:
        parts.append(f'<div class="ls-loading">⏳ Loading preset <b>{html.escape(loading)}</b>: '
                     f"{html.escape(message)} ({fraction:.0%}) "
                     f'<progress max="100" value="{round(100 * fraction)}"></progress></div>')
    if error is not None:
        parts.append(f'<div class="ls-error">⚠ {html.escape(error)}</div>')
    if active_title is not None:
        parts.append(f'<div class="ls-active">✓ Active preset: <b>{html.escape(active_title)}</b>'
                     f" (<code>{html.escape(active_key or '')}</code>)</div>")
    elif loading is None:
        parts.append('<div class="ls-active">No model loaded: pick a preset that fits this '
                     "machine.</div>")
    return f'<div class="ls-status">{"".join(parts)}</div>'
