"""The CPU forward (``CpuDecoder``) on tiny random models: the dense kind reproduces the
Hugging Face forward (Qwen2 and Llama, RoPE scaling, biases, tied heads, chunked feeding and
rollback); the w8a8 kind is batch invariant bit for bit, which is what keeps greedy
speculation exactly lossless; the int8 linear layer, the cut LM head and the KV cache's growth;
and what ``load_model`` does with "w8a8" for a supported and an unsupported architecture."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import (
    MAX_POSITIONS,
    TOKENIZER_TEXTS,
    TOKENIZER_VOCAB,
    VOCAB,
    collect,
    decode,
    make_tiny_model,
    train_tokenizer,
)
from tolerance import assert_within, forward_atol, gamma, matmul_bound, unit_roundoff
from torch.nn import functional as F
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    Qwen2Config,
)

from localspec.config import ModelSpec
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.errors import ModelLoadError
from localspec.models.loading import load_model
from localspec.runtime.decoder import (
    CACHE_BLOCK,
    CpuDecoder,
    KVCache,
    LMHead,
    unsupported_reason,
)
from localspec.runtime.quant import DenseLinear, W8A8Linear, quantize_per_channel
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import ROW_ATTENTION_MAX, hadamard, rotate
from localspec.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model stores w8a8 weights under the cache root: keep them out of the user's."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "localspec-cache"))


def _tokens(count: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cpu_runner(model: PreTrainedModel, kind: str,
                 dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A runner over a CpuDecoder built from a copy of ``model`` (the decoder empties the
    model it is given)."""
    taken = copy.deepcopy(model).to(dtype)
    return ModelRunner(taken, decoder=CpuDecoder(taken, kind))


def _randomize_biases(model: PreTrainedModel, seed: int) -> None:
    """Qwen2 and Llama initialise biases to zero; a dropped or misplaced bias would not show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator))


def _chunked_logits(runner: ModelRunner, tokens: list[int],
                    chunks: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``tokens`` in chunks of the given sizes, then one at a time; return the logits
    and last hidden states of every position, concatenated."""
    logits, hidden, start = [], [], 0
    sizes = [*chunks, *[1] * (len(tokens) - sum(chunks))]
    for size in sizes:
        logits.append(runner.forward(tokens[start:start + size]))
        hidden.append(runner.last_hidden)
        start += size
    assert start == len(tokens) and runner.length == len(tokens)
    return torch.cat(logits), torch.cat(hidden)


def _assert_dense_matches_hf(model: PreTrainedModel, tokens: list[int]) -> None:
    """Dense CPU-forward logits (and final hidden states) equal the HF forward's, fed in chunks of
    20, 15 and then one at a time, and again after rolling back and feeding the rest anew.

    Equal up to float32 rounding (``forward_atol``: the longest reduction is the MLP width or
    the positions attended; measured ~2e-6 on logits of size ~8, 2 ulps, against a bound of
    ~6e-5). A RoPE or mask bug moves the logits by 0.02 or more."""
    hf = ModelRunner(model)
    reference = hf.forward(tokens)
    reference_hidden = hf.last_hidden
    reduction = max(model.config.hidden_size, model.config.intermediate_size, len(tokens))
    atol = forward_atol(reference, reduction)
    cpu = _cpu_runner(model, "dense")
    logits, hidden = _chunked_logits(cpu, tokens, (20, 15))
    assert logits.shape == reference.shape == (len(tokens), model.config.vocab_size)
    torch.testing.assert_close(logits, reference, rtol=0, atol=atol)
    torch.testing.assert_close(hidden, reference_hidden, rtol=0,
                               atol=forward_atol(reference_hidden, reduction))
    # Roll back into the middle of a chunk and into the one-at-a-time part: the stale
    # positions behind the new length must not leak into what is fed next.
    for keep in (27, 10, len(tokens) - 6):
        cpu.crop(keep)
        assert cpu.length == keep
        again = torch.cat([cpu.forward(tokens[keep:keep + 4]), cpu.forward(tokens[keep + 4:])])
        torch.testing.assert_close(again, reference[keep:], rtol=0, atol=atol)
    cpu.reset()
    torch.testing.assert_close(cpu.forward(tokens[:5]), reference[:5], rtol=0, atol=atol)


# ----------------------------------------------------------------------------- dense == HF


def test_dense_qwen2_equals_hf_forward() -> None:
    """The dense CPU forward of a float32 Qwen2 (random q/k/v biases) is the HF forward:
    same logits and last hidden states up to float32 rounding whatever the chunking, and after
    crop."""
    model = make_tiny_model(seed=0)
    _randomize_biases(model, seed=5)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    _assert_dense_matches_hf(model, _tokens(60, seed=1))


LLAMA_VARIANTS = {
    # Llama 3.x: llama3 frequency scaling, LM head tied to the embedding
    "llama3-rope-tied": dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        tie_word_embeddings=True),
    # linear scaling; head_dim != hidden / heads (q_size 64 > hidden 32); every linear biased
    "linear-rope-biases-head-dim": dict(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        head_dim=16, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
}


def _tiny_llama(seed: int, **overrides: object) -> PreTrainedModel:
    """A random Llama of tiny_config's sizes in float32. Weights 5x larger than transformers'
    default init: attention is then peaked and depends on position (with the default, RoPE
    changes the logits by under 1e-3 and a RoPE bug could hide under the tolerance)."""
    settings: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.1)
    settings.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_dense_llama_equals_hf_forward(variant: str) -> None:
    """A Llama with scaled RoPE: the CPU forward takes cos/sin from the model's own rotary
    module, so it matches the HF forward; the scaling is checked to matter (the same weights
    with plain RoPE give other logits), so a decoder with its own RoPE would fail here."""
    overrides = LLAMA_VARIANTS[variant]
    model = _tiny_llama(seed=3, **overrides)
    _randomize_biases(model, seed=6)
    if overrides["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokens = _tokens(60, seed=2)
    _assert_dense_matches_hf(model, tokens)

    plain = _tiny_llama(seed=3, **{**overrides, "rope_parameters": None})
    plain.load_state_dict(model.state_dict())
    unscaled = ModelRunner(plain).forward(tokens)
    # measured 0.07 and 0.5: over a thousand times the rounding tolerance above
    assert (unscaled - ModelRunner(model).forward(tokens)).abs().max() > 0.02


# ----------------------------------------------------------------------------- w8a8 invariance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_w8a8_batch_equals_one_token_steps(target_model: PreTrainedModel,
                                           dtype: torch.dtype) -> None:
    """What makes speculation lossless against the w8a8 model: after any prefix, a pass over
    n tokens (n = 2..13, a verify pass) gives bit for bit the logits that n one-token steps
    (plain decoding) give, also when the cache was cropped back and fed again."""
    tokens = _tokens(60, seed=3)
    runner = _cpu_runner(target_model, "w8a8", dtype)
    steps = torch.cat([runner.forward([t]) for t in tokens])  # plain decoding, token by token
    assert torch.isfinite(steps).all()
    for prefix in (1, 9, 40):
        runner.reset()
        assert torch.equal(runner.forward(tokens[:prefix]), steps[:prefix]), prefix
        for n in range(2, 14):
            runner.crop(prefix)  # after the first n: stale positions lie behind the length
            batch = runner.forward(tokens[prefix:prefix + n])
            assert torch.equal(batch, steps[prefix:prefix + n]), (prefix, n)
    # a longer rollback: to the middle of the last batch, then a fresh batch
    runner.crop(45)
    assert torch.equal(runner.forward(tokens[45:58]), steps[45:58])


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)],
                         ids=["float32", "bfloat16"])
def test_w8a8_long_batch_uses_mask_and_stays_close(target_model: PreTrainedModel,
                                                   dtype: torch.dtype, tolerance: float) -> None:
    """Past ROW_ATTENTION_MAX new tokens (a long prompt) attention runs as one masked call:
    not bit-identical to one-token steps, but the same logits up to rounding and the same
    argmaxes. A causal mask off by one key (a row seeing a later key, or one too few) is off
    by 3e-2 relative in both dtypes, measured.

    Rounding here is not float rounding alone: each layer re-quantizes its activations to
    int8, and an attention output that rounds one ulp differently moves an int8 activation a
    whole step (1/127 of its row's largest entry) when it sits on a rounding boundary. One
    such flip moves these logits by ~5e-4 relative (measured: 64-ulp noise on the attention
    output makes one); on this machine none happens in float32 (4e-8 relative), and another
    CPU's attention may make one or two: 2e-3 allows four. In bfloat16 flips are the rule
    (measured 2.7e-3); 2e-2 is 7 times that."""
    n = ROW_ATTENTION_MAX + 12
    tokens = _tokens(5 + n, seed=4)
    runner = _cpu_runner(target_model, "w8a8", dtype)
    steps = torch.cat([runner.forward([t]) for t in tokens])
    runner.reset()
    runner.forward(tokens[:5])
    batch = runner.forward(tokens[5:])
    relative = float((batch - steps[5:]).norm() / steps[5:].norm())
    assert relative < tolerance, relative
    agreement = float((batch.argmax(-1) == steps[5:].argmax(-1)).float().mean())
    assert agreement >= 0.95, agreement  # measured 1.0


def test_w8a8_follows_the_float_model(target_model: PreTrainedModel) -> None:
    """The w8a8 forward approximates the float model (relative logit error measured 0.8%,
    argmax agreement 97%): exact batch invariance is only worth having on the right values."""
    tokens = _tokens(60, seed=1)
    reference = ModelRunner(target_model).forward(tokens)
    logits = _cpu_runner(target_model, "w8a8").forward(tokens)
    relative = float((logits - reference).norm() / reference.norm())
    assert relative < 0.03, relative
    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    assert agreement >= 0.9, agreement


# ----------------------------------------------------------------------------- W8A8Linear


def _linear_data(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 256 -> 96 weight whose rows have very different ranges, a bias, 8 input rows."""
    weight = torch.randn(96, 256, generator=generator) * torch.rand(96, 1, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(8, 256, generator=generator)
    return weight, bias, x


def test_w8a8_linear_close_to_float_linear() -> None:
    """Per-channel int8 weights with per-token int8 activations: within 2% of F.linear."""
    weight, _, x = _linear_data(torch.Generator().manual_seed(0))
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and (q.abs().amax(dim=1) == 127).all()
    assert torch.equal(scale, weight.abs().amax(dim=1) / 127)  # the same ops: exact
    layer = W8A8Linear.from_float(weight)
    out = layer(x)
    reference = F.linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (8, 96)
    relative = float((out - reference).norm() / reference.norm())
    assert relative < 0.02, relative
    per_row = (out - reference).norm(dim=1) / reference.norm(dim=1)
    assert (per_row < 0.02).all(), per_row


def test_w8a8_linear_rows_are_independent() -> None:
    """A row's output is bit-identical alone or beside a row with a 1000x outlier (per-token
    scales: a per-tensor scale would crush the normal row onto a few levels) and stays
    accurate; the outlier crushes only its own row."""
    weight, _, x = _linear_data(torch.Generator().manual_seed(1))
    layer = W8A8Linear.from_float(weight)
    row = x[:1]
    outlier = x[1:2].clone()
    outlier[0, 17] *= 1000.0
    alone = layer(row)
    for batch, index in ((torch.cat([row, outlier]), 0), (torch.cat([outlier, row]), 1),
                         (torch.cat([outlier, x[2:], row]), 7)):
        assert torch.equal(layer(batch)[index:index + 1], alone), index
    reference = F.linear(row, weight)
    assert float((alone - reference).norm() / reference.norm()) < 0.02


def test_w8a8_linear_bias() -> None:
    """The bias is added after dequantization, in float32: output = biasless output + bias
    (up to the rounding of that addition and of the subtraction that recovers it, u each of
    |output| + |bias|), and a zero input row gives exactly the bias."""
    weight, bias, x = _linear_data(torch.Generator().manual_seed(2))
    biased, plain = W8A8Linear.from_float(weight, bias), W8A8Linear.from_float(weight)
    assert_within(biased(x) - plain(x), bias.expand(8, -1),
                  2 * unit_roundoff() * (plain(x).abs() + bias.abs()))
    reference = F.linear(x, weight, bias)
    assert float((biased(x) - reference).norm() / reference.norm()) < 0.02
    assert torch.equal(biased(torch.zeros(1, 256))[0], bias)
    assert torch.equal(DenseLinear(weight, bias)(x), F.linear(x, weight, bias))


# ----------------------------------------------------------------------------- LM head


@pytest.mark.parametrize("kind", ["w8a8", "dense"])
def test_lm_head_rows(kind: str) -> None:
    """A head cut to some rows (a draft's FR-Spec head) gives the full head's logits at those
    rows (bit for bit in w8a8: exact int32 sums per column; in float32 a matrix of other rows
    is summed in other blocks, so up to the rounding of a dot product of the hidden size) and
    -inf everywhere else."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, 32, generator=generator)
    hidden = torch.randn(5, 32, generator=generator)
    head = LMHead(dict(zip(("q", "scale"), quantize_per_channel(weight), strict=True))
                  if kind == "w8a8" else {"weight": weight})
    assert head.vocab_size == VOCAB
    full = head.logits(hidden)
    assert full.shape == (5, VOCAB) and torch.isfinite(full).all()
    reference = F.linear(hidden, weight)
    if kind == "w8a8":
        assert float((full - reference).norm() / reference.norm()) < 0.02
    else:  # the whole dense head is F.linear itself
        assert torch.equal(full, reference)
    rows = torch.tensor([0, 3, 5, 50, VOCAB - 1])
    for _ in range(2):  # the second call uses the packed cut made by the first
        cut = head.logits(hidden, rows)
        assert cut.shape == (5, VOCAB)
        if kind == "w8a8":
            assert torch.equal(cut[:, rows], full[:, rows])
        else:
            assert_within(cut[:, rows], full[:, rows], matmul_bound(hidden, weight[rows]))
        others = torch.ones(VOCAB, dtype=torch.bool)
        others[rows] = False
        assert (cut[:, others] == float("-inf")).all()


def test_runner_vocab_rows_over_cpu_decoder(target_model: PreTrainedModel) -> None:
    """A CPU-forward runner given vocab_rows (as the draft drafter is) returns the full runner's
    logits at those rows and -inf elsewhere."""
    rows = torch.tensor([1, 2, 40, 96])
    tokens = _tokens(12, seed=8)
    taken = copy.deepcopy(target_model)
    decoder = CpuDecoder(taken, "w8a8")
    full = ModelRunner(taken, decoder=decoder).forward(tokens)
    cut = ModelRunner(taken, decoder=decoder, vocab_rows=rows).forward(tokens)
    assert torch.equal(cut[:, rows], full[:, rows])
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[rows] = False
    assert (cut[:, others] == float("-inf")).all()


# ----------------------------------------------------------------------------- KV cache


def _round_up(length: int) -> int:
    return -(-length // CACHE_BLOCK) * CACHE_BLOCK


@pytest.mark.parametrize("max_length", [4 * CACHE_BLOCK, 600, 0])
def test_kv_cache_reserve_grows_in_blocks(max_length: int) -> None:
    """reserve(length) makes room for ``length`` positions in whole CACHE_BLOCKs, keeps what
    was written, never shrinks, copies nothing when there is room already, and grows no
    further than max(max_length, length) rounded up to a block (a config without
    max_position_embeddings gives max_length 0)."""
    cache = KVCache(layers=2, kv_heads=2, head_dim=4, dtype=torch.bfloat16,
                    max_length=max_length)
    assert cache.keys.shape == cache.values.shape == (2, 2, 0, 4)
    written = 0
    for length in (1, 5, CACHE_BLOCK, CACHE_BLOCK + 1, 2 * CACHE_BLOCK + 3, 3 * CACHE_BLOCK - 1,
                   4 * CACHE_BLOCK, 4 * CACHE_BLOCK + 7, 5 * CACHE_BLOCK + 100, 3):
        before = cache.keys.shape[2]
        old_keys = cache.keys
        cache.reserve(length)
        capacity = cache.keys.shape[2]
        assert cache.keys.shape == cache.values.shape == (2, 2, capacity, 4)
        assert cache.keys.dtype == cache.values.dtype == torch.bfloat16
        assert capacity % CACHE_BLOCK == 0 and capacity >= max(length, before)
        assert capacity <= max(before, _round_up(max(max_length, length))), (length, capacity)
        if length <= before:
            assert cache.keys is old_keys  # no copy when it fits
        keys = torch.arange(written, dtype=torch.float32).to(torch.bfloat16)
        assert torch.equal(cache.keys[:, :, :written], keys.view(1, 1, -1, 1).expand(
            2, 2, written, 4)), length
        assert torch.equal(cache.values[:, :, :written], -cache.keys[:, :, :written])
        # write every position now reserved (small integers: exact in bfloat16)
        written = min(length, 256)
        pattern = torch.arange(written, dtype=torch.float32).to(torch.bfloat16)
        cache.keys[:, :, :written] = pattern.view(1, 1, -1, 1)
        cache.values[:, :, :written] = -pattern.view(1, 1, -1, 1)


def test_kv_cache_doubles_below_max_length() -> None:
    """Below max_length the capacity at least doubles, so a long generation copies the cache
    a logarithmic number of times, not once per block."""
    cache = KVCache(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32,
                    max_length=16 * CACHE_BLOCK)
    capacities = []
    for length in range(1, 16 * CACHE_BLOCK + 1, 37):
        cache.reserve(length)
        if not capacities or capacities[-1] != cache.keys.shape[2]:
            capacities.append(cache.keys.shape[2])
    assert capacities == [CACHE_BLOCK * 2**i for i in range(5)]


# ----------------------------------------------------------------------------- speculation

SPEC_PROMPTS = [[5, 17, 33, 2, 80, 41, 9], [60, 3, 91, 44, 12, 12, 70, 8, 25, 38, 77]]


@pytest.fixture(scope="module")
def w8a8_runners(target_model: PreTrainedModel,
                 close_draft_model: PreTrainedModel) -> dict[str, ModelRunner]:
    return {"target": _cpu_runner(target_model, "w8a8"),
            "draft": _cpu_runner(close_draft_model, "w8a8")}


@pytest.mark.parametrize("k", [1, 3, 8, 13])
def test_w8a8_greedy_speculation_equals_plain_w8a8(k: int,
                                                   w8a8_runners: dict[str, ModelRunner]) -> None:
    """Greedy speculative decoding with a w8a8 target and a w8a8 draft model emits exactly
    the tokens of plain w8a8 greedy decoding (fixed k, no adaptation), with drafts both
    accepted and rejected along the way."""
    target, draft_runner = w8a8_runners["target"], w8a8_runners["draft"]
    accepted = rejected = 0
    for prompt in SPEC_PROMPTS:
        def make(k_: int, prompt: list[int] = prompt) -> GenerationRequest:
            return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=40,
                                     sampling=SamplingParams(), num_speculative_tokens=k_,
                                     adaptive=False)

        plain, _ = collect(SpeculativeEngine(target, None, decode, set()), make(k))
        drafter = DraftModelDrafter(draft_runner, target_vocab_size=VOCAB,
                                    tokenizer_vocab_size=VOCAB)
        tokens, events = collect(SpeculativeEngine(target, drafter, decode, set()), make(k))
        assert len(plain) == 40
        assert tokens == plain, (prompt, k)
        assert all(len(e.drafted) <= e.k <= k for e in events)
        assert max(e.k for e in events) == k
        accepted += sum(e.accepted for e in events)
        rejected += sum(len(e.drafted) - e.accepted for e in events)
    assert accepted > 0 and rejected > 0, (accepted, rejected)


# ----------------------------------------------------------------------------- support, loading


def _tiny_gpt2() -> PreTrainedModel:
    config = GPT2Config(vocab_size=TOKENIZER_VOCAB, n_positions=64, n_embd=32, n_layer=1,
                        n_head=2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_unsupported_reason() -> None:
    """Only Llama-family models with SiLU and full attention are taken; anything else is
    refused with a reason naming what is unsupported, and CpuDecoder raises it."""
    gpt2 = _tiny_gpt2()
    reason = unsupported_reason(gpt2)
    assert reason is not None and "gpt2" in reason and "llama" in reason and "qwen2" in reason
    with pytest.raises(ValueError, match="gpt2"):
        CpuDecoder(gpt2, "w8a8")
    assert gpt2.transformer.h[0].attn.c_attn.weight.numel() > 0  # refused before emptying

    def qwen2(**overrides: object) -> PreTrainedModel:
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=MAX_POSITIONS, **overrides)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    assert unsupported_reason(qwen2()) is None
    assert unsupported_reason(_tiny_llama(seed=0)) is None
    assert "gelu" in (unsupported_reason(qwen2(hidden_act="gelu")) or "")
    assert "sliding" in (unsupported_reason(qwen2(use_sliding_window=True)) or "")


def test_load_w8a8_refuses_unsupported_architecture(tmp_path: Path) -> None:
    """load_model with quantization "w8a8" on a saved GPT-2 folder fails with a
    ModelLoadError naming the architecture and the way out, instead of a traceback."""
    train_tokenizer(TOKENIZER_TEXTS).save_pretrained(tmp_path)
    _tiny_gpt2().save_pretrained(tmp_path)
    spec = ModelSpec(str(tmp_path), dtype="float32", device="cpu", quantization="w8a8")
    with pytest.raises(ModelLoadError, match="gpt2") as error:
        load_model(spec)
    assert "w8a8" in str(error.value) and "int8-weight-only" in str(error.value)
    # the same folder loads without the CPU forward
    assert load_model(ModelSpec(str(tmp_path), dtype="float32", device="cpu")).decoder is None


def test_load_w8a8_builds_cpu_decoder(saved_model_dir: Path) -> None:
    """load_model(..., quantization="w8a8") of a saved Qwen2 gives a LoadedModel with a
    CpuDecoder; its runners run that decoder, with the saved model's vocabulary and logits
    close to the float model's (the right weights were taken)."""
    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", device="cpu", quantization="w8a8")
    loaded = load_model(spec)
    assert isinstance(loaded.decoder, CpuDecoder)
    assert loaded.decoder.dtype == torch.bfloat16
    runner = loaded.runner()
    assert runner.decoder is loaded.decoder and runner.vocab_size == TOKENIZER_VOCAB
    tokens = loaded.tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    assert len(tokens) > 3
    logits = runner.forward(tokens)
    assert logits.shape == (len(tokens), TOKENIZER_VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and runner.length == len(tokens)
    reference = ModelRunner(make_tiny_model(seed=0, vocab_size=TOKENIZER_VOCAB)).forward(tokens)
    relative = float((logits - reference).norm() / reference.norm())
    assert relative < 0.05, relative
    # a second runner has its own cache
    other = loaded.runner()
    assert other.length == 0 and torch.equal(other.forward(tokens), logits)
    # loading again (the w8a8 weights may now come from a stored copy) gives the same model
    reloaded = load_model(spec)
    assert isinstance(reloaded.decoder, CpuDecoder)
    assert torch.equal(reloaded.runner().forward(tokens), logits)


def test_w8a8_store_is_reused_and_rebuilt_when_damaged(saved_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first w8a8 load stores its int8 weights; the next reads them (no quantization,
    and the float weights are never loaded: an empty model tree with the real config and
    generation settings) and gives the same logits; a damaged store is quantized again, never
    read as garbage."""
    from localspec.models import loading, packed_store

    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8")
    ids = list(range(3, 40))
    original = load_model(spec)
    first = original.runner().forward(ids)
    store = packed_store.store_dir(saved_model_dir) / packed_store.WEIGHTS_NAME
    assert store.is_file()

    calls: list[str] = []
    real_export = packed_store.export_weights
    monkeypatch.setattr(packed_store, "export_weights",
                        lambda *a, **k: calls.append("quantize") or real_export(*a, **k))
    real_load = loading.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append("float weights") or real_load(*a, **k))
    again = load_model(spec)
    assert torch.equal(again.runner().forward(ids), first)
    assert calls == []  # read from the store, nothing else
    for settings in ("generation_config", "config"):
        assert getattr(again.model, settings).to_dict() == getattr(original.model,
                                                                   settings).to_dict()

    data = bytearray(store.read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(bytes(data))
    assert torch.equal(load_model(spec).runner().forward(ids), first)
    assert calls == ["float weights", "quantize"]  # the damage was seen: quantized again


def test_store_of_an_older_format_is_replaced(saved_model_dir: Path) -> None:
    """A new store removes what an earlier format left for the same model folder."""
    from localspec.models import packed_store

    current = packed_store.store_dir(saved_model_dir)
    stale = current.with_name(current.name.rsplit("-", 1)[0] + "-0123456789ab")
    stale.mkdir(parents=True)
    (stale / packed_store.WEIGHTS_NAME).write_bytes(b"old")
    load_model(ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8"))
    assert (current / packed_store.WEIGHTS_NAME).is_file() and not stale.exists()


def test_draft_shares_the_targets_tokenizer_only_when_its_files_are_the_same(
        saved_model_dir: Path, tmp_path: Path) -> None:
    """A draft folder with byte-identical tokenizer files reuses the target's tokenizer (one
    tokenizer load fewer per start); a changed file gets its own."""
    import shutil

    target = load_model(ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8"))
    twin = tmp_path / "twin"
    shutil.copytree(saved_model_dir, twin)
    spec = ModelSpec(str(twin), dtype="bfloat16", quantization="w8a8")
    assert load_model(spec, share_tokenizer=target).tokenizer is target.tokenizer
    config = twin / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 77}', 1))
    other = load_model(spec, share_tokenizer=target).tokenizer
    assert other is not target.tokenizer and other.model_max_length == 77


@pytest.mark.parametrize(("width", "block"), [(8960, 256), (4864, 256), (896, 128), (96, 32)])
def test_hadamard_rotation_is_orthonormal_and_row_exact(width: int, block: int) -> None:
    """The down projection's input rotation: the largest power-of-two block up to 256 that
    divides the width, orthonormal (the product with the rotated weight is unchanged), and a
    row turned within a batch equals the row turned alone, bit for bit.

    Every entry of h is 1/sqrt(block) rounded once to float32, so h is (1 + d) times an exact
    orthonormal matrix with |d| <= u: h @ h is within 3u of I plus the rounding of its sums.
    The product is checked in float64, where that 3u (of |x| |w|) is all that float32 adds;
    in float32 a sum over 8960 products of size ~20 rounds by ~1e-2, whatever h is."""
    h = hadamard(width)
    assert h.shape == (block, block)
    assert_within(h @ h, torch.eye(block),
                  matmul_bound(h, h, evaluations=1) + 3 * unit_roundoff())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(20, width, generator=generator) * 30
    w = torch.randn(7, width, generator=generator)
    x64, w64, h64 = x.double(), w.double(), h.double()
    through = rotate(x64.abs(), h64.abs()) @ rotate(w64.abs(), h64.abs()).T  # |terms| rotated
    assert_within(rotate(x64, h64) @ rotate(w64, h64).T, x64 @ w64.T,
                  3 * unit_roundoff() * (x64.abs() @ w64.abs().T)
                  + 2 * gamma(width + block, torch.float64) * through)
    for n in (2, 9, 20):
        assert torch.equal(rotate(x[:n], h), torch.cat([rotate(x[i:i + 1], h) for i in range(n)]))
