"""The native Q4_K and Q6_K kernels (``localspec.runtime.kernels``, ``lean.c``), ``Q4KLinear``
and ``Q6KLinear``.

What speculation needs from it: the product it computes is the documented one (Q4_K weights
times activations quantized to int8 per group of 32), and a row's output is bit for bit the same
whatever other rows share the call and however many threads run, so a verify pass computes
exactly what one-token steps compute. Shapes are small; CPUs without AVX-512 VNNI skip.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from localspec.runtime.kernels import (
    GROUP,
    KernelUnavailable,
    Q4KWeights,
    Q6KWeights,
    RowAttention,
    cpu_flags,
    load_kernels,
    pack_q4k,
    pack_q6k,
    parse_q4k,
    parse_q6k,
    pick_variant,
    quantize_q4k,
    quantize_q6k,
)
from localspec.runtime.quant import Q4KLinear, Q6KLinear

ROWS_PER_PASS = 8  # lean.c's ROWS_PER_PASS: batch sizes around and past it are the risky ones


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernel, built once for this module into a temporary cache (skip where it cannot run:
    no AVX-512 VNNI, no compiler)."""
    try:
        return load_kernels(tmp_path_factory.mktemp("kernels"))
    except KernelUnavailable as exc:
        pytest.skip(str(exc))


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Random normal weights whose rows have different ranges (so per-block scales matter)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=generator)
            * (0.1 + torch.rand(n, 1, generator=generator)))


def _inputs(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=generator)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations the kernel really multiplies, dequantized: per group of 32, int8 with
    scale amax / 127, rounded half to even and clamped to ±127; an all-zero group is zeros.
    Computed as x * (127 / amax), as lean.c does, so that no value lands on the other side of a
    rounding tie than in the kernel."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(groups * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).view(m, k)


def reference(x: torch.Tensor, weights: Q4KWeights | Q6KWeights,
              bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float32 torch (up to the order of the float sums)."""
    y = quantize_activations(x) @ weights.dequantize().T
    return y if bias is None else y + bias


def assert_matches_reference(y: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 summation order: 1e-4 of the output's magnitude."""
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    scale = float(expected.abs().max())
    torch.testing.assert_close(y, expected, rtol=0.0, atol=1e-4 * scale)


# ----------------------------------------------------------------------------- quantize / pack


@pytest.mark.parametrize(("n", "k"), [(48, 512), (16, 256), (32, 896)])
def test_quantize_q4k_round_trips_within_4_bit_error(n: int, k: int) -> None:
    """quantize_q4k's weights dequantize to the input within 4-bit error, with every field in
    its Q4_K range (q 4 bits, sc/mn 6 bits, d/dmin fp16 as the file stores them)."""
    w = _weights(n, k, seed=0)
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
    weights = quantize_q4k(_weights(n, k, seed=1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)) if with_bias else None
    layer = Q4KLinear.from_weights(weights, bias, lib)
    assert (layer.in_features, layer.out_features) == (k, n)
    x = _inputs(5, k, seed=3)
    assert_matches_reference(layer(x), reference(x, weights, bias))


def test_q4k_linear_casts_and_copies_its_input(lib: ctypes.CDLL) -> None:
    """A bfloat16 or non-contiguous input gives the float32 product of its float32 values."""
    weights = quantize_q4k(_weights(16, 256, seed=4))
    layer = Q4KLinear.from_weights(weights, None, lib)
    x = _inputs(256, 3, seed=5).T  # [3, 256], not contiguous
    assert not x.is_contiguous()
    assert torch.equal(layer(x), layer(x.contiguous()))
    xb = x.to(torch.bfloat16)
    assert torch.equal(layer(xb), layer(xb.float()))


def test_rows_do_not_depend_on_the_batch(lib: ctypes.CDLL) -> None:
    """Every row of an M-row call, M = 1..20 (past the kernel's 8 rows per pass), equals that row
    computed alone, bit for bit, and equals it again when the row sits at another position of a
    call of another size: a verify pass computes exactly what one-token steps compute."""
    weights = quantize_q4k(_weights(48, 512, seed=6))
    layer = Q4KLinear.from_weights(weights, torch.randn(48), lib)
    x = _inputs(20, 512, seed=7)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    for m in range(1, 21):
        batch = layer(x[:m])
        assert batch.shape == (m, 48)
        for i in range(m):
            assert torch.equal(batch[i], alone[i]), (m, i)
    for start in (1, 3, ROWS_PER_PASS - 1, ROWS_PER_PASS + 3):  # rows shift to other pass slots
        assert torch.equal(layer(x[start:]), alone[start:]), start
    assert_matches_reference(alone, reference(x, weights, layer.bias))


def test_rows_do_not_depend_on_the_thread_count(lib: ctypes.CDLL) -> None:
    """One thread or two (the kernel splits output blocks between them): the same bits."""
    weights = quantize_q4k(_weights(64, 512, seed=8))
    layer = Q4KLinear.from_weights(weights, None, lib)
    x = _inputs(ROWS_PER_PASS * 2 + 3, 512, seed=9)
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
    weights = quantize_q4k(_weights(32, 256, seed=10))
    bias = torch.randn(32) if with_bias else None
    layer = Q4KLinear.from_weights(weights, bias, lib)
    x = _inputs(3, 256, seed=11)
    x[1] = 0.0
    y = layer(x)
    assert torch.equal(y[1], bias if bias is not None else torch.zeros(32))
    assert torch.equal(y[0], layer(x[:1])[0])  # its neighbours are unaffected


def test_an_outlier_only_coarsens_its_own_group(lib: ctypes.CDLL) -> None:
    """One channel at 1e4 (Qwen's outlier activations): the output stays finite and matches the
    reference, and it differs from the outlier-free row's output only by what the outlier's
    group of 32 contributes. A per-row scale would flatten every other group too."""
    k, channel = 512, 100
    weights = quantize_q4k(_weights(48, k, seed=12))
    layer = Q4KLinear.from_weights(weights, None, lib)
    x = _inputs(1, k, seed=13)
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
    first, second = quantize_q4k(_weights(32, 512, seed=14)), quantize_q4k(_weights(48, 512, 15))
    fused = Q4KWeights.cat([first, second])
    assert torch.equal(fused.dequantize(), torch.cat([first.dequantize(), second.dequantize()]))
    x = _inputs(ROWS_PER_PASS + 2, 512, seed=16)
    parts = torch.cat([Q4KLinear.from_weights(first, None, lib)(x),
                       Q4KLinear.from_weights(second, None, lib)(x)], dim=1)
    assert torch.equal(Q4KLinear.from_weights(fused, None, lib)(x), parts)


# ----------------------------------------------------------------------------- building


def test_load_kernels_builds_once_per_cache(lib: ctypes.CDLL, tmp_path: Path) -> None:
    """The first load compiles into the cache (the .so and its digest, no temporary left
    over); the next one reuses it (a rebuild would replace the file: new inode and mtime); a
    damaged library is rebuilt, never loaded."""
    cache = tmp_path / "kernels"
    first = load_kernels(cache)
    built = sorted(cache.iterdir())
    assert [p.suffix for p in built] == [".so", ".sha256"], built
    library = built[0]
    before = library.stat()
    second = load_kernels(cache)
    after = library.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert sorted(cache.iterdir()) == built
    assert first.q4k_linear is not None and second.q4k_linear is not None

    # a damaged copy in a cache this process never loaded from (writing into a library that
    # is mapped would crash the process that mapped it, which is why builds replace files)
    other = tmp_path / "other"
    shutil.copytree(cache, other)
    damaged = other / library.name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    third = load_kernels(other)
    assert third.q4k_linear is not None
    assert damaged.read_bytes() != bytes(data)  # rebuilt, not loaded as it was


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


def test_load_kernels_in_an_unwritable_place_says_why(tmp_path: Path) -> None:
    """A cache that cannot take the library (here: a file where the folder should be) is
    KernelUnavailable with the reason, which callers turn into a w8a8 fallback."""
    blocker = tmp_path / "kernels"
    blocker.write_text("not a folder")
    with pytest.raises(KernelUnavailable):
        load_kernels(blocker)


def test_avx2_variant_gives_the_same_bits(lib: ctypes.CDLL, tmp_path: Path) -> None:
    """CPUs without AVX-512 VNNI (most laptops) run the AVX2 variant: the same integer sums
    and the same float operations on each lane, so the served model is the same model,
    bit for bit, whichever variant a machine builds."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU cannot run the AVX2 variant")
    avx2 = load_kernels(tmp_path / "avx2", variant="avx2")
    bias = torch.randn(48, generator=torch.Generator().manual_seed(22))
    for layer, weights, k in ((Q4KLinear, quantize_q4k(_weights(48, 896, seed=21)), 896),
                              (Q6KLinear, quantize_q6k(_weights(48, 768, seed=23)), 768)):
        for rows in (1, 3, 5, 9, 17):
            x = _inputs(rows, k, seed=rows)
            wide = layer.from_weights(weights, bias, lib)(x)
            narrow = layer.from_weights(weights, bias, avx2)(x)
            assert torch.equal(wide, narrow), (layer.__name__, rows)
    q, keys, values = _attention_inputs(12, 2, 128, capacity=256, n=9, seed=24)
    for start in (0, 37, 200):
        assert torch.equal(RowAttention(lib, 12, 2, 128, 0.088)(q, keys, values, start),
                           RowAttention(avx2, 12, 2, 128, 0.088)(q, keys, values, start))


# ----------------------------------------------------------------------------- attention


def _attention_inputs(heads: int, kv_heads: int, d: int, capacity: int, n: int, seed: int,
                      spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, d, generator=generator) * spread
    keys = torch.randn(kv_heads, capacity, d, generator=generator).bfloat16()
    values = torch.randn(kv_heads, capacity, d, generator=generator).bfloat16()
    return q, keys, values


def _attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                         scale: float) -> torch.Tensor:
    """Causal attention in float64 over the same bf16 keys and values: [n, heads * d]."""
    heads, n, d = q.shape
    shared = heads // keys.shape[0]
    k = keys.double().repeat_interleave(shared, 0)[:, :start + n]
    v = values.double().repeat_interleave(shared, 0)[:, :start + n]
    scores = q.double() @ k.transpose(1, 2) * scale  # [heads, n, start + n]
    visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1).reshape(n, heads * d)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(12, 2, 128), (14, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["soft", "peaked"])
def test_row_attention_matches_causal_attention(lib: ctypes.CDLL, heads: int, kv_heads: int,
                                                d: int, spread: float) -> None:
    """Each row attends over exactly the keys up to its own position (the Qwen2.5 1.5B's and
    0.5B's shapes, and heads without sharing), with float32 error only; peaked scores put
    most weights far below exp's range, which must give 0, never NaN."""
    scale = d ** -0.5
    q, keys, values = _attention_inputs(heads, kv_heads, d, capacity=320, n=21, seed=d,
                                        spread=spread)
    attention = RowAttention(lib, heads, kv_heads, d, scale)
    for start in (0, 5, 16, 290):
        out = attention(q, keys, values, start)
        expected = _attention_reference(q, keys, values, start, scale)
        assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5), start


def test_row_attention_rows_do_not_depend_on_the_batch(lib: ctypes.CDLL) -> None:
    """Row j of a call over n rows at ``start`` is bit for bit the one-row call at start + j,
    with 1 or 2 threads, around the 16-key blocks the kernel works in: what keeps a verify
    pass equal to one-token steps."""
    q, keys, values = _attention_inputs(12, 2, 128, capacity=256, n=20, seed=3)
    attention = RowAttention(lib, 12, 2, 128, 0.088)
    for start in (0, 11, 31, 200):
        rows = torch.cat([attention(q[:, j:j + 1], keys, values, start + j) for j in range(20)])
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(attention(q, keys, values, start), rows), (start, threads)
            finally:
                torch.set_num_threads(previous)


def test_row_attention_refuses_what_it_cannot_take(lib: ctypes.CDLL) -> None:
    """Positions past the cache are an error before the kernel could read past it; shapes
    outside its limits are not ``fits``."""
    q, keys, values = _attention_inputs(4, 2, 32, capacity=16, n=4, seed=1)
    with pytest.raises(ValueError, match="cache holds 16"):
        RowAttention(lib, 4, 2, 32, 0.2)(q, keys, values, start=13)
    assert RowAttention.fits(12, 2, 128, torch.bfloat16)
    assert not RowAttention.fits(12, 2, 128, torch.float32)  # the cache must be bf16
    assert not RowAttention.fits(4, 2, 8, torch.bfloat16)  # head_dim % 32
    assert not RowAttention.fits(40, 2, 64, torch.bfloat16)  # 20 heads share one


# ----------------------------------------------------------------------------- Q6_K


@pytest.mark.parametrize(("n", "k"), [(16, 256), (48, 512)])
def test_quantize_q6k_round_trips_within_6_bit_error(n: int, k: int) -> None:
    """quantize_q6k (for tests) gives fields in their Q6_K ranges that dequantize close to the
    input: the reference the kernel is checked against is a real Q6_K matrix."""
    w = _weights(n, k, seed=30)
    q = quantize_q6k(w)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 63
    assert q.sc.dtype == torch.int8 and q.sc.shape == (n, k // 16) and q.d.shape == (n, k // 256)
    assert torch.equal(q.d, q.d.half().float())
    error = (q.dequantize() - w).abs().amax(-1) / w.abs().amax(-1)
    assert float(error.max()) < 0.03


def test_pack_and_parse_q6k_refuse_wrong_shapes() -> None:
    q = quantize_q6k(_weights(16, 256, seed=31))
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
    weights = quantize_q6k(_weights(n, k, seed=32))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(33)) if with_bias else None
    layer = Q6KLinear.from_weights(weights, bias, lib)
    assert (layer.in_features, layer.out_features) == (k, n)
    x = _inputs(5, k, seed=34)
    assert_matches_reference(layer(x), reference(x, weights, bias))


def test_q6k_rows_do_not_depend_on_the_batch_or_threads(lib: ctypes.CDLL) -> None:
    """As for Q4_K: each row of an M-row call, M = 1..20, is bit for bit that row alone, with
    one thread or two."""
    layer = Q6KLinear.from_weights(quantize_q6k(_weights(48, 512, seed=35)), None, lib)
    x = _inputs(20, 512, seed=36)
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


def test_pick_variant() -> None:
    """The best variant a CPU has; neither is a KernelUnavailable that says so."""
    assert pick_variant({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma"}) == (
        "avx512")
    assert pick_variant({"avx2", "fma", "sse4_2"}) == "avx2"
    with pytest.raises(KernelUnavailable, match="AVX2"):
        pick_variant({"sse4_2"})
