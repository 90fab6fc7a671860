"""The native Q4_K and Q6_K products (``kquant_matmul.c``), ``Q4KLinear`` and ``Q6KLinear``,
and the weight formats they read (``kquant_formats``).

What speculation needs from them: the product computed is the documented one (Q4_K weights
times activations quantized to int8 per group of 32), and a row's output is bit for bit the same
whatever other rows share the call and however many threads run, so a verify pass computes
exactly what one-token steps compute. Every test runs on the kernels this machine serves (the
best variant that builds, or LOCALSPEC_KERNELS's) and on the portable build; a machine where
neither builds fails here rather than skipping (``kernel_helpers.kernel_lib``). Shapes are small.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from kernel_helpers import (
    assert_matches_reference,
    quantize_activations,
    random_inputs,
    random_weights,
    reference,
)

from localspec.runtime.kernels import (
    GROUP,
    KERNELS_ENV,
    Q6KWeights,
    cat_rows,
    cpu_features,
    pack_q4k,
    pack_q6k,
    parse_q4k,
    parse_q6k,
    quantize_q4k,
    quantize_q6k,
    runnable_variants,
)
from localspec.runtime.quant import Q4KLinear, Q6KLinear


def test_the_kernels_tested_are_the_ones_asked_for(lib: ctypes.CDLL,
                                                   request: pytest.FixtureRequest) -> None:
    """What runs below is the portable build, or the served one: LOCALSPEC_KERNELS's variant
    when it is set (a run with it at "portable" tests the portable build throughout), else
    one this CPU runs."""
    lib.kernels_variant.restype = ctypes.c_char_p
    variant = lib.kernels_variant().decode()
    served = request.node.callspec.params["lib"] == "served"
    forced = os.environ.get(KERNELS_ENV)
    if not served:
        assert variant == "portable"
    elif forced:
        assert variant == forced
    else:
        assert variant in runnable_variants(cpu_features())


# ----------------------------------------------------------------------------- quantize / pack


@pytest.mark.parametrize(("n", "k"), [(48, 512), (16, 256), (32, 896)])
def test_quantize_q4k_round_trips_within_4_bit_error(n: int, k: int) -> None:
    """quantize_q4k's weights dequantize to the input within 4-bit error, with every field in
    its Q4_K range (q 4 bits, sc/mn 6 bits, d/dmin fp16 as the file stores them)."""
    w = random_weights(n, k, seed=0)
    q = quantize_q4k(w)
    assert q.q.shape == (n, k) and q.sc.shape == q.mn.shape == (n, k // 32)
    assert q.d.shape == q.dmin.shape == (n, -(-k // 256))  # 896: a partial last super-block
    assert q.q.dtype == q.sc.dtype == q.mn.dtype == torch.uint8
    assert int(q.q.max()) <= 15 and int(q.sc.max()) <= 63 and int(q.mn.max()) <= 63
    assert torch.equal(q.d, q.d.half().float()) and torch.equal(q.dmin, q.dmin.half().float())
    error = (q.dequantize() - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
    assert float(error) < 0.1, float(error)


def test_quantize_q4k_degenerate_rows() -> None:
    """Zero, constant and tiny rows take the d == 0 / low == 0 branches without NaNs."""
    w = torch.zeros(16, 256)
    w[1] = 3.0
    w[2] = -3.0
    w[3, :5] = 1e-3
    back = quantize_q4k(w).dequantize()
    assert torch.isfinite(back).all()
    assert torch.equal(back[0], torch.zeros(256))
    torch.testing.assert_close(back, w, rtol=0.0, atol=3.0 / 1000)  # fp16-scale rounding


def test_quantize_q4k_refuses_a_width_not_divisible_by_32() -> None:
    with pytest.raises(ValueError, match="32"):
        quantize_q4k(torch.randn(16, 300))


def test_pack_q4k_refuses_rows_not_divisible_by_16() -> None:
    """The kernel interleaves rows in blocks of 16: a partial block would be read past its end."""
    with pytest.raises(ValueError, match="16"):
        pack_q4k(quantize_q4k(torch.randn(8, 256)))


def test_parse_q4k_refuses_the_wrong_byte_count() -> None:
    with pytest.raises(ValueError, match="not a Q4_K matrix"):
        parse_q4k(np.zeros(144 * 3, np.uint8), 2, 256)


# ----------------------------------------------------------------------------- the product


@pytest.mark.parametrize(("n", "k"), [(48, 512), (16, 256), (32, 896), (16, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4k_linear_matches_the_torch_reference(lib: ctypes.CDLL, n: int, k: int,
                                                with_bias: bool) -> None:
    """The kernel computes group-quantized int8 activations times the Q4_K weights (plus bias):
    this checks pack_q4k's layout and the C arithmetic together."""
    weights = quantize_q4k(random_weights(n, k, seed=1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)) if with_bias else None
    layer = Q4KLinear.from_weights(weights, bias, lib)
    assert (layer.in_features, layer.out_features) == (k, n)
    x = random_inputs(5, k, seed=3)
    assert_matches_reference(layer(x), reference(x, weights, bias))


def test_q4k_linear_casts_and_copies_its_input(lib: ctypes.CDLL) -> None:
    """A bfloat16 or non-contiguous input gives the float32 product of its float32 values."""
    weights = quantize_q4k(random_weights(16, 256, seed=4))
    layer = Q4KLinear.from_weights(weights, None, lib)
    x = random_inputs(256, 3, seed=5).T  # [3, 256], not contiguous
    assert not x.is_contiguous()
    assert torch.equal(layer(x), layer(x.contiguous()))
    xb = x.to(torch.bfloat16)
    assert torch.equal(layer(xb), layer(xb.float()))


def test_rows_do_not_depend_on_the_batch(lib: ctypes.CDLL) -> None:
    """Every row of an M-row call, M = 1..20 (past the kernel's rows per pass: 8 or 4), equals
    that row computed alone, bit for bit, and equals it again when the row sits at another
    position of a call of another size: a verify pass computes exactly what one-token steps
    compute."""
    per_pass = lib.kernels_rows_per_pass()
    weights = quantize_q4k(random_weights(48, 512, seed=6))
    layer = Q4KLinear.from_weights(weights, torch.randn(48), lib)
    x = random_inputs(20, 512, seed=7)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    for m in range(1, 21):
        batch = layer(x[:m])
        assert batch.shape == (m, 48)
        for i in range(m):
            assert torch.equal(batch[i], alone[i]), (m, i)
    for start in (1, 3, per_pass - 1, per_pass + 3):  # rows shift to other pass slots
        assert torch.equal(layer(x[start:]), alone[start:]), start
    assert_matches_reference(alone, reference(x, weights, layer.bias))


def test_rows_do_not_depend_on_the_thread_count(lib: ctypes.CDLL) -> None:
    """One thread or two (the kernel splits output blocks between them): the same bits."""
    weights = quantize_q4k(random_weights(64, 512, seed=8))
    layer = Q4KLinear.from_weights(weights, None, lib)
    x = random_inputs(lib.kernels_rows_per_pass() * 2 + 3, 512, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("with_bias", [False, True])
def test_zero_row_gives_exactly_the_bias(lib: ctypes.CDLL, with_bias: bool) -> None:
    """An all-zero row (every group has amax 0) gives exactly the bias, or zeros: no 0/0."""
    weights = quantize_q4k(random_weights(32, 256, seed=10))
    bias = torch.randn(32) if with_bias else None
    layer = Q4KLinear.from_weights(weights, bias, lib)
    x = random_inputs(3, 256, seed=11)
    x[1] = 0.0
    y = layer(x)
    assert torch.equal(y[1], bias if bias is not None else torch.zeros(32))
    assert torch.equal(y[0], layer(x[:1])[0])  # its neighbours are unaffected


def test_an_outlier_only_coarsens_its_own_group(lib: ctypes.CDLL) -> None:
    """One channel at 1e4 (Qwen's outlier activations): the output stays finite and matches the
    reference, and it differs from the outlier-free row's output only by what the outlier's
    group of 32 contributes. A per-row scale would flatten every other group too."""
    k, channel = 512, 100
    weights = quantize_q4k(random_weights(48, k, seed=12))
    layer = Q4KLinear.from_weights(weights, None, lib)
    x = random_inputs(1, k, seed=13)
    spiked = x.clone()
    spiked[0, channel] = 1e4
    y, y_spiked = layer(x), layer(spiked)
    assert torch.isfinite(y_spiked).all()
    assert_matches_reference(y_spiked, reference(spiked, weights, None))

    group = slice(channel // GROUP * GROUP, (channel // GROUP + 1) * GROUP)
    plain, coarse = quantize_activations(x), quantize_activations(spiked)
    outside = torch.ones(k, dtype=torch.bool)
    outside[group] = False
    assert torch.equal(plain[:, outside], coarse[:, outside])  # other groups keep their levels
    assert torch.count_nonzero(coarse[0, group]) == 1  # N(0, 1) values under a 1e4/127 step
    w = weights.dequantize()
    expected_change = (coarse - plain)[:, group] @ w[:, group].T
    torch.testing.assert_close(y_spiked - y, expected_change, rtol=0.0,
                               atol=1e-4 * float(expected_change.abs().max()))


def test_cat_equals_the_parts_bit_for_bit(lib: ctypes.CDLL) -> None:
    """Fused layers (q|k|v, gate|up) built with Q4KWeights.cat give each part's own output."""
    first = quantize_q4k(random_weights(32, 512, seed=14))
    second = quantize_q4k(random_weights(48, 512, seed=15))
    fused = cat_rows([first, second])
    assert torch.equal(fused.dequantize(), torch.cat([first.dequantize(), second.dequantize()]))
    x = random_inputs(lib.kernels_rows_per_pass() + 2, 512, seed=16)
    parts = torch.cat([Q4KLinear.from_weights(first, None, lib)(x),
                       Q4KLinear.from_weights(second, None, lib)(x)], dim=1)
    assert torch.equal(Q4KLinear.from_weights(fused, None, lib)(x), parts)


# ----------------------------------------------------------------------------- the real file


@pytest.mark.real_model
def test_parse_equals_gguf_dequantize_on_the_real_target() -> None:
    """parse_q4k and parse_q6k decode the built-in target's Q4_K and Q6_K bytes exactly as
    gguf-py does (the same float32 values, bit for bit), so the kernels serve the weights the
    file holds."""
    gguf = pytest.importorskip("gguf")
    from localspec.errors import ModelLoadError
    from localspec.models.builtin import BUILTIN_MODELS
    from localspec.models.cache import assemble_builtin

    try:
        path = assemble_builtin(BUILTIN_MODELS["qwen2.5-coder-1.5b-instruct"])
    except ModelLoadError as exc:
        pytest.skip(f"the built-in target is not available: {exc}")
    kinds = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K",
             "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"}
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors if t.name in kinds}
    assert set(tensors) == set(kinds)
    for name, tensor in tensors.items():
        assert tensor.tensor_type.name == kinds[name], name
        k, n = (int(s) for s in tensor.shape[:2])
        parse = parse_q4k if kinds[name] == "Q4_K" else parse_q6k
        ours = parse(np.asarray(tensor.data), n, k).dequantize()
        theirs = torch.from_numpy(
            np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                       dtype=np.float32).reshape(n, k))
        assert ours.shape == (n, k)
        assert torch.equal(ours, theirs), name


# ----------------------------------------------------------------------------- Q6_K


@pytest.mark.parametrize(("n", "k"), [(16, 256), (48, 512)])
def test_quantize_q6k_round_trips_within_6_bit_error(n: int, k: int) -> None:
    """quantize_q6k (for tests) gives fields in their Q6_K ranges that dequantize close to the
    input: the reference the kernel is checked against is a real Q6_K matrix."""
    w = random_weights(n, k, seed=30)
    q = quantize_q6k(w)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 63
    assert q.sc.dtype == torch.int8 and q.sc.shape == (n, k // 16) and q.d.shape == (n, k // 256)
    assert torch.equal(q.d, q.d.half().float())
    error = (q.dequantize() - w).abs().amax(-1) / w.abs().amax(-1)
    assert float(error.max()) < 0.03


def test_pack_and_parse_q6k_refuse_wrong_shapes() -> None:
    q = quantize_q6k(random_weights(16, 256, seed=31))
    with pytest.raises(ValueError, match="rows % 16"):
        pack_q6k(Q6KWeights(q.q[:8], q.sc[:8], q.d[:8]))
    with pytest.raises(ValueError, match="not a Q6_K matrix"):
        parse_q6k(np.zeros(100, np.uint8), 16, 256)


@pytest.mark.parametrize(("n", "k"), [(16, 256), (48, 512), (32, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q6k_linear_matches_the_torch_reference(lib: ctypes.CDLL, n: int, k: int,
                                                with_bias: bool) -> None:
    """Group-quantized int8 activations times the Q6_K weights (plus bias): pack_q6k's layout
    of the low and top bits, the signed scales and the -32 offset, together."""
    weights = quantize_q6k(random_weights(n, k, seed=32))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(33)) if with_bias else None
    layer = Q6KLinear.from_weights(weights, bias, lib)
    assert (layer.in_features, layer.out_features) == (k, n)
    x = random_inputs(5, k, seed=34)
    assert_matches_reference(layer(x), reference(x, weights, bias))


def test_q6k_rows_do_not_depend_on_the_batch_or_threads(lib: ctypes.CDLL) -> None:
    """As for Q4_K: each row of an M-row call, M = 1..20, is bit for bit that row alone, with
    one thread or two."""
    layer = Q6KLinear.from_weights(quantize_q6k(random_weights(48, 512, seed=35)), None, lib)
    x = random_inputs(20, 512, seed=36)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    for m in range(1, 21):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)
