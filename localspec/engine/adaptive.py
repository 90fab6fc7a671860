"""Adaptive draft length: pick k to maximise expected tokens per second.

Model (after Leviathan et al. 2023, section 3.4): a step with k drafts yields
E[tokens] = 1 + sum_{i<k} prod_{j<=i} r_j and costs k * c_draft + c_verify(k), where r_j is the
probability that draft position j is accepted given that all before it were. Leviathan et al.
take every r_j equal to one alpha, (1 - alpha^(k+1)) / (1 - alpha); we estimate each r_j from
recent steps instead, because acceptance is far from geometric for n-gram lookup (a match is
either wrong at once or right for a long run), and a single alpha would keep k short exactly
when long drafts pay. We estimate
  * r_j as (accepted past j) / (steps that tested position j), with exponential forgetting,
    shrunk towards alpha = accepted / (accepted + rejections) (the geometric MLE) where a
    position has little data, and alpha towards a prior: the share of the drafter's guesses
    kept over earlier requests where its ``Calibration`` has judged enough of them (weighing
    LEARNT_PRIOR_WEIGHT steps), else 0.7 (weighing 2). A chat reply's first guesses are its
    least predictable; with the weak prior alone one early miss kept a draft model resting
    through replies where most of its guesses would have been kept (docs/research-log.md);
  * c_draft from measured draft time per drafted token;
  * c_verify(n) = a + b * n from measured verify times, by least squares with forgetting (one
    line through all widths: a price per width measured alone drafts more on chat, where
    drafting does not pay),
and we keep both robust to stalls: a time can only be too long (another program took the CPU,
a first call set up its kernels), so a step slower than STALL_FACTOR times the estimate counts
as that bound, and one faster than half the estimate replaces the history it contradicts
(two slow steps at the start of a reply must not make drafting look many times dearer than it
is and keep it off for the whole reply),
and choose the k in [0, k_max] with the best E[tokens] / cost. k = 0 is plain decoding, which
wins when the drafter keeps missing: then drafting stops, so speculation is never slower than
plain decoding by more than the probes. A probe follows a run of plain
steps whose length doubles after each failed probe (8, 16, ... up to 128 steps), so acceptance
can recover when the text changes (a long quote, a repeated block) at a cost of at most one
probe per 8 steps; a probe drafts what adds at most half a plain step, and at most FIRST_K.
A drafter that can tell for free that its next guess is well founded (n-gram lookup matching
its longest n-gram) has it probed at once instead: on a code edit whose first guesses miss,
the answer reaches the prompt's code again long before the interval runs out. Each such
probe that misses doubles the plain steps the next one waits (1, 2, 4, ...), which bounds
their cost when guesses only look sure. A fixed "+2 on success, -1 on failure" rule
(transformers') knows neither the costs nor where acceptance falls off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_PROBE_INTERVAL = 8  # plain steps before drafting is tried again
MAX_PROBE_INTERVAL = 128
PROBE_BUDGET = 0.5  # a probe step costs at most this share more than a plain step
STALL_FACTOR = 3.0  # a measured time counts as at most this many times its estimate
FIRST_K = 4  # drafts of the first step, before anything is measured
# Drafting must promise this much more than plain decoding: estimates err, and a draft step
# that merely breaks even loses to plain once its errors are paid (a chat reply at middling
# acceptance, drafting one token every few steps, ran slower than plain; docs/research-log.md).
DRAFT_MARGIN = 0.05
# The weight, in steps, of a drafter's kept share over earlier requests (``Calibration``) as
# the prior of its acceptance in this answer; without one, ``alpha_prior`` weighs 2 steps.
LEARNT_PRIOR_WEIGHT = 6.0


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per step] with k drafts, each accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class Load:
    """What the other requests of a batched target pass bring to it (``localspec serve
    --parallel``): the tokens they are expected to keep, the seconds they spend drafting
    before it, and their rows. A request's k is then the one that maximises the whole pass's
    tokens per second, (tokens + E[tokens](k)) / (seconds + k c_draft + c_verify(rows + k +
    1)): the same model as alone (a zero load is exactly it), and the rows of one pass are
    shared out by it, each request drafting only while its drafts add more than they cost
    everyone in the pass."""

    tokens: float = 0.0
    seconds: float = 0.0
    rows: int = 0


ALONE = Load()  # a request whose pass is its own


@dataclass
class VerifyLine:
    """c_verify(n) = a + b * n: a target pass over n tokens, by least squares with forgetting,
    robust to stalls (see the module docstring). One per engine: every drafter of an ``auto``
    set verifies through the same target."""

    decay: float = 0.9
    _w: float = field(default=0.0, init=False)
    _sn: float = field(default=0.0, init=False)
    _st: float = field(default=0.0, init=False)
    _snn: float = field(default=0.0, init=False)
    _snt: float = field(default=0.0, init=False)

    def cost(self, n_tokens: int) -> float | None:
        """Estimated seconds of a target pass over ``n_tokens``; None before any is measured."""
        if self._w <= 0:
            return None
        mean_n, mean_t = self._sn / self._w, self._st / self._w
        var_n = self._snn / self._w - mean_n**2
        slope = 0.0 if var_n < 1e-9 else max(0.0, (self._snt / self._w - mean_n * mean_t) / var_n)
        return max(1e-6, mean_t + slope * (n_tokens - mean_n))

    def update(self, n: int, verify_time: float) -> None:
        """Record a target pass over ``n`` tokens that took ``verify_time`` seconds."""
        d = self.decay
        predicted = self.cost(n)
        if predicted is not None and verify_time < 0.5 * predicted:
            self._w = self._sn = self._st = self._snn = self._snt = 0.0
        elif predicted is not None:
            verify_time = min(verify_time, STALL_FACTOR * predicted)
        self._w = d * self._w + 1.0
        self._sn = d * self._sn + n
        self._st = d * self._st + verify_time
        self._snn = d * self._snn + n * n
        self._snt = d * self._snt + n * verify_time


@dataclass
class AdaptiveK:
    """Online estimates of acceptance and costs; ``choose()`` returns the next k."""

    k_max: int
    enabled: bool = True
    # the drafter ends its own chains where their chance stops paying (``DraftChain``): when
    # drafting pays it is asked for k_max, and its stop, which sees each guess's confidence,
    # sets the length that the rates by position (blind to it) would cap
    stops_itself: bool = False
    decay: float = 0.9
    alpha_prior: float = 0.7
    prior_weight: float = 2.0
    _accepted: float = field(default=0.0, init=False)
    _rejections: float = field(default=0.0, init=False)
    _tested: list[float] = field(default_factory=list, init=False)  # position j was tested
    _passed: list[float] = field(default_factory=list, init=False)  # position j was accepted
    _draft_time: float = field(default=0.0, init=False)
    _draft_count: float = field(default=0.0, init=False)
    # c_verify: one line for every drafter of an engine (the target's cost, not a drafter's)
    verify: VerifyLine = field(default_factory=VerifyLine)
    # steps off (k = 0) before the next probe, and how many have run
    _probe_interval: int = field(default=FIRST_PROBE_INTERVAL, init=False)
    _plain_steps: int = field(default=0, init=False)
    # plain steps a sure probe waits for (doubles while sure probes miss), and whether the
    # step under way is one
    _sure_gap: int = field(default=0, init=False)
    _sure_probe: bool = field(default=False, init=False)

    @property
    def alpha(self) -> float:
        accepted = self._accepted + self.prior_weight * self.alpha_prior
        rejections = self._rejections + self.prior_weight * (1.0 - self.alpha_prior)
        return accepted / (accepted + rejections)

    def position_rates(self, k: int) -> list[float]:
        """r_j for j < k: acceptance of position j given all earlier drafts were accepted."""
        alpha, w = self.alpha, self.prior_weight
        return [((self._passed[j] if j < len(self._passed) else 0.0) + w * alpha)
                / ((self._tested[j] if j < len(self._tested) else 0.0) + w) for j in range(k)]

    def expected_tokens(self, k: int) -> float:
        """E[tokens per step] with k drafts under the per-position rates."""
        total, survive = 1.0, 1.0
        for rate in self.position_rates(k):
            survive *= rate
            total += survive
        return total

    @property
    def measured(self) -> bool:
        """Whether this drafter has drafted (and so its cost is known) in this answer."""
        return self._draft_count > 0

    def draft_cost(self) -> float | None:
        return self._draft_time / self._draft_count if self._draft_count > 0 else None

    def verify_cost(self, n_tokens: int) -> float | None:
        return self.verify.cost(n_tokens)

    def update(self, drafted: int, accepted: int, draft_time: float, verify_time: float) -> None:
        """Record one step: how many were drafted and kept, and what it cost."""
        self.record_draft(drafted, accepted, draft_time)
        self.verify.update(drafted + 1, verify_time)

    def record_draft(self, drafted: int, accepted: int, draft_time: float) -> None:
        """Record this drafter's part of a step it was asked to draft (``drafted`` = 0: it
        proposed nothing); the verify pass goes to ``verify`` apart."""
        d = self.decay
        if self._sure_probe:
            self._sure_probe = False
            self._sure_gap = 0 if accepted else min(max(1, 2 * self._sure_gap),
                                                    MAX_PROBE_INTERVAL)
        if drafted <= 0:
            return
        self._accepted = d * self._accepted + accepted
        self._rejections = d * self._rejections + (1.0 if accepted < drafted else 0.0)
        tested = min(drafted, accepted + 1)  # positions 0..accepted were looked at
        width = max(drafted, len(self._tested))
        self._tested = [d * x for x in self._tested] + [0.0] * (width - len(self._tested))
        self._passed = [d * x for x in self._passed] + [0.0] * (width - len(self._passed))
        for j in range(tested):
            self._tested[j] += 1.0
            self._passed[j] += float(j < accepted)
        per_token, estimate = draft_time / drafted, self.draft_cost()
        if estimate is not None and per_token < 0.5 * estimate:
            self._draft_time = self._draft_count = 0.0  # the history was stalled
        elif estimate is not None:
            draft_time = drafted * min(per_token, STALL_FACTOR * estimate)
        self._draft_time = d * self._draft_time + draft_time
        self._draft_count = d * self._draft_count + drafted

    def choose(self, sure: bool = False) -> int:
        """The next k. ``sure``: the drafter has strong evidence for its next guess (n-gram
        lookup matched its longest n-gram), so a probe need not wait out the interval."""
        if not self.enabled or self.k_max == 0:
            return self.k_max
        best_k, _ = self.plan()
        if best_k > 0:
            self.paid()
            return best_k
        if self.probe_due(sure):
            self.start_probe(sure)
            return self.probe_k()
        self.rest()
        return 0

    def plan(self, load: Load = ALONE) -> tuple[int, float]:
        """(k, expected tokens per second) of the best draft, without changing any state
        (``load``: the rest of a batched pass, whose tokens and costs count in the rate);
        k = 0 when no draft beats plain decoding by DRAFT_MARGIN; k_max instead of any other k
        for a drafter that ``stops_itself``. Before this drafter's cost or a verify pass is
        measured: a moderate first draft (the first tokens of a reply are the least
        predictable; 12 wrong guesses of a draft model cost ~0.5 s here), or k_max for a drafter
        whose own stop reads each guess's confidence, at an infinite rate, so an unmeasured
        drafter is tried."""
        c_draft, c_verify_1 = self.draft_cost(), self.verify_cost(1)
        if c_draft is None or c_verify_1 is None:
            return self.k_max if self.stops_itself else min(self.k_max, FIRST_K), float("inf")
        plain = self.verify_cost(load.rows + 1) or c_verify_1
        best_k, best_rate = 0, (1.0 + DRAFT_MARGIN) * (load.tokens + 1.0) / (load.seconds + plain)
        for k in range(1, self.k_max + 1):
            cost = load.seconds + k * c_draft + (self.verify_cost(load.rows + k + 1) or c_verify_1)
            rate = (load.tokens + self.expected_tokens(k)) / cost
            if rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        return (self.k_max if self.stops_itself and best_k else best_k), best_rate

    def paid(self) -> None:
        """Drafting pays again: the probe interval starts over."""
        self._probe_interval, self._plain_steps = FIRST_PROBE_INTERVAL, 0

    def rest(self) -> None:
        """A step this drafter did not draft counts towards its next probe."""
        self._plain_steps += 1

    def probe_due(self, sure: bool) -> bool:
        """Whether this drafter's next probe is due: after ``_probe_interval`` steps off; a sure
        guess after ``_sure_gap`` steps, at once until one misses."""
        if sure and self._plain_steps >= self._sure_gap:
            return True
        return self._plain_steps >= self._probe_interval

    def start_probe(self, sure: bool) -> None:
        """A probe is under way. The interval doubles while probes keep failing (a success
        resets it through ``paid``); each sure probe that misses doubles the sure gap (in
        ``record_draft``), so guesses that only look sure cost a few probes, not every step."""
        if sure and self._plain_steps >= self._sure_gap:
            self._sure_probe = True
        else:
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
        self._plain_steps = 0

    def probe_k(self, load: Load = ALONE) -> int:
        """As many drafts as add at most half a plain step's cost, drafting and the wider verify
        pass together, and at most FIRST_K: one token of a draft model that costs a sizeable
        part of the target; for lookup, which costs next to nothing, what the verify pass
        takes at little extra. A probe only tests whether drafting pays again (``choose``
        lengthens the drafts once it does): a missed 16-token lookup probe cost 4.5 plain
        steps, and early in a reply, before passes of many widths are timed, the verify line
        looks flat and a budget alone allowed 10 head drafts on a chat reply."""
        c_draft, c_plain = self.draft_cost() or 0.0, self.verify_cost(1) or 0.0
        base = self.verify_cost(load.rows + 1) or c_plain  # the pass without this probe's rows
        best = 1
        for k in range(2, min(self.k_max, FIRST_K) + 1):
            extra = k * c_draft + (self.verify_cost(load.rows + k + 1) or c_plain) - base
            if extra <= PROBE_BUDGET * c_plain:
                best = k
        return best
