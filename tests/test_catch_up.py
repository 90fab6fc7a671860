"""A drafter behind the context (a draft model that has not read the prompt yet) waits while a
measured drafter pays, until the steps that kept no draft have paid ``CATCH_UP_RENT`` times its
catch-up beyond ``CATCH_UP_ALLOWANCE`` plain steps (``engine.choice``), and a draft model tells
its backlog and times its catch-up."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import collect, decode, draft_drafter
from engine_helpers import Gate, plain_tokens, request
from transformers import PreTrainedModel

import localspec.engine.choice as choice_module
from localspec.engine.choice import CATCH_UP_ALLOWANCE, CATCH_UP_RENT, Attempt, DrafterChoice
from localspec.engine.engine import SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

PASS = 0.1  # seconds of every target pass below, whatever its width


def first_step(choice: DrafterChoice, catch_up: list[float]) -> None:
    """Drafter 0 drafts 4 tokens, all kept, at a fortieth of a pass a token."""
    assert asked(choice, catch_up)[0] == 0
    choice.asked(Attempt(0, 4))
    choice.record(0, 4, 4, {0: 0.01}, PASS)


def asked(choice: DrafterChoice, catch_up: list[float]) -> list[int]:
    return [a.index for a in choice.order([False, False], catch_up)]


def test_a_behind_drafter_waits_until_the_rent_paid_reaches_its_catch_up() -> None:
    """Drafter 1's catch-up is 0.15 s beyond the allowance: while drafter 0 pays it is not
    asked; each step that kept nothing (0.1 s) adds to the rent, and once that reaches
    CATCH_UP_RENT times 0.15 s (at the fifth) it is asked, first (nothing is known of it yet)."""
    beyond = 0.45 / CATCH_UP_RENT
    choice, catch_up = DrafterChoice(2, k_max=4), [0.0, CATCH_UP_ALLOWANCE * PASS + beyond]
    first_step(choice, catch_up)
    for _ in range(4):
        assert asked(choice, catch_up) == [0]
        choice.asked(Attempt(0, 4))
        choice.record(None, 0, 0, {0: 0.0}, PASS)  # drafter 0 had nothing: a plain step
    assert asked(choice, catch_up) == [0]
    choice.asked(Attempt(0, 4))
    choice.record(0, 4, 3, {0: 0.01}, PASS)  # kept some: no loss
    assert asked(choice, catch_up) == [0]
    choice.asked(Attempt(0, 4))
    choice.record(None, 0, 0, {0: 0.0}, PASS)
    assert asked(choice, catch_up) == [1, 0]


def test_a_catch_up_within_the_allowance_is_paid_at_once() -> None:
    """A short prompt's catch-up (a chat request's) costs less than waiting for it would."""
    choice, catch_up = DrafterChoice(2, k_max=4), [0.0, (CATCH_UP_ALLOWANCE - 1) * PASS]
    first_step(choice, catch_up)
    assert asked(choice, catch_up) == [1, 0]


def test_a_drafter_with_nothing_to_catch_up_is_tried_at_once() -> None:
    choice = DrafterChoice(2, k_max=4)
    first_step(choice, [0.0, 0.0])
    assert asked(choice, [0.0, 0.0]) == [1, 0]


def test_a_behind_drafter_waits_for_the_rent_when_nothing_else_pays() -> None:
    """Drafter 0 keeps missing (it soon rests) and drafter 1's catch-up is 0.25 s beyond the
    allowance: it is asked once the missed steps have paid CATCH_UP_RENT times that, as when
    another drafter pays (an agent's long prompt with a short answer is never read for it)."""
    beyond = 0.25
    choice, catch_up = DrafterChoice(2, k_max=4), [0.0, CATCH_UP_ALLOWANCE * PASS + beyond]
    first_step(choice, catch_up)
    misses = 0
    while 1 not in (order := asked(choice, catch_up)):
        if order:
            choice.asked(Attempt(order[0], 4))
        choice.record(order[0] if order else None, 4 if order else 0, 0, {0: 0.01}, PASS)
        misses += 1
    assert misses == math.ceil(CATCH_UP_RENT * beyond / PASS) and order[0] == 1


def test_a_behind_drafter_waits_at_an_answers_first_step() -> None:
    """Before any pass is timed there is no allowance to weigh a catch-up against: one step."""
    choice = DrafterChoice(1, k_max=4)
    assert choice.order([False], [0.01]) == []
    choice.record(None, 0, 0, {}, PASS)
    assert [a.index for a in choice.order([False], [0.01])] == [0]


def test_the_draft_model_never_reads_the_prompt_while_another_drafter_keeps_everything(
        target_runner: ModelRunner, close_draft_model: PreTrainedModel,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the choice priced the catch-up, the unmeasured draft model was asked at the
    second step and read the whole prompt for nothing. (No allowance here: these tiny models
    read a whole prompt within one.)"""
    monkeypatch.setattr(choice_module, "CATCH_UP_ALLOWANCE", 0.0)
    prompt = [(7 * i + 3) % 64 for i in range(48)]
    reference = plain_tokens(target_runner.model, prompt, max_new_tokens=60)
    draft = draft_drafter(close_draft_model)
    always_right = Gate(reference, len(prompt), block=len(reference))  # one open block
    engine = SpeculativeEngine(target_runner, (always_right, draft), decode, set())
    tokens, events = collect(engine, request(prompt, k=3, adaptive=True, max_new_tokens=40))
    assert tokens == reference[:40]
    assert {e.drafter for e in events if e.drafted} == {"gate"}
    assert draft.runner.length == 0 and draft.catch_up_cost is None


def test_a_draft_model_tells_its_backlog_and_times_its_catch_up(
        close_draft_model: PreTrainedModel) -> None:
    draft = draft_drafter(close_draft_model)
    context = [(5 * i + 1) % 64 for i in range(20)]
    assert draft.outlook(context).backlog == 20
    proposal = draft.propose(context, 2, SamplingParams(), torch.Generator().manual_seed(0))
    assert draft.catch_up_cost is not None and draft.catch_up_cost > 0
    longer = [*context, *proposal.tokens[:1], 9]
    assert draft.outlook(longer).backlog == 1  # it read its first draft: only the target's token
    assert draft.outlook([*context[:10], 63, 62]).backlog == 2  # a different turn: cropped to 10
