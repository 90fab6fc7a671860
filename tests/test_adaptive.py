"""Adaptive draft length: the expected-tokens formula and the choices AdaptiveK makes; a drafter
that ends its own chains is asked for k_max; a drafter's kept share over earlier requests is
the prior of its acceptance in a new answer."""

from __future__ import annotations

import pytest
from conftest import collect, decode, draft_drafter
from engine_helpers import PROMPTS, request
from transformers import PreTrainedModel

import localspec.engine.choice as choice_module
from localspec.drafters.base import Calibration
from localspec.engine.adaptive import DRAFT_MARGIN, FIRST_K, AdaptiveK, expected_tokens
from localspec.engine.choice import DrafterChoice
from localspec.engine.engine import SpeculativeEngine
from localspec.runtime.runner import ModelRunner


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [
        (0.5, 0, 1.0),
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.8, 3, (1 - 0.8**4) / 0.2),
        (0.0, 5, 1.0),
        (1.0, 4, 5.0),
        (1.0, 0, 1.0),
    ],
)
def test_expected_tokens(alpha: float, k: int, expected: float) -> None:
    """(1 - alpha^(k+1)) / (1 - alpha), and k + 1 when every draft is accepted."""
    assert expected_tokens(alpha, k) == pytest.approx(expected)


def test_no_measurements_explores_a_moderate_k() -> None:
    """Before any step has been measured, choose() returns FIRST_K (or k_max if smaller)."""
    assert AdaptiveK(k_max=7).choose() == FIRST_K
    assert AdaptiveK(k_max=2).choose() == 2


def test_drafting_that_barely_pays_is_left_off() -> None:
    """One draft accepted 2 times in 3, costing half a verify pass (and the verify of 2 tokens
    10% dearer than of 1): ~1.66 tokens for 1.6 passes' time, better than plain decoding by
    less than the margin, so k = 0; accepted 4 times in 5, drafting clearly pays."""
    def controller(pattern: list[int]) -> AdaptiveK:
        c = AdaptiveK(k_max=1, alpha_prior=0.5)
        for step in range(100):
            c.update(drafted=1, accepted=pattern[step % len(pattern)], draft_time=0.05,
                     verify_time=0.11)
            c.update(drafted=0, accepted=0, draft_time=0.0, verify_time=0.1)
        return c

    barely = controller([1, 1, 0])
    assert 1.0 < barely.expected_tokens(1) / (0.05 + 0.11) * 0.1 < 1.0 + DRAFT_MARGIN
    assert barely.choose() == 0
    assert controller([1, 1, 1, 1, 0]).choose() == 1


def test_a_drafter_that_stops_itself_is_asked_for_k_max_when_drafting_pays() -> None:
    """The rates by position would cap a chain at one draft; a drafter that ends its own
    chains (``stops_itself``) is asked for k_max instead, from the first step on, and still
    rests where drafting does not pay."""
    def controller(stops_itself: bool, accepted: int) -> AdaptiveK:
        c = AdaptiveK(k_max=8, stops_itself=stops_itself)
        for _ in range(30):
            c.update(drafted=2, accepted=accepted, draft_time=2 * 0.01, verify_time=0.1)
        return c

    assert controller(False, 1).choose() == 1
    assert controller(True, 1).choose() == 8
    assert controller(True, 0).choose() == 0
    assert AdaptiveK(k_max=8, stops_itself=True).choose() == 8


def test_the_choice_asks_a_member_that_stops_itself_for_k_max() -> None:
    """Two members with the same record: the one that ends its own chains gets k_max, the
    other the k its rates by position give."""
    choice = DrafterChoice(2, k_max=8, stops_itself=[False, True])
    for estimator in choice.estimators:
        for _ in range(30):
            estimator.update(drafted=2, accepted=1, draft_time=2 * 0.01, verify_time=0.1)
    assert {a.index: a.k for a in choice.order([False, False])} == {0: 1, 1: 8}


def answer_start(choice: DrafterChoice, verdicts: list[int]) -> list[int]:
    """The ks a lone self-stopping member is asked at each step, one-token chains judged
    ``verdicts`` (1 kept, 0 missed), at a 2-core CPU's costs (a pass of one row 31 ms, of two
    34.5 ms, a draft token 12 ms), after the prompt's plain first step."""
    asked = []
    choice.verify.update(1, 0.031)
    for kept in verdicts:
        attempts = choice.order([False])
        asked.append(attempts[0].k if attempts else 0)
        if attempts:
            choice.asked(attempts[0])
            choice.record(0, 1, kept, {0: 0.012}, 0.0345)
        else:
            choice.record(None, 0, 0, {}, 0.031)
    return asked


def test_a_learnt_kept_share_outweighs_an_answers_first_miss() -> None:
    """A chat reply's first guesses are its least predictable. After one kept and one missed,
    a draft model whose guesses were kept 70% of the time over earlier requests drafts on; one
    with no history rests (its rate at the first position: 0.53, under what pays). The
    history is a prior, not a verdict: a second miss in a row stops it too."""
    def choice(share: float | None) -> DrafterChoice:
        return DrafterChoice(1, k_max=8, stops_itself=[True], kept_shares=[share])

    assert answer_start(choice(None), [1, 0, 0]) == [8, 8, 0]
    assert answer_start(choice(0.7), [1, 0, 0, 0]) == [8, 8, 8, 0]


@pytest.fixture
def choices_made(monkeypatch: pytest.MonkeyPatch
                 ) -> list[tuple[list[bool], list[float | None]]]:
    """What the engine gives each ``DrafterChoice`` it makes: its members' stop flags and
    kept shares, one pair per request."""
    made: list[tuple[list[bool], list[float | None]]] = []

    def recording(count: int, k_max: int, enabled: bool = True,
                  stops_itself: list[bool] | None = None,
                  kept_shares: list[float | None] | None = None) -> DrafterChoice:
        made.append((list(stops_itself or []), list(kept_shares or [])))
        return DrafterChoice(count, k_max, enabled, stops_itself or [], kept_shares or [])

    monkeypatch.setattr(choice_module, "DrafterChoice", recording)
    return made


def test_the_engine_tells_the_choice_which_members_stop_themselves(
        choices_made: list[tuple[list[bool], list[float | None]]],
        target_runner: ModelRunner, close_draft_model: PreTrainedModel) -> None:
    """A draft model with a confidence threshold ends its own chains; without one it does
    not, and adaptive k sets its length. A new drafter has judged nothing yet: no share."""
    for threshold in (0.3, 0.0):
        engine = SpeculativeEngine(target_runner, (draft_drafter(close_draft_model, threshold),),
                                   decode, set())
        collect(engine, request(PROMPTS["random-b"], k=4, max_new_tokens=4))
    assert choices_made == [([True], [None]), ([False], [None])]


def test_the_engine_gives_the_choice_each_drafters_kept_share(
        choices_made: list[tuple[list[bool], list[float | None]]],
        target_runner: ModelRunner, close_draft_model: PreTrainedModel) -> None:
    """Once a drafter's calibration has judged enough guesses, the next request's choice
    starts from the share it kept."""
    drafter = draft_drafter(close_draft_model, 0.3)
    for i in range(Calibration.LEARNT):  # earlier requests: 3 guesses in 4 kept
        drafter.calibration.record((0.6,), accepted=int(i % 4 != 0))
    engine = SpeculativeEngine(target_runner, (drafter,), decode, set())
    collect(engine, request(PROMPTS["random-b"], k=4, max_new_tokens=4))
    assert [shares for _, shares in choices_made] == [[pytest.approx(0.75)]]


def test_disabled_always_returns_k_max() -> None:
    """enabled=False ignores measurements entirely."""
    controller = AdaptiveK(k_max=6, enabled=False)
    for _ in range(20):
        controller.update(drafted=6, accepted=0, draft_time=1.0, verify_time=0.01)
    assert controller.choose() == 6


def test_k_max_zero_is_plain_decoding() -> None:
    """With no drafter (k_max=0) the controller never asks for drafts."""
    controller = AdaptiveK(k_max=0)
    controller.update(drafted=0, accepted=0, draft_time=0.0, verify_time=0.01)
    assert controller.choose() == 0


def test_high_acceptance_cheap_drafts_choose_k_max() -> None:
    """Every draft accepted and drafting nearly free: the longest draft wins."""
    controller = AdaptiveK(k_max=8)
    for _ in range(30):
        controller.update(drafted=8, accepted=8, draft_time=8 * 1e-4, verify_time=0.02)
    assert controller.alpha > 0.95
    assert controller.choose() == 8


def test_no_acceptance_expensive_drafts_stop_drafting_with_sparse_probes() -> None:
    """Drafts always rejected and costly: k = 0 (plain decoding), except one probe draft after
    8, 16, 32, 64, then every 128 plain steps; once drafts pay again the probing starts over
    from 8."""
    controller = AdaptiveK(k_max=8)
    for _ in range(30):
        controller.update(drafted=4, accepted=0, draft_time=4 * 0.02, verify_time=0.02)
    assert controller.alpha < 0.2

    def run(steps: int, accepted_share: float, draft_time: float) -> list[int]:
        choices = []
        for _ in range(steps):
            k = controller.choose()
            choices.append(k)
            controller.update(drafted=k, accepted=round(k * accepted_share),
                              draft_time=k * draft_time, verify_time=0.02)
        return choices

    choices = run(400, 0.0, 0.02)
    assert set(choices) == {0, 1}
    probes = [i for i, k in enumerate(choices) if k]
    gaps = [b - a - 1 for a, b in zip([-1, *probes], probes, strict=False)]
    assert gaps == [8, 16, 32, 64, 128, 128]  # plain steps before each probe
    for _ in range(30):  # the text changed: drafts are accepted and cheap again
        controller.update(drafted=8, accepted=8, draft_time=8e-4, verify_time=0.02)
    assert run(1, 1.0, 1e-4)[0] > 0
    for _ in range(30):  # and failing again: the first probe comes after 8 steps, not 128
        controller.update(drafted=4, accepted=0, draft_time=4 * 0.02, verify_time=0.02)
    assert run(9, 0.0, 0.02) == [0] * 8 + [1]


@pytest.mark.parametrize(("draft_time", "per_token", "probe_k"),
                         [(0.02, 0.0, 1), (0.004, 0.0, 2), (0.0, 0.0, FIRST_K), (0.0, 0.003, 3)])
def test_probe_adds_at_most_half_a_plain_step(draft_time: float, per_token: float,
                                               probe_k: int) -> None:
    """A probe after plain steps drafts what adds at most half a plain step (0.02 s here),
    drafting and the wider verify pass together, and at most FIRST_K: one token of a costly
    draft model; FIRST_K of free lookup when the pass costs the same at any width; three when
    each verified token adds 3 ms."""
    controller = AdaptiveK(k_max=8)

    def verify(n: int) -> float:
        return 0.02 + per_token * (n - 1)

    for _ in range(30):  # drafts rejected: k = 0 wins
        for drafted in range(9):
            controller.update(drafted=drafted, accepted=0, draft_time=drafted * draft_time,
                              verify_time=verify(drafted + 1))
    choices = [controller.choose() for _ in range(9)]
    assert choices == [0] * 8 + [probe_k]


def test_a_sure_guess_is_probed_at_once_until_sure_guesses_miss() -> None:
    """While drafting is off, a sure guess (lookup matched its longest n-gram) is probed at the
    next step instead of after the interval; each miss doubles the plain steps the next sure
    probe waits for (1, 2, 4, ...), and an accepted one makes the next sure guess wait for none."""
    controller = AdaptiveK(k_max=8)
    for _ in range(30):  # rejected, each drafted token adds 10 ms: k = 0 wins
        for drafted in range(9):
            controller.update(drafted=drafted, accepted=0, draft_time=0.0,
                              verify_time=0.02 + 0.01 * drafted)

    def steps(count: int, accepted: int) -> list[int]:
        choices = []
        for _ in range(count):
            k = controller.choose(sure=True)
            choices.append(k)
            controller.update(drafted=k, accepted=min(k, accepted), draft_time=0.0,
                              verify_time=0.02 + 0.01 * k)
        return choices

    assert controller.choose() == 0
    misses = steps(11, accepted=0)  # probes at once, then after 1, 2 and 4 plain steps
    assert [i for i, k in enumerate(misses) if k] == [0, 2, 5, 10]
    assert set(misses) == {0, 1}  # a probe's k: what adds at most half a plain step
    controller._sure_gap = 0  # the next sure probe is accepted: the one after comes at once
    assert steps(2, accepted=1) == [1, 1]


def test_alpha_prior_and_estimate() -> None:
    """alpha starts at the prior and moves to accepted / (accepted + rejections)."""
    controller = AdaptiveK(k_max=4)
    assert controller.alpha == pytest.approx(controller.alpha_prior)
    for _ in range(200):  # 3 accepted then a rejection each step: MLE alpha = 3/4
        controller.update(drafted=4, accepted=3, draft_time=0.004, verify_time=0.02)
    assert controller.alpha == pytest.approx(0.75, abs=0.01)
    assert controller.draft_cost() == pytest.approx(0.001)


def test_verify_cost_linear_fit_recovers_line() -> None:
    """Least squares with forgetting recovers verify_time = a + b * n from exact data."""
    a, b = 0.05, 0.004
    controller = AdaptiveK(k_max=8)
    assert controller.verify_cost(1) is None
    for step in range(60):
        n = 1 + step % 9  # n = drafted + 1 in 1..9
        controller.update(drafted=n - 1, accepted=0, draft_time=0.0, verify_time=a + b * n)
    for n in (1, 4, 9, 16):
        assert controller.verify_cost(n) == pytest.approx(a + b * n, rel=1e-6)


def test_verify_cost_constant_n_and_negative_slope() -> None:
    """One n only: the mean time. A decreasing trend is clipped to a flat cost (slope >= 0)."""
    flat = AdaptiveK(k_max=4)
    for _ in range(10):
        flat.update(drafted=3, accepted=3, draft_time=0.0, verify_time=0.03)
    assert flat.verify_cost(1) == pytest.approx(0.03)
    assert flat.verify_cost(10) == pytest.approx(0.03)
    falling = AdaptiveK(k_max=4)
    for step in range(20):
        n = 1 + step % 4
        falling.update(drafted=n - 1, accepted=0, draft_time=0.0, verify_time=0.05 - 0.01 * n)
    assert falling.verify_cost(1) == pytest.approx(falling.verify_cost(4))


def test_bimodal_acceptance_is_seen_per_position() -> None:
    """n-gram-like steps (a miss, or a long hit) give r_0 ~ 0.5 but r_j ~ 1 after it, so the
    controller keeps long drafts when drafting is free."""
    controller = AdaptiveK(k_max=8)
    for i in range(200):
        hit = i % 2 == 0
        controller.update(drafted=8, accepted=8 if hit else 0, draft_time=1e-5,
                          verify_time=0.17 + 0.005 * 9)
    rates = controller.position_rates(8)
    assert rates[0] == pytest.approx(0.5, abs=0.05)
    assert min(rates[1:]) > 0.95
    assert controller.expected_tokens(8) > 4.0
    assert controller.choose() == 8


def test_stalled_first_steps_do_not_keep_drafting_off() -> None:
    """Two steps slowed 20x by something else on the CPU (measured on a bench prompt): the
    first probe that runs at the true cost brings drafting back at once."""
    controller = AdaptiveK(k_max=12)
    controller.update(drafted=12, accepted=0, draft_time=12 * 0.5, verify_time=1.8)
    controller.update(drafted=3, accepted=2, draft_time=3.0, verify_time=0.8)
    choices = []
    for _ in range(12):  # drafts cost 0.035 s and are accepted; a verify pass 0.09 s
        k = controller.choose()
        choices.append(k)
        controller.update(drafted=k, accepted=k, draft_time=k * 0.035, verify_time=0.09)
    first = next(i for i, k in enumerate(choices) if k)
    assert first <= 8 and all(choices[first + 1:]), choices


def test_one_stall_while_drafting_pays_does_not_stop_drafting() -> None:
    controller = AdaptiveK(k_max=8)
    for _ in range(20):
        controller.update(drafted=6, accepted=5, draft_time=6 * 0.035, verify_time=0.1)
    controller.update(drafted=6, accepted=5, draft_time=6 * 2.0, verify_time=5.0)
    assert controller.choose() >= 3
    assert controller.draft_cost() < 0.035 * 1.5
