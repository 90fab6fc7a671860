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
from dataclasses import dataclass, field, replace

import torch

from localspec.config import MAX_SPECULATIVE_TOKENS
from localspec.drafters.base import Drafter, Proposal
from localspec.drafters.multi import MultiDrafter
from localspec.engine.choice import DrafterChoice, Shadows
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
    drafter: str | None = None  # the drafter of ``drafted`` (a member's name); None: no drafts
    cached: int = 0  # first step only: prompt tokens kept from the last request's cache

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
    """Streams generation of a target model, optionally sped up by a drafter."""

    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        decode: Callable[[list[int]], str],
        eos_token_ids: set[int],
    ) -> None:
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"{type(drafter).__name__} is not a Drafter: a drafter subclasses "
                            "localspec.drafters.base.Drafter (reset, propose, sure)")
        self.target = target
        self.drafter = drafter
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
        if self.drafter is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
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

    def _generate(
        self, request: GenerationRequest, max_new: int, cancelled: Callable[[], bool]
    ) -> Iterator[StepEvent]:
        params = request.sampling
        # Every draw on the target's device: a CPU generator cannot drive CUDA multinomials.
        generator = torch.Generator(device=self.target.device).manual_seed(request.seed)
        stream = _TextStream(self.decode, request.stop_strings)

        # Hidden states are kept only for a drafter that reads them: a head drafter asks
        # again in its reset, and the engines of one preset share the target runner.
        self.target.record_features(None)
        if self.drafter is not None and request.reuse_prefix:
            self.drafter.reset_keeping_cache()
        elif self.drafter is not None:
            self.drafter.reset()
        members = self.members()
        choice = DrafterChoice(len(members), request.num_speculative_tokens, request.adaptive,
                               [member.stops_itself for member in members],
                               [None if member.calibration is None
                                else member.calibration.kept_share() for member in members])
        # what free drafters would have drafted, where the output alone says what was kept
        shadows = Shadows() if params.greedy and len(members) > 1 else None
        width = request.tree_width if params.greedy and self.target.supports_trees else 1
        context = list(request.prompt_ids)
        cached = 0  # prompt tokens whose cache the last request left
        if request.reuse_prefix:
            cached = self.target.keep_prefix(context[:-1])
        else:
            self.target.reset()
        prefill_cost = 0.0  # seconds a token of the target's prefill: a catch-up's upper bound
        if len(context) - 1 > cached:
            start = time.perf_counter()
            self.target.forward(context[cached:-1], logits_to_keep=1)
            prefill_cost = (time.perf_counter() - start) / (len(context) - 1 - cached)
        generated = 0
        step = 0
        while True:
            step += 1
            if cancelled():
                yield self._final_event(step, stream, "cancelled")
                return
            t0 = time.perf_counter()
            k, used, proposal, draft_times = self._draft(members, choice, context,
                                                         max_new - generated, params, generator,
                                                         width, prefill_cost)
            if shadows is not None:
                self._shadow(members, set(draft_times), choice, shadows, context, params,
                             generator)
            t1 = time.perf_counter()
            drafts = proposal.tokens
            if proposal.parents is None:
                logits = self.target.forward([context[-1], *drafts])  # [len(drafts) + 1, vocab]
                verdict, p_rows = self._verify(logits, proposal, drafts, params, generator)
                path = list(range(verdict.num_accepted + 1))
                t2 = time.perf_counter()
                # Keep the pending token and the accepted drafts; the target's token is pending.
                self.target.crop(len(context) + verdict.num_accepted)
            else:  # a tree: every node sees its root path only, the agreed path is kept
                logits = self.target.forward([context[-1], *drafts],
                                             parents=[-1, *proposal.parents])
                verdict, path = verify_tree(logits, drafts, proposal.parents)
                p_rows = torch.softmax(logits[path], dim=-1)  # the kept rows only
                t2 = time.perf_counter()
                self.target.keep_path(path)
            chain = proposal.chain_length  # adaptive k and calibration judge the chain
            choice.record(used, chain, verdict.num_accepted, draft_times, t2 - t1)
            if used is not None and (calibration := members[used].calibration) is not None:
                on_chain = path == list(range(len(path)))
                calibration.record(proposal.confidences[:chain],
                                   verdict.num_accepted if on_chain else 0)
            # the kept path's drafts first: drafted[:accepted] are the accepted tokens
            order = [*path[1:], *(r for r in range(1, len(drafts) + 1) if r not in path)]
            accepted = [drafts[r - 1] for r in path[1:]]
            new_tokens = [*accepted, verdict.token]
            kept, finish = self._cut(new_tokens, generated, max_new)
            context.extend(kept)
            if shadows is not None:
                shadows.resolve(context, choice)
            generated += len(kept)
            delta, stopped = stream.push(kept, final=finish is not None)
            if stopped:
                finish = "stop"
            yield StepEvent(
                step=step,
                k=k,
                drafted=tuple(drafts[r - 1] for r in order),
                accepted=verdict.num_accepted,
                target_token=verdict.token if len(kept) == len(new_tokens) else None,
                target_token_kind="bonus" if verdict.is_bonus else "recovered",
                tokens=tuple(kept),
                p_target=tuple(float(p_rows[i, t]) for i, t in enumerate(kept)),
                q_draft=tuple(proposal.confidences[r - 1] for r in order
                              if r <= len(proposal.confidences)),
                text_delta=delta,
                draft_time=t1 - t0,
                verify_time=t2 - t1,
                finish_reason=finish,
                drafter=proposal.drafter if drafts else None,
                cached=cached if step == 1 else 0,
            )
            if finish is not None:
                return

    def members(self) -> tuple[Drafter, ...]:
        """The drafters the engine chooses from each step: an ``auto`` set's members, else its
        one drafter (none for plain decoding)."""
        if isinstance(self.drafter, MultiDrafter):
            return self.drafter.members
        return () if self.drafter is None else (self.drafter,)

    @staticmethod
    def _draft(
        members: Sequence[Drafter],
        choice: DrafterChoice,
        context: list[int],
        room: int,
        params: SamplingParams,
        generator: torch.Generator,
        width: int = 1,
        prefill_cost: float = 0.0,
    ) -> tuple[int, int | None, Proposal, dict[int, float]]:
        """Ask the drafters ``choice`` ranks, in turn, for at most ``room`` tokens; return the
        k asked last, the index of the drafter whose proposal has tokens (None: a plain step),
        that proposal (its ``drafter`` named) and each asked drafter's drafting seconds, its
        catch-up on the context left out (``Proposal.sync_time``). A drafter that knows for
        free that its next guess is well founded (n-gram lookup: a long match) says so; adaptive
        k probes such a guess while drafting is off. With ``width`` > 1 each is asked for a tree
        (``Drafter.propose_tree``). A drafter behind the context tells its backlog, priced at
        its own last catch-up or else at ``prefill_cost``, the target's."""
        times: dict[int, float] = {}
        k = 0
        catch_up = [member.backlog(context) * (member.catch_up_cost or prefill_cost)
                    for member in members]
        for attempt in choice.order([member.sure(context) for member in members], catch_up):
            choice.asked(attempt)
            member, k = members[attempt.index], min(attempt.k, room)
            start = time.perf_counter()
            proposal = (member.propose_tree(context, k, width, params, generator) if width > 1
                        else member.propose(context, k, params, generator))
            times[attempt.index] = time.perf_counter() - start - proposal.sync_time
            if proposal.tokens:  # a tree is k deep at most by construction
                tokens = proposal.tokens if proposal.parents else proposal.tokens[:k]
                proposal = replace(proposal, tokens=tokens,
                                   drafter=proposal.drafter or member.name)
                return k, attempt.index, proposal, times
        return k, None, Proposal([]), times

    @staticmethod
    def _shadow(members: Sequence[Drafter], asked: set[int], choice: DrafterChoice,
                shadows: Shadows, context: list[int], params: SamplingParams,
                generator: torch.Generator) -> None:
        """Ask each free drafter not ``asked`` this step (one asked drafted, or had nothing)
        what it would have drafted."""
        for i, member in enumerate(members):
            if member.free and i not in asked:
                start = time.perf_counter()
                guess = member.propose(context, choice.k_max, params, generator)
                shadows.add(i, len(context), guess.tokens, time.perf_counter() - start,
                            choice.sure_now(i))

    def _verify(
        self,
        logits: torch.Tensor,
        proposal: Proposal,
        drafts: list[int],
        params: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[Verdict, torch.Tensor]:
        """Run the verifier; also return target probabilities per row for the event."""
        if params.greedy:
            # probabilities of the rows whose tokens are kept only: a softmax over 151,936
            # logits costs ~1 ms a row, and a rejected draft's row is never shown
            verdict = verify_greedy(logits, drafts)
            return verdict, torch.softmax(logits[: verdict.num_accepted + 1], dim=-1)
        p_target = logits_to_probs(logits, params)  # [k + 1, vocab]
        q_draft = proposal.q_draft[: len(drafts)] if proposal.q_draft is not None else None
        return verify_sampling(p_target, q_draft, drafts, generator), p_target

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

    @staticmethod
    def _final_event(step: int, stream: _TextStream, reason: str) -> StepEvent:
        """An event without a forward pass: flushes held-back text and says why we stopped."""
        delta, _ = stream.push([], final=True)
        return StepEvent(step, 0, (), 0, None, "bonus", (), (), (), delta, 0.0, 0.0, reason)
