"""The speculative engine on tiny random models: greedy speculation emits exactly plain greedy
decoding's tokens for every drafter (n-gram lookup, draft models close, random, padded, the
target itself, lookup first) and every k, fixed or adaptive, also on static graphed caches; the
drafters' own guarantees (no padding rows, no ids past the tokenizer); the caches rolled back
after every step and reset between generations.

Stops and bad requests are ``test_engine_stops``, sampling ``test_engine_sampling``, the stats
and adaptive k ``test_engine_stats``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import PADDED_VOCAB, VOCAB, collect, decode, draft_drafter
from engine_helpers import GREEDY, HOT, PROMPTS, plain_tokens, request
from transformers import PreTrainedModel

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.choice import Draft, DraftPolicy
from localspec.engine.drafter import Drafter
from localspec.engine.engine import SpeculativeEngine
from localspec.runtime.runner import ModelRunner


@pytest.fixture(scope="module")
def plain_reference(target_model: PreTrainedModel) -> dict[str, list[int]]:
    """Plain greedy decoding of every prompt: the reference every drafter must reproduce."""
    return {name: plain_tokens(target_model, prompt) for name, prompt in PROMPTS.items()}


# ----------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kind", ["ngram", "random-draft", "close-draft", "close-draft-threshold",
                                  "self-draft", "padded-draft", "lookup-first"])
def test_greedy_equals_plain(kind: str, k: int, adaptive: bool, target_runner: ModelRunner,
                             make_drafter: Callable[[str], Drafter],
                             plain_reference: dict[str, list[int]]) -> None:
    """Greedy speculation emits exactly the plain greedy tokens, whatever the drafter proposes."""
    engine = SpeculativeEngine(target_runner, make_drafter(kind), decode, set())
    drafted = 0
    for name, prompt in PROMPTS.items():
        tokens, events = collect(engine, request(prompt, k=k, adaptive=adaptive))
        assert tokens == plain_reference[name], name
        assert events[-1].finish_reason == "length"
        assert all(len(e.drafted) <= k for e in events)
        assert all(t < VOCAB for e in events for t in e.drafted)
        drafted += sum(len(e.drafted) for e in events)
    assert drafted > 0, "the drafter never proposed anything: the test would prove nothing"


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_static_graphed_runners_equal_plain(adaptive: bool, target_model: PreTrainedModel,
                                            close_draft_model: PreTrainedModel,
                                            plain_reference: dict[str, list[int]]) -> None:
    """Target and draft on static caches with ``cuda_graphs`` (traced with the eager backend
    off CUDA: the padding to width buckets, the cropping, the kept outputs): greedy
    speculation still emits the plain tokens, through accepted and rejected drafts."""
    def graphed(model: PreTrainedModel) -> ModelRunner:
        return ModelRunner(model, static_cache=128, cuda_graphs=True)

    drafter = DraftModelDrafter(graphed(close_draft_model), target_vocab_size=VOCAB,
                                tokenizer_vocab_size=VOCAB)
    engine = SpeculativeEngine(graphed(target_model), (drafter,), decode, set())
    rejected = 0
    for name, prompt in PROMPTS.items():
        tokens, events = collect(engine, request(prompt, k=5, adaptive=adaptive))
        assert tokens == plain_reference[name], name
        rejected += sum(len(e.rejected) for e in events)
    assert rejected > 0


def test_drafters_exercise_accept_and_reject(target_runner: ModelRunner,
                                             make_drafter: Callable[[str], Drafter]) -> None:
    """Sanity of the fixtures: the close draft and n-gram lookup see both accepted and
    rejected drafts, so the equality tests above cover rollback after rejection."""
    for kind in ("ngram", "close-draft"):
        engine = SpeculativeEngine(target_runner, make_drafter(kind), decode, set())
        accepted = rejected = 0
        for prompt in PROMPTS.values():
            events = collect(engine, request(prompt, k=3))[1]
            accepted += sum(e.accepted for e in events)
            rejected += sum(len(e.rejected) for e in events)
        assert accepted > 0 and rejected > 0, kind


def test_lookup_first_prefers_lookup(close_draft_model: PreTrainedModel) -> None:
    """A lookup hit is proposed as is (one-hot, no model pass); a miss asks the draft model."""
    lookup, model = NgramDrafter(3, 2), draft_drafter(close_draft_model)
    generator = torch.Generator().manual_seed(0)

    def draft(context: list[int]) -> tuple[Draft, DraftPolicy]:
        policy = DraftPolicy((lookup, model), context, 3, adaptive=False, greedy=False)
        return policy.draft(context, 3, HOT, generator), policy

    hit, policy = draft(PROMPTS["repetitive"])
    assert hit.proposal.tokens == [12, 13, 14] and hit.proposal.q_draft is None
    assert policy.name(hit) == "ngram"
    assert lookup.outlook(PROMPTS["repetitive"]).sure
    assert not lookup.outlook(PROMPTS["random-a"]).sure
    assert model.runner.length == 0  # the draft model was not run
    miss, policy = draft(PROMPTS["random-a"])
    assert len(miss.proposal.tokens) == 3 and miss.proposal.q_draft is not None
    assert policy.name(miss) == "draft_model"
    assert model.runner.length > 0
    model.reset()
    assert model.runner.length == 0

def test_self_draft_accepts_everything(target_runner: ModelRunner,
                                       target_model: PreTrainedModel) -> None:
    """Draft = target (same weights, own cache): every greedy draft is accepted."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(target_model),), decode, set())
    for prompt in PROMPTS.values():
        events = collect(engine, request(prompt, k=4))[1]
        for event in events:
            assert event.accepted == len(event.drafted)
            if event.finish_reason is None:
                assert len(event.drafted) == 4
                assert event.target_token_kind == "bonus"
                assert len(event.tokens) == 5


def test_padded_draft_vocab_is_masked(padded_draft_model: PreTrainedModel,
                                      target_runner: ModelRunner,
                                      plain_reference: dict[str, list[int]]) -> None:
    """The padded draft's own argmax is often a padding row (>= 97), yet the drafter never
    proposes one, its q rows are sized to the target vocabulary, and output stays equal."""
    raw = ModelRunner(padded_draft_model).forward(PROMPTS["random-a"])
    assert raw.shape[-1] == PADDED_VOCAB and (raw.argmax(-1) >= VOCAB).any()
    drafter = draft_drafter(padded_draft_model)
    proposal = drafter.propose(PROMPTS["random-a"], 4, HOT, torch.Generator().manual_seed(0))
    assert proposal.q_draft is not None and proposal.q_draft.shape == (4, VOCAB)
    assert all(t < VOCAB for t in proposal.tokens)
    engine = SpeculativeEngine(target_runner, (draft_drafter(padded_draft_model),), decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-a"], k=4))
    assert tokens == plain_reference["random-a"]
    assert max(t for e in events for t in e.drafted) < VOCAB


def test_tokenizer_smaller_than_vocab_limits_drafts(target_runner: ModelRunner,
                                                    target_model: PreTrainedModel) -> None:
    """Rows past the tokenizer's size are padding too: a draft never proposes them."""
    drafter = draft_drafter(target_model, tokenizer_vocab=50)
    engine = SpeculativeEngine(target_runner, (drafter,), decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-b"], k=4))
    assert all(t < 50 for e in events for t in e.drafted)
    assert tokens == plain_tokens(target_model, PROMPTS["random-b"])


# ----------------------------------------------------------------------------- cache handling


@pytest.mark.parametrize("kind", ["ngram", "close-draft", "padded-draft", "lookup-first"])
def test_cache_rollback_invariants(kind: str, target_runner: ModelRunner,
                                   make_drafter: Callable[[str], Drafter]) -> None:
    """After every step the target cache holds exactly prompt + generated - 1 tokens, and a
    draft model's cache holds exactly the tokens it believes it has seen."""
    drafters = make_drafter(kind)
    engine = SpeculativeEngine(target_runner, drafters, decode, set())
    prompt = PROMPTS["random-b"]
    generated = 0
    for event in engine.generate(request(prompt, k=5)):
        generated += len(event.tokens)
        assert target_runner.cache.get_seq_length() == target_runner.length
        if event.finish_reason is None:
            assert target_runner.length == len(prompt) + generated - 1
        model = drafters[-1]
        if isinstance(model, DraftModelDrafter):
            assert model.runner.length == len(model._seen)
            assert model.runner.cache.get_seq_length() == model.runner.length


def test_generating_twice_gives_identical_results(target_runner: ModelRunner,
                                                  close_draft_model: PreTrainedModel) -> None:
    """The engine resets target and draft state: the same request twice gives the same
    tokens, and a different prompt in between does not leak into the next run."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(close_draft_model),), decode, set())
    for sampling in (GREEDY, HOT):
        first = collect(engine, request(PROMPTS["random-a"], k=4, sampling=sampling, seed=3))
        collect(engine, request(PROMPTS["repetitive"], k=2, sampling=sampling, seed=9))
        second = collect(engine, request(PROMPTS["random-a"], k=4, sampling=sampling, seed=3))
        assert first[0] == second[0]
        assert [e.drafted for e in first[1]] == [e.drafted for e in second[1]]
