"""Every kernel variant this machine runs against the portable build, bit for bit (as ggml's
test-quantize-fns checks each SIMD path against its scalar reference).

The variants promise the same bits (``kernels.h``: the same float operations per lane, fused
only where the code says so, the same reduction trees, roundings and exp polynomial), so the
served model is the same model on every machine. Checked on random inputs of many shapes: the
products for 1..17 rows (around every variant's rows per pass) and widths with a partial Q4_K
super-block, rows of zeros, NaN, infinities and subnormals; attention over many starts,
lengths, GQA ratios and head sizes; the whole decoder stack of a tiny model.
"""

from __future__ import annotations

import copy
import ctypes
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MAX_POSITIONS, VOCAB, tiny_config
from kernel_helpers import (
    attention_inputs,
    kernel_cache,
    kernel_lib,
    random_inputs,
    random_weights,
    same_bits,
)
from transformers import AutoModelForCausalLM, Qwen3Config

from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.kernels import (
    VARIANTS,
    KernelUnavailable,
    RowAttention,
    cpu_features,
    load_kernels,
    quantize_q3m,
    quantize_q4_0,
    quantize_q4k,
    quantize_q5k,
    quantize_q6k,
    quantize_q8_0,
    runnable_variants,
)
from localspec.runtime.kernels.library import SOURCE_DIR, find_compiler
from localspec.runtime.quant import (
    Q3MLinear,
    Q4_0Linear,
    Q4KLinear,
    Q5KLinear,
    Q6KLinear,
    Q8_0Linear,
)
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import export_weights


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return kernel_lib(tmp_path_factory, "portable")


@pytest.fixture(scope="module", params=[name for name in VARIANTS if name != "portable"])
def simd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> ctypes.CDLL:
    """Each SIMD variant this CPU runs (one it cannot run, or that this compiler cannot build,
    is not served here either: the served kernels are tested in test_kernels.py)."""
    name = request.param
    if name not in runnable_variants(cpu_features()):
        pytest.skip(f"this CPU cannot run the {name} kernels")
    try:
        return load_kernels(kernel_cache(tmp_path_factory), name)
    except KernelUnavailable as exc:
        pytest.skip(f"the {name} kernels do not build here: {exc}")


def _awkward_rows(k: int) -> torch.Tensor:
    """Rows that take every special path of the activation quantizer: zeros, NaN (rounds to
    -127), +-inf (a zero scale, then inf * 0), subnormals (127 / amax overflows to inf),
    values near float32's top, a single nonzero, negative zero."""
    rows = random_inputs(9, k, seed=k)
    rows[0] = 0.0
    rows[1, ::7] = float("nan")
    rows[2, 3] = float("inf")
    rows[3, 40] = float("-inf")
    rows[4] = torch.randn(k, generator=torch.Generator().manual_seed(1)) * 1e-42
    rows[5] = rows[5].sign() * 3e38
    rows[6] = 0.0
    rows[6, k // 2] = -2.5
    rows[7] = -0.0
    rows[8, : k // 2] = float("nan")
    return rows


@pytest.mark.parametrize(("layer", "quantize", "k"),
                         [(Q4KLinear, quantize_q4k, 256), (Q4KLinear, quantize_q4k, 896),
                          (Q4KLinear, quantize_q4k, 1536), (Q3MLinear, quantize_q3m, 896),
                          (Q3MLinear, quantize_q3m, 1536), (Q6KLinear, quantize_q6k, 256),
                          (Q6KLinear, quantize_q6k, 1536), (Q5KLinear, quantize_q5k, 896),
                          (Q5KLinear, quantize_q5k, 1536), (Q8_0Linear, quantize_q8_0, 96),
                          (Q8_0Linear, quantize_q8_0, 1536), (Q4_0Linear, quantize_q4_0, 96),
                          (Q4_0Linear, quantize_q4_0, 1536)],
                         ids=["q4k-256", "q4k-896", "q4k-1536", "q3m-896", "q3m-1536", "q6k-256",
                              "q6k-1536", "q5k-896", "q5k-1536", "q8_0-96", "q8_0-1536", "q4_0-96",
                              "q4_0-1536"])
def test_products_equal_the_portable_build(simd: ctypes.CDLL, portable: ctypes.CDLL,
                                           layer: type[Q4KLinear], quantize: object,
                                           k: int) -> None:
    """Q4_K, Q3_M, Q6_K, Q5_K, Q8_0 and Q4_0 products of 1..17 rows (every row count around 4 and 8
    rows per pass), plain and awkward rows: the same bits from the SIMD variant and the
    portable build."""
    w = quantize(random_weights(48, k, seed=k + 1))  # type: ignore[operator]
    fast, reference = layer.from_weights(w, None, simd), layer.from_weights(w, None, portable)
    x = random_inputs(17, k, seed=k + 2)
    for rows in range(1, 18):
        assert torch.equal(fast(x[:rows]), reference(x[:rows])), rows
    awkward = _awkward_rows(k)
    ours, theirs = fast(awkward), reference(awkward)
    assert same_bits(ours, theirs)
    assert torch.isfinite(ours[[0, 1, 4, 6, 7, 8]]).all()  # NaN inputs give finite outputs
    assert torch.equal(ours[0], torch.zeros(48)) and torch.equal(ours[7], torch.zeros(48))


@pytest.mark.parametrize(("heads", "kv_heads", "d"),
                         [(12, 2, 128), (14, 2, 64), (4, 4, 32), (16, 1, 256), (6, 3, 96)])
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["soft", "peaked"])
def test_attention_equals_the_portable_build(simd: ctypes.CDLL, portable: ctypes.CDLL,
                                             heads: int, kv_heads: int, d: int,
                                             spread: float) -> None:
    """Attention over many starts and lengths (around the 16-key blocks), GQA ratios 1..16
    and head sizes 32..256, soft and peaked scores (exp's flush to zero): the same bits."""
    q, keys, values = attention_inputs(heads, kv_heads, d, capacity=160, n=17, seed=d + heads,
                                       spread=spread)
    fast = RowAttention(simd, heads, kv_heads, d, d ** -0.5)
    reference = RowAttention(portable, heads, kv_heads, d, d ** -0.5)
    for start, n in ((0, 1), (0, 17), (1, 16), (15, 2), (16, 1), (31, 17), (100, 5),
                     (143, 17)):
        ours = fast(q[:, :n], keys, values, start)
        assert torch.isfinite(ours).all()
        assert torch.equal(ours, reference(q[:, :n], keys, values, start)), (start, n)


def test_tree_attention_equals_the_portable_build(simd: ctypes.CDLL,
                                                  portable: ctypes.CDLL) -> None:
    """Tree attention (rows over their root paths, gathered past the last whole block of 16):
    the same bits as the portable build, for several trees, starts and head shapes."""
    for heads, kv_heads, d in ((12, 2, 128), (6, 3, 96), (16, 1, 256)):
        q, keys, values = attention_inputs(heads, kv_heads, d, capacity=96, n=11, seed=heads)
        fast = RowAttention(simd, heads, kv_heads, d, d ** -0.5)
        reference = RowAttention(portable, heads, kv_heads, d, d ** -0.5)
        for seed, start in enumerate((0, 7, 16, 33, 80)):
            generator = torch.Generator().manual_seed(seed)
            parents = torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=generator))
                                           for j in range(1, 11)])
            ours = fast(q, keys, values, start, parents)
            assert torch.isfinite(ours).all()
            assert torch.equal(ours, reference(q, keys, values, start, parents)), (d, start)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_decoder_stack_equals_the_portable_build(simd: ctypes.CDLL, portable: ctypes.CDLL,
                                                 architecture: str) -> None:
    """The whole native stack (products, attention, norms, RoPE, SwiGLU, cache writes; Qwen3's
    per-head q/k norms) of a tiny w4a8 model with EAGLE features: the same logits and
    features, bit for bit, over a prompt and one-token steps."""
    config = tiny_config() if architecture == "qwen2" else Qwen3Config(
        vocab_size=VOCAB, num_hidden_layers=2, num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS, head_dim=64)  # q: 4 x 64 over hidden 128
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 128, 128, 4
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokens = torch.randint(0, config.vocab_size, (30,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    results = []
    for lib in (simd, portable):
        taken = copy.deepcopy(model).to(torch.bfloat16)
        decoder = CpuDecoder(taken, "requant-q4k", export_weights(taken, "requant-q4k", None),
                             lib)
        assert decoder.native is not None
        runner = ModelRunner(taken, decoder=decoder)
        runner.record_features((0, 1))
        logits = torch.cat([runner.forward(tokens[:20])] +
                           [runner.forward([t]) for t in tokens[20:]])
        results.append((logits, runner.features(0, 30).clone()))
    (logits, features), (expected_logits, expected_features) = results
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, expected_logits)
    assert torch.equal(features, expected_features)


_FMA_HARNESS = """#include "vec16.h"
void fma32_many(const float *a, const float *b, const float *c, float *out, long n) {
    for (long i = 0; i < n; i++) out[i] = fma32(a[i], b[i], c[i]);
}
"""


def _fma32(tmp_path: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """vec16.h's fma32 built with ``flags`` (without -mfma on x86: its inline emulation)."""
    (tmp_path / "harness.c").write_text(_FMA_HARNESS)
    out = tmp_path / f"fma32{len(flags)}.so"
    subprocess.run([find_compiler().path, "-O2", "-std=c11", "-ffp-contract=off", "-shared",
                    "-fPIC", *flags, f"-I{SOURCE_DIR}", str(tmp_path / "harness.c"), "-o",
                    str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.fma32_many.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long]
    return lib


def _run_fma(lib: ctypes.CDLL, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    lib.fma32_many(a.ctypes.data, b.ctypes.data, c.ctypes.data, out.ctypes.data, a.size)
    return out


def _rounded_fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to the nearest float32, ties to even (exact rationals; unlike
    float32(float(...)), which rounds twice). An exact zero takes IEEE's sign: -0 only from
    -0 + -0."""
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if x == 0:
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    guess = np.float32(float(x))
    around = [np.nextafter(guess, np.float32(-np.inf)), guess,
              np.nextafter(guess, np.float32(np.inf))]
    return min(around, key=lambda f: (abs(Fraction(float(f)) - x),
                                      int(np.array(f).view(np.int32)) & 1))


def _hard_fma_cases(count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """a * b + c landing within 2^-60 of a midpoint between two floats, from either side (where
    rounding to double first, then to float, picks the wrong one), scaled and signed at random."""
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 300, count).astype(np.float64)
    c = 1.0 + rng.integers(0, 2**23, count) * 2.0**-23  # both parities of the last bit
    side = rng.choice([-1.0, 1.0], count)
    a = side * 2.0**-24 * (1 + k * 2.0**-23)  # a * b = +-(half an ulp of c) * (1 - k^2 2^-46)
    b = 1 - k * 2.0**-23
    scale = 2.0 ** rng.integers(-60, 60, count) * rng.choice([-1.0, 1.0], count)
    return ((a * scale).astype(np.float32), b.astype(np.float32), (c * scale).astype(np.float32))


def test_fma32_rounds_once(tmp_path: Path) -> None:
    """The portable build's fused multiply-add (an exact emulation where the CPU target has no
    FMA) rounds a * b + c once, to nearest even, exactly as an FMA instruction: near-midpoint
    cases that a double-rounded sum gets wrong, random values, signed zeros, subnormals;
    and, where this CPU has FMA, the same bits as the instruction on a million more."""
    emulated = _fma32(tmp_path, ())
    a, b, c = _hard_fma_cases(3000, seed=1)
    rng = np.random.default_rng(2)
    wide = (rng.standard_normal((3, 3000)) * 2.0 ** rng.integers(-40, 40, (3, 3000))
            ).astype(np.float32)
    special = np.array([[-0.0, 1.0, 0.0], [-0.0, 1.0, -0.0], [1e-30, 1e-30, 0.0],
                        [1e-20, 1e-20, -1e-40], [3.0, 1.0 / 3.0, -1.0], [0.0, 0.0, -0.0]],
                       np.float32).T
    a, b, c = (np.concatenate(parts) for parts in zip((a, b, c), wide, special, strict=True))
    naive = (a.astype(np.float64) * b + c).astype(np.float32)
    expected = np.array([_rounded_fma(x, y, z) for x, y, z in zip(a, b, c, strict=True)])
    got = _run_fma(emulated, a, b, c)
    assert np.array_equal(got.view(np.int32), expected.view(np.int32))
    assert not np.array_equal(naive.view(np.int32), expected.view(np.int32))  # cases bite
    if "fma3" in cpu_features():
        hardware = _fma32(tmp_path, ("-mfma",))
        many = (rng.standard_normal((3, 1_000_000)) * 2.0 ** rng.integers(-30, 30, (3, 1))
                ).astype(np.float32)
        hard = _hard_fma_cases(200_000, seed=3)
        for x, y, z in (many, hard):
            assert np.array_equal(_run_fma(emulated, x, y, z).view(np.int32),
                                  _run_fma(hardware, x, y, z).view(np.int32))
