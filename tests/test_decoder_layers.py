"""The CPU forward's parts on their own: the int8 linear layer (per-channel weights, per-token
activations, rows independent of each other, the bias), the LM head cut to some rows (alone and
under a runner), the KV cache's growth in blocks, and the Hadamard rotation of the down
projection's input."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB
from decoder_helpers import _tokens
from tolerance import assert_within, gamma, matmul_bound, unit_roundoff
from torch.nn import functional as F
from transformers import PreTrainedModel

from localspec.runtime.decoder import CACHE_BLOCK, CpuDecoder, KVCache, LMHead
from localspec.runtime.quant import DenseLinear, W8A8Linear, quantize_per_channel
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import hadamard, rotate

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


# ----------------------------------------------------------------------------- Hadamard rotation


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
