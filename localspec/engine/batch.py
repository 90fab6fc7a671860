"""Several requests stepped together: one target pass for all of their rows.

A ``Batch`` holds the generations in flight (each ``Generation`` its own target runner and
drafters, over one model's shared weights: ``Pipeline``'s slots). A step plans every member
(each drafts as it would alone), feeds every member's ``[pending, *drafts]`` through the
target in ONE pass (``runtime.runner.forward_batch``: the weights are read once for all rows,
and each row's logits are the bits its request alone gets), then finishes every member
(verify, keep, event). So each answer is token for token the one it gets alone, and N
requests cost about one pass of N rows a step instead of N passes.

Each member's k is chosen for the whole pass (``adaptive.Load``): the other members' expected
tokens, drafting seconds and rows are its load, read off their last steps, so the rows of a
pass go to the drafts that add most to the pass's tokens per second, by the same cost model
that picks k alone.

Members join and leave between passes (``add``, and a member leaves when its step ends it or
raises); a failure in one member's drafting or verifying ends that member only. This module
does not schedule (who joins when, queue limits): the host does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from localspec.engine.adaptive import Load
from localspec.engine.engine import (
    Generation,
    GenerationRequest,
    SpeculativeEngine,
    StepEvent,
    StepPlan,
)
from localspec.runtime.runner import Feed, forward_batch

SHARE_DECAY = 0.5  # how fast a member's share of the pass follows its last steps


@dataclass
class _Share:
    """What a member brought to its last passes (smoothed): kept tokens, drafting seconds,
    rows. The other members' shares are its ``Load``."""

    tokens: float = 1.0
    seconds: float = 0.0
    rows: int = 1

    def learn(self, tokens: int, seconds: float, rows: int) -> None:
        d = SHARE_DECAY
        self.tokens = d * self.tokens + (1.0 - d) * tokens
        self.seconds = d * self.seconds + (1.0 - d) * seconds
        self.rows = rows


Outcome = StepEvent | Exception  # a member's step: its event, or what it raised


class Batch:
    """The generations in flight, stepped together (see the module docstring)."""

    def __init__(self) -> None:
        self.members: list[Generation] = []
        self._shares: dict[int, _Share] = {}

    def add(self, generation: Generation) -> None:
        """``generation`` joins from the next step (its own target runner: one a member)."""
        if any(m.target is generation.target for m in self.members):
            raise ValueError("each member of a batch needs a target runner of its own")
        self.members.append(generation)
        self._shares[id(generation)] = _Share()

    def remove(self, generation: Generation) -> None:
        self.members = [m for m in self.members if m is not generation]
        self._shares.pop(id(generation), None)

    def _load(self, member: Generation) -> Load:
        others = [s for key, s in self._shares.items() if key != id(member)]
        return Load(sum(s.tokens for s in others), sum(s.seconds for s in others),
                    sum(s.rows for s in others))

    def step(self) -> list[tuple[Generation, Outcome]]:
        """One step of every member: each one's event (or the error that ended it); members
        whose generation ended leave."""
        outcomes: list[tuple[Generation, Outcome]] = []
        planned: list[tuple[Generation, StepPlan]] = []
        for member in list(self.members):
            try:
                plan = member.plan(self._load(member))
            except Exception as exc:  # this member's failure, handed to its caller
                outcomes.append((member, exc))
                continue
            if isinstance(plan, StepEvent):  # cancelled
                outcomes.append((member, plan))
            else:
                planned.append((member, plan))
        if planned:
            rows = sum(len(plan.feed) for _, plan in planned)
            start = time.perf_counter()
            try:
                logits = forward_batch([Feed(m.target, p.feed, parents=p.parents)
                                        for m, p in planned])
            except Exception as exc:  # the pass itself failed: every member in it ends
                outcomes += [(m, exc) for m, _ in planned]
                planned, logits = [], []
            seconds = time.perf_counter() - start
            for (member, plan), rows_logits in zip(planned, logits, strict=True):
                try:
                    event = member.finish(plan, rows_logits, seconds, rows)
                except Exception as exc:
                    outcomes.append((member, exc))
                    continue
                self._shares[id(member)].learn(len(event.tokens), plan.draft_time,
                                               len(plan.feed))
                outcomes.append((member, event))
        for member, outcome in outcomes:
            if isinstance(outcome, Exception) or outcome.finish_reason is not None:
                self.remove(member)
        return outcomes


def run_together(jobs: Sequence[tuple[SpeculativeEngine, GenerationRequest]]
                 ) -> list[list[StepEvent]]:
    """Generate every job to its end in one ``Batch`` (each engine its own target runner,
    e.g. a pipeline's slots): each job's events, in order. What raises in a job is raised."""
    generations = [engine.start(request) for engine, request in jobs]
    batch = Batch()
    for generation in generations:
        batch.add(generation)
    events: dict[int, list[StepEvent]] = {id(g): [] for g in generations}
    while batch.members:
        for member, outcome in batch.step():
            if isinstance(outcome, Exception):
                raise outcome
            events[id(member)].append(outcome)
    return [events[id(g)] for g in generations]
