"""The drafter contract (``localspec.drafters.base.Drafter``): ``reset`` and ``propose`` are each
drafter's own, ``sure(context)`` is part of the contract with a default of "no evidence", and
the engine asks every drafter through it, refusing an object that only looks like a drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import collect, decode

from localspec.drafters.base import Drafter, Proposal
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.eagle import EagleDrafter
from localspec.drafters.medusa import MedusaDrafter
from localspec.drafters.multi import MultiDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.simulated import SimulatedDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

PROMPT = [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11]


class Repeat(Drafter):
    """Guesses the last token again: the least a drafter must write."""

    name = "repeat"

    def reset(self) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        return Proposal([context[-1]] * k)


class SureRepeat(Repeat):
    """Repeat, claiming evidence for every guess and recording the contexts it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def sure(self, context: list[int]) -> bool:
        self.asked.append(list(context))
        return True


class LooksLikeADrafter:
    """Every method of a drafter, but not a Drafter."""

    name = "duck"

    def reset(self) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        return Proposal([])

    def sure(self, context: list[int]) -> bool:
        return False


def request(max_new_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(PROMPT), max_new_tokens=max_new_tokens,
                             sampling=SamplingParams(), num_speculative_tokens=3, adaptive=True)


def test_sure_defaults_to_no_evidence() -> None:
    """A drafter that does not override ``sure`` answers 0 for any context."""
    assert Repeat().sure(PROMPT) == 0 and Repeat().sure([]) == 0


@pytest.mark.parametrize("cls", [DraftModelDrafter, NgramDrafter, EagleDrafter, MedusaDrafter,
                                 MultiDrafter, SimulatedDrafter])
def test_every_drafter_subclasses_the_contract(cls: type) -> None:
    assert issubclass(cls, Drafter)


def test_only_lookup_overrides_sure() -> None:
    """N-gram lookup (and a set of drafters, through its members) has evidence for free; the
    model drafters inherit the default."""
    overriding = {cls.__name__ for cls in (DraftModelDrafter, NgramDrafter, EagleDrafter,
                                           MedusaDrafter, MultiDrafter, SimulatedDrafter)
                  if cls.sure is not Drafter.sure}
    assert overriding == {"NgramDrafter", "MultiDrafter"}


def test_backlog_defaults_to_nothing_and_only_the_draft_model_has_one() -> None:
    """``backlog`` (what a drafter must feed its own model before drafting) is 0 unless the
    drafter reports one: only the draft model, which must read the prompt with its own model
    (a head catches up on the target's recorded features and reports none)."""
    assert Repeat().backlog(PROMPT) == 0 and Repeat().catch_up_cost is None
    overriding = {cls.__name__ for cls in (DraftModelDrafter, NgramDrafter, EagleDrafter,
                                           MedusaDrafter, MultiDrafter, SimulatedDrafter)
                  if cls.backlog is not Drafter.backlog}
    assert overriding == {"DraftModelDrafter"}


def test_a_drafter_must_propose_and_reset() -> None:
    """Leaving out part of the contract fails when the drafter is made, not mid-generation."""

    class NoReset(Drafter):
        name = "no-reset"

        def propose(self, context: list[int], k: int, params: SamplingParams,
                    generator: torch.Generator) -> Proposal:
            return Proposal([])

    with pytest.raises(TypeError, match="reset"):
        NoReset()  # type: ignore[abstract]


def test_the_engine_refuses_what_is_not_a_drafter(target_runner: ModelRunner) -> None:
    with pytest.raises(TypeError, match="LooksLikeADrafter is not a Drafter"):
        SpeculativeEngine(target_runner, LooksLikeADrafter(), decode, set())  # type: ignore[arg-type]


def test_the_engine_asks_sure_each_step(target_runner: ModelRunner) -> None:
    """The engine asks the drafter's ``sure`` with the live context before each step, and
    plain output is unchanged whatever it answers."""
    drafter = SureRepeat()
    tokens, events = collect(SpeculativeEngine(target_runner, drafter, decode, set()), request())
    plain, _ = collect(SpeculativeEngine(target_runner, None, decode, set()), request())
    assert tokens == plain
    assert len(drafter.asked) == len(events)
    assert drafter.asked[0] == PROMPT
    assert drafter.asked[-1] == PROMPT + tokens[: len(drafter.asked[-1]) - len(PROMPT)]
