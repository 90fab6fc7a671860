"""Benchmark only: a drafter with a chosen acceptance rate that still pays a real drafter's cost.

On random-weight models (a GPU machine with no checkpoints) a draft model agrees with its
target by chance only, so a benchmark cannot show what speculation gains at realistic
acceptance. This drafter runs the real drafter first (its forward passes are paid in full, so
draft cost and engine overhead are real), then proposes the target's own greedy tokens from a
reference run of plain decoding instead of the drafter's guesses: each is kept with probability
``acceptance``, and the first one not kept is replaced by another token (and drafting stops
there, as every later draft would be rejected anyway). Verification is real, so the output is
still exactly the target's; only the acceptance is simulated. Greedy only.

Never used outside ``localspec bench --simulate-acceptance``.
"""

from __future__ import annotations

import torch

from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.sampling import SamplingParams


class SimulatedDrafter(Drafter):
    """A real drafter's cost with the target's greedy tokens, each kept with ``acceptance``."""

    traits = DrafterTraits("simulated")

    def __init__(self, inner: Drafter, reference: list[int], prompt_length: int,
                 acceptance: float, seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.inner = inner
        self.reference = reference  # plain decoding's tokens after the prompt
        self.prompt_length = prompt_length
        self.acceptance = acceptance
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)

    def reset(self, keep_cache: bool = False) -> None:
        self.inner.reset()
        self._generator = torch.Generator().manual_seed(self.seed)

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        real = self.inner.propose(context, k, params, generator)  # the cost, paid
        start = len(context) - self.prompt_length
        truth = self.reference[start : start + len(real.tokens)]
        kept = (torch.rand(len(truth), generator=self._generator) < self.acceptance).tolist()
        tokens = []
        for token, keep in zip(truth, kept, strict=True):
            tokens.append(token if keep else (token - 1 if token > 0 else 1))
            if not keep:
                break
        return Proposal(tokens, None, tuple(1.0 for _ in tokens), real.sync_time)
