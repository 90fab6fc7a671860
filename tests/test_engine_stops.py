"""How the speculative engine ends a generation and what it refuses, on tiny random models: an
EOS or max_new_tokens inside an accepted run cuts the run there; stop strings cut the streamed
text before them, within one step or across two; cancelling ends with an event of no tokens;
text ending in a partial UTF-8 character is held back; requests the engine cannot serve raise
GenerationError with the reason, and a prompt near the context limit still generates."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import VOCAB, collect, decode, draft_drafter
from engine_helpers import PROMPTS, plain_tokens, request
from transformers import PreTrainedModel

from localspec.config import MAX_SPECULATIVE_TOKENS
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.drafter import Drafter
from localspec.engine.engine import GenerationError, GenerationRequest, SpeculativeEngine
from localspec.engine.stats import GenerationStats
from localspec.runtime.runner import ModelRunner

# ----------------------------------------------------------------------------- stopping


def test_eos_inside_accepted_run(target_model: PreTrainedModel) -> None:
    """An EOS among accepted drafts ends the generation right after it."""
    prompt = PROMPTS["random-a"]
    plain = plain_tokens(target_model, prompt)
    position = next(i for i in range(3, 8) if plain[i] not in plain[:i])
    eos = plain[position]
    expected = plain[: position + 1]
    assert plain_tokens(target_model, prompt, eos={eos}) == expected
    engine = SpeculativeEngine(ModelRunner(target_model), (draft_drafter(target_model),), decode,
                               {eos})
    tokens, events = collect(engine, request(prompt, k=8))
    assert tokens == expected
    assert events[-1].finish_reason == "eos"
    # It really was inside an accepted run: one step, 8 drafts accepted, cut after the EOS.
    assert len(events) == 1 and events[0].accepted == 8 and events[0].target_token is None


def test_max_new_tokens_inside_accepted_run(target_model: PreTrainedModel) -> None:
    """max_new_tokens=5 with k=8 and a perfect draft: exactly 5 tokens, reason 'length'."""
    prompt = PROMPTS["random-b"]
    engine = SpeculativeEngine(ModelRunner(target_model), (draft_drafter(target_model),), decode,
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
    engine = SpeculativeEngine(ModelRunner(target_model), (draft_drafter(target_model),), decode,
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
    engine = SpeculativeEngine(ModelRunner(target_model), (), decode, set())
    _, events = collect(engine, request(prompt, stop_strings=(stop,)))
    assert events[-1].finish_reason == "stop"
    assert "".join(e.text_delta for e in events) == expected


def test_cancel_flag(target_runner: ModelRunner, target_model: PreTrainedModel) -> None:
    """cancelled() turning True ends generation with a 'cancelled' event carrying no tokens."""
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    engine = SpeculativeEngine(target_runner, (draft_drafter(target_model),), decode, set())
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

    engine = SpeculativeEngine(ModelRunner(target_model), (), partial_decode, set())
    tokens, events = collect(engine, request(PROMPTS["random-a"]))
    assert any(t % 2 for t in tokens[:-1])
    for event in events[:-1]:
        if event.tokens[-1] % 2:
            assert event.text_delta == ""
    assert "".join(e.text_delta for e in events) == partial_decode(tokens)


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
    drafters = (NgramDrafter(),) if with_drafter else ()
    engine = SpeculativeEngine(target_runner, drafters, decode, set())
    with pytest.raises(GenerationError, match=phrase):
        list(engine.generate(GenerationRequest(**values)))  # type: ignore[arg-type]


def test_plain_engine_ignores_k(target_runner: ModelRunner) -> None:
    """Without a drafter, num_speculative_tokens=0 is fine (there is nothing to draft)."""
    engine = SpeculativeEngine(target_runner, (), decode, set())
    tokens, events = collect(engine, request([1, 2, 3], k=0, max_new_tokens=3))
    assert len(tokens) == 3 and all(e.drafted == () for e in events)


def test_prompt_near_context_limit_still_generates(target_runner: ModelRunner,
                                                   target_model: PreTrainedModel) -> None:
    """A prompt that leaves less room than k + 1 positions still yields (at least) one token
    and never runs the caches past max_position_embeddings."""
    engine = SpeculativeEngine(target_runner, (draft_drafter(target_model),), decode, set())
    prompt = [(7 * i) % VOCAB for i in range(250)]
    tokens, events = collect(engine, request(prompt, k=8, max_new_tokens=40))
    assert len(tokens) >= 1 and events[-1].finish_reason == "length"
    assert target_runner.length <= target_runner.max_length
