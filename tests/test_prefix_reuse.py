"""A chat's next turn keeps the cached tokens its prompt starts with (``keep_prefix``,
``GenerationRequest.reuse_prefix``): only where the native stack makes every token's keys and
logits the same bits however it was fed, so a warm turn answers exactly as a cold one, greedy
and sampled, with a draft model that keeps its own cache too."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, collect, decode, tiny_config
from kernel_helpers import kernel_lib
from transformers import AutoModelForCausalLM, PreTrainedModel

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import ROW_ATTENTION_MAX, export_weights
from localspec.sampling import SamplingParams


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> object:
    return kernel_lib(tmp_path_factory)


def _model(seed: int) -> PreTrainedModel:
    """A tiny model the native stack serves whole (bf16 cache, head_dim 32)."""
    config = tiny_config()
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 128, 128, 4
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _runner(model: PreTrainedModel, lib: object) -> ModelRunner:
    taken = copy.deepcopy(model).to(torch.bfloat16)
    runner = ModelRunner(taken, decoder=CpuDecoder(
        taken, "requant-q4k", export_weights(taken, "requant-q4k"), lib))
    assert runner.row_exact
    return runner


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_kept_prefix_is_the_cache_a_cold_prefill_makes(lib: object) -> None:
    """Fed as a prompt, steps, a verify pass cropped back and a tree, the cache keeps exactly
    the tokens a new prompt starts with; feeding the rest gives a cold prefill's logits bit for
    bit (past ROW_ATTENTION_MAX rows too)."""
    runner = _runner(_model(3), lib)
    first = _tokens(60, seed=1)
    runner.forward(first[:40], logits_to_keep=1)
    for token in first[40:50]:
        runner.forward([token])
    runner.forward(first[50:56])  # a verify pass of which two are rejected
    runner.crop(54)
    runner.forward([first[54], 7, 9], parents=[-1, 0, 0])  # a tree: its second branch kept
    runner.keep_path([0, 2])
    held = [*first[:55], 9]
    assert runner.keep_prefix([*held, 1]) == len(held)
    later = [*held[:50], *_tokens(ROW_ATTENTION_MAX + 20, seed=2)]
    assert runner.keep_prefix(later) == 50
    warm = runner.forward(later[50:])
    cold_runner = _runner(_model(3), lib)
    cold = cold_runner.forward(later)
    assert torch.equal(warm, cold[50:])
    assert runner.keep_prefix([*later, 5]) == len(later)  # the whole cache, then more
    assert runner.keep_prefix(later[:30]) == 30  # a shorter prompt: a regenerated turn
    assert runner.keep_prefix([held[0] + 1, *held[1:]]) == 0 and runner.length == 0


def test_no_prefix_is_kept_where_it_would_not_be_exact(lib: object) -> None:
    """Features recorded for a head (it reads the prompt's) or a forward that is not the
    native stack's: a reset, nothing kept."""
    runner = _runner(_model(3), lib)
    tokens = _tokens(30, seed=4)
    runner.forward(tokens)
    runner.record_features((1,))
    assert runner.keep_prefix(tokens) == 0 and runner.length == 0
    runner.record_features(None)
    runner.forward(tokens)
    runner.decoder.native = None  # the tensor-call loop: not row-exact
    assert not runner.row_exact
    assert runner.keep_prefix(tokens) == 0 and runner.length == 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_warm_turn_answers_as_a_cold_one(lib: object, sampled: bool) -> None:
    """Turn two of a conversation (turn one's prompt and answer, then more) with a draft
    model: the target reads only the new tokens, the draft keeps its cache, and the answer is
    the cold start's token for token (sampled with the same seed too: every p and q the same
    bits, so every draw the same)."""
    target_model = _model(3)
    draft_model = copy.deepcopy(target_model)
    with torch.no_grad():  # a draft that agrees often but not always
        for p in draft_model.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(8)))
    params = SamplingParams(0.8, 0, 0.95) if sampled else SamplingParams()

    def engine() -> tuple[SpeculativeEngine, ModelRunner, ModelRunner]:
        target, draft = _runner(target_model, lib), _runner(draft_model, lib)
        drafter = DraftModelDrafter(draft, target_vocab_size=VOCAB, tokenizer_vocab_size=VOCAB)
        return SpeculativeEngine(target, (drafter,), decode, set()), target, draft

    def request(prompt: list[int], reuse: bool) -> GenerationRequest:
        return GenerationRequest(prompt_ids=prompt, max_new_tokens=24, sampling=params,
                                 num_speculative_tokens=4, adaptive=False, seed=5,
                                 reuse_prefix=reuse)  # fixed k: no step depends on a clock

    warm, target, draft = engine()
    first = _tokens(40, seed=6)
    answer, _ = collect(warm, request(first, True))
    second = [*first, *answer, *_tokens(12, seed=7)]
    fed: dict[str, list[int]] = {"target": [], "draft": []}
    for name, runner in (("target", target), ("draft", draft)):
        forward = runner.forward
        runner.forward = (lambda ids, *a, _f=forward, _n=name, **k:  # type: ignore[method-assign]
                          fed[_n].append(len(ids)) or _f(ids, *a, **k))
    tokens, events = collect(warm, request(second, True))
    cold, _, _ = engine()
    expected, cold_events = collect(cold, request(second, False))
    assert tokens == expected
    assert fed["target"][0] <= 12  # the new tokens only: not the whole conversation
    assert events[0].cached + fed["target"][0] == len(second) - 1 and cold_events[0].cached == 0
    assert fed["draft"] and fed["draft"][0] <= len(second) - len(first)  # not turn one's prompt
