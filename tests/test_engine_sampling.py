"""Sampling through the speculative engine on tiny random models: seeded runs repeat, a draft
equal to the target is (almost) always accepted, top_k=1 is greedy; and a statistical
end-to-end check that the first two sampled tokens follow the target's exact distributions,
with a negative control (a wrong residual) that the same check must catch."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import collect, decode, draft_drafter, make_tiny_model, perturbed_copy
from engine_helpers import HOT, PROMPTS, plain_tokens, request
from transformers import PreTrainedModel

import localspec.engine.verify as verify_module
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.engine.drafter import Drafter
from localspec.engine.engine import SpeculativeEngine
from localspec.engine.stats import GenerationStats
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams


def test_sampling_is_seeded(target_runner: ModelRunner,
                            close_draft_model: PreTrainedModel) -> None:
    """temperature 1.0: the same seed gives the same tokens; another seed differs."""
    def run(seed: int) -> list[int]:
        engine = SpeculativeEngine(target_runner, (draft_drafter(close_draft_model),), decode,
                                   set())
        return collect(engine, request(PROMPTS["random-a"], k=3, sampling=HOT, seed=seed))[0]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_sampling_self_draft_high_acceptance(target_runner: ModelRunner,
                                             target_model: PreTrainedModel) -> None:
    """With q == p (draft = target) sampled drafts are accepted (almost) always."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(target_model),), decode, set())
    stats = GenerationStats()
    for seed, prompt in enumerate(PROMPTS.values()):
        for event in engine.generate(request(prompt, k=4, sampling=HOT, seed=seed)):
            stats.add(event)
    assert stats.drafted > 50
    assert stats.acceptance_rate > 0.9


def test_top_k_one_sampling_equals_greedy(target_runner: ModelRunner,
                                                        close_draft_model: PreTrainedModel
                                                        ) -> None:
    """With top_k=1 sampling collapses to greedy, so it must equal plain greedy output."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(close_draft_model),), decode, set())
    params = SamplingParams(temperature=0.8, top_k=1, top_p=0.9)
    tokens = collect(engine, request(PROMPTS["random-b"], k=3, sampling=params, seed=4))[0]
    assert tokens == plain_tokens(target_runner.model, PROMPTS["random-b"])


# Statistical end-to-end check on a 13-token model: the first two sampled tokens.
STAT_VOCAB = 13
STAT_PROMPT = [1, 2, 3, 4]


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.719: alpha = 1e-4)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic against p, cells with expected count < 5 pooled; (stat, df)."""
    n = float(counts.sum())
    expected = p.double() * n
    big = expected >= 5
    observed = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.fixture(scope="module")
def stat_models() -> tuple[PreTrainedModel, PreTrainedModel, torch.Tensor, torch.Tensor]:
    """Target and draft over 13 tokens (peaked but not degenerate; acceptance about 0.3) and
    the exact distributions of the first and the second token under plain sampling."""
    target = make_tiny_model(5, vocab_size=STAT_VOCAB, head_scale=15.0)
    draft = perturbed_copy(target, seed=6, noise=1.0)
    runner = ModelRunner(target)
    p1 = torch.softmax(runner.forward(STAT_PROMPT)[-1].double(), dim=-1)
    p2 = torch.zeros(STAT_VOCAB, dtype=torch.float64)
    for x in range(STAT_VOCAB):
        runner.reset()
        p2 += p1[x] * torch.softmax(runner.forward([*STAT_PROMPT, x])[-1].double(), dim=-1)
    return target, draft, p1, p2


def first_two_counts(target: PreTrainedModel,
                     draft: PreTrainedModel | Drafter | tuple[Drafter, ...] | None,
                     seeds: range) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
    """How often each token comes first and second, over ``seeds``; ``draft`` a draft model
    (drafting over the whole vocabulary), a drafter, drafters, or None (plain decoding)."""
    if isinstance(draft, PreTrainedModel):
        draft = DraftModelDrafter(ModelRunner(draft), STAT_VOCAB, STAT_VOCAB)
    drafters = () if draft is None else draft if isinstance(draft, tuple) else (draft,)
    engine = SpeculativeEngine(ModelRunner(target), drafters, decode, set())
    counts = torch.zeros(2, STAT_VOCAB, dtype=torch.long)
    stats = GenerationStats()
    for seed in seeds:
        tokens, events = collect(engine, request(STAT_PROMPT, k=3, max_new_tokens=2,
                                                 sampling=HOT, seed=seed))
        counts[0, tokens[0]] += 1
        counts[1, tokens[1]] += 1
        for event in events:
            stats.add(event)
    return counts[0], counts[1], stats


def test_sampled_first_two_tokens_match_target_distribution(stat_models: tuple) -> None:
    """Speculative sampling with a different draft model (k=3) gives the first and second
    token the same marginal distributions as plain sampling (exact, computed from the
    target); plain sampling through the engine is checked against the same reference."""
    target, draft, p1, p2 = stat_models
    for model, seeds in ((draft, range(1500)), (None, range(10_000, 10_800))):
        c1, c2, stats = first_two_counts(target, model, seeds)
        if model is not None:
            assert 0.1 < stats.acceptance_rate < 0.7  # rejections are frequent: residual matters
        for counts, p in ((c1, p1), (c2, p2)):
            stat, df = chi_square(counts, p)
            assert stat < chi_square_critical(df), (model is None, stat, df)


def test_a_chain_that_ends_itself_keeps_the_target_distribution(stat_models: tuple) -> None:
    """A draft model that ends its chain on the chain's chance (a length set by the sampled
    drafts' q) leaves the first two tokens distributed as under plain sampling."""
    target, draft, p1, p2 = stat_models
    drafter = DraftModelDrafter(ModelRunner(draft), STAT_VOCAB, STAT_VOCAB,
                                confidence_threshold=0.5)
    c1, c2, stats = first_two_counts(target, drafter, range(1500))
    lengths = stats.drafted_per_position  # steps that drafted a first, second, third token
    assert lengths[0] > lengths[1] > 0  # some chains ended before k
    for counts, p in ((c1, p1), (c2, p2)):
        stat, df = chi_square(counts, p)
        assert stat < chi_square_critical(df), (stat, df)


def test_statistical_check_has_power(stat_models: tuple, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    """Negative control: resampling from p after a rejection (a wrong residual) fails the
    same chi-square check, even with fewer samples."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, token: p)
    target, draft, p1, p2 = stat_models
    c1, c2, _ = first_two_counts(target, draft, range(600))
    assert chi_square(c1, p1)[0] > chi_square_critical(chi_square(c1, p1)[1])
    assert chi_square(c2, p2)[0] > chi_square_critical(chi_square(c2, p2)[1])
