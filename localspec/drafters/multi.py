"""Several drafters as one: the members of method "auto" (and of ``lookup_first``).

A ``MultiDrafter`` holds its members and is a drafter itself, so everything that takes a
drafter takes it. The engine sees through it: each step its choosing policy
(``engine.choice.DrafterChoice``) asks the member whose expected tokens per second is highest,
from that member's own acceptance and costs, and attributes the verdict to it. Called as a
plain drafter (``propose``) it takes the first member, in the listed order, that proposes
anything: lookup first, the model on a miss.

Each member keeps its own state in step with the context by itself (the drafter contract): a
draft model that was skipped for some steps catches up on every token it did not see the next
time it is asked, whoever drafted them. So members need no notice of what the others did.
Which member drafts never depends on the target's draws at that step, and each proposal is
verified with its own q (``q_draft`` None for a one-hot draft), so the output stays exactly the
target's.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence

import torch

from localspec.drafters.base import BuildContext, Drafter, Proposal
from localspec.registry import AUTO, DrafterSpec, drafter_spec
from localspec.sampling import SamplingParams


class MultiDrafter(Drafter):
    """Drafters of one engine, one of them asked each step."""

    name = AUTO

    def __init__(self, members: Sequence[Drafter]) -> None:
        names = [member.name for member in members]
        if not members or len(set(names)) < len(names):
            raise ValueError(f"a MultiDrafter needs distinct members, got {names}")
        self.members = tuple(members)

    def reset(self) -> None:
        for member in self.members:
            member.reset()

    def reset_keeping_cache(self) -> None:
        for member in self.members:
            member.reset_keeping_cache()

    def sure(self, context: list[int]) -> int:
        """The strongest member's evidence (see ``NgramDrafter.sure``)."""
        return max((int(member.sure(context)) for member in self.members), default=0)

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        """The first member's proposal that has tokens, named after that member."""
        proposal = Proposal([])
        for member in self.members:
            proposal = member.propose(context, k, params, generator)
            if proposal.tokens:
                return dataclasses.replace(proposal, drafter=member.name)
        return proposal


def build_drafter(spec: DrafterSpec, ctx: BuildContext) -> Drafter:
    """Method ``spec``'s drafter, made by its registered build."""
    if spec.build is None:
        raise ValueError(f"method '{spec.name}' has no drafter (plain decoding)")
    module, _, function = spec.build.partition(":")
    build: Callable[[BuildContext], Drafter] = getattr(importlib.import_module(module), function)
    return build(ctx)


def build(ctx: BuildContext) -> MultiDrafter:
    """The drafter of method "auto": the preset's members (``Preset.drafter_methods``)."""
    return MultiDrafter([build_drafter(drafter_spec(name), ctx)
                         for name in ctx.preset.drafter_methods(AUTO)])
