"""The drafter contract (``localspec.engine.drafter.Drafter``): ``traits``, ``reset`` and
``propose`` are each drafter's own, ``outlook(context)`` is part of the contract with a default
of "nothing known", and the engine asks every drafter through it, refusing an object that only
looks like a drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, collect, decode

from localspec.drafters.base import ModelDrafter
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.eagle import EagleDrafter
from localspec.drafters.medusa import MedusaDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.simulated import SimulatedDrafter
from localspec.engine.drafter import Drafter, DrafterTraits, Outlook, Proposal
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

PROMPT = [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11]


class Repeat(Drafter):
    """Guesses the last token again: the least a drafter must write."""

    traits = DrafterTraits("repeat")

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        return Proposal([context[-1]] * k)


class SureRepeat(Repeat):
    """Repeat, claiming evidence for every guess and recording the contexts it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def outlook(self, context: list[int]) -> Outlook:
        self.asked.append(list(context))
        return Outlook(sure=1)


class LooksLikeADrafter:
    """Every method of a drafter, but not a Drafter."""

    traits = DrafterTraits("duck")

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        return Proposal([])


def request(max_new_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(PROMPT), max_new_tokens=max_new_tokens,
                             sampling=SamplingParams(), num_speculative_tokens=3, adaptive=True)


def test_outlook_defaults_to_nothing_known() -> None:
    """A drafter that does not override ``outlook`` has no evidence, no backlog and no price
    or kept share yet, for any context."""
    assert Repeat().outlook(PROMPT) == Outlook() == Repeat().outlook([])


DRAFTERS = (DraftModelDrafter, NgramDrafter, EagleDrafter, MedusaDrafter, SimulatedDrafter)


@pytest.mark.parametrize("cls", DRAFTERS)
def test_every_drafter_subclasses_the_contract(cls: type) -> None:
    assert issubclass(cls, Drafter)


def test_the_contract_is_small() -> None:
    """``traits``, ``reset``, ``propose`` and the optional ``outlook``: nothing else is public
    on the contract."""
    public = {name for name in vars(Drafter) if not name.startswith("_")}
    assert public == {"reset", "propose", "outlook"}
    assert set(Drafter.__annotations__) == {"traits"}


def test_the_model_drafters_share_one_base() -> None:
    """Draft model, EAGLE and Medusa draft through ``ModelDrafter``: each writes ``_draft``
    only, and none repeats ``propose`` or the calibration."""
    for cls in (DraftModelDrafter, EagleDrafter, MedusaDrafter):
        assert issubclass(cls, ModelDrafter)
        assert "propose" not in vars(cls) and "_draft" in vars(cls)


def test_only_lookup_is_sure_and_only_the_draft_model_is_behind(
        target_runner: ModelRunner) -> None:
    """N-gram lookup has evidence for free; a draft model must read the prompt with its own
    model before drafting (a backlog); a head catches up on the target's recorded features and
    reports none."""
    assert NgramDrafter(3, 1).outlook(PROMPT).sure > 0
    draft = DraftModelDrafter(ModelRunner(target_runner.model), VOCAB, VOCAB)
    assert draft.outlook(PROMPT).backlog == len(PROMPT) and draft.outlook(PROMPT).sure == 0


def test_a_drafter_must_propose_and_reset() -> None:
    """Leaving out part of the contract fails when the drafter is made, not mid-generation."""

    class NoReset(Drafter):
        traits = DrafterTraits("no-reset")

        def propose(self, context: list[int], k: int, params: SamplingParams,
                    generator: torch.Generator, width: int = 1) -> Proposal:
            return Proposal([])

    with pytest.raises(TypeError, match="reset"):
        NoReset()  # type: ignore[abstract]


def test_the_engine_refuses_what_is_not_a_drafter(target_runner: ModelRunner) -> None:
    with pytest.raises(TypeError, match="LooksLikeADrafter is not a Drafter"):
        SpeculativeEngine(target_runner, (LooksLikeADrafter(),),  # type: ignore[arg-type]
                          decode, set())


def test_the_engine_asks_the_outlook_each_step(target_runner: ModelRunner) -> None:
    """The engine asks the drafter's ``outlook`` with the live context before each step (and
    once for the prompt, for its kept share), and output is unchanged whatever it answers."""
    drafter = SureRepeat()
    tokens, events = collect(SpeculativeEngine(target_runner, (drafter,), decode, set()),
                             request())
    plain, _ = collect(SpeculativeEngine(target_runner, (), decode, set()), request())
    assert tokens == plain
    assert len(drafter.asked) == len(events) + 1
    assert drafter.asked[0] == drafter.asked[1] == PROMPT
    assert drafter.asked[-1] == PROMPT + tokens[: len(drafter.asked[-1]) - len(PROMPT)]
