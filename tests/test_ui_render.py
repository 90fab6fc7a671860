"""The app's pure renderers on canned StepEvents: colours by origin, rejected drafts in place,
hover text, escaping and whitespace, UTF-8 split over tokens, the live readout, the race verdict;
the conversation view (escaped, inert, exact text), the preset panels, the streaming loop.
No Gradio, no model."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import replace
from html.parser import HTMLParser

import pytest
from conftest import TOKENIZER_TEXTS, train_tokenizer

from localspec.config import parse_preset
from localspec.engine.engine import StepEvent
from localspec.engine.spans import KINDS, TokenSpan, TokenTexts, event_spans
from localspec.errors import ModelLoadError
from localspec.models.hardware import PresetSummary
from localspec.ui.chat_view import code_segments, notice_html, text_html
from localspec.ui.preset_view import preset_info_html, presets_html
from localspec.ui.render import (
    LiveStats,
    RaceSide,
    acceptance_chart_html,
    legend_html,
    race_html,
    spans_html,
    stats_html,
    status_html,
    summary_html,
    summary_line,
)
from localspec.ui.streaming import FAILED_MID_ANSWER, Answer, follow

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
    assert "kept from the last turn" not in stats_html(live)  # a cold start says nothing


def test_a_warm_turn_shows_the_prompt_tokens_it_kept() -> None:
    live = LiveStats("none", clock=FakeClock())
    live.add(replace(event(1, (), 0, 1, "bonus"), cached=412))
    live.add(event(2, (), 0, 2, "bonus", finish="eos"))
    assert live.stats.cached_tokens == 412
    assert "prompt tokens kept from the last turn</td><td class=\"ls-num\">412" in stats_html(live)
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


# ----------------------------------------------------------------------------- escaping

INJECTIONS = [
    '<img src="http://127.0.0.1:9/leak">',
    "![x](http://127.0.0.1:9/leak) <b>bold</b> &amp; &lt;b&gt;",
    "\"' onmouseover=alert(1) x='",
    "<script>alert(1)</script><style>body{background:url(http://e/x)}</style>",
    "</div></span><iframe src=//e></iframe><!-- ${1+1} {{x}}",
    "```html\n<img src=x onerror=alert(1)>\n```\n    indented\tand tabbed\r\n",
]
SAFE_ATTRIBUTES = {"class", "title", "type", "data-label", "data-ls-copy", "max", "value"}
SAFE_TAGS = {"div", "span", "b", "code", "button", "progress", "table", "tr", "td", "h3", "br",
             "p", "ul", "li"}


class _Page(HTMLParser):
    """Every tag and attribute of an HTML fragment, and its text (entities decoded)."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def handle_comment(self, data: str) -> None:
        raise AssertionError(f"a comment in the page: {data!r}")


def assert_inert(page: str) -> _Page:
    """Only the renderer's own tags and attributes: nothing that could load or run anything."""
    parsed = _Page(page)
    for tag, attrs in parsed.tags:
        assert tag in SAFE_TAGS, (tag, page)
        for name, value in attrs:
            numeric_style = name == "style" and re.fullmatch(r"height:\d+(%|px)", value or "")
            assert name in SAFE_ATTRIBUTES or numeric_style, (tag, name, value)
    return parsed


@pytest.mark.parametrize("evil", INJECTIONS)
def test_token_view_escapes_model_text(evil: str) -> None:
    spans = [TokenSpan(evil, kind, 1, 7, 0.5, 0.5) for kind in KINDS]
    page = assert_inert(spans_html(spans))
    shown = "".join(page.text)
    assert shown == "".join(evil.replace("\n", "↵") if k == "rejected" else evil for k in KINDS)
    titles = [dict(attrs)["title"] for tag, attrs in page.tags if tag == "span"]
    assert all(repr(evil) in title for title in titles)  # hover text survives, as text


@pytest.mark.parametrize("evil", INJECTIONS)
def test_readout_race_and_status_escape_names_and_errors(evil: str) -> None:
    clock = FakeClock()
    live = LiveStats(evil, clock=clock)
    live.add(event(1, (1, 2), 1, 3, finish="eos"))
    assert evil in "".join(assert_inert(stats_html(live)).text)
    side = RaceSide(evil, (TokenSpan(evil, "target", 1, 1),), live, (1,), True)
    race = assert_inert(race_html(side, side, greedy=False))
    assert "".join(race.text).count(evil) >= 3  # two titles and two answers, as text
    status = status_html(evil, evil, evil, evil, float("nan"), evil)
    assert "".join(assert_inert(status).text).count(evil) == 5
    assert evil in "".join(assert_inert(summary_html(live)).text)


# ----------------------------------------------------------------------------- the chat


def _fuzz_texts(count: int) -> list[str]:
    alphabet = ["<", ">", "&", '"', "'", "`", "~", "!", "[", "]", "(", ")", "\n", "\r\n", " ",
                "    ", "\t", "b", "img", "amp;", "#", "$", "{", "}", "é", "€", "```", "~~~"]
    rng = random.Random(0)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
            for _ in range(count)]


@pytest.mark.parametrize("text", INJECTIONS + _fuzz_texts(300))
def test_message_text_is_shown_exactly_and_never_interpreted(text: str) -> None:
    """The text of a message as the page shows it (and the copy button copies, textContent)
    is exactly what was said; no tag but the renderer's own."""
    page = assert_inert(text_html(text))
    assert "".join(page.text) == text
    assert {tag for tag, _ in page.tags} <= {"code", "span"}
    assert "".join(piece for piece, _ in code_segments(text)) == text


def test_code_blocks_are_set_off_with_their_fences() -> None:
    text = "Here:\n```python\ndef f(x):\n    return x < 1\n```\nThat's it.\n~~~\nopen"
    assert [is_code for _, is_code in code_segments(text)] == [False, True, False, True]
    page = text_html(text)
    assert page.count('<code class="ls-code">') == 2
    assert "    return x &lt; 1\n" in page  # indentation and the comparison kept, escaped
    assert '<span class="ls-fence">```python\n</span>' in page
    # A shorter fence, or another fence character, does not close a block.
    segments = code_segments("````\na\n```\n~~~~\nb\n````\nafter")
    assert [is_code for _, is_code in segments] == [True, False]
    assert segments[0][0].endswith("````\n")


def test_notice_escapes_error_messages() -> None:
    page = notice_html("⚠ could not load preset '<img src=x>': ![a](http://e/)")
    assert 'class="ls-notice ls-error"' in page and "&lt;img src=x&gt;" in page
    assert_inert(page)
    assert notice_html("") == "" and "ls-info" in notice_html("Stopped.")


def test_preset_panels_escape_the_users_preset_file() -> None:
    evil = '<img src="http://127.0.0.1:9/leak">'
    preset = parse_preset({"name": evil, "description": f"![x](http://e/) {evil}",
                           "hardware": "cpu", "target": {"model": evil}})
    page = assert_inert(preset_info_html(preset))
    assert "".join(page.text).count(evil) == 3
    assert preset_info_html(None) == ""
    row = PresetSummary(key=evil, preset=None, error=evil, estimate=None, fits=False, reason="")
    listing = assert_inert(presets_html([row], evil))
    assert "".join(listing.text).count(evil) == 3


# ----------------------------------------------------------------------------- streaming


def test_follow_throttles_and_always_ends_with_the_whole_answer() -> None:
    clock = FakeClock()
    steps = [event(i, (), 0, 12, "bonus") for i in range(1, 6)]
    steps.append(event(6, (), 0, 12, "bonus", finish="length"))

    def timed() -> Iterator[StepEvent]:
        for e in steps:
            clock.now += 0.03
            yield e

    answer = Answer(LiveStats("none", clock=clock), TokenTexts(toy_decode))
    seen = [(a.text, a.done) for a in follow(timed(), answer, clock, min_interval=0.1)]
    assert seen[-1] == ("x" * 6, True) and seen[-2] == ("x" * 6, False)
    assert seen[0] == ("x", False) and len(seen) < len(steps)  # throttled, first step shown
    assert answer.error == "" and not answer.stopped


def _failing(after: int, error: Exception) -> Iterator[StepEvent]:
    for i in range(after):
        yield event(i + 1, (), 0, 12, "bonus")
    raise error


def test_follow_keeps_the_partial_answer_on_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    answer = Answer(LiveStats("none", clock=FakeClock()), TokenTexts(toy_decode))
    last = list(follow(_failing(2, RuntimeError("boom")), answer, FakeClock(), 0.0))[-1]
    assert last.done and last.text == "xx" and last.error == FAILED_MID_ANSWER
    assert "boom" not in last.error
    assert any(r.exc_info and r.levelname == "ERROR" for r in caplog.records)  # traceback
    caplog.clear()
    answer = Answer(LiveStats("none", clock=FakeClock()), TokenTexts(toy_decode))
    last = list(follow(_failing(1, ModelLoadError("disk gone")), answer, FakeClock(), 0.0))[-1]
    assert last.error == "⚠ disk gone" and last.text == "x"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # expected: no traceback


def test_a_token_guessed_by_lookup_is_marked_and_the_legend_says_so() -> None:
    spans = [TokenSpan("a", "accepted", 1, 5, drafter="ngram"),
             TokenSpan("b", "accepted", 2, 6, drafter="draft_model"),
             TokenSpan("c", "bonus", 2, 7),
             TokenSpan("d", "accepted", 3, 8, drafter='x" onmouseover="alert(1)')]
    out = spans_html(spans)
    assert out.count("ls-by-ngram") == 1 and "ls-by-draft_model" in out
    assert 'onmouseover="' not in out  # a name that is no registry name: no class, escaped
    assert out.count('class="ls-tok ls-accepted" title') == 1
    assert "ls-by-ngram" in legend_html() and "n-gram lookup" in legend_html()
