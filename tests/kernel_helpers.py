"""What the native kernel tests share: building the library once per session, random weights
and inputs, the torch references the kernels are checked against, and bit comparison.

``kernel_lib`` never skips: where the best SIMD variant cannot be built, ``load_kernels`` falls
back to the portable build, and only when that fails too does the test fail, with the
compiler's message. A CI without AVX2 (or on ARM, or a Mac) therefore tests the kernels it
serves instead of passing while testing nothing.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from localspec.runtime.kernels import GROUP, SUPER, KernelUnavailable, KQuantWeights, load_kernels
from localspec.runtime.kernels.kquant_formats import Q5KWeights


def kernel_cache(factory: pytest.TempPathFactory) -> Path:
    """One kernel cache for the whole session: each variant is compiled once."""
    return factory.getbasetemp() / "kernel-cache"


def kernel_lib(factory: pytest.TempPathFactory, variant: str | None = None) -> ctypes.CDLL:
    """The kernels the product would load here (``variant`` None, LOCALSPEC_KERNELS respected)
    or ``variant``'s; a failure to build is a test failure, never a skip."""
    try:
        return load_kernels(kernel_cache(factory), variant)
    except KernelUnavailable as exc:
        pytest.fail(f"no kernel variant builds here, not even the portable one: {exc}")


def random_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Random normal weights whose rows have different ranges (so per-block scales matter)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=generator)
            * (0.1 + torch.rand(n, 1, generator=generator)))


def random_inputs(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=generator)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations the kernel really multiplies, dequantized: per group of 32, int8 with
    scale amax / 127, rounded half to even and clamped to ±127; an all-zero group is zeros.
    Computed as x * (127 / amax), as the kernel does, so that no value lands on the other side
    of a rounding tie than in the kernel."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(groups * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).view(m, k)


def reference(x: torch.Tensor, w: KQuantWeights,
              bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float32 torch (up to the order of the float sums)."""
    y = quantize_activations(x) @ w.dequantize().T
    return y if bias is None else y + bias


def assert_matches_reference(y: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 summation order: 1e-4 of the output's magnitude."""
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    scale = float(expected.abs().max())
    torch.testing.assert_close(y, expected, rtol=0.0, atol=1e-4 * scale)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal, signed zeros included; NaNs must sit at the same places, whatever
    their payloads (IEEE leaves which NaN an operation returns to the hardware)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def attention_inputs(heads: int, kv_heads: int, d: int, capacity: int, n: int, seed: int,
                     spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [heads, n, d] float32, keys and values [kv_heads, capacity, d] bf16."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, d, generator=generator) * spread
    keys = torch.randn(kv_heads, capacity, d, generator=generator).bfloat16()
    values = torch.randn(kv_heads, capacity, d, generator=generator).bfloat16()
    return q, keys, values


def attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                        scale: float) -> torch.Tensor:
    """Causal attention in float64 over the same bf16 keys and values: [n, heads * d]."""
    heads, n, d = q.shape
    shared = heads // keys.shape[0]
    k = keys.double().repeat_interleave(shared, 0)[:, :start + n]
    v = values.double().repeat_interleave(shared, 0)[:, :start + n]
    scores = q.double() @ k.transpose(1, 2) * scale  # [heads, n, start + n]
    visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    attention = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (attention @ v).transpose(0, 1).reshape(n, heads * d)


def q5k_bytes(w: Q5KWeights) -> np.ndarray:
    """GGUF Q5_K bytes [n, k/256 * 176] of ``w`` (k % 256 == 0): ``parse_q5k``'s inverse,
    written from ggml's block layout (``block_q5_K``, ``get_scale_min_k4``) so that gguf-py
    can check what the parser reads."""
    n, k = w.q.shape
    supers = k // SUPER
    sc = w.sc.numpy().reshape(n, supers, 8)
    mn = w.mn.numpy().reshape(n, supers, 8)
    scales = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], axis=-1)
    q = w.q.numpy().reshape(n, supers, 8, 32)  # element 32 i + l
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).sum(2, dtype=np.uint8)
    low = (q & 0xF).reshape(n, supers, 4, 2, 32)  # chunk c: elements 64 c + 32 h + l
    qs = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(n, supers, 128)
    halves = [t.numpy().astype(np.float16).view(np.uint8).reshape(n, supers, 2)
              for t in (w.d, w.dmin)]
    return np.concatenate([*halves, scales.astype(np.uint8), qh, qs], axis=-1).reshape(n, -1)
