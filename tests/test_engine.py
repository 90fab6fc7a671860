"""The speculative engine on tiny random models: greedy equality with plain decoding for every
drafter, stop conditions inside accepted runs, cache rollback, input validation, seeded
sampling, a statistical end-to-end check of sampled output, and the stats folded from events."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from conftest import PADDED_VOCAB, VOCAB, collect, decode, make_tiny_model, perturbed_copy
from transformers import PreTrainedModel

import localspec.engine.engine as engine_module
import localspec.engine.verify as verify_module
from localspec.config import MAX_SPECULATIVE_TOKENS
from localspec.drafters.base import Drafter
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.lookup_first import LookupFirstDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.simulated import SimulatedDrafter
from localspec.engine.engine import (
    GenerationError,
    GenerationRequest,
    SpeculativeEngine,
    StepEvent,
)
from localspec.engine.stats import GenerationStats
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

PROMPTS = {
    "random-a": [5, 17, 33, 2, 80, 41, 9],
    "random-b": [60, 3, 91, 44, 12, 12, 70, 8, 25, 38, 77],
    # repeats itself, so prompt lookup has something to copy from the start
    "repetitive": [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11],
}
MAX_NEW = 40
GREEDY = SamplingParams()
HOT = SamplingParams(temperature=1.0)


def request(prompt: list[int], k: int = 3, adaptive: bool = False, max_new_tokens: int = MAX_NEW,
            sampling: SamplingParams = GREEDY, **kwargs: object) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                             sampling=sampling, num_speculative_tokens=k, adaptive=adaptive,
                             **kwargs)


def draft_drafter(model: PreTrainedModel, threshold: float = 0.0,
                  tokenizer_vocab: int = VOCAB) -> DraftModelDrafter:
    return DraftModelDrafter(ModelRunner(model), target_vocab_size=VOCAB,
                             tokenizer_vocab_size=tokenizer_vocab,
                             confidence_threshold=threshold)


def plain_tokens(target_model: PreTrainedModel, prompt: list[int], eos: set[int] | None = None,
                 max_new_tokens: int = MAX_NEW) -> list[int]:
    engine = SpeculativeEngine(ModelRunner(target_model), None, decode, eos or set())
    return collect(engine, request(prompt, max_new_tokens=max_new_tokens))[0]


@pytest.fixture(scope="module")
def plain_reference(target_model: PreTrainedModel) -> dict[str, list[int]]:
    """Plain greedy decoding of every prompt: the reference every drafter must reproduce."""
    return {name: plain_tokens(target_model, prompt) for name, prompt in PROMPTS.items()}


@pytest.fixture
def make_drafter(target_model: PreTrainedModel, random_draft_model: PreTrainedModel,
                 close_draft_model: PreTrainedModel, padded_draft_model: PreTrainedModel
                 ) -> Callable[[str], Drafter]:
    def make(kind: str) -> Drafter:
        return {
            "ngram": lambda: NgramDrafter(prompt_lookup_max=4, prompt_lookup_min=1),
            "random-draft": lambda: draft_drafter(random_draft_model),
            "close-draft": lambda: draft_drafter(close_draft_model),
            "close-draft-threshold": lambda: draft_drafter(close_draft_model, threshold=0.3),
            "self-draft": lambda: draft_drafter(target_model),
            "padded-draft": lambda: draft_drafter(padded_draft_model),
            "lookup-first": lambda: LookupFirstDrafter(NgramDrafter(3, 2),
                                                       draft_drafter(close_draft_model)),
        }[kind]()

    return make


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
    engine = SpeculativeEngine(graphed(target_model), drafter, decode, set())
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
    model = draft_drafter(close_draft_model)
    drafter = LookupFirstDrafter(NgramDrafter(3, 2), model)
    assert drafter.name == model.name
    generator = torch.Generator().manual_seed(0)
    hit = drafter.propose(PROMPTS["repetitive"], 3, HOT, generator)
    assert hit.tokens == [12, 13, 14] and hit.q_draft is None
    assert drafter.sure(PROMPTS["repetitive"]) and not drafter.sure(PROMPTS["random-a"])
    assert model.runner.length == 0  # the draft model was not run
    miss = drafter.propose(PROMPTS["random-a"], 3, HOT, generator)
    assert len(miss.tokens) == 3 and miss.q_draft is not None
    assert model.runner.length > 0
    drafter.reset()
    assert model.runner.length == 0


def test_lookups_evidence_reaches_adaptive_k(target_runner: ModelRunner,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step the engine asks adaptive k with the drafter's ``sure``: true on a prompt whose
    last n-gram occurred before, never for a drafter without lookup (plain decoding here)."""
    seen: list[bool] = []

    class Recording(engine_module.AdaptiveK):
        def choose(self, sure: bool = False) -> int:
            seen.append(sure)
            return super().choose(sure)

    monkeypatch.setattr(engine_module, "AdaptiveK", Recording)
    lookup = SpeculativeEngine(target_runner, NgramDrafter(3, 1), decode, set())
    collect(lookup, request(PROMPTS["repetitive"], adaptive=True))
    assert seen[0] is True
    seen.clear()
    collect(SpeculativeEngine(target_runner, None, decode, set()),
            request(PROMPTS["repetitive"]))
    assert seen and not any(seen)


def test_self_draft_accepts_everything(target_runner: ModelRunner,
                                       target_model: PreTrainedModel) -> None:
    """Draft = target (same weights, own cache): every greedy draft is accepted."""
    engine = SpeculativeEngine(target_runner, draft_drafter(target_model), decode, set())
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
    engine = SpeculativeEngine(target_runner, draft_drafter(padded_draft_model), decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-a"], k=4))
    assert tokens == plain_reference["random-a"]
    assert max(t for e in events for t in e.drafted) < VOCAB


def test_tokenizer_smaller_than_vocab_limits_drafts(target_runner: ModelRunner,
                                                    target_model: PreTrainedModel) -> None:
    """Rows past the tokenizer's size are padding too: a draft never proposes them."""
    drafter = draft_drafter(target_model, tokenizer_vocab=50)
    engine = SpeculativeEngine(target_runner, drafter, decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-b"], k=4))
    assert all(t < 50 for e in events for t in e.drafted)
    assert tokens == plain_tokens(target_model, PROMPTS["random-b"])


# ----------------------------------------------------------------------------- stopping


def test_eos_inside_accepted_run(target_model: PreTrainedModel) -> None:
    """An EOS among accepted drafts ends the generation right after it."""
    prompt = PROMPTS["random-a"]
    plain = plain_tokens(target_model, prompt)
    position = next(i for i in range(3, 8) if plain[i] not in plain[:i])
    eos = plain[position]
    expected = plain[: position + 1]
    assert plain_tokens(target_model, prompt, eos={eos}) == expected
    engine = SpeculativeEngine(ModelRunner(target_model), draft_drafter(target_model), decode,
                               {eos})
    tokens, events = collect(engine, request(prompt, k=8))
    assert tokens == expected
    assert events[-1].finish_reason == "eos"
    # It really was inside an accepted run: one step, 8 drafts accepted, cut after the EOS.
    assert len(events) == 1 and events[0].accepted == 8 and events[0].target_token is None


def test_max_new_tokens_inside_accepted_run(target_model: PreTrainedModel) -> None:
    """max_new_tokens=5 with k=8 and a perfect draft: exactly 5 tokens, reason 'length'."""
    prompt = PROMPTS["random-b"]
    engine = SpeculativeEngine(ModelRunner(target_model), draft_drafter(target_model), decode,
                               set())
    tokens, events = collect(engine, request(prompt, k=8, max_new_tokens=5))
    assert tokens == plain_tokens(target_model, prompt)[:5]
    assert events[-1].finish_reason == "length"
    assert all(len(e.drafted) <= 5 for e in events)


@pytest.mark.parametrize("kind", ["ngram", "self-draft"])
def test_stop_string_cuts_text(kind: str, target_model: PreTrainedModel,
                               make_drafter: Callable[[str], Drafter]) -> None:
    """The streamed text ends right before the first occurrence of a (one-character) stop
    string, empty stop strings are ignored, and the reason is 'stop'."""
    prompt = PROMPTS["repetitive"]
    full_text = decode(plain_tokens(target_model, prompt))
    stop = full_text[12]
    expected = full_text[: full_text.find(stop)]
    engine = SpeculativeEngine(ModelRunner(target_model), make_drafter(kind), decode, set())
    _, events = collect(engine, request(prompt, k=4, stop_strings=("", "never-there", stop)))
    assert "".join(e.text_delta for e in events) == expected
    assert events[-1].finish_reason == "stop"


def test_stop_string_inside_one_accepted_run(target_model: PreTrainedModel) -> None:
    """A multi-character stop string completed inside one step's accepted run is cut there."""
    prompt = PROMPTS["random-a"]
    full_text = decode(plain_tokens(target_model, prompt))
    stop = full_text[2:5]
    expected = full_text[: full_text.find(stop)]
    engine = SpeculativeEngine(ModelRunner(target_model), draft_drafter(target_model), decode,
                               set())
    _, events = collect(engine, request(prompt, k=8, stop_strings=(stop,)))
    assert len(events) == 1  # the whole stop string arrived in the first step's 9 tokens
    assert events[0].text_delta == expected
    assert events[-1].finish_reason == "stop"


def test_stop_string_spanning_two_steps(target_model: PreTrainedModel) -> None:
    """A stop string whose first characters arrived in an earlier step must not leak them:
    the concatenated stream must equal the text cut before the stop string."""
    prompt = PROMPTS["random-a"]
    full_text = decode(plain_tokens(target_model, prompt))
    stop = full_text[3:5]
    expected = full_text[: full_text.find(stop)]
    engine = SpeculativeEngine(ModelRunner(target_model), None, decode, set())
    _, events = collect(engine, request(prompt, stop_strings=(stop,)))
    assert events[-1].finish_reason == "stop"
    assert "".join(e.text_delta for e in events) == expected


def test_cancel_flag(target_runner: ModelRunner, target_model: PreTrainedModel) -> None:
    """cancelled() turning True ends generation with a 'cancelled' event carrying no tokens."""
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    engine = SpeculativeEngine(target_runner, draft_drafter(target_model), decode, set())
    _, events = collect(engine, request(PROMPTS["random-a"], k=3), cancelled)
    assert [e.finish_reason for e in events] == [None, None, "cancelled"]
    assert events[-1].tokens == ()
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    assert stats.target_forward_passes == 2


def test_text_stream_holds_back_partial_characters(target_model: PreTrainedModel) -> None:
    """Text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until completed;
    the deltas add up to the full decoded text."""

    def partial_decode(ids: list[int]) -> str:
        return decode(ids) + ("\ufffd" if ids and ids[-1] % 2 else "")

    engine = SpeculativeEngine(ModelRunner(target_model), None, partial_decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-a"]))
    assert any(t % 2 for t in tokens[:-1])
    for event in events[:-1]:
        if event.tokens[-1] % 2:
            assert event.text_delta == ""
    assert "".join(e.text_delta for e in events) == partial_decode(tokens)


# ----------------------------------------------------------------------------- cache handling


@pytest.mark.parametrize("kind", ["ngram", "close-draft", "padded-draft", "lookup-first"])
def test_cache_rollback_invariants(kind: str, target_runner: ModelRunner,
                                   make_drafter: Callable[[str], Drafter]) -> None:
    """After every step the target cache holds exactly prompt + generated - 1 tokens, and a
    draft model's cache holds exactly the tokens it believes it has seen."""
    drafter = make_drafter(kind)
    engine = SpeculativeEngine(target_runner, drafter, decode, set())
    prompt = PROMPTS["random-b"]
    generated = 0
    for event in engine.generate(request(prompt, k=5)):
        generated += len(event.tokens)
        assert target_runner.cache.get_seq_length() == target_runner.length
        if event.finish_reason is None:
            assert target_runner.length == len(prompt) + generated - 1
        model = drafter.model if isinstance(drafter, LookupFirstDrafter) else drafter
        if isinstance(model, DraftModelDrafter):
            assert model.runner.length == len(model._seen)
            assert model.runner.cache.get_seq_length() == model.runner.length


def test_generating_twice_gives_identical_results(target_runner: ModelRunner,
                                                  close_draft_model: PreTrainedModel) -> None:
    """The engine resets target and draft state: the same request twice gives the same
    tokens, and a different prompt in between does not leak into the next run."""
    engine = SpeculativeEngine(target_runner, draft_drafter(close_draft_model), decode, set())
    for sampling in (GREEDY, HOT):
        first = collect(engine, request(PROMPTS["random-a"], k=4, sampling=sampling, seed=3))
        collect(engine, request(PROMPTS["repetitive"], k=2, sampling=sampling, seed=9))
        second = collect(engine, request(PROMPTS["random-a"], k=4, sampling=sampling, seed=3))
        assert first[0] == second[0]
        assert [e.drafted for e in first[1]] == [e.drafted for e in second[1]]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("overrides", "with_drafter", "phrase"),
    [
        ({"prompt_ids": []}, False, "prompt is empty"),
        ({"prompt_ids": list(range(50)) * 6}, False, "context holds 256"),
        ({"prompt_ids": [1] * 256}, True, "shorten the conversation"),
        ({"num_speculative_tokens": 0}, True, "num_speculative_tokens must be between 1 and 32"),
        ({"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, True, "got 33"),
        ({"max_new_tokens": 0}, False, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": -3}, True, "got -3"),
    ],
)
def test_bad_requests_raise_generation_error(overrides: dict[str, object], with_drafter: bool,
                                             phrase: str, target_runner: ModelRunner) -> None:
    """Requests the engine cannot serve raise GenerationError with a message saying why."""
    values: dict[str, object] = {"prompt_ids": [1, 2, 3], "max_new_tokens": 5,
                                 "num_speculative_tokens": 3}
    values.update(overrides)
    drafter = NgramDrafter() if with_drafter else None
    engine = SpeculativeEngine(target_runner, drafter, decode, set())
    with pytest.raises(GenerationError, match=phrase):
        list(engine.generate(GenerationRequest(**values)))  # type: ignore[arg-type]


def test_plain_engine_ignores_k(target_runner: ModelRunner) -> None:
    """Without a drafter, num_speculative_tokens=0 is fine (there is nothing to draft)."""
    engine = SpeculativeEngine(target_runner, None, decode, set())
    tokens, events = collect(engine, request([1, 2, 3], k=0, max_new_tokens=3))
    assert len(tokens) == 3 and all(e.drafted == () for e in events)


def test_prompt_near_context_limit_still_generates(target_runner: ModelRunner,
                                                   target_model: PreTrainedModel) -> None:
    """A prompt that leaves less room than k + 1 positions still yields (at least) one token
    and never runs the caches past max_position_embeddings."""
    engine = SpeculativeEngine(target_runner, draft_drafter(target_model), decode, set())
    prompt = [(7 * i) % VOCAB for i in range(250)]
    tokens, events = collect(engine, request(prompt, k=8, max_new_tokens=40))
    assert len(tokens) >= 1 and events[-1].finish_reason == "length"
    assert target_runner.length <= target_runner.max_length


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_seeded(target_runner: ModelRunner,
                            close_draft_model: PreTrainedModel) -> None:
    """temperature 1.0: the same seed gives the same tokens; another seed differs."""
    def run(seed: int) -> list[int]:
        engine = SpeculativeEngine(target_runner, draft_drafter(close_draft_model), decode, set())
        return collect(engine, request(PROMPTS["random-a"], k=3, sampling=HOT, seed=seed))[0]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_sampling_self_draft_high_acceptance(target_runner: ModelRunner,
                                             target_model: PreTrainedModel) -> None:
    """With q == p (draft = target) sampled drafts are accepted (almost) always."""
    engine = SpeculativeEngine(target_runner, draft_drafter(target_model), decode, set())
    stats = GenerationStats()
    for seed, prompt in enumerate(PROMPTS.values()):
        for event in engine.generate(request(prompt, k=4, sampling=HOT, seed=seed)):
            stats.add(event)
    assert stats.drafted > 50
    assert stats.acceptance_rate > 0.9


def test_top_k_one_sampling_equals_greedy(target_runner: ModelRunner,
                                                        close_draft_model: PreTrainedModel
                                                        ) -> None:
    """With top_k=1 sampling collapses to greedy, so it must equal plain greedy output."""
    engine = SpeculativeEngine(target_runner, draft_drafter(close_draft_model), decode, set())
    params = SamplingParams(temperature=0.8, top_k=1, top_p=0.9)
    tokens = collect(engine, request(PROMPTS["random-b"], k=3, sampling=params, seed=4))[0]
    assert tokens == plain_tokens(target_runner.model, PROMPTS["random-b"])


# Statistical end-to-end check on a 13-token model: the first two sampled tokens.
STAT_VOCAB = 13
STAT_PROMPT = [1, 2, 3, 4]


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.719: alpha = 1e-4)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic against p, cells with expected count < 5 pooled; (stat, df)."""
    n = float(counts.sum())
    expected = p.double() * n
    big = expected >= 5
    observed = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.fixture(scope="module")
def stat_models() -> tuple[PreTrainedModel, PreTrainedModel, torch.Tensor, torch.Tensor]:
    """Target and draft over 13 tokens (peaked but not degenerate; acceptance about 0.3) and
    the exact distributions of the first and the second token under plain sampling."""
    target = make_tiny_model(5, vocab_size=STAT_VOCAB, head_scale=15.0)
    draft = perturbed_copy(target, seed=6, noise=1.0)
    runner = ModelRunner(target)
    p1 = torch.softmax(runner.forward(STAT_PROMPT)[-1].double(), dim=-1)
    p2 = torch.zeros(STAT_VOCAB, dtype=torch.float64)
    for x in range(STAT_VOCAB):
        runner.reset()
        p2 += p1[x] * torch.softmax(runner.forward([*STAT_PROMPT, x])[-1].double(), dim=-1)
    return target, draft, p1, p2


def first_two_counts(target: PreTrainedModel, draft: PreTrainedModel | None, seeds: range
                     ) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
    drafter = None
    if draft is not None:
        drafter = DraftModelDrafter(ModelRunner(draft), STAT_VOCAB, STAT_VOCAB)
    engine = SpeculativeEngine(ModelRunner(target), drafter, decode, set())
    counts = torch.zeros(2, STAT_VOCAB, dtype=torch.long)
    stats = GenerationStats()
    for seed in seeds:
        tokens, events = collect(engine, request(STAT_PROMPT, k=3, max_new_tokens=2,
                                                 sampling=HOT, seed=seed))
        counts[0, tokens[0]] += 1
        counts[1, tokens[1]] += 1
        for event in events:
            stats.add(event)
    return counts[0], counts[1], stats


def test_sampled_first_two_tokens_match_target_distribution(stat_models: tuple) -> None:
    """Speculative sampling with a different draft model (k=3) gives the first and second
    token the same marginal distributions as plain sampling (exact, computed from the
    target); plain sampling through the engine is checked against the same reference."""
    target, draft, p1, p2 = stat_models
    for model, seeds in ((draft, range(1500)), (None, range(10_000, 10_800))):
        c1, c2, stats = first_two_counts(target, model, seeds)
        if model is not None:
            assert 0.1 < stats.acceptance_rate < 0.7  # rejections are frequent: residual matters
        for counts, p in ((c1, p1), (c2, p2)):
            stat, df = chi_square(counts, p)
            assert stat < chi_square_critical(df), (model is None, stat, df)


def test_statistical_check_has_power(stat_models: tuple, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    """Negative control: resampling from p after a rejection (a wrong residual) fails the
    same chi-square check, even with fewer samples."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, token: p)
    target, draft, p1, p2 = stat_models
    c1, c2, _ = first_two_counts(target, draft, range(600))
    assert chi_square(c1, p1)[0] > chi_square_critical(chi_square(c1, p1)[1])
    assert chi_square(c2, p2)[0] > chi_square_critical(chi_square(c2, p2)[1])


# ----------------------------------------------------------------------------- stats


def test_stats_folded_from_events(target_runner: ModelRunner,
                                  close_draft_model: PreTrainedModel) -> None:
    """GenerationStats agrees with the events: tokens per pass, acceptance, per-position
    acceptance counts that can only fall with the position."""
    engine = SpeculativeEngine(target_runner, draft_drafter(close_draft_model), decode, set())
    stats = GenerationStats()
    events: list[StepEvent] = []
    for prompt in PROMPTS.values():
        for event in engine.generate(request(prompt, k=5)):
            stats.add(event)
            events.append(event)
    assert stats.new_tokens == sum(len(e.tokens) for e in events) == 3 * MAX_NEW
    assert stats.target_forward_passes == len(events)
    assert stats.mean_accepted_length == pytest.approx(stats.new_tokens / len(events))
    assert stats.drafted == sum(len(e.drafted) for e in events)
    assert stats.accepted == sum(e.accepted for e in events)
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    assert 0 < stats.acceptance_rate < 1
    per_position = stats.accepted_per_position
    assert sum(per_position) == stats.accepted
    assert all(a >= b for a, b in itertools.pairwise(per_position))
    assert stats.drafted_per_position[0] == sum(1 for e in events if e.drafted)
    merged = GenerationStats().merge(stats).merge(stats)
    assert merged.new_tokens == 2 * stats.new_tokens
    assert merged.accepted_per_position == [2 * a for a in per_position]
    assert stats.as_dict()["new_tokens"] == stats.new_tokens


def test_plain_stats_one_token_per_pass(target_runner: ModelRunner) -> None:
    """Plain decoding: one token per target pass, nothing drafted, acceptance rate 0."""
    engine = SpeculativeEngine(target_runner, None, decode, set())
    stats = GenerationStats()
    for event in engine.generate(request(PROMPTS["random-a"], max_new_tokens=10)):
        stats.add(event)
    assert stats.mean_accepted_length == 1.0
    assert stats.target_forward_passes == 10 and stats.drafted == 0
    assert stats.acceptance_rate == 0.0 and stats.accepted_per_position == []


def test_drafting_stops_when_it_does_not_pay(target_runner: ModelRunner,
                                             random_draft_model: PreTrainedModel) -> None:
    """A draft that is never right and costs as much as the target: adaptive k falls back to
    plain steps (k = 0) with rare probes, so speculation is not slower than plain decoding."""
    engine = SpeculativeEngine(target_runner, draft_drafter(random_draft_model), decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-a"], k=8, adaptive=True,
                                             max_new_tokens=120))
    drafting = [e for e in events if e.drafted]
    assert len(tokens) == 120
    assert sum(not e.drafted for e in events) > 80
    assert len(drafting) <= 12, [len(e.drafted) for e in events]


def test_draft_catch_up_is_timed_apart(close_draft_model: PreTrainedModel) -> None:
    """The draft's prefill (the prompt, or a gap while drafting was off) is reported as
    sync_time, so adaptive k does not count it as the cost of each draft token."""
    drafter = draft_drafter(close_draft_model)
    context = PROMPTS["random-b"]
    first = drafter.propose(context, 3, GREEDY, torch.Generator())
    assert first.sync_time > 0 and len(first.tokens) == 3
    steady = drafter.propose([*context, first.tokens[0]], 3, GREEDY, torch.Generator())
    assert steady.sync_time == 0.0
    fresh = draft_drafter(close_draft_model).propose([*context, first.tokens[0]], 3, GREEDY,
                                                     torch.Generator())
    assert steady.tokens == fresh.tokens  # the split feed drafts the same tokens


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_simulated_acceptance_pays_the_draft_and_stays_exact(
        acceptance: float, target_runner: ModelRunner, target_model: PreTrainedModel,
        random_draft_model: PreTrainedModel) -> None:
    """bench --simulate-acceptance: the real (here: always wrong) draft model runs, but the
    drafts are the target's greedy tokens kept with the chosen probability; verification is
    real, so the output is plain decoding's."""
    prompt = PROMPTS["random-b"]
    reference = plain_tokens(target_model, prompt, max_new_tokens=80)
    inner = draft_drafter(random_draft_model)
    drafter = SimulatedDrafter(inner, reference, len(prompt), acceptance, seed=3)
    engine = SpeculativeEngine(target_runner, drafter, decode, set())
    tokens, events = collect(engine, request(prompt, k=4, max_new_tokens=80))
    assert tokens == reference
    assert inner._seen  # the draft model really ran
    drafted = sum(len(e.drafted) for e in events)
    accepted = sum(e.accepted for e in events)
    tested = sum(min(len(e.drafted), e.accepted + 1) for e in events)  # positions looked at
    if acceptance == 1.0:
        assert accepted == drafted > 0
    elif acceptance == 0.0:
        assert accepted == 0 and drafted > 0
    else:
        assert 0.3 < accepted / tested < 0.7, (accepted, tested)
