"""The drafter contract: what the engine needs from anything that guesses ahead of the target.

A drafter has three parts: ``reset`` (forget the last sequence), ``propose`` (up to k guesses
continuing the whole token context, with their q rows when it has a distribution) and
``traits`` (a small frozen description the engine's policy reads). It keeps whatever state it
needs (a KV cache, a calibration of its confidence) in step with the context by itself, so the
engine never tells it what was rejected: the next ``propose`` simply shows the new context.

``outlook`` is optional: what a drafter can tell for free before it drafts (how well founded
its next guess is, how far behind the context it is). The default says nothing, which is right
for any drafter whose guesses are all alike and that is never behind.

The contract lives in the engine, which is its only caller; drafters (``localspec.drafters``)
implement it, one module each. The engine refuses anything that does not subclass ``Drafter``,
so a drafter cannot miss part of the contract by misspelling a method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from localspec.sampling import SamplingParams


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and, for drafters with a distribution, their q rows.

    ``parents`` None: the tokens are one chain. Else they are a tree (greedy requests only):
    ``parents[i]`` is where token i's parent sits in the target's feed ``[pending, *tokens]``
    (0: the pending token), always an earlier place; a chain comes first (token i's parent is
    i, for the first ``chain_length`` tokens), then the other candidates."""

    tokens: list[int]
    q_draft: torch.Tensor | None = None  # [len(tokens), vocab] or None (one-hot draft)
    confidences: tuple[float, ...] = ()  # q(token) for each drafted token, for display
    # Seconds spent catching up with the context (a prompt's prefill, tokens generated while
    # drafting was off): paid once, not per draft, so adaptive k leaves it out of c_draft.
    sync_time: float = 0.0
    parents: tuple[int, ...] | None = None

    @property
    def chain_length(self) -> int:
        """How many leading tokens form the chain (all of them when there is no tree)."""
        if self.parents is None:
            return len(self.tokens)
        return next((i for i, parent in enumerate(self.parents) if parent != i),
                    len(self.parents))


@dataclass(frozen=True)
class DrafterTraits:
    """What the engine's policy knows of a drafter without asking it anything."""

    name: str  # which drafter it is (a registered drafter: its method's name)
    # A proposal costs next to nothing and changes no state (n-gram lookup): in greedy decoding
    # the policy may ask it what it would have drafted on steps another drafter drafted.
    free: bool = False
    # It ends each chain where the chain's chance stops paying (a model-based drafter with a
    # confidence threshold): adaptive k then asks it for k_max whenever drafting pays.
    stops_itself: bool = False


@dataclass(frozen=True)
class Outlook:
    """What a drafter can tell for free about the step ahead, before it drafts."""

    # How well founded its next guess is: 0 no evidence, 1 enough that adaptive k may probe it
    # while drafting is off, 2 more (n-gram lookup in the middle of a long copy). Each grade's
    # guesses are learnt apart (``engine.choice.DrafterChoice``).
    sure: int = 0
    # Tokens of the context it must still feed its own model before it can draft (a draft
    # model skipped so far catches up on the whole prompt), and the seconds a token of its
    # last catch-up took (None: not timed yet; the target's prefill stands in).
    backlog: int = 0
    catch_up_cost: float | None = None
    # The share of its guesses the target kept over earlier requests (None: unknown): the
    # prior of its acceptance in this answer (``Calibration.kept_share``).
    kept_share: float | None = None


class Drafter(ABC):
    """What the engine needs from any drafter: ``traits``, ``reset`` and ``propose``."""

    traits: DrafterTraits

    @abstractmethod
    def reset(self, keep_cache: bool = False) -> None:
        """Forget all per-sequence state before a new generation. ``keep_cache``: the next
        context may start with this one's tokens (a conversation's next turn), so a drafter
        whose cache is exact whatever fed it (``ModelRunner.row_exact``) may keep it."""

    @abstractmethod
    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        """At most ``k`` draft tokens continuing ``context``. With ``width`` > 1 (asked for
        greedy requests only) a drafter may add up to ``width - 1`` other candidates for the
        first token as a tree (``Proposal.parents``); it may also ignore ``width``."""

    def outlook(self, context: list[int]) -> Outlook:
        """What it can tell about its next guess after ``context`` without drafting."""
        return Outlook()
