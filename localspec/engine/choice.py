"""Which drafter drafts each step, and how many tokens: adaptive k over one or more drafters.

One ``AdaptiveK`` estimator per drafter (its acceptance r_j by position in this answer and its
drafting cost per token), all sharing one verify-cost line (a pass over n tokens costs the
same whoever drafted them). Each step ``order`` ranks the drafters to ask:

  1. a resting drafter (one whose drafts do not pay) that is sure of its next guess and whose
     sure-probe is due (n-gram lookup matching its longest n-gram: the text reached a copy);
  2. the drafters whose best draft beats plain decoding, highest expected tokens per second
     first (a sure one first among equals: lookup's sure guesses in code generation miss
     often enough that ranking them above a faster draft model cost 10-20% there);
  3. a resting drafter whose probe interval has run out.

A drafter that says it is sure of its next guess is ranked by an estimator that learns only
its guesses of that grade of evidence (``Drafter.sure``): lookup's guesses after a match of its
longest n-gram are kept far more often than after a one-token match (90% against 28% on the
bench's answers), and one estimate of both kept it below the draft model at the start of a
copied stretch after a run of weak misses (in one process, interleaved, over the six built-in
prompts: `ngram` 33.52 -> 36.16 tok/s, `auto` 40.66 -> 42.10). Where its sure guesses miss
(code generation), that estimator learns it and the draft model stays first. Its second
grade, a match reaching back ``ngram.LONG_MATCH`` tokens (a copy under way, whose next guess
was kept 98% of the time once the match reached 10 tokens), starts from a prior of
``LONG_COPY_PRIOR`` weighing ``LONG_COPY_WEIGHT`` steps: learnt from the same weak prior as the
others, it drafted 3, 4, 6, 7 tokens, a pass each, into a summary's 31-token copy, where 12
would have been kept (virtual clock, bench prompts: `auto` 1.520 -> 1.541,
docs/benchmarks.md).

A drafter that has not drafted yet in this answer and is behind the context (a draft model that
must first read the whole prompt: ``Drafter.backlog``) waits while a drafter already measured
pays, as in ski rental: its catch-up is the price of buying, and each step that kept no draft
pays the rent, what the drafter could have saved there. That is a share of the step, not all
of it (where a draft model pays here it answers 1.3-1.5x faster than plain decoding, saving a
quarter to a third of a step), so it starts once the verify time of the steps that kept no
draft reaches ``CATCH_UP_RENT`` times its catch-up. A catch-up within ``CATCH_UP_ALLOWANCE``
plain steps is paid at once: a chat or code request's prompt (35-60 tokens, ~0.1 s for the
0.5B here) costs less than waiting for it would. The catch-up is priced at the drafter's own
last one per token (``Drafter.catch_up_cost``), else at the target's prefill, an upper bound
for a smaller model. Where the drafters that run do well, a costly catch-up never pays: on the
summary prompt, once the 0.5B had read its 179 prompt tokens, its confident chains took steps
that lookup would have copied for free. Priced as the whole lost step with no allowance, the
virtual clock (``scripts/policy_clock.py``, 22 prompts) gave 1.321x; with rent and allowance
1.362x, the summary 1.40 -> 1.71x and no bench prompt slower (docs/benchmarks.md).

The engine asks them in that order and takes the first proposal that has tokens: a drafter
that has nothing to offer (lookup without a match) costs almost nothing and cedes the step.
When no drafter is asked, or none proposes anything, the step is plain decoding, so
speculation is never slower than plain decoding by more than the probes, and the probes let
a drafter come back when the text changes. With one drafter this is exactly ``AdaptiveK``'s
own ``choose``. With adaptive k off every drafter is asked ``k_max`` tokens, in the listed
order (lookup first).

``record`` attributes the verdict to the drafter that drafted (the engine knows
``verdict.num_accepted``), closes the probes of those asked, and counts the step towards the
next probe of those that rested.

Only the drafter that drafts learns from a step, so a drafter ranked below another would never
learn that it would now do better: one early miss of n-gram lookup kept it resting for whole
stretches of a summary while the draft model drafted 2-5 tokens a step at ~10 ms a draft, where
lookup's free runs of 3-11 would have paid more. So in greedy decoding, whose output is the
target's whatever drafts, a free drafter (``Drafter.free``: a proposal costs nothing and changes
no state) that did not draft is asked what it would have drafted (``Shadows``), and once the
output shows how many of those tokens it would have kept, its estimator learns that as if it
had drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec.engine.adaptive import LEARNT_PRIOR_WEIGHT, AdaptiveK, VerifyLine

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
    sure: int = 0  # the drafter's evidence for its next guess (``Drafter.sure``)


class DrafterChoice:
    """Online estimates for each drafter; ``order`` ranks them, ``record`` learns a step."""

    def __init__(self, count: int, k_max: int, enabled: bool = True,
                 stops_itself: Sequence[bool] = (),
                 kept_shares: Sequence[float | None] = ()) -> None:
        """``stops_itself[i]``: drafter i ends its own chains (``Drafter.stops_itself``);
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

    def order(self, sure: list[int], catch_up: list[float] | None = None) -> list[Attempt]:
        """The drafters to ask this step, in turn, until one proposes tokens; [] for a plain
        step. ``sure[i]``: drafter i's evidence for its next guess (``Drafter.sure``);
        ``catch_up[i]``: the seconds it would take to catch up on the context first."""
        self._resting = []
        self._sure = [int(s) for s in sure]
        if self.k_max == 0:
            attempts: list[Attempt] = []
        elif not self.enabled:
            attempts = [Attempt(i, self.k_max, sure=s) for i, s in enumerate(self._sure)]
        else:
            attempts = self._rank(self._sure, catch_up or [0.0] * len(sure))
        self._asked = []
        return attempts

    def sure_estimator(self, drafter: int, grade: int) -> AdaptiveK:
        """The estimator of ``drafter``'s guesses made at evidence ``grade`` (>= 1)."""
        key = (drafter, grade)
        if key not in self._sure_estimators:
            self._sure_estimators[key] = self._estimator(drafter, grade)
        return self._sure_estimators[key]

    def _rank(self, sure: list[int], catch_up: list[float]) -> list[Attempt]:
        paying: list[tuple[float, int, int, int]] = []  # -rate, -grade, drafter, k
        for i, estimator in enumerate(self.estimators):
            k, rate = estimator.plan()
            if sure[i] and (sure_plan := self.sure_estimator(i, sure[i]).plan())[0] > 0:
                k, rate = sure_plan
            if k > 0:
                paying.append((-rate, -sure[i], i, k))
            else:
                self._resting.append(i)
        if any(self.estimators[i].measured for _, _, i, _ in paying):
            allowance = CATCH_UP_ALLOWANCE * (self.verify.cost(1) or 0.0)
            paying = [p for p in paying if self.estimators[p[2]].measured
                      or CATCH_UP_RENT * (catch_up[p[2]] - allowance) <= self._lost]
        for _, _, i, _ in paying:
            self.estimators[i].paid()
        ranked = [Attempt(i, k, sure=sure[i]) for _, _, i, k in sorted(paying)]
        due = [i for i in self._resting if self.estimators[i].probe_due(sure[i])]
        first = [Attempt(i, self.estimators[i].probe_k(), True, sure[i]) for i in due if sure[i]]
        last = [Attempt(i, self.estimators[i].probe_k(), True) for i in due if not sure[i]]
        return first + ranked + last

    def asked(self, attempt: Attempt) -> None:
        """The engine asks ``attempt``'s drafter now: a probe is under way."""
        if attempt.probe:
            self.estimators[attempt.index].start_probe(attempt.sure)
        self._asked.append(attempt)

    def record(self, drafter: int | None, drafted: int, accepted: int,
               draft_times: dict[int, float], verify_time: float) -> None:
        """Learn one step: ``drafter`` (None: a plain step) drafted ``drafted`` tokens and the
        target kept ``accepted``; ``draft_times`` are the seconds each asked drafter took
        (catching up on the context left out); the pass took ``verify_time``."""
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
        self.verify.update(drafted + 1, verify_time)
        if accepted == 0:
            self._lost += verify_time

    def sure_now(self, drafter: int) -> int:
        """``drafter``'s evidence for its next guess this step (``Drafter.sure``)."""
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
