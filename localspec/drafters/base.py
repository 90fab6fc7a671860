"""What the drafters share: the model-based drafters' base, their chain and calibration.

The contract every drafter meets (``Drafter``: ``traits``, ``reset``, ``propose``) lives with
its caller, ``localspec.engine.drafter``. Here is what the three drafters that draft with a
model or head (draft model, EAGLE/EAGLE-3, Medusa) have in common, in ``ModelDrafter``: one
chain a step, picked by ``DraftChain`` and ended where its chance of being kept whole stops
paying; a ``Calibration`` of their confidence, learnt from the target's verdicts, which they
read off the next context (the tokens after their last chain say how much of it was kept); and
the price of their last catch-up on the context. Each subclass writes only ``_draft`` (its
model's passes) and, where it keeps a cache, ``_forget`` and ``_backlog``.

How a method's drafter is made is the method's own business: each drafter module has a
``build(ctx)`` that the registry (``localspec.registry``) names, and ``ctx`` is a
``BuildContext``: the preset and the models' runners, given by the pipeline, which sits above
the drafters and so is never named here.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from localspec.config import Preset
from localspec.drafters.suffix_index import AnswerHistory
from localspec.engine.drafter import Drafter, DrafterTraits, Outlook, Proposal
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams, logits_to_probs, sample

CATCH_UP_SPLIT = 4  # more tokens than this to catch up on are fed in a timed pass of their own


def spread_probs(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A distribution [len(ids)] over a cut vocabulary -> [vocab_size], 0 at the other ids."""
    return probs.new_zeros(vocab_size).index_copy_(0, ids, probs)


class Calibration:
    """How often a drafter's guesses are accepted, by the confidence it had in them, learned
    online from the target's verdicts. A trained head is overconfident (guesses at 0.6-0.7
    accepted a sixth of the time), so its raw confidence is a poor place to stop drafting; the
    calibrated chance is what a guess is worth. Each bin starts from ``PRIOR`` pseudo-guesses
    accepted as often as their confidence says, so an unseen bin trusts the drafter."""

    BINS = 10
    PRIOR = 8.0
    LEARNT = 32  # judged guesses before ``kept_share`` speaks

    def __init__(self) -> None:
        self.drafted = [0] * self.BINS
        self.accepted = [0] * self.BINS

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.BINS), self.BINS - 1)

    def chance(self, confidence: float) -> float:
        """The chance that a guess made with ``confidence`` is accepted."""
        b = self._bin(confidence)
        return (self.accepted[b] + self.PRIOR * confidence) / (self.drafted[b] + self.PRIOR)

    def kept_share(self) -> float | None:
        """The share of all judged guesses that were kept, over every request so far; None
        before ``LEARNT`` guesses were judged. What one answer's first few verdicts should be
        weighed against (``AdaptiveK.alpha_prior``)."""
        judged = sum(self.drafted)
        return sum(self.accepted) / judged if judged >= self.LEARNT else None

    def record(self, confidences: tuple[float, ...], accepted: int) -> None:
        """One verified chain: its first ``accepted`` guesses kept, the next one rejected (the
        ones after it were never judged on their own)."""
        for i, confidence in enumerate(confidences[: accepted + 1]):
            b = self._bin(confidence)
            self.drafted[b] += 1
            self.accepted[b] += i < accepted


class DraftChain:
    """The drafts of one chain as a model-based drafter picks them, one position at a time:
    the argmax (greedy) or a draw from the drafter's distribution q, kept with its q row for
    the verifier. A later draft counts only if every one before it is kept, so what the next
    draft pass can earn is the chance that the whole chain so far is kept: the product of its
    guesses' chances (their confidences, through ``calibration`` when given). Once that falls
    below ``confidence_threshold`` the chain is ``done``: the guess just picked is still
    proposed (its pass is paid; verifying it costs one row), but no further pass is run.
    Stopping on each guess's own chance would pay a pass for a guess it then drops and let a
    chain of even chances grow long; the chain's chance does better on the virtual clock of
    ``scripts/policy_clock.py`` and over the draft's teacher-forced guesses (docs/research-log.md).
    Where to stop depends on q and on verdicts already given, never on this step's target,
    so the output is exact whatever the chain's length.

    With ``width`` > 1 on a greedy request the proposal is a static tree: the chain, plus the
    next ``width - 1`` best first guesses as its first token's siblings (taken from the first
    distribution, so no extra draft pass); the target keeps whichever it agrees with."""

    def __init__(self, params: SamplingParams, generator: torch.Generator,
                 confidence_threshold: float = 0.0,
                 calibration: Calibration | None = None, width: int = 1,
                 cut: tuple[torch.Tensor, int] | None = None) -> None:
        """``cut``: (ids, vocab_size) when ``pick`` is given logits over a cut vocabulary
        ``ids`` only (the rest can never be drafted, so their q is 0): the pick stays in the
        cut, and only a sampled draft's q row is spread to ``vocab_size`` for the verifier.
        On the 0.5B's 64k cut (2-core EPYC) that spares a greedy draft a 152k-wide fill,
        softmax and argmax, and a sampled one warps and draws over 65k rows, not 152k."""
        self.params = params
        self.cut = cut
        self.generator = generator
        self.confidence_threshold = confidence_threshold
        self.calibration = calibration
        self.width = width if params.greedy else 1
        self.tokens: list[int] = []
        self.chance = 1.0  # that every guess so far is kept
        self._q_rows: list[torch.Tensor] = []
        self._confidences: list[float] = []
        self._siblings: list[tuple[int, float]] = []  # the other first guesses, best first

    def pick(self, logits: torch.Tensor) -> int:
        """The next draft from the drafter's logits [vocab_target] (or over the cut's ids)."""
        ids = None if self.cut is None else self.cut[0]
        if self.params.greedy:
            probs = torch.softmax(logits, dim=-1)
            index = int(probs.argmax())
        else:
            probs = logits_to_probs(logits[None], self.params)[0]
            index = sample(probs, self.generator)
        token = index if ids is None else int(ids[index])
        confidence = float(probs[index])
        self.chance *= (confidence if self.calibration is None
                        else self.calibration.chance(confidence))
        if not self.tokens and self.width > 1:
            top = torch.topk(probs, min(self.width, probs.shape[-1])).indices.tolist()
            self._siblings = [(t if ids is None else int(ids[t]), float(probs[t])) for t in top
                              if t != index and probs[t] > 0][: self.width - 1]
        self.tokens.append(token)
        if not self.params.greedy:  # the verifier's q row spans the whole vocabulary
            self._q_rows.append(probs if ids is None else spread_probs(probs, *self.cut))
        self._confidences.append(confidence)
        return token

    @property
    def done(self) -> bool:
        """Whether the chain ends at its last pick: the chance that it is kept whole is below
        ``confidence_threshold``."""
        return self.chance < self.confidence_threshold

    def proposal(self, sync_time: float = 0.0) -> Proposal:
        q_draft = None if self.params.greedy else torch.stack(self._q_rows)
        if not self._siblings:
            return Proposal(self.tokens, q_draft, tuple(self._confidences), sync_time)
        return Proposal([*self.tokens, *(t for t, _ in self._siblings)], None,
                        (*self._confidences, *(c for _, c in self._siblings)), sync_time,
                        parents=(*range(len(self.tokens)), *[0] * len(self._siblings)))


class ModelDrafter(Drafter):
    """A drafter that drafts one chain a step with a model or head (see the module docstring).

    Its last chain's verdict is read off the next context it is shown: the tokens that follow
    where the chain started are the target's output, so the chain's guesses up to the first
    that differs were kept. The recovered token after a rejection never equals the rejected
    guess (greedy: it is the target's argmax; sampled: the residual is 0 there), and a tree's
    other first guess kept counts as the chain rejected at once, so this reads exactly the
    verifier's count. A chain that ends the answer is never read."""

    def __init__(self, name: str, confidence_threshold: float = 0.0,
                 cut: tuple[torch.Tensor, int] | None = None) -> None:
        """``cut``: (ids, target vocabulary size) when the drafter's logits cover ``ids`` only
        (``DraftChain``)."""
        self.traits = DrafterTraits(name, stops_itself=confidence_threshold > 0)
        self.confidence_threshold = confidence_threshold
        self.calibration = Calibration()  # outlives ``reset``: it learns the drafter
        self.catch_up_cost: float | None = None  # seconds a token of the last catch-up took
        self._cut = cut
        # the last chain: where it started in the context, its tokens and their confidences
        self._last_chain: tuple[int, list[int], tuple[float, ...]] | None = None

    def reset(self, keep_cache: bool = False) -> None:
        self._last_chain = None
        self._forget(keep_cache)

    def _forget(self, keep_cache: bool) -> None:
        """Drop per-sequence state (``reset``); none by default."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        """A chain of at most ``k``; with ``width`` > 1 (greedy) the next best first guesses
        beside its first token (``DraftChain``)."""
        self._learn(context)
        if k <= 0:
            return Proposal([])
        chain = DraftChain(params, generator, self.confidence_threshold, self.calibration,
                           width, self._cut)
        sync_time = self._draft(context, k, chain)
        if sync_time is None or not chain.tokens:
            return Proposal([])
        proposal = chain.proposal(sync_time)
        self._last_chain = (len(context), list(chain.tokens),
                            proposal.confidences[: len(chain.tokens)])
        return proposal

    @abstractmethod
    def _draft(self, context: list[int], k: int, chain: DraftChain) -> float | None:
        """Pick at most ``k`` tokens continuing ``context`` into ``chain`` (``chain.pick`` on
        each position's logits, stopping once ``chain.done``); return the seconds spent
        catching up on the context first (``_catch_up``), None if it cannot draft here."""

    def outlook(self, context: list[int]) -> Outlook:
        return Outlook(backlog=self._backlog(context), catch_up_cost=self.catch_up_cost,
                       kept_share=self.calibration.kept_share())

    def _backlog(self, context: list[int]) -> int:
        """Tokens of ``context`` still to feed before drafting (``Outlook.backlog``)."""
        return 0

    def _catch_up(self, feed: Callable[[], object], tokens: int) -> float:
        """Run ``feed``, a pass over ``tokens`` tokens of context, timed apart from drafting
        (a one-off cost that must not make each draft look dear to adaptive k); return its
        seconds and keep their price per token."""
        start = time.perf_counter()
        feed()
        seconds = time.perf_counter() - start
        self.catch_up_cost = seconds / max(1, tokens)
        return seconds

    def _learn(self, context: list[int]) -> None:
        """Teach the calibration the last chain's verdict, read off ``context``."""
        if self._last_chain is None:
            return
        start, tokens, confidences = self._last_chain
        known = context[start:]
        if not known:  # not verified yet
            return
        kept = 0
        while kept < min(len(known), len(tokens)) and known[kept] == tokens[kept]:
            kept += 1
        self.calibration.record(confidences, kept)
        self._last_chain = None


class BuildContext(Protocol):
    """What a drafter's ``build`` may use: the pipeline gives it (``Pipeline`` is one)."""

    @property
    def preset(self) -> Preset:
        """The validated preset: [speculative_config] and [localspec] settings."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (the draft model shares it)."""
        ...

    def target_runner(self) -> ModelRunner:
        """The target's runner, shared with the engine (a head reads its features)."""
        ...

    def draft_vocab_size(self) -> int:
        """Rows of the draft model's LM head; PresetError if no draft model is loaded."""
        ...

    def answer_history(self) -> AnswerHistory | None:
        """The user's earlier answers, shared by the pipeline's engines (the suffix
        drafter's global index); None when ``[localspec] history_drafts`` is off."""
        ...

    def draft_runner(self, vocab_rows: torch.Tensor | None = None) -> ModelRunner:
        """A new runner (own KV cache) of the draft model, its LM head cut to ``vocab_rows``
        (None: all), ready to run; PresetError if no draft model is loaded."""
        ...
