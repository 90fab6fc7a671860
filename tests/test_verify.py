"""The verifier alone: greedy rules, probability warping, and the exactness of speculative
sampling (analytically, and by seeded Monte Carlo with a negative control that must fail)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import localspec.engine.verify as verify_module
from localspec.engine.verify import (
    Verdict,
    acceptance_probability,
    residual_distribution,
    verify_greedy,
    verify_sampling,
)
from localspec.sampling import SamplingParams, logits_to_probs, sample

V = 7
N_TRIALS = 20_000
TV_THRESHOLD = 0.02  # sampling noise for V=7, N=20000 is about 0.006 in expectation

# Two deliberately different distributions (q is p reversed), so rejections are frequent and
# a wrong residual visibly changes the output distribution.
P_FIXED = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02], dtype=torch.float64)
Q_FIXED = P_FIXED.flip(0)


# ----------------------------------------------------------------------------- helpers


def rigged_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(argmaxes), vocab] logits whose row i has its maximum at argmaxes[i]."""
    torch.manual_seed(123)
    logits = torch.randn(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = logits[row].max() + 1.0
    return logits


def random_dist(seed: int, vocab: int = V, zeros: int = 0) -> torch.Tensor:
    """A random distribution over ``vocab`` tokens with ``zeros`` entries forced to 0."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(vocab, generator=g, dtype=torch.float64) ** 2 + 1e-3
    if zeros:
        weights[torch.randperm(vocab, generator=g)[:zeros]] = 0.0
    return weights / weights.sum()


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between the empirical distribution of ``counts`` and ``p``."""
    empirical = counts.double() / counts.sum()
    return 0.5 * float((empirical - p.double()).abs().sum())


def first_token_counts(p_rows: torch.Tensor, q_rows: torch.Tensor | None, one_hot_draft: int,
                       trials: int, seed: int) -> torch.Tensor:
    """Counts of the first emitted token over ``trials`` runs of verify_sampling with k=1.

    The draft token is drawn from q (or fixed to ``one_hot_draft`` when q is None); the emitted
    token is the draft when accepted, else the recovered token.
    """
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p_rows.shape[1], dtype=torch.long)
    for _ in range(trials):
        if q_rows is None:
            draft = one_hot_draft
        else:
            draft = int(torch.multinomial(q_rows[0], 1, generator=g))
        verdict = verify_sampling(p_rows, q_rows, [draft], g)
        counts[draft if verdict.num_accepted >= 1 else verdict.token] += 1
    return counts


# ----------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_takes_bonus_from_row_k() -> None:
    """Drafts equal to every argmax are all kept; the bonus is the argmax of the last row."""
    logits = rigged_logits([3, 5, 1, 8])
    assert verify_greedy(logits, [3, 5, 1]) == Verdict(3, 8, True)


def test_greedy_first_rejected_recovers_target_argmax() -> None:
    """A wrong first draft keeps nothing and emits the target's argmax at position 0."""
    logits = rigged_logits([3, 5, 1, 8])
    assert verify_greedy(logits, [4, 5, 1]) == Verdict(0, 3, False)


def test_greedy_middle_rejection() -> None:
    """Only the agreeing prefix is kept, even if later drafts happen to match again."""
    logits = rigged_logits([3, 5, 1, 8])
    assert verify_greedy(logits, [3, 6, 1]) == Verdict(1, 5, False)


def test_greedy_no_drafts_is_plain_decoding() -> None:
    """k=0: the single row's argmax, counted as a bonus token."""
    logits = rigged_logits([7])
    assert verify_greedy(logits, []) == Verdict(0, 7, True)


# ----------------------------------------------------------------------------- warping


def test_sampling_params_validation() -> None:
    """Out-of-range parameters are refused with the parameter's name in the message."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


def test_sample_draws_from_the_distribution_and_never_a_token_without_mass() -> None:
    """20,000 draws from an unnormalised row with zeros (between, first and last): each
    token's count within 5 standard deviations of its share, the zeros never drawn; a row
    without mass is refused."""
    weights = torch.tensor([0.0, 0.2, 0.0, 0.6, 1.2, 0.0, 0.02, 0.0])
    share = weights / weights.sum()
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(len(weights))
    for _ in range(20_000):
        counts[sample(weights, generator)] += 1
    assert (counts[share == 0] == 0).all()
    assert ((counts - 20_000 * share).abs() <= 5 * (20_000 * share * (1 - share)).sqrt()).all()
    with pytest.raises(ValueError, match="no mass"):
        sample(torch.zeros(4), generator)


def test_logits_to_probs_temperature() -> None:
    """Probabilities are softmax(logits / T) and sum to 1."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_logits_to_probs_top_k_keeps_exactly_k() -> None:
    """top_k keeps the k largest logits (renormalised) and zeroes the rest."""
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.9, -0.2]])
    for k in (1, 2, 3, 5):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=k))[0]
        kept = set(torch.nonzero(probs > 0).flatten().tolist())
        assert kept == set(torch.topk(logits[0], k).indices.tolist())
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
    everything = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=100))
    torch.testing.assert_close(everything, torch.softmax(logits, dim=-1))


def test_top_p_over_a_large_vocabulary_is_the_full_sorts_nucleus() -> None:
    """Rows of 40,000 logits whose nucleus holds from a few tokens to most of the row (past the
    first 1,024 candidates, so the search widens): the kept set is the full sort's, away from
    float near-ties at the edge (tokens whose mass before them is within 1e-4 of top_p)."""
    generator = torch.Generator().manual_seed(7)
    for scale in (0.2, 2.0, 8.0):
        logits = torch.randn(3, 40_000, generator=generator) * scale
        probs = torch.softmax(logits.double(), dim=-1)
        for top_p in (0.3, 0.9, 0.99):
            kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            want = torch.zeros_like(kept).scatter(-1, order, before < top_p)
            edge = torch.zeros_like(kept).scatter(-1, order, (before - top_p).abs() < 1e-4)
            assert torch.equal(kept[~edge], want[~edge]), (scale, top_p)
            assert scale > 1 or bool((want.sum(dim=-1) > 1024).all())  # the search widened


def test_logits_to_probs_top_p_keeps_smallest_nucleus() -> None:
    """top_p keeps the smallest prefix (by probability) whose mass reaches top_p."""
    base = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = base.log()[None]
    cases = {0.01: {1}, 0.45: {1}, 0.75: {1, 3}, 0.9: {1, 3, 2}, 0.99: {0, 1, 2, 3}}
    for top_p, expected in cases.items():
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
        assert set(torch.nonzero(probs > 0).flatten().tolist()) == expected, top_p
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)
        kept = sorted(expected)
        torch.testing.assert_close(probs[kept], base[kept] / base[kept].sum())


def test_logits_to_probs_batch_rows_independent() -> None:
    """Warping is per row: each row of a batch gets its own nucleus."""
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.1, 0.2]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[0].tolist() == [1.0, 0.0, 0.0]
    assert probs[1, 2] > 0 and probs[1, 1] > 0 and probs[1, 0] == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


# ----------------------------------------------------------------------------- exactness


def composed_output(p: torch.Tensor, q: torch.Tensor | None, draft: int | None = None
                    ) -> torch.Tensor:
    """The distribution of the first emitted token, composed from the code's own pieces:
    sum_x q(x) * [a(x) * onehot(x) + (1 - a(x)) * residual(x)]."""
    out = torch.zeros_like(p)
    drafts = [(draft, 1.0)] if q is None else [(x, float(q[x])) for x in range(len(p))]
    for x, weight in drafts:
        if weight == 0.0:
            continue
        a = acceptance_probability(p, q, x)
        out[x] += weight * a
        out += weight * (1.0 - a) * residual_distribution(p, q, x)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_exact_composition_random_p_q(seed: int) -> None:
    """For random p and q, accept-or-residual reproduces p exactly."""
    p, q = random_dist(2 * seed), random_dist(2 * seed + 1)
    torch.testing.assert_close(composed_output(p, q), p, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_exact_composition_with_zeros(seed: int) -> None:
    """Zeros in p (tokens the target never emits) and in q (never drafted) keep exactness."""
    p, q = random_dist(10 + seed, zeros=2), random_dist(20 + seed, zeros=3)
    torch.testing.assert_close(composed_output(p, q), p, atol=1e-6, rtol=0)
    assert acceptance_probability(p, q, int(torch.nonzero(p == 0)[0])) in (0.0, 1.0)


def test_exact_composition_p_equals_q_and_fixed_pair() -> None:
    """p == q (always accepted; residual degenerate) and the fixed contrasting pair."""
    p = random_dist(5)
    torch.testing.assert_close(composed_output(p, p.clone()), p, atol=1e-6, rtol=0)
    torch.testing.assert_close(composed_output(P_FIXED, Q_FIXED), P_FIXED, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_exact_composition_one_hot_draft(seed: int) -> None:
    """q=None (n-gram): for every possible drafted token the output is exactly p,
    including a p with zeros and a p that is itself one-hot."""
    p = random_dist(30 + seed, zeros=seed)
    for draft in range(V):
        torch.testing.assert_close(composed_output(p, None, draft), p, atol=1e-6, rtol=0)
    one_hot = torch.zeros(V, dtype=torch.float64)
    one_hot[seed] = 1.0
    for draft in range(V):
        torch.testing.assert_close(composed_output(one_hot, None, draft), one_hot, atol=1e-6,
                                   rtol=0)


def test_residual_distribution_values() -> None:
    """norm(max(0, p - q)); with q=None, p with the drafted token removed."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual_distribution(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    assert acceptance_probability(p, q, 0) == 1.0
    assert acceptance_probability(p, q, 1) == pytest.approx(0.6)
    assert acceptance_probability(p, None, 2) == pytest.approx(0.2)


# ----------------------------------------------------------------------------- Monte Carlo


def wrong_residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """A classic bug: resample from p itself after a rejection."""
    return p


@pytest.mark.parametrize("q_kind", ["fixed", "random"])
def test_monte_carlo_k1_matches_p(q_kind: str) -> None:
    """End to end with k=1: the first emitted token is distributed as p."""
    if q_kind == "fixed":
        p, q = P_FIXED, Q_FIXED
    else:
        p, q = random_dist(40), random_dist(41)
    p_rows = torch.stack([p, random_dist(42)])
    counts = first_token_counts(p_rows, q[None], 0, N_TRIALS, seed=7)
    assert tv(counts, p) < TV_THRESHOLD


def test_monte_carlo_k1_one_hot_draft_matches_p() -> None:
    """k=1 with a deterministic (n-gram-like) draft of the most likely and of a rare token."""
    p_rows = torch.stack([P_FIXED, P_FIXED])
    for draft in (0, 5):
        counts = first_token_counts(p_rows, None, draft, N_TRIALS // 2, seed=11 + draft)
        assert tv(counts, P_FIXED) < 1.5 * TV_THRESHOLD


@pytest.mark.parametrize("q_is_none", [False, True])
def test_negative_control_wrong_residual_fails(monkeypatch: pytest.MonkeyPatch,
                                               q_is_none: bool) -> None:
    """The same check must catch a sampler that resamples from p after a rejection: proof that
    the Monte Carlo test above has the power to detect a broken residual."""
    monkeypatch.setattr(verify_module, "residual_distribution", wrong_residual)
    p_rows = torch.stack([P_FIXED, P_FIXED])
    q_rows = None if q_is_none else Q_FIXED[None]
    counts = first_token_counts(p_rows, q_rows, 1, N_TRIALS, seed=7)
    assert tv(counts, P_FIXED) > 3 * TV_THRESHOLD


def pair_counts(p_rows: torch.Tensor, q_rows: torch.Tensor, trials: int, seed: int,
                verifier: Callable[..., Verdict] = verify_sampling) -> torch.Tensor:
    """Counts of the first two emitted tokens with k=2 (rows of p and q do not depend on the
    history, so a step that stops after one token continues by sampling p_rows[1])."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.long)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q_rows[i], 1, generator=g)) for i in range(2)]
        verdict = verifier(p_rows, q_rows, drafts, g)
        if verdict.num_accepted >= 2:
            first, second = drafts
        elif verdict.num_accepted == 1:
            first, second = drafts[0], verdict.token
        else:
            first, second = verdict.token, int(torch.multinomial(p_rows[1], 1, generator=g))
        counts[first, second] += 1
    return counts


def test_monte_carlo_k2_first_token_and_pair() -> None:
    """k=2: the first token is distributed as p0, the second as p1, the pair as p0 x p1."""
    p0, p1, p2 = P_FIXED, random_dist(50), random_dist(51)
    q0, q1 = Q_FIXED, random_dist(52)
    counts = pair_counts(torch.stack([p0, p1, p2]), torch.stack([q0, q1]), N_TRIALS, seed=3)
    assert tv(counts.sum(1), p0) < TV_THRESHOLD
    assert tv(counts.sum(0), p1) < TV_THRESHOLD
    # 49 cells: expected noise ~0.02, so a wider bound; a wrong joint is far outside it.
    assert tv(counts.flatten(), torch.outer(p0, p1).flatten()) < 0.045


def test_seeded_determinism() -> None:
    """Same seed, same verdicts; another seed gives a different sequence."""

    def run(seed: int) -> list[Verdict]:
        g = torch.Generator().manual_seed(seed)
        p_rows = torch.stack([P_FIXED, random_dist(60), random_dist(61), random_dist(62)])
        q_rows = torch.stack([Q_FIXED, random_dist(63), random_dist(64)])
        return [verify_sampling(p_rows, q_rows, [0, 3, 6], g) for _ in range(200)]

    assert run(5) == run(5)
    assert run(5) != run(6)
