"""The drafter contract (``localspec.drafters.base.Drafter``): ``reset`` and ``propose`` are each
drafter's own, ``sure(context)`` is part of the contract with a default of "no evidence", and
the engine asks every drafter through it, refusing an object that only looks like a drafter.
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
from conftest import collect, decode

import localspec.drafters as drafters_package
from localspec import registry
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
NOT_METHODS = {"SimulatedDrafter"}  # bench --simulate-acceptance (drafters/simulated.py)


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
