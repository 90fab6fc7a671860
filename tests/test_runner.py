"""ModelRunner: incremental forwards through the KV cache, crop and reset agree with one
full forward; float32-exact top logits on a bfloat16 model.

Forwards of other shapes (chunks, a static cache, padding) round differently: they agree up
to ``close``'s float32 tolerance. The same call on the same tensors agrees bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from tolerance import assert_within, forward_atol, matmul_bound
from transformers import PreTrainedModel

from localspec.runtime import hf_forward
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import refine_top_logits

TOKENS = [5, 17, 33, 2, 80, 41, 9, 60, 3, 91, 44, 12]


def full_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return ModelRunner(model).forward(tokens)


def close(actual: torch.Tensor, expected: torch.Tensor, model: PreTrainedModel,
          positions: int = 128) -> None:
    """Two float32 forwards of ``model`` computed in other shapes agree to ``forward_atol``:
    the longest reduction is the MLP width or the ``positions`` attended."""
    reduction = max(model.config.hidden_size, model.config.intermediate_size, positions)
    torch.testing.assert_close(actual, expected, rtol=0,
                               atol=forward_atol(expected, reduction))


def test_chunked_forward_matches_full(target_model: PreTrainedModel) -> None:
    """Feeding tokens in chunks through the cache gives the logits of one full pass."""
    runner = ModelRunner(target_model)
    chunks = [runner.forward(TOKENS[:5]), runner.forward(TOKENS[5:6]), runner.forward(TOKENS[6:])]
    close(torch.cat(chunks), full_logits(target_model, TOKENS), target_model)
    assert runner.length == len(TOKENS) == runner.cache.get_seq_length()
    assert runner.vocab_size == 97 and runner.max_length == 256


def test_logits_to_keep_and_last_hidden(target_model: PreTrainedModel) -> None:
    """logits_to_keep=1 returns only the last row; last_hidden holds the kept rows' final
    hidden states, the ones the LM head turns into the returned logits (the same call: bit
    for bit). The LM head over one row rounds as a dot product of the hidden size may."""
    runner = ModelRunner(target_model)
    last = runner.forward(TOKENS, logits_to_keep=1)
    assert last.shape == (1, 97) and last.dtype == torch.float32
    assert runner.last_hidden is not None and runner.last_hidden.shape == (1, 32)
    weight = target_model.lm_head.weight
    assert_within(last[0], full_logits(target_model, TOKENS)[-1],
                  matmul_bound(runner.last_hidden, weight)[0])
    with torch.no_grad():
        assert torch.equal(target_model.lm_head(runner.last_hidden), last)
        runner.reset()
        three = runner.forward(TOKENS, logits_to_keep=3)
        assert runner.last_hidden.shape == (3, 32)
        assert torch.equal(target_model.lm_head(runner.last_hidden), three)


def test_crop_then_continue_matches_fresh(target_model: PreTrainedModel) -> None:
    """Rolling back past rejected tokens and feeding others equals never having seen them."""
    runner = ModelRunner(target_model)
    runner.forward(TOKENS[:8])
    runner.forward([70, 71, 72])  # a rejected draft
    runner.crop(8)
    assert runner.length == 8 == runner.cache.get_seq_length()
    continued = runner.forward(TOKENS[8:])
    close(continued, full_logits(target_model, TOKENS)[8:], target_model)
    runner.crop(100)  # longer than the cache: nothing to do
    assert runner.length == len(TOKENS)
    runner.crop(0)
    assert runner.length == 0 == runner.cache.get_seq_length()
    close(runner.forward(TOKENS), full_logits(target_model, TOKENS), target_model)


def test_reset_forgets_everything(target_model: PreTrainedModel) -> None:
    runner = ModelRunner(target_model)
    runner.forward(TOKENS)
    runner.reset()
    assert runner.length == 0 and runner.last_hidden is None
    # a new cache: the very computation of a new runner
    assert torch.equal(runner.forward(TOKENS[:3]), full_logits(target_model, TOKENS[:3]))


def test_refine_top_logits_is_float32_exact_near_the_maximum() -> None:
    """Logits within the margin of each row's maximum are recomputed in float32, so the argmax
    is the float32 argmax even where bf16 rounding creates near-ties."""
    g = torch.Generator().manual_seed(0)
    weight = (0.1 * torch.randn(64, 16, generator=g)).to(torch.bfloat16)
    direction = torch.randn(16, generator=g)
    direction[0] = 2.0
    weight[3] = direction.to(torch.bfloat16)
    weight[3, 0] = 1.0
    weight[7] = weight[3]
    weight[7, 0] = 1.0 + 2.0**-7  # entry 7 beats entry 3 by hidden[0] / 128, about 0.015
    scales = torch.linspace(20.0, 40.0, 8)[:, None]
    hidden = direction[None] * scales / float(direction @ weight[3].float())
    hidden += 1e-3 * torch.randn(hidden.shape, generator=g)
    exact = hidden @ weight.float().T
    refined = refine_top_logits(hidden, weight)
    assert refined.dtype == torch.float32 and refined.shape == (8, 64)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    near = exact >= exact.max(-1, keepdim=True).values - 0.25
    assert_within(refined[near], exact[near], matmul_bound(hidden, weight.float())[near])
    assert (exact.argmax(-1) == 7).all()
    coarse = torch.nn.functional.linear(hidden.to(torch.bfloat16), weight).float()
    assert (coarse.argmax(-1) != 7).any(), "no bf16 near-tie: the test would prove nothing"
    torch.testing.assert_close(refined, coarse, atol=0.5, rtol=0.02)


def test_logits_fp32_on_bfloat16_model() -> None:
    """logits_fp32 on a bf16 model: float32 logits, close to the float32 model's, and the
    model itself is left untouched (no hook survives a forward). The last two rows alone
    equal the whole pass's up to one bfloat16 rounding of the LM head over other rows (in
    another matrix shape): eps(bf16) of |logit| + |hidden| @ |weight|."""
    reference = full_logits(make_tiny_model(seed=0), TOKENS)
    bf16 = make_tiny_model(seed=0).to(torch.bfloat16)
    runner = ModelRunner(bf16, logits_fp32=True)
    logits = runner.forward(TOKENS)
    assert logits.dtype == torch.float32 and logits.shape == (len(TOKENS), 97)
    assert not bf16.base_model.norm._forward_pre_hooks
    torch.testing.assert_close(logits, reference, atol=0.5, rtol=0.05)
    alone = ModelRunner(bf16, logits_fp32=True)
    last = alone.forward(TOKENS, logits_to_keep=2)
    hidden, weight = alone.last_hidden.double(), bf16.lm_head.weight.double()
    assert_within(last, logits[-2:], torch.finfo(torch.bfloat16).eps
                  * (logits[-2:].abs() + hidden.abs() @ weight.abs().T))


def test_static_cache_runner_equals_the_dynamic_one(target_model: PreTrainedModel) -> None:
    """A static cache: the same logits through prefill, a rejected draft rolled back and
    reset; its tensors are allocated once (rollback moves a length); its capacity is the
    runner's context."""
    dynamic = ModelRunner(target_model)
    static = ModelRunner(target_model, static_cache=64)
    assert static.max_length == 64
    for runner in (dynamic, static):
        runner.forward(TOKENS[:8])
        runner.forward([70, 71, 72])
        runner.crop(8)
    keys = static.cache.layers[0].keys
    close(static.forward(TOKENS[8:]), dynamic.forward(TOKENS[8:]), target_model)
    static.reset()
    assert static.length == 0 and static.cache.layers[0].keys is keys
    close(static.forward(TOKENS), full_logits(target_model, TOKENS), target_model)
    with pytest.raises(ValueError, match="do not fit the static cache of 64"):
        static.forward(list(range(60)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_runner_pads_to_its_buckets_and_equals_eager(dtype: torch.dtype) -> None:
    """``cuda_graphs``: every forward of up to 32 tokens runs the compiled step at a bucket
    width (here traced with the eager backend: no GPU), padded, the padding's cache entries
    dropped. Logits (float32-refined on a bf16 model), hidden states, recorded features and
    rollback equal the eager static runner's; widths past the buckets run eagerly. In
    bfloat16 a padded batch rounds differently (as any batch of another size does): close,
    with the same argmax. Float32: ``close``. Bfloat16 rounds each layer's outputs to 8 bits
    (eps 2^-7), whatever the reduction length: 0.1 + 0.05 |x| is some 6 of those roundings."""
    model = make_tiny_model(seed=0).to(dtype)
    eager = ModelRunner(model, logits_fp32=True, static_cache=128)
    graphed = ModelRunner(model, logits_fp32=True, static_cache=128, cuda_graphs=True)

    def same(actual: torch.Tensor, expected: torch.Tensor) -> None:
        if dtype == torch.float32:
            close(actual, expected, model)
        else:
            torch.testing.assert_close(actual, expected, atol=0.1, rtol=0.05)

    for runner in (eager, graphed):
        runner.record_features((1, 2))
    feeds = [TOKENS[:7], TOKENS[7:8], [70, 71, 72], TOKENS[8:], list(range(40))]
    for tokens in feeds:
        a, b = eager.forward(tokens), graphed.forward(tokens)
        assert graphed.length == eager.length == graphed.cache.get_seq_length()
        same(b, a)
        assert torch.equal(b.argmax(-1), a.argmax(-1))
        same(graphed.last_hidden, eager.last_hidden)
        if tokens == [70, 71, 72]:  # a rejected draft
            eager.crop(8)
            graphed.crop(8)
    same(graphed.features(0, graphed.length), eager.features(0, eager.length))
    hooks = model.base_model.norm._forward_pre_hooks  # the graphed runner's own (bf16)
    assert len(hooks) == (dtype == torch.bfloat16)
    with pytest.raises(ValueError, match="static cache"):
        ModelRunner(model, cuda_graphs=True)


def test_compile_graphs_compiles_every_bucket_before_the_first_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_graphs`` on an empty runner compiles each width bucket, with and without
    hidden states, and leaves the runner empty: the forwards after it compile nothing more.
    (Two buckets here: each compile takes seconds even with the eager backend.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(hf_forward, "GRAPH_WIDTHS", (1, 4))
    torch._dynamo.reset()  # other tests' compiled variants count against the same limit
    model = make_tiny_model(seed=0)
    runner = ModelRunner(model, static_cache=128, cuda_graphs=True)
    before = counters["stats"]["unique_graphs"]
    runner.compile_graphs()
    compiled = counters["stats"]["unique_graphs"] - before
    assert compiled == 2 * 2
    assert runner.length == 0 and runner.cache.get_seq_length() == 0
    eager = ModelRunner(model, static_cache=128)
    runner.record_features((1, 2))
    for width in (1, 3, 4):  # 3 runs padded to 4
        feed = TOKENS[:width]
        close(runner.forward(feed), eager.forward(feed), model)
        runner.reset()
        eager.reset()
    assert counters["stats"]["unique_graphs"] - before == compiled


def test_long_prefill_runs_in_pieces(target_model: PreTrainedModel,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than PREFILL_CHUNK whose leading logits are not wanted is fed in
    pieces: the same kept logits and recorded features, the pieces visible as backbone
    calls."""
    whole = ModelRunner(target_model)
    whole.record_features((1, 2))
    expected = whole.forward(TOKENS, logits_to_keep=2)
    monkeypatch.setattr(hf_forward, "PREFILL_CHUNK", 5)
    pieces = ModelRunner(target_model)
    pieces.record_features((1, 2))
    calls: list[int] = []
    step = pieces._backend._backbone_step
    monkeypatch.setattr(pieces._backend, "_backbone_step",
                        lambda ids, *rest: calls.append(ids.shape[1]) or step(ids, *rest))
    close(pieces.forward(TOKENS, logits_to_keep=2), expected, target_model)
    assert calls == [5, 5, 2] and pieces.length == len(TOKENS)
    close(pieces.features(0, len(TOKENS)), whole.features(0, len(TOKENS)), target_model)
