"""The drafter contract (``localspec.engine.drafter.Drafter``): ``traits``, ``reset`` and
``propose`` are each drafter's own, ``outlook(context)`` is part of the contract with a default
of "nothing known", and the engine asks every drafter through it, refusing an object that only
looks like a drafter.
Every drafter class under ``localspec/drafters`` is built by a registry entry (a drafter
module without its entry fails, the negative control shows)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from types import ModuleType

import pytest
import torch
from conftest import VOCAB, collect, decode

import localspec.drafters as drafters_package
from localspec import registry
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


# ----------------------------------------------------------------- every drafter registered


def drafter_classes(modules: list[ModuleType]) -> list[type[Drafter]]:
    """The concrete Drafter subclasses defined in ``modules``."""
    return [cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Drafter) and cls.__module__ == module.__name__
            and not inspect.isabstract(cls)]


def unregistered(modules: list[ModuleType]) -> list[str]:
    """The drafters of ``modules`` that no registry entry builds: a drafter counts as
    registered when some entry's ``build`` returns it (its return annotation), so a class
    whose entry is missing, or whose build returns another class, is listed."""
    built = set()
    for spec in registry.drafters():
        if spec.build is not None:
            module, _, function = spec.build.partition(":")
            returned = getattr(importlib.import_module(module), function).__annotations__.get(
                "return")
            built.add(returned if isinstance(returned, str) else getattr(returned, "__name__",
                                                                           None))
    return [f"{cls.__module__}.{cls.__name__}" for cls in drafter_classes(modules)
            if cls.__name__ not in built and cls.__name__ not in NOT_METHODS]


def drafter_modules() -> list[ModuleType]:
    """Every module under localspec/drafters."""
    return [importlib.import_module(f"localspec.drafters.{info.name}")
            for info in pkgutil.iter_modules(drafters_package.__path__)]


# Drafters that are no method of their own: they wrap a registered drafter.
NOT_METHODS = {"SimulatedDrafter"}  # bench's draft_model@A (drafters/simulated.py)


def test_every_drafter_under_drafters_has_a_registry_entry() -> None:
    """A drafter module without its entry in ``localspec/registry.py`` fails here."""
    assert drafter_classes(drafter_modules())
    assert unregistered(drafter_modules()) == []


def test_a_drafter_missing_from_the_registry_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: a drafter module dropped under localspec/drafters with no entry
    is listed; its entry added, it is not."""
    module = ModuleType("localspec.drafters.unlisted")

    class Unlisted(Repeat):
        """A new drafter, unregistered."""

    def build(ctx: object) -> Unlisted:
        return Unlisted()

    Unlisted.__module__ = module.__name__
    module.Unlisted, module.build = Unlisted, build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    modules = [*drafter_modules(), module]
    assert unregistered(modules) == ["localspec.drafters.unlisted.Unlisted"]
    entry = registry.DrafterSpec("unlisted", "unlisted", f"{module.__name__}:build")
    monkeypatch.setattr(registry, "DRAFTERS", (*registry.DRAFTERS, entry))
    assert unregistered(modules) == []
