"""The speculative engine: draft, verify in one target pass, stream one event per step.

One sequence at a time. The target's cache always holds every token but the last one (the
"pending" token the target has not consumed yet). A step feeds ``[pending] + drafts`` in one
forward pass, which yields k + 1 rows of logits; the verifier keeps a prefix of the drafts and
appends the target's own token; the cache is cropped back past the rejected drafts. With no
drafter (method "none") the very same loop is plain decoding, so it is the reference for
equality and speed.

With ``tree_width`` > 1 on a greedy request (and a target runner that ``supports_trees``),
model-based drafters add the next best first guesses beside the chain's first token: a small
static tree fed in the same one pass, each node seeing only its root path, so each row's
logits are those of a chain; the longest path whose tokens are the target's argmaxes is kept
(``verify_tree``) and its keys and values moved into place (``ModelRunner.keep_path``).

The engine knows token ids and asks the tokenizer only to decode text deltas; it does not
apply chat templates, load models or render anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from localspec.config import MAX_SPECULATIVE_TOKENS
from localspec.engine.adaptive import ALONE, Load
from localspec.engine.choice import Draft, DraftPolicy
from localspec.engine.constraint import Constraint, Shaped
from localspec.engine.drafter import Drafter, Proposal
from localspec.engine.grammar import CompiledGrammar
from localspec.engine.verify import Verdict, verify_greedy, verify_sampling, verify_tree
from localspec.errors import LocalSpecError
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams, logits_to_probs


class GenerationError(LocalSpecError):
    """A request the engine cannot serve (prompt too long, k out of range, ...)."""


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one generation needs besides the models."""

    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_speculative_tokens: int = 5
    adaptive: bool = True
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    # candidates for the first draft token, verified as a tree (greedy, where the target
    # runner supports trees; 1: a chain)
    tree_width: int = 1
    # keep the caches' tokens this prompt starts with (a conversation's earlier turns) where
    # they are exact (``ModelRunner.keep_prefix``); False: a cold start, as benchmarks need
    reuse_prefix: bool = False
    # the grammar every answer token must follow (structured output), compiled once per
    # format by the pipeline; None: free text
    grammar: CompiledGrammar | None = None


@dataclass(frozen=True)
class StepEvent:
    """What happened in one target forward pass.

    ``tokens`` are the ids appended to the output this step: ``drafted[:accepted]`` followed by
    the target's own token, cut short when generation stops inside the run.
    """

    step: int
    k: int  # draft length asked of the drafter
    drafted: tuple[int, ...]
    accepted: int
    target_token: int | None  # recovered (after a rejection) or bonus token; None if cut off
    target_token_kind: str  # "recovered" | "bonus"
    tokens: tuple[int, ...]
    p_target: tuple[float, ...]  # p(token) under the target for each of ``tokens``
    q_draft: tuple[float, ...]  # q(token) under the drafter for each drafted token
    text_delta: str
    draft_time: float
    verify_time: float
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled" | None
    drafter: str | None = None  # the drafter of ``drafted`` (its traits' name); None: no drafts
    cached: int = 0  # first step only: prompt tokens kept from the last request's cache
    forced: int = 0  # drafted tokens the grammar forced (the only one it allowed): free drafts

    @property
    def rejected(self) -> tuple[int, ...]:
        return self.drafted[self.accepted :]


class _TextStream:
    """UTF-8-safe incremental decoding with stop strings.

    Text is emitted only once it no longer ends mid-character, and a tail that could be the
    start of a stop string is held back until the next tokens show whether it is one, so a
    stop string never leaks into the output even when it spans two steps.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...]) -> None:
        self.decode = decode
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of ``text`` already streamed

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(len(text), max((len(s) for s in self.stop_strings), default=1) - 1),
                       0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop_strings):
                return n
        return 0

    def push(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Add token ids; return (text to stream now, whether a stop string was reached)."""
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return "", False
        self.text = text
        hits = [i for s in self.stop_strings if (i := text.find(s, self.emitted)) >= 0]
        if hits:
            end, stopped = min(hits), True
            self.text = text[:end]
        else:
            end, stopped = len(text) - (0 if final else self._held_back(text)), False
        delta, self.emitted = text[self.emitted : end], max(self.emitted, end)
        return delta, stopped


class SpeculativeEngine:
    """Streams generation of a target model, optionally sped up by drafters."""

    def __init__(
        self,
        target: ModelRunner,
        drafters: Sequence[Drafter],
        decode: Callable[[list[int]], str],
        eos_token_ids: set[int],
    ) -> None:
        """``drafters``: none for plain decoding, one, or several that ``DraftPolicy`` picks
        from each step (method "auto")."""
        for drafter in drafters:
            if not isinstance(drafter, Drafter):
                raise TypeError(f"{type(drafter).__name__} is not a Drafter: a drafter "
                                "subclasses localspec.engine.drafter.Drafter (traits, reset, "
                                "propose)")
        names = [drafter.traits.name for drafter in drafters]
        if len(set(names)) < len(names):
            raise ValueError(f"an engine's drafters must be distinct, got {names}")
        self.target = target
        self.drafters = tuple(drafters)
        self.decode = decode
        self.eos_token_ids = set(eos_token_ids)

    def check(self, request: GenerationRequest) -> int:
        """Validate a request; return the number of new tokens that fit in the context.

        Public so that a caller with many prompts (bench, verify) refuses an over-long one
        before it spends minutes on the others."""
        if not request.prompt_ids:
            raise GenerationError("the prompt is empty: nothing to continue")
        if request.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        k = request.num_speculative_tokens
        if self.drafters and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise GenerationError(
                f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}"
            )
        if request.tree_width < 1:
            raise GenerationError(f"tree_width must be >= 1, got {request.tree_width}")
        limit = self.target.max_length
        if limit and len(request.prompt_ids) >= limit:
            raise GenerationError(
                f"the prompt is {len(request.prompt_ids)} tokens but the model's context holds "
                f"{limit}: shorten the conversation or start a new one"
            )
        room = (limit - len(request.prompt_ids) - (k + request.tree_width) if limit
                else request.max_new_tokens)
        return max(1, min(request.max_new_tokens, room))

    def generate(
        self, request: GenerationRequest, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[StepEvent]:
        """Validate now (errors raise here), then yield one StepEvent per target pass."""
        return self._generate(request, self.check(request), cancelled)

    def start(self, request: GenerationRequest,
              cancelled: Callable[[], bool] = lambda: False) -> Generation:
        """Validate ``request`` (errors raise here), prefill, and return its ``Generation``,
        whose steps a caller drives: the single-request loop below, or a scheduler that runs
        several generations' target passes as one (``localspec.engine.batch``)."""
        return Generation(self, request, self.check(request), cancelled)

    def _generate(
        self, request: GenerationRequest, max_new: int, cancelled: Callable[[], bool]
    ) -> Iterator[StepEvent]:
        generation = Generation(self, request, max_new, cancelled)
        while not generation.done:
            plan = generation.plan()
            if isinstance(plan, StepEvent):  # cancelled before the step
                yield plan
                return
            start = time.perf_counter()
            logits = self.target.forward(plan.feed, parents=plan.parents)
            yield generation.finish(plan, logits, time.perf_counter() - start)

    def _cut(
        self, new_tokens: list[int], generated: int, max_new: int
    ) -> tuple[list[int], str | None]:
        """Stop inside an accepted run at EOS or at max_new_tokens."""
        for i, token in enumerate(new_tokens):
            if token in self.eos_token_ids:
                return new_tokens[: i + 1], "eos"
            if generated + i + 1 >= max_new:
                return new_tokens[: i + 1], "length"
        return new_tokens, None



@dataclass(frozen=True)
class StepPlan:
    """One step's drafts and what the target must be fed for them: ``[pending, *drafts]``,
    a tree where ``parents`` says so (``ModelRunner.forward``'s arguments)."""

    draft: Draft
    proposal: Proposal  # the draft's proposal as the grammar shaped it (else the draft's own)
    feed: list[int]
    parents: list[int] | None
    draft_time: float
    shaped: Shaped | None = None  # the grammar's rows for this step (a constraint's)


class Generation:
    """One request's generation as steps a caller drives: ``plan`` (draft: what the target is
    fed), the target's pass (the caller's: alone, or batched with other requests'), then
    ``finish`` (verify the pass's logits, keep, the step's event). Alone or in a batch, a
    step's tokens are the same: they depend only on this request's logits, drafts and
    generator, and the target's rows are the same bits either way.

    The three places where a constraint on the answer would act are apart: the proposal after
    drafting (``_shape``), the logits before verifying (``_verdict``), and the kept tokens
    (``_advance``)."""

    def __init__(self, engine: SpeculativeEngine, request: GenerationRequest, max_new: int,
                 cancelled: Callable[[], bool]) -> None:
        """Reset the drafters and the target for the prompt and prefill the target up to its
        last token."""
        self.engine, self.target = engine, engine.target
        self.request, self.max_new, self.cancelled = request, max_new, cancelled
        self.params = request.sampling
        # Every draw on the target's device: a CPU generator cannot drive CUDA multinomials.
        self.generator = torch.Generator(device=self.target.device).manual_seed(request.seed)
        self.stream = _TextStream(engine.decode, request.stop_strings)
        self.context = list(request.prompt_ids)
        self.policy, self.cached, self.prefill_cost = self._start()
        self.width = (request.tree_width if self.params.greedy and self.target.supports_trees
                      else 1)
        self.constraint = None if request.grammar is None else Constraint(request.grammar)
        self.generated = self.step = 0
        self.done = False

    def _start(self) -> tuple[DraftPolicy, int, float]:
        """The step policy, the prompt tokens whose cache the last request left
        (``reuse_prefix``) and the seconds a token of the prefill took (a catch-up's upper
        bound)."""
        request, context = self.request, self.context
        # Hidden states are kept only for a drafter that reads them: a head drafter asks
        # again in its reset, and the engines of one preset share the target runner.
        self.target.record_features(None)
        for drafter in self.engine.drafters:
            drafter.reset(keep_cache=request.reuse_prefix)
        cached = self.target.keep_prefix(context[:-1]) if request.reuse_prefix else 0
        if not request.reuse_prefix:
            self.target.reset()
        prefill_cost = 0.0
        if len(context) - 1 > cached:
            start = time.perf_counter()
            self.target.forward(context[cached:-1], logits_to_keep=1)
            prefill_cost = (time.perf_counter() - start) / (len(context) - 1 - cached)
        policy = DraftPolicy(self.engine.drafters, context, request.num_speculative_tokens,
                             request.adaptive, request.sampling.greedy)
        return policy, cached, prefill_cost

    def plan(self, load: Load = ALONE) -> StepPlan | StepEvent:
        """Draft the next step (``load``: the rest of a batched pass, see ``adaptive.Load``);
        the final "cancelled" event instead when the request was cancelled."""
        self.step += 1
        if self.cancelled():
            self.done = True
            return self._final_event("cancelled")
        t0 = time.perf_counter()
        draft = self.policy.draft(self.context, self.max_new - self.generated, self.params,
                                  self.generator, self.width, self.prefill_cost, load)
        shaped = self._shape(draft)
        proposal = draft.proposal if shaped is None else shaped.proposal
        parents = None if proposal.parents is None else [-1, *proposal.parents]
        return StepPlan(draft, proposal, [self.context[-1], *proposal.tokens], parents,
                        time.perf_counter() - t0, shaped)

    def _shape(self, draft: Draft) -> Shaped | None:
        """Step 1 of 3 of a constraint: the grammar cuts the drafts at the first token it
        refuses (never fed) and adds the tokens it forces (free drafts); None: no grammar."""
        if self.constraint is None:
            return None
        return self.constraint.shape(draft.proposal, self.max_new - self.generated)

    def finish(self, plan: StepPlan, logits: torch.Tensor, pass_time: float,
               rows: int = 0) -> StepEvent:
        """Verify the target's ``logits`` of ``plan.feed`` (a pass of ``pass_time`` seconds
        over ``rows`` rows, this request's and others'; 0: its own), keep, and return the
        step's event."""
        start = time.perf_counter()
        draft, drafts, shaped = plan.draft, plan.proposal.tokens, plan.shaped
        verdict, path, p_rows = self._verdict(plan, logits)
        verify_time = pass_time + time.perf_counter() - start
        new_tokens = [*(drafts[r - 1] for r in path[1:]), verdict.token]
        kept, finish = self.engine._cut(new_tokens, self.generated, self.max_new)
        self.context.extend(kept)
        self.policy.record(draft, verdict.num_accepted if shaped is None
                           else min(verdict.num_accepted, shaped.own), verify_time,
                           self.context, rows)
        self.generated += len(kept)
        delta, stopped = self._advance(plan, kept, finish)
        # the kept path's drafts first: drafted[:accepted] are the accepted tokens
        order = [*path[1:], *(r for r in range(1, len(drafts) + 1) if r not in path)]
        self.done = stopped or finish is not None
        return StepEvent(
            step=self.step,
            k=draft.k,
            drafted=tuple(drafts[r - 1] for r in order),
            accepted=verdict.num_accepted,
            target_token=verdict.token if len(kept) == len(new_tokens) else None,
            target_token_kind="bonus" if verdict.is_bonus else "recovered",
            tokens=tuple(kept),
            p_target=tuple(float(p_rows[i, t]) for i, t in enumerate(kept)),
            q_draft=tuple(plan.proposal.confidences[r - 1] for r in order
                          if r <= len(plan.proposal.confidences)),
            text_delta=delta,
            draft_time=plan.draft_time,
            verify_time=verify_time,
            finish_reason="stop" if stopped else finish,
            drafter="grammar" if shaped is not None and shaped.grammar_only
            else self.policy.name(draft),
            cached=self.cached if self.step == 1 else 0,
            forced=0 if shaped is None else shaped.forced,
        )

    def _verdict(self, plan: StepPlan, logits: torch.Tensor
                 ) -> tuple[Verdict, list[int], torch.Tensor]:
        """The verdict on the pass's ``logits`` [len(feed), vocab], the kept path (feed rows:
        0 and the accepted drafts') and the target's probabilities of the kept rows. The
        target's cache keeps the path; the target's own token is pending."""
        proposal, drafts, shaped = plan.proposal, plan.proposal.tokens, plan.shaped
        if proposal.parents is not None:  # a tree: every node sees its root path only
            verdict, path = verify_tree(logits, drafts, proposal.parents)
            self.target.keep_path(path)
            return verdict, path, torch.softmax(logits[path], dim=-1)
        if self.constraint is not None and shaped is not None:
            logits = self.constraint.mask(logits, shaped)  # step 2 of 3: p is the masked target
        if self.params.greedy:
            # probabilities of the rows whose tokens are kept only: a softmax over 151,936
            # logits costs ~1 ms a row, and a rejected draft's row is never shown
            verdict = verify_greedy(logits, drafts)
            p_rows = torch.softmax(logits[: verdict.num_accepted + 1], dim=-1)
        else:
            p_rows = logits_to_probs(logits, self.params)  # [k + 1, vocab]
            q_draft = proposal.q_draft[: len(drafts)] if proposal.q_draft is not None else None
            verdict = verify_sampling(p_rows, q_draft, drafts, self.generator,
                                      None if shaped is None else shaped.refused)
        self.target.crop(len(self.context) + verdict.num_accepted)
        return verdict, list(range(verdict.num_accepted + 1)), p_rows

    def _advance(self, plan: StepPlan, kept: list[int], finish: str | None
                 ) -> tuple[str, bool]:
        """Take the kept tokens into the grammar's state (step 3 of 3 of a constraint) and the
        answer's text: the text to stream now, and whether a stop string was reached."""
        if self.constraint is not None and plan.shaped is not None:
            self.constraint.advance(plan.shaped, kept)
        return self.stream.push(kept, final=finish is not None)

    def _final_event(self, reason: str) -> StepEvent:
        """An event without a forward pass: flushes held-back text and says why we stopped."""
        delta, _ = self.stream.push([], final=True)
        return StepEvent(self.step, 0, (), 0, None, "bonus", (), (), (), delta, 0.0, 0.0,
                         reason)
