"""The drafter contract: propose a few tokens ahead of the target.

A drafter sees the whole token context (prompt + generated, ending with the token the target
has not yet consumed) and returns up to ``k`` guesses, with their draft probabilities q when it
has a distribution (a draft model) or ``None`` when it is deterministic (n-gram lookup). It
keeps whatever state it needs (a KV cache) in step with the context by itself, so the engine
never has to tell it what was rejected: the next ``propose`` call simply shows the new context.

Every drafter subclasses ``Drafter``: ``reset`` and ``propose`` are its own, and ``sure(context)``
answers 0 unless the drafter can tell for free that its next guess is well founded (n-gram
lookup: the context's longest n-gram occurred before, 1, and reaches back a long way, 2);
adaptive k then probes such a guess while drafting is off (``AdaptiveK.choose``). The engine
refuses anything else, so a drafter cannot miss part of the contract by misspelling a method.

How a method's drafter is made is the method's own business: each drafter module has a
``build(ctx)`` that the registry (``localspec.registry``) names, and ``ctx`` is a
``BuildContext``: the preset and the models' runners, given by the pipeline, which sits above
the drafters and so is never named here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from localspec.config import Preset
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams, logits_to_probs, sample


def spread_probs(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A distribution [len(ids)] over a cut vocabulary -> [vocab_size], 0 at the other ids."""
    return probs.new_zeros(vocab_size).index_copy_(0, ids, probs)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and, for drafters with a distribution, their q rows.

    ``parents`` None: the tokens are one chain. Else they are a tree (greedy requests only):
    ``parents[i]`` is where token i's parent sits in the target's feed ``[pending, *tokens]``
    (0: the pending token), always an earlier place; a chain comes first (token i's parent is
    i, for the first ``chain_length`` tokens), then the other candidates."""

    tokens: list[int]
    q_draft: torch.Tensor | None = None  # [len(tokens), vocab] or None (one-hot draft)
    confidences: tuple[float, ...] = ()  # q(token) for each drafted token, for display
    # Seconds spent catching up with the context (a prompt's prefill, tokens generated while
    # drafting was off): paid once, not per draft, so adaptive k leaves it out of c_draft.
    sync_time: float = 0.0
    drafter: str | None = None  # which member of several drafted it (None: the drafter itself)
    parents: tuple[int, ...] | None = None

    @property
    def chain_length(self) -> int:
        """How many leading tokens form the chain (all of them when there is no tree)."""
        if self.parents is None:
            return len(self.tokens)
        return next((i for i, parent in enumerate(self.parents) if parent != i),
                    len(self.parents))


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
    ``scripts/policy_clock.py`` and over the draft's teacher-forced guesses (docs/benchmarks.md).
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


class Drafter(ABC):
    """What the engine needs from any drafter."""

    name: str  # which drafter it is (a method's drafter: the method's name), set by each
    # Whether a proposal costs next to nothing and changes no state (n-gram lookup): the engine
    # may then ask it for the drafts it would have made on steps another drafter drafted.
    free: bool = False
    # How often its guesses are accepted by confidence (model-based drafters): the engine
    # records each verified chain in it, and it outlives ``reset`` (it learns the drafter).
    calibration: Calibration | None = None
    # Seconds a token of its last catch-up on the context took (``backlog``); None: not timed.
    catch_up_cost: float | None = None
    # Where a model-based drafter ends a chain (``DraftChain``); 0: where adaptive k says.
    confidence_threshold: float = 0.0

    @property
    def stops_itself(self) -> bool:
        """Whether it ends each chain where the chain's chance stops paying (a model-based
        drafter with a threshold): adaptive k then asks it for k_max whenever drafting pays."""
        return self.confidence_threshold > 0

    @abstractmethod
    def reset(self) -> None:
        """Forget all per-sequence state before a new generation."""

    def reset_keeping_cache(self) -> None:
        """``reset``, where the next context may start with this one's tokens (a conversation's
        next turn): a drafter whose cache is exact whatever fed it (``ModelRunner.row_exact``)
        may keep it. A plain ``reset`` by default."""
        self.reset()

    @abstractmethod
    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        """Return at most ``k`` draft tokens continuing ``context``."""

    def propose_tree(self, context: list[int], k: int, width: int, params: SamplingParams,
                     generator: torch.Generator) -> Proposal:
        """A proposal at most ``k`` deep with up to ``width`` candidates for the first token
        (``Proposal.parents``), asked for greedy requests only. A chain unless the drafter
        overrides it (model-based drafters: ``DraftChain``'s ``width``)."""
        return self.propose(context, k, params, generator)

    def sure(self, context: list[int]) -> int:
        """How well founded the next guess after ``context`` is, known without drafting: 0
        for no evidence (the default), 1 for enough that adaptive k may probe it while drafting
        is off, 2 for more (n-gram lookup in the middle of a long copy). Each grade's guesses
        are learnt apart (``DrafterChoice``); a bool is grade 0 or 1."""
        return 0

    def backlog(self, context: list[int]) -> int:
        """Tokens of ``context`` this drafter must still feed its own model before it can
        draft (a draft model skipped so far catches up on the whole prompt): the choice of
        drafter weighs that cost. None to feed by default."""
        return 0


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

    def draft_runner(self, vocab_rows: torch.Tensor | None = None) -> ModelRunner:
        """A new runner (own KV cache) of the draft model, its LM head cut to ``vocab_rows``
        (None: all), ready to run; PresetError if no draft model is loaded."""
        ...
