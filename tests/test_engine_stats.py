"""What the speculative engine reports and how it sizes its drafts, on tiny random models: the
stats folded from the events (tokens per pass, acceptance per position, merging); adaptive k
told when lookup is sure, falling back to plain steps when drafting does not pay, not charged
for the draft's catch-up; simulated acceptance that runs the real draft and stays exact."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import collect, decode, draft_drafter
from engine_helpers import GREEDY, MAX_NEW, PROMPTS, plain_tokens, request
from transformers import PreTrainedModel

import localspec.engine.choice as choice_module
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.simulated import SimulatedDrafter
from localspec.engine.adaptive import ALONE, Load
from localspec.engine.choice import Attempt
from localspec.engine.engine import SpeculativeEngine, StepEvent
from localspec.engine.stats import GenerationStats
from localspec.runtime.runner import ModelRunner


def test_lookups_evidence_reaches_adaptive_k(target_runner: ModelRunner,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step the engine asks adaptive k with each drafter's ``sure``: grade 2 on a prompt
    whose last n-gram occurred before in a match reaching back 12 tokens (a long copy); plain
    decoding has no drafter to ask."""
    seen: list[list[int]] = []

    class Recording(choice_module.DrafterChoice):
        def order(self, sure: list[int], catch_up: list[float] | None = None,
                  load: Load = ALONE) -> list[Attempt]:
            seen.append(list(sure))
            return super().order(sure, catch_up, load)

    monkeypatch.setattr(choice_module, "DrafterChoice", Recording)
    lookup = SpeculativeEngine(target_runner, (NgramDrafter(3, 1),), decode, set())
    collect(lookup, request(PROMPTS["repetitive"], adaptive=True))
    assert seen[0] == [2]
    seen.clear()
    collect(SpeculativeEngine(target_runner, (), decode, set()),
            request(PROMPTS["repetitive"]))
    assert seen and all(sure == [] for sure in seen)


def test_stats_folded_from_events(target_runner: ModelRunner,
                                  close_draft_model: PreTrainedModel) -> None:
    """GenerationStats agrees with the events: tokens per pass, acceptance, per-position
    acceptance counts that can only fall with the position."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(close_draft_model),), decode, set())
    stats = GenerationStats()
    events: list[StepEvent] = []
    for prompt in PROMPTS.values():
        for event in engine.generate(request(prompt, k=5)):
            stats.add(event)
            events.append(event)
    assert stats.new_tokens == sum(len(e.tokens) for e in events) == 3 * MAX_NEW
    assert stats.target_forward_passes == len(events)
    assert stats.mean_accepted_length == pytest.approx(stats.new_tokens / len(events))
    assert stats.drafted == sum(len(e.drafted) for e in events)
    assert stats.accepted == sum(e.accepted for e in events)
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    assert 0 < stats.acceptance_rate < 1
    per_position = stats.accepted_per_position
    assert sum(per_position) == stats.accepted
    assert all(a >= b for a, b in itertools.pairwise(per_position))
    assert stats.drafted_per_position[0] == sum(1 for e in events if e.drafted)
    merged = GenerationStats().merge(stats).merge(stats)
    assert merged.new_tokens == 2 * stats.new_tokens
    assert merged.accepted_per_position == [2 * a for a in per_position]
    assert stats.as_dict()["new_tokens"] == stats.new_tokens


def test_plain_stats_one_token_per_pass(target_runner: ModelRunner) -> None:
    """Plain decoding: one token per target pass, nothing drafted, acceptance rate 0."""
    engine = SpeculativeEngine(target_runner, (), decode, set())
    stats = GenerationStats()
    for event in engine.generate(request(PROMPTS["random-a"], max_new_tokens=10)):
        stats.add(event)
    assert stats.mean_accepted_length == 1.0
    assert stats.target_forward_passes == 10 and stats.drafted == 0
    assert stats.acceptance_rate == 0.0 and stats.accepted_per_position == []


def test_drafting_stops_when_it_does_not_pay(target_runner: ModelRunner,
                                             random_draft_model: PreTrainedModel) -> None:
    """A draft that is never right and costs as much as the target: adaptive k falls back to
    plain steps (k = 0) with rare probes, so speculation is not slower than plain decoding."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(random_draft_model),), decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-a"], k=8, adaptive=True,
                                             max_new_tokens=120))
    drafting = [e for e in events if e.drafted]
    assert len(tokens) == 120
    assert sum(not e.drafted for e in events) > 80
    assert len(drafting) <= 12, [len(e.drafted) for e in events]


def test_draft_catch_up_is_timed_apart(close_draft_model: PreTrainedModel) -> None:
    """The draft's prefill (the prompt, or a gap while drafting was off) is reported as
    sync_time, so adaptive k does not count it as the cost of each draft token."""
    drafter = draft_drafter(close_draft_model)
    context = PROMPTS["random-b"]
    first = drafter.propose(context, 3, GREEDY, torch.Generator())
    assert first.sync_time > 0 and len(first.tokens) == 3
    steady = drafter.propose([*context, first.tokens[0]], 3, GREEDY, torch.Generator())
    assert steady.sync_time == 0.0
    fresh = draft_drafter(close_draft_model).propose([*context, first.tokens[0]], 3, GREEDY,
                                                     torch.Generator())
    assert steady.tokens == fresh.tokens  # the split feed drafts the same tokens


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_simulated_acceptance_pays_the_draft_and_stays_exact(
        acceptance: float, target_runner: ModelRunner, target_model: PreTrainedModel,
        random_draft_model: PreTrainedModel) -> None:
    """bench --simulate-acceptance: the real (here: always wrong) draft model runs, but the
    drafts are the target's greedy tokens kept with the chosen probability; verification is
    real, so the output is plain decoding's."""
    prompt = PROMPTS["random-b"]
    reference = plain_tokens(target_model, prompt, max_new_tokens=80)
    inner = draft_drafter(random_draft_model)
    drafter = SimulatedDrafter(inner, reference, len(prompt), acceptance, seed=3)
    engine = SpeculativeEngine(target_runner, (drafter,), decode, set())
    tokens, events = collect(engine, request(prompt, k=4, max_new_tokens=80))
    assert tokens == reference
    assert inner._seen  # the draft model really ran
    drafted = sum(len(e.drafted) for e in events)
    accepted = sum(e.accepted for e in events)
    tested = sum(min(len(e.drafted), e.accepted + 1) for e in events)  # positions looked at
    if acceptance == 1.0:
        assert accepted == drafted > 0
    elif acceptance == 0.0:
        assert accepted == 0 and drafted > 0
    else:
        assert 0.3 < accepted / tested < 0.7, (accepted, tested)
