"""The app's pure renderers on canned StepEvents: colours by origin, rejected drafts in place,
hover text, escaping and whitespace, UTF-8 split over tokens, the live readout, the race verdict.
No Gradio, no model."""

from __future__ import annotations

import re

import pytest
from conftest import TOKENIZER_TEXTS, train_tokenizer

from localspec.engine.engine import StepEvent
from localspec.ui.render import (
    KINDS,
    LiveStats,
    RaceSide,
    TokenSpan,
    TokenTexts,
    acceptance_chart_html,
    event_spans,
    legend_html,
    race_html,
    spans_html,
    stats_html,
    status_html,
    summary_line,
)

# A byte-level toy vocabulary: ids 10 and 11 split the euro sign's three UTF-8 bytes.
VOCAB = {1: b"def", 2: b" add", 3: b"(a", 4: b", b", 5: b"):", 6: b"\n    ", 7: b"<b>&",
         8: b" return", 9: b" a + b", 10: b"\xe2\x82", 11: b"\xac", 12: b"x", 0: b""}


def toy_decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def event(step: int, drafted: tuple[int, ...], accepted: int, target: int | None,
          kind: str = "recovered", finish: str | None = None,
          tokens: tuple[int, ...] | None = None) -> StepEvent:
    if tokens is None:
        tokens = drafted[:accepted] + ((target,) if target is not None else ())
    return StepEvent(
        step=step, k=max(len(drafted), 1), drafted=drafted, accepted=accepted,
        target_token=target, target_token_kind=kind, tokens=tokens,
        p_target=tuple(0.5 + 0.01 * i for i in range(len(tokens))),
        q_draft=tuple(0.9 - 0.1 * i for i in range(len(drafted))),
        text_delta=toy_decode(list(tokens)), draft_time=0.01, verify_time=0.02,
        finish_reason=finish)


def test_kinds_and_order_of_one_step() -> None:
    """Accepted drafts, then the rejected ones struck through in place, then the target's token."""
    texts = TokenTexts(toy_decode)
    spans = event_spans(event(1, drafted=(1, 2, 7, 12), accepted=2, target=3), texts)
    assert [s.kind for s in spans] == ["accepted", "accepted", "rejected", "rejected", "recovered"]
    assert [s.text for s in spans] == ["def", " add", "<b>&", "x", "(a"]
    assert [s.token_id for s in spans] == [1, 2, 7, 12, 3]
    assert spans[0].p_target == pytest.approx(0.5) and spans[0].q_draft == pytest.approx(0.9)
    assert spans[2].p_target is None and spans[2].q_draft == pytest.approx(0.7)  # rejected: q only
    assert spans[4].p_target == pytest.approx(0.52) and spans[4].q_draft is None
    assert texts.ids == [1, 2, 3]  # rejected tokens never enter the output


def test_bonus_plain_and_cut_steps() -> None:
    texts = TokenTexts(toy_decode)
    bonus = event_spans(event(1, (1, 2), 2, 3, kind="bonus"), texts)
    assert [s.kind for s in bonus] == ["accepted", "accepted", "bonus"]
    plain = event_spans(event(2, (), 0, 4, kind="bonus"), texts)
    assert [s.kind for s in plain] == ["target"]  # nothing drafted: the target alone
    cut = event_spans(event(3, (5, 6, 8), 3, None, finish="length", tokens=(5, 6)), texts)
    assert [s.kind for s in cut] == ["accepted", "accepted"]  # stopped inside the accepted run
    cancelled = StepEvent(4, 0, (), 0, None, "bonus", (), (), (), "", 0.0, 0.0, "cancelled")
    assert event_spans(cancelled, texts) == []


def test_character_split_over_tokens_renders_on_the_completing_token() -> None:
    texts = TokenTexts(toy_decode)
    spans = event_spans(event(1, (12, 10), 2, 11, kind="bonus"), texts)
    assert [s.text for s in spans] == ["x", "", "€"]
    # A rejected run that ends mid-character shows a replacement char rather than nothing.
    spans = event_spans(event(2, (10,), 0, 12), texts)
    assert [(s.kind, s.text) for s in spans] == [("rejected", "\ufffd"), ("recovered", "x")]


def test_token_texts_join_to_the_decoded_text_with_a_real_tokenizer() -> None:
    """Per-token texts concatenate to exactly the decoded output (byte-level BPE, window cut)."""
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    text = "def add(a, b):\n    return a + b\n\nhello wörld €€ ✓ " * 3
    ids = tokenizer.encode(text)
    texts = TokenTexts(tokenizer.decode, window=3)
    pieces = []
    for start in range(0, len(ids), 4):  # in steps, as the engine emits them
        pieces += texts.append(ids[start:start + 4])
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_html_escapes_keeps_whitespace_and_has_hover() -> None:
    texts = TokenTexts(toy_decode)
    spans = event_spans(event(7, (7, 6), 1, 8), texts)
    page = spans_html(spans)
    assert '<span class="ls-tok ls-accepted"' in page
    assert "&lt;b&gt;&amp;" in page and "<b>" not in page  # text is escaped, never markup
    assert ">↵    </span>" in page  # a rejected line break is drawn, not taken
    accepted_newline = spans_html([TokenSpan("\n  x", "accepted", 1, 6)])
    assert ">\n  x</span>" in accepted_newline  # the answer's own whitespace, verbatim
    assert 'class="ls-tokens"' in page  # the container that sets white-space: pre-wrap
    title = re.search(r'ls-accepted" title="([^"]*)"', page).group(1)
    assert "step 7" in title and "p_target=0.500" in title and "q_draft=0.900" in title
    assert "ls-rejected" not in spans_html(spans, show_rejected=False)
    assert spans_html(spans, show_rejected=False).count("ls-tok ") == 2


def test_legend_names_every_kind() -> None:
    legend = legend_html()
    for kind in KINDS:
        assert f"ls-{kind}" in legend


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_live_stats_rates_counts_and_chart() -> None:
    clock = FakeClock()
    live = LiveStats("draft_model", clock=clock, window_s=1.0)
    steps = [event(1, (1, 2, 3), 3, 4, "bonus"), event(2, (5, 6, 7), 1, 8),
             event(3, (9, 9, 9), 0, 12)]
    for i, e in enumerate(steps):
        clock.now = 100.0 + 0.5 * (i + 1)
        live.add(e)
    s = live.stats
    assert (s.new_tokens, s.drafted, s.accepted, s.target_forward_passes) == (7, 9, 4, 3)
    assert s.wall_time == pytest.approx(1.5)
    assert s.tokens_per_second == pytest.approx(7 / 1.5)
    assert live.current_tokens_per_second == pytest.approx((2 + 1) / 1.0)  # last second only
    assert live.k == 3
    html = stats_html(live)
    for label in ("tokens/s (current)", "tokens/s (average)", "acceptance rate", "current k",
                  "draft time / verify time", "drafted / accepted"):
        assert label in html
    assert "44%" in html and "9 / 4" in html and "7 / 3" in html
    chart = acceptance_chart_html(s)
    assert chart.count('class="ls-bar"') == 3
    assert 'title="position 1: 2/3 accepted (67%)"' in chart
    assert 'title="position 3: 1/3 accepted (33%)"' in chart
    assert "draft_model: 7 tokens in 1.5 s, 4.7 tok/s, acceptance 44%" in summary_line(live)


def test_plain_decoding_readout_has_no_acceptance() -> None:
    live = LiveStats("none", clock=FakeClock())
    live.add(event(1, (), 0, 1, "bonus", finish="eos"))
    assert "acceptance" not in summary_line(live)
    assert "stopped: eos" in summary_line(live)
    assert "no drafts yet" in acceptance_chart_html(live.stats)


def _side(title: str, ids: tuple[int, ...], seconds: float) -> RaceSide:
    clock = FakeClock()
    live = LiveStats(title, clock=clock)
    clock.now += seconds
    live.add(event(1, (), 0, ids[0], "bonus", finish="eos", tokens=ids))
    spans = tuple(TokenSpan(VOCAB[i].decode(), "target", 1, i) for i in ids)
    return RaceSide(title, spans, live, ids, True)


def test_race_verdict() -> None:
    plain, spec = _side("none", (1, 2, 3), 2.0), _side("ngram", (1, 2, 3), 1.0)
    page = race_html(plain, spec, greedy=True)
    assert "identical: <b>yes</b>" in page and "speedup: <b>2.00×</b>" in page
    differs = race_html(plain, _side("ngram", (1, 2, 4), 1.0), greedy=False)
    assert "identical: <b>no</b>" in differs and "different samples" in differs
    running = race_html(plain, RaceSide("ngram", (), None, (), False), greedy=True)
    assert "identical" not in running and "waiting" in running


def test_status_line() -> None:
    loading = status_html(None, None, "cpu-x", "converting <model>", 0.5, None)
    assert "Loading preset" in loading and "50%" in loading and "&lt;model&gt;" in loading
    failed = status_html("CPU · A", "a", None, "", 1.0, "could not load preset 'b': boom")
    assert 'class="ls-error"' in failed and "Active preset" in failed and "CPU · A" in failed
    assert "No model loaded" in status_html(None, None, None, "", 0.0, "bad")
