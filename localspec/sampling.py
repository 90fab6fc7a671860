"""Sampling: how the target's (and a drafter's) next-token distribution is shaped and drawn from.

Pure functions over logits and probabilities, below both the engine and the drafters: a drafter
warps its q exactly as the verifier warps p (the same temperature, top-k and top-p), so both
read the one definition here. Every draw takes an explicit ``torch.Generator``.
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
        logits = _top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


NUCLEUS_FIRST = 1024  # candidates ``_top_p`` sorts first; 8x more each time they fall short


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of each row, best first, whose mass reaches ``top_p`` (the
    first token always stays); the others -inf.

    The nucleus is looked for among the best ``NUCLEUS_FIRST`` tokens (``topk``), 8x more while
    some row's candidates hold less than ``top_p``: sorting all of a 152k vocabulary costs
    every row many times what this costs the whole warp (docs/research-log.md). Once the
    candidates hold
    ``top_p``, no token after them can be in the prefix, so the cut is the full sort's."""
    vocab = logits.shape[-1]
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    count = min(NUCLEUS_FIRST, vocab)
    while True:
        values, order = torch.topk(logits, count, dim=-1)
        probs = torch.exp(values - log_total)
        if count == vocab or bool((probs.sum(dim=-1) >= top_p).all()):
            break
        count = min(8 * count, vocab)
    keep = (probs.cumsum(dim=-1) - probs) < top_p
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, keep)
    return logits.masked_fill(~kept, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a [vocab] distribution (its mass need not be 1), by the inverse of its
    float64 CDF: ``torch.multinomial`` over a 152k row costs many times more
    (docs/research-log.md). A token without mass is never drawn (``right=True`` skips its flat
    step)."""
    cdf = probs.double().cumsum(dim=-1)
    total = float(cdf[-1])
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    index = int(torch.searchsorted(cdf, u * total, right=True))
    # u * total rounds to total at most once in 2^53 draws: the last token with mass
    return index if index < len(cdf) else int(torch.nonzero(probs).max())
