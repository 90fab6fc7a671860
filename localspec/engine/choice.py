"""The engine's policy: which drafter drafts each step, and how many tokens.

The engine runs one or more drafters (method "auto", or a model behind n-gram lookup, runs
several; a single method runs one; plain decoding none). ``DraftPolicy`` is all the engine asks
about them: ``draft`` for this step's proposal, ``record`` for the step's verdict. Inside it:

``DrafterChoice`` keeps one ``AdaptiveK`` estimator per drafter (its acceptance r_j by position
in this answer and its drafting cost per token), all sharing one verify-cost line (a pass over
n tokens costs the same whoever drafted them). Each step ``order`` ranks the drafters to ask:

  1. a resting drafter (one whose drafts do not pay) that is sure of its next guess and whose
     sure-probe is due (n-gram lookup matching its longest n-gram: the text reached a copy);
  2. the drafters whose best draft beats plain decoding, highest expected tokens per second
     first (a sure one first among equals: ranking lookup's sure guesses above a faster draft
     model lost in code generation, where they miss often);
  3. a resting drafter whose probe interval has run out.

A drafter's guesses made with evidence (``Outlook.sure``) are learnt by estimators of their
own, one per grade: lookup's guesses after a match of its longest n-gram are kept far more often
than after a one-token match, and one estimate of both kept it below the draft model at the
start of a copied stretch. Its second grade, a copy under way, starts from a strong prior
(``LONG_COPY_PRIOR`` weighing ``LONG_COPY_WEIGHT`` steps), so it drafts long into a copy at once.

A drafter that has not drafted yet in this answer and is behind the context (a draft model that
must first read the whole prompt: ``Outlook.backlog``) waits, as in ski rental: its catch-up is
the price of buying, and each step that kept no draft pays the rent, a share of the step the
drafter could have saved. It waits whether or not another drafter pays meanwhile: an agent's
turn reads a prompt of thousands of tokens to answer a 15-token tool call, and a draft model
that read it first answered 28% slower than plain decoding. It starts once the verify time
of the steps that kept no draft reaches ``CATCH_UP_RENT`` times its catch-up; a catch-up within
``CATCH_UP_ALLOWANCE`` plain steps (a chat prompt's) is paid at once. The catch-up is priced at
the drafter's own last one per token (``Outlook.catch_up_cost``), else at the target's prefill,
an upper bound for a smaller model.

The policy asks the drafters in that order and takes the first proposal that has tokens: a
drafter with nothing to offer (lookup without a match) costs almost nothing and cedes the step.
When none is asked or none proposes, the step is plain decoding, so speculation is never slower
than plain decoding by more than the probes. With one drafter this is exactly ``AdaptiveK``'s
own ``choose``; with adaptive k off every drafter is asked ``k_max`` tokens in the listed order.

Only the drafter that drafts learns from a step, so a drafter ranked below another would never
learn that it would now do better. So in greedy decoding, whose output is the target's whatever
the drafts, a free drafter (``DrafterTraits.free``: a proposal costs nothing and changes no
state) that did not draft is asked what it would have drafted (``Shadows``), and once the output
shows how many of those tokens it would have kept, its estimator learns that as if it had
drafted. Which drafter drafts never depends on the target's draws at that step, and each
proposal is verified with its own q, so the output stays exactly the target's. The constants'
measurements are in docs/research-log.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from localspec.engine.adaptive import (
    ALONE,
    LEARNT_PRIOR_WEIGHT,
    AdaptiveK,
    Load,
    VerifyLine,
)
from localspec.engine.drafter import Drafter, Proposal
from localspec.sampling import SamplingParams

# A drafter behind the context starts once the steps that kept no draft have cost this many
# times its catch-up beyond CATCH_UP_ALLOWANCE plain steps (see the module docstring).
CATCH_UP_RENT = 3.0
CATCH_UP_ALLOWANCE = 6.0
# The prior of a drafter's guesses at evidence grade 2 and above (lookup: a long copy under way)
LONG_COPY_PRIOR = 0.9
LONG_COPY_WEIGHT = 4.0


@dataclass(frozen=True)
class Attempt:
    """One drafter to ask this step: its index among the drafters and its k."""

    index: int
    k: int
    probe: bool = False  # a probe of a resting drafter
    sure: int = 0  # the drafter's evidence for its next guess (``Outlook.sure``)


class DrafterChoice:
    """Online estimates for each drafter; ``order`` ranks them, ``record`` learns a step."""

    def __init__(self, count: int, k_max: int, enabled: bool = True,
                 stops_itself: Sequence[bool] = (),
                 kept_shares: Sequence[float | None] = ()) -> None:
        """``stops_itself[i]``: drafter i ends its own chains (``DrafterTraits.stops_itself``);
        ``kept_shares[i]``: the share of its guesses kept over earlier requests
        (``Calibration.kept_share``), None where unknown."""
        self.k_max = k_max if count else 0
        self.enabled = enabled
        self.verify = VerifyLine()
        stops = list(stops_itself) + [False] * (count - len(stops_itself))
        shares = list(kept_shares) + [None] * (count - len(kept_shares))

        def estimator(i: int, grade: int = 0) -> AdaptiveK:
            prior: dict[str, float] = {}  # AdaptiveK's weak prior
            share = shares[i]
            if grade >= 2:
                prior = {"alpha_prior": LONG_COPY_PRIOR, "prior_weight": LONG_COPY_WEIGHT}
            elif share is not None:
                prior = {"alpha_prior": share, "prior_weight": LEARNT_PRIOR_WEIGHT}
            return AdaptiveK(k_max=self.k_max, enabled=enabled, verify=self.verify,
                             stops_itself=stops[i], **prior)

        self._estimator = estimator
        self.estimators = [estimator(i) for i in range(count)]
        # each drafter's guesses made while it was sure, apart by grade (lookup's long matches)
        self._sure_estimators: dict[tuple[int, int], AdaptiveK] = {}
        self._sure: list[int] = [0] * count  # this step's evidence
        self._asked: list[Attempt] = []
        self._resting: list[int] = []
        self._lost = 0.0  # verify seconds of steps that kept no draft: what a new one could save

    def order(self, sure: list[int], catch_up: list[float] | None = None,
              load: Load = ALONE) -> list[Attempt]:
        """The drafters to ask this step, in turn, until one proposes tokens; [] for a plain
        step. ``sure[i]``: drafter i's evidence for its next guess (``Outlook.sure``);
        ``catch_up[i]``: the seconds it would take to catch up on the context first;
        ``load``: the other requests of a batched pass (``adaptive.Load``)."""
        self._resting = []
        self._sure = [int(s) for s in sure]
        if self.k_max == 0:
            attempts: list[Attempt] = []
        elif not self.enabled:
            attempts = [Attempt(i, self.k_max, sure=s) for i, s in enumerate(self._sure)]
        else:
            attempts = self._rank(self._sure, catch_up or [0.0] * len(sure), load)
        self._asked = []
        return attempts

    def sure_estimator(self, drafter: int, grade: int) -> AdaptiveK:
        """The estimator of ``drafter``'s guesses made at evidence ``grade`` (>= 1)."""
        key = (drafter, grade)
        if key not in self._sure_estimators:
            self._sure_estimators[key] = self._estimator(drafter, grade)
        return self._sure_estimators[key]

    def _rank(self, sure: list[int], catch_up: list[float], load: Load) -> list[Attempt]:
        paying: list[tuple[float, int, int, int]] = []  # -rate, -grade, drafter, k
        for i, estimator in enumerate(self.estimators):
            k, rate = estimator.plan(load)
            if sure[i] and (sure_plan := self.sure_estimator(i, sure[i]).plan(load))[0] > 0:
                k, rate = sure_plan
            if k > 0:
                paying.append((-rate, -sure[i], i, k))
            else:
                self._resting.append(i)
        allowance = CATCH_UP_ALLOWANCE * (self.verify.cost(1) or 0.0)
        paying = [p for p in paying if self.estimators[p[2]].measured
                  or CATCH_UP_RENT * (catch_up[p[2]] - allowance) <= self._lost]
        for _, _, i, _ in paying:
            self.estimators[i].paid()
        ranked = [Attempt(i, k, sure=sure[i]) for _, _, i, k in sorted(paying)]
        due = [i for i in self._resting if self.estimators[i].probe_due(sure[i])]
        first = [Attempt(i, self.estimators[i].probe_k(load), True, sure[i]) for i in due
                 if sure[i]]
        last = [Attempt(i, self.estimators[i].probe_k(load), True) for i in due if not sure[i]]
        return first + ranked + last

    def asked(self, attempt: Attempt) -> None:
        """The engine asks ``attempt``'s drafter now: a probe is under way."""
        if attempt.probe:
            self.estimators[attempt.index].start_probe(attempt.sure)
        self._asked.append(attempt)

    def record(self, drafter: int | None, drafted: int, accepted: int,
               draft_times: dict[int, float], verify_time: float, rows: int = 0) -> None:
        """Learn one step: ``drafter`` (None: a plain step) drafted ``drafted`` tokens and the
        target kept ``accepted``; ``draft_times`` are the seconds each asked drafter took
        (catching up on the context left out); the pass took ``verify_time`` over ``rows``
        rows (0: this request's own ``drafted`` + 1; more in a batched pass)."""
        asked = {attempt.index for attempt in self._asked}
        for i in asked:
            mine = i == drafter
            self.estimators[i].record_draft(drafted if mine else 0, accepted if mine else 0,
                                            draft_times.get(i, 0.0))
            if mine and self._sure[i]:
                self.sure_estimator(i, self._sure[i]).record_draft(drafted, accepted,
                                                                  draft_times.get(i, 0.0))
        for i in self._resting:
            if i not in asked:
                self.estimators[i].rest()
        self._resting = []
        self.verify.update(rows or drafted + 1, verify_time)
        if accepted == 0:
            self._lost += verify_time

    def sure_now(self, drafter: int) -> int:
        """``drafter``'s evidence for its next guess this step (``Outlook.sure``)."""
        return self._sure[drafter]

    def shadow(self, drafter: int, drafted: int, accepted: int, draft_time: float,
               sure: int = 0) -> None:
        """Learn what ``drafter`` would have kept of ``drafted`` tokens it did not draft
        (``sure``: its evidence for them)."""
        self.estimators[drafter].record_draft(drafted, accepted, draft_time)
        if sure:
            self.sure_estimator(drafter, sure).record_draft(drafted, accepted, draft_time)


@dataclass
class _Pending:
    drafter: int
    start: int  # the context's length when it was asked: its tokens continue from there
    tokens: list[int]
    seconds: float
    sure: int


class Shadows:
    """What free drafters would have drafted on steps they did not draft, until the output
    shows how many of those tokens the target would have kept (greedy decoding only: there the
    output does not depend on the drafts, so a guess is kept exactly when it is the output)."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def add(self, drafter: int, start: int, tokens: list[int], seconds: float,
            sure: int = 0) -> None:
        if tokens:
            self._pending.append(_Pending(drafter, start, list(tokens), seconds, sure))

    def resolve(self, output: list[int], choice: DrafterChoice) -> None:
        """Teach ``choice`` every pending guess that ``output`` (the context so far) settles:
        one that already differs from it, or that it covers whole."""
        waiting = []
        for p in self._pending:
            known = output[p.start:]
            kept = 0
            while kept < min(len(known), len(p.tokens)) and known[kept] == p.tokens[kept]:
                kept += 1
            if kept < len(known) or kept == len(p.tokens):
                choice.shadow(p.drafter, len(p.tokens), kept, p.seconds, p.sure)
            else:
                waiting.append(p)
        self._pending = waiting


@dataclass(frozen=True)
class Draft:
    """One step's drafts, as the policy got them."""

    k: int  # the draft length asked last (0: no drafter asked)
    proposal: Proposal  # what to verify (no tokens: a plain step)
    drafter: int | None  # the index of the drafter that proposed it; None: a plain step
    times: dict[int, float]  # drafting seconds of each drafter asked, catch-up left out


class DraftPolicy:
    """The drafters of one answer and how each step is drafted: ``draft``, then ``record``."""

    def __init__(self, drafters: Sequence[Drafter], context: list[int], k_max: int,
                 adaptive: bool, greedy: bool) -> None:
        """``context``: the prompt, which the drafters were just reset for."""
        self.drafters = tuple(drafters)
        outlooks = [drafter.outlook(context) for drafter in self.drafters]
        self.choice = DrafterChoice(len(self.drafters), k_max, adaptive,
                                    [drafter.traits.stops_itself for drafter in self.drafters],
                                    [outlook.kept_share for outlook in outlooks])
        # what free drafters would have drafted, where the output alone says what was kept
        self.shadows = Shadows() if greedy and len(self.drafters) > 1 else None

    def draft(self, context: list[int], room: int, params: SamplingParams,
              generator: torch.Generator, width: int = 1, prefill_cost: float = 0.0,
              load: Load = ALONE) -> Draft:
        """Ask the drafters ``choice`` ranks, in turn, for at most ``room`` tokens (a tree of
        ``width`` first guesses where ``width`` > 1) until one proposes any; then ask the free
        drafters not asked what they would have drafted. A drafter behind the context has its
        backlog priced at its own last catch-up or else at ``prefill_cost``, the target's.
        ``load``: the other requests of a batched pass, which k is chosen with."""
        outlooks = [drafter.outlook(context) for drafter in self.drafters]
        catch_up = [o.backlog * (o.catch_up_cost or prefill_cost) for o in outlooks]
        times: dict[int, float] = {}
        result = Draft(0, Proposal([]), None, times)
        for attempt in self.choice.order([o.sure for o in outlooks], catch_up, load):
            self.choice.asked(attempt)
            k = min(attempt.k, room)
            start = time.perf_counter()
            proposal = self.drafters[attempt.index].propose(context, k, params, generator, width)
            times[attempt.index] = time.perf_counter() - start - proposal.sync_time
            if proposal.tokens:  # a tree is k deep at most by construction
                if proposal.parents is None:
                    proposal = replace(proposal, tokens=proposal.tokens[:k])
                result = Draft(k, proposal, attempt.index, times)
                break
            result = Draft(k, proposal, None, times)
        if self.shadows is not None:
            self._shadow(self.shadows, set(times), context, params, generator)
        return result

    def _shadow(self, shadows: Shadows, asked: set[int], context: list[int],
                params: SamplingParams, generator: torch.Generator) -> None:
        """Ask each free drafter not ``asked`` this step what it would have drafted."""
        for i, drafter in enumerate(self.drafters):
            if drafter.traits.free and i not in asked:
                start = time.perf_counter()
                guess = drafter.propose(context, self.choice.k_max, params, generator)
                shadows.add(i, len(context), guess.tokens, time.perf_counter() - start,
                            self.choice.sure_now(i))

    def record(self, draft: Draft, accepted: int, verify_time: float,
               context: list[int], rows: int = 0) -> None:
        """Learn one step: the target kept ``accepted`` of ``draft``'s chain in a pass of
        ``verify_time`` seconds, and ``context`` is the output so far (shadows settle on it)."""
        self.choice.record(draft.drafter, draft.proposal.chain_length, accepted, draft.times,
                           verify_time, rows)
        if self.shadows is not None:
            self.shadows.resolve(context, self.choice)

    def name(self, draft: Draft) -> str | None:
        """The name of ``draft``'s drafter (None: a plain step)."""
        return None if draft.drafter is None else self.drafters[draft.drafter].traits.name
