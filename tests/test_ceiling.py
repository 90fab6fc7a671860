"""The bounds on what chain drafting can give (``engine.ceiling``), on hand-worked cases."""

from __future__ import annotations

import random

import pytest

from localspec.engine.ceiling import DrafterRuns, blind_time, oracle_time, runs_from_agreement


def test_runs_count_agreements_up_to_the_first_miss() -> None:
    assert runs_from_agreement([True, True, False, True, False, False]) == [2, 1, 0, 1, 0, 0]
    assert runs_from_agreement([]) == []


def test_without_drafts_the_oracle_decodes_plainly() -> None:
    ceiling = oracle_time(5, [1.0, 1.2], [DrafterRuns("d", [0] * 5, 0.1)], per_pass=0.5)
    assert ceiling.seconds == pytest.approx(7.5)
    assert ceiling.steps == [(None, 0)] * 5


def test_a_free_drafter_right_for_the_whole_answer() -> None:
    """Lookup right on 7 tokens in a row: one pass verifies 3 of them (k_max 3) and keeps 4
    tokens, the next verifies the last 3: two passes, 1.6 + 1.6."""
    ceiling = oracle_time(8, [1.0, 1.2, 1.4, 1.6], [DrafterRuns("lookup", [7, 6, 5, 4, 3, 2, 1, 0],
                                                                  0.0)])
    assert ceiling.seconds == pytest.approx(3.2)
    assert ceiling.steps == [("lookup", 3), ("lookup", 3)]


def test_a_draft_too_dear_to_pay_is_not_used() -> None:
    """A token drafted at 1.0 plus a wider pass costs more than the plain pass it saves."""
    runs = DrafterRuns("draft", [3, 2, 1, 0], 1.0)
    assert oracle_time(4, [1.0, 1.1, 1.2, 1.3], [runs]).steps == [(None, 0)] * 4
    cheap = DrafterRuns("draft", [3, 2, 1, 0], 0.1)
    ceiling = oracle_time(4, [1.0, 1.1, 1.2, 1.3], [cheap])
    assert ceiling.steps == [("draft", 3)]
    assert ceiling.seconds == pytest.approx(0.3 + 1.3)


def test_the_cheaper_drafter_wins_where_both_are_right() -> None:
    both = [2, 1, 0, 0]
    ceiling = oracle_time(4, [1.0, 1.1, 1.2], [DrafterRuns("draft", both, 0.2),
                                              DrafterRuns("lookup", both, 0.0)])
    assert ceiling.steps == [("lookup", 2), (None, 0)]
    assert ceiling.seconds == pytest.approx(1.2 + 1.0)


def test_the_oracle_is_never_slower_than_plain_decoding() -> None:
    runs = [1, 0, 4, 3, 2, 1, 0, 0, 2, 1, 0, 0]
    verify = [1.0, 1.3, 1.5, 1.9, 2.4]
    ceiling = oracle_time(len(runs), verify, [DrafterRuns("draft", runs, 0.3)], per_pass=0.1)
    assert ceiling.seconds <= len(runs) * 1.1
    assert sum(k + 1 for _, k in ceiling.steps) == len(runs)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="one-row pass"):
        oracle_time(2, [], [])
    with pytest.raises(ValueError, match="3 runs for an answer of 2"):
        oracle_time(2, [1.0], [DrafterRuns("d", [0, 0, 0], 0.1)])


def test_blind_with_certain_verdicts_is_the_oracle() -> None:
    """Chances of 0 or 1 are verdicts known in advance: the blind policy is the oracle."""
    rng = random.Random(7)
    verify = [1.0, 1.1, 1.25, 1.4, 1.6]
    for _ in range(20):
        agree = [rng.random() < 0.7 for _ in range(30)]
        runs = DrafterRuns("draft", runs_from_agreement(agree), 0.3)
        lookup = DrafterRuns("lookup", runs_from_agreement([rng.random() < 0.3
                                                            for _ in range(30)]), 0.0)
        expected = oracle_time(30, verify, [runs, lookup], per_pass=0.1).seconds
        chances = [float(a) for a in agree]
        assert blind_time(verify, chances, 0.3, 0.1, lookup) == pytest.approx(expected)


def test_blind_prices_a_coin_flip() -> None:
    """Two tokens, the first guess kept half the time at 0.1 a draft: drafting it costs
    0.1 + 1.2 and leaves the last token to a plain pass (1.0) half the time: 1.8 < 2.0."""
    assert blind_time([1.0, 1.2], [0.5, 0.5], 0.1) == pytest.approx(1.8)
    assert blind_time([1.0, 1.2], [0.5, 0.5], 0.4) == pytest.approx(2.0)  # 2.1 would lose


def test_uncertainty_costs_against_the_oracle() -> None:
    """Guesses kept 70% of the time: knowing which ones is worth something."""
    rng = random.Random(3)
    agree = [rng.random() < 0.7 for _ in range(200)]
    verify = [1.0, 1.05, 1.1, 1.15, 1.2]
    oracle = oracle_time(200, verify, [DrafterRuns("d", runs_from_agreement(agree), 0.3)])
    blind = blind_time(verify, [0.7] * 200, 0.3)
    assert oracle.seconds < blind < 200.0


def test_blind_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="one-row pass"):
        blind_time([], [0.5], 0.1)
    with pytest.raises(ValueError, match="3 runs for 2 chances"):
        blind_time([1.0], [0.5, 0.5], 0.1, lookup=DrafterRuns("l", [0, 0, 0], 0.0))
