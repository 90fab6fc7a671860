"""The drafter contract: propose a few tokens ahead of the target.

A drafter sees the whole token context (prompt + generated, ending with the token the target
has not yet consumed) and returns up to ``k`` guesses, with their draft probabilities q when it
has a distribution (a draft model) or ``None`` when it is deterministic (n-gram lookup). It
keeps whatever state it needs (a KV cache) in step with the context by itself, so the engine
never has to tell it what was rejected: the next ``propose`` call simply shows the new context.

EAGLE and Medusa heads slot in by implementing the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from localspec.engine.verify import SamplingParams


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and, for drafters with a distribution, their q rows."""

    tokens: list[int]
    q_draft: torch.Tensor | None = None  # [len(tokens), vocab] or None (one-hot draft)
    confidences: tuple[float, ...] = ()  # q(token) for each drafted token, for display
    # Seconds spent catching up with the context (a prompt's prefill, tokens generated while
    # drafting was off): paid once, not per draft, so adaptive k leaves it out of c_draft.
    sync_time: float = 0.0


class Drafter(Protocol):
    """What the engine needs from any drafter."""

    name: str

    def reset(self) -> None:
        """Forget all per-sequence state before a new generation."""

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        """Return at most ``k`` draft tokens continuing ``context``."""
        ...
