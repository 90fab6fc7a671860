"""Lookup-first drafting: try n-gram prompt lookup, fall back to the draft model on a miss.

A prompt-lookup hit costs no model pass, while each draft-model token costs a sizeable
fraction of a target pass on a CPU (0.5B draft vs 1.5B target: about 0.4). Code answers often
repeat identifiers and lines from the prompt or from themselves, so taking the free guesses
first and paying for the draft model only when lookup has nothing cuts the drafting cost
without changing the output: any proposal is verified the same way.
"""

from __future__ import annotations

import torch

from localspec.drafters.base import Drafter, Proposal
from localspec.drafters.ngram import NgramDrafter
from localspec.sampling import SamplingParams


class LookupFirstDrafter(Drafter):
    """Compose an n-gram drafter and a model drafter: lookup hits first."""

    def __init__(self, lookup: NgramDrafter, model: Drafter) -> None:
        self.lookup = lookup
        self.model = model
        self.name = model.name

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    def sure(self, context: list[int]) -> bool:
        """Lookup's evidence (see ``NgramDrafter.sure``)."""
        return self.lookup.sure(context)

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        proposal = self.lookup.propose(context, k, params, generator)
        if proposal.tokens:
            return proposal
        return self.model.propose(context, k, params, generator)
