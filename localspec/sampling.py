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
