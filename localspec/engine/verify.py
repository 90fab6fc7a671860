"""The verifier: pure functions that decide which draft tokens the target keeps.

Vocabulary (as in vLLM's rejection sampler):
  * **accepted** draft tokens: the prefix of the draft the target agrees with;
  * a **recovered** token: sampled from the residual ``norm(max(0, p - q))`` (or the
    target's argmax, greedily) at the first rejected position;
  * a **bonus** token: sampled from ``p`` at position ``k`` once all ``k`` drafts were accepted.

Notation follows Leviathan et al. (2023) and Chen et al. (2023): **p = target, q = draft**.
``q_draft=None`` means a deterministic drafter (n-gram, argmax draft): q is one-hot on the
drafted token, so acceptance becomes ``min(1, p(x))`` and the residual is ``p`` with ``x``
removed.

These functions know nothing about models, caches or tokenizers; they take probabilities or
logits and an explicit ``torch.Generator`` for every random draw, so they are tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped; the same warping is applied to q."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: keep ``num_accepted`` drafts, then append ``token``."""

    num_accepted: int
    token: int
    is_bonus: bool  # True: all drafts accepted and ``token`` came from p at position k


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax, in float32.

    logits: [n, vocab]. Returns probs: [n, vocab]. ``params.temperature`` must be > 0.
    """
    logits = logits.float()
    # A tiny temperature (1e-40 is valid) must mean argmax, not NaN: shift by the row maximum
    # first (softmax does not change) so the others go to -inf instead of the best one to inf,
    # and keep the divisor a float32 normal number (smaller ones round to 0, and 0/0 is NaN).
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
    """min(1, p(x) / q(x)) for a drafted token x; q=None is a one-hot draft."""
    p_x = float(p[token])
    q_x = 1.0 if q is None else float(q[token])
    if q_x <= 0.0:
        return 1.0 if p_x > 0.0 else 0.0
    return min(1.0, p_x / q_x)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): where the recovered token is drawn after rejecting ``token``.

    p, q: [vocab]. With a one-hot q at ``token`` this is p with ``token`` removed.
    """
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0:
        # Only reachable when p == q, where rejection has probability 0; keep p to stay defined.
        return p
    return residual / total


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> Verdict:
    """Keep the longest draft prefix that equals the target's argmax, then the target's argmax.

    target_logits: [k + 1, vocab] for the positions after the last kept token and each draft.
    """
    k = len(draft_tokens)
    target_argmax = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    num_accepted = 0
    while num_accepted < k and draft_tokens[num_accepted] == target_argmax[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted, target_argmax[num_accepted], num_accepted == k)


def verify_sampling(
    p_target: torch.Tensor,
    q_draft: torch.Tensor | None,
    draft_tokens: list[int],
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling: accept x_i with min(1, p/q), else draw from the residual.

    p_target: [k + 1, vocab] target probabilities (already warped by ``logits_to_probs``).
    q_draft:  [k, vocab] draft probabilities under the same warping, or None (one-hot draft).
    The emitted tokens are distributed exactly as sampling from p one token at a time.
    """
    k = len(draft_tokens)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64,
                          device=generator.device).tolist()
    for i, token in enumerate(draft_tokens):
        q_i = None if q_draft is None else q_draft[i]
        if uniforms[i] < acceptance_probability(p_target[i], q_i, token):
            continue
        residual = residual_distribution(p_target[i], q_i, token)
        return Verdict(i, sample(residual, generator), False)
    return Verdict(k, sample(p_target[k], generator), True)
