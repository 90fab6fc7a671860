"""The GGUF Q8_0 and Q4_0 weight formats on the Python side (ggml's "legacy" types: one fp16
scale per block of 32 inputs, no super-block): matrices read from a file (``parse_q8_0``,
``parse_q4_0``), made from float weights for tests (``quantize_q8_0``, ``quantize_q4_0``, the
rule gguf-py and ggml use), and packed into the layout the native kernels read (``pack_q8_0``,
``pack_q4_0``; ``Q8Group`` and ``Q4KGroup`` in ``kernels.h``). Also ``KQuantWeights``: every
form a GGUF matrix is served in natively. No native code runs here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from localspec.runtime.kernels.kquant_formats import (
    BLOCK_ROWS,
    GROUP,
    Q3MWeights,
    Q4KWeights,
    Q5KWeights,
    Q6KWeights,
    pack_nibbles,
    rows_last,
)

Q8_0_PACKED = ("qs8", "d")  # the kernel's tensors, in its argument order
Q8_0_BLOCK_BYTES = 34  # d (fp16), 32 int8
Q4_0_PACKED = ("qs4", "d")
Q4_0_BLOCK_BYTES = 18  # d (fp16), 16 bytes: byte j holds q[j] (low nibble) and q[j + 16]


@dataclass(frozen=True)
class Q8_0Weights:
    """One matrix [n, k] in Q8_0 form: q [n, k] int8 and d [n, k/32] float32 (fp16 values);
    w = d * q."""

    q: torch.Tensor
    d: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] (exact: an fp16 times an int8 fits float32)."""
        n, k = self.q.shape
        return (self.q.float().view(n, k // GROUP, GROUP) * self.d[..., None]).view(n, k)


@dataclass(frozen=True)
class Q4_0Weights:
    """One matrix [n, k] in Q4_0 form: q (0..15) [n, k] uint8 and d [n, k/32] float32;
    w = d * (q - 8)."""

    q: torch.Tensor
    d: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] (exact)."""
        n, k = self.q.shape
        q = (self.q.to(torch.int16) - 8).float().view(n, k // GROUP, GROUP)
        return (self.d[..., None] * q).view(n, k)


# Every form a matrix is served in by the native kernels (a GGUF's types, and Q3_M).
KQuantWeights = Q4KWeights | Q5KWeights | Q6KWeights | Q8_0Weights | Q4_0Weights | Q3MWeights


def _blocks(raw: np.ndarray, n: int, k: int, size: int, what: str) -> np.ndarray:
    if k % GROUP or raw.size != n * (k // GROUP) * size:
        raise ValueError(f"{raw.size} bytes are not a {what} matrix of {n} x {k}")
    return np.ascontiguousarray(raw).reshape(n, k // GROUP, size)


def _scales(blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))


def parse_q8_0(raw: np.ndarray, n: int, k: int) -> Q8_0Weights:
    """GGUF Q8_0 bytes of an [n, k] matrix (k % 32 == 0) as ``Q8_0Weights``."""
    blocks = _blocks(raw, n, k, Q8_0_BLOCK_BYTES, "Q8_0")
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Q8_0Weights(torch.from_numpy(q), _scales(blocks))


def parse_q4_0(raw: np.ndarray, n: int, k: int) -> Q4_0Weights:
    """GGUF Q4_0 bytes of an [n, k] matrix as ``Q4_0Weights`` (ggml's ``dequantize_row_q4_0``:
    byte j of a block holds element j in its low nibble, j + 16 in its high one)."""
    blocks = _blocks(raw, n, k, Q4_0_BLOCK_BYTES, "Q4_0")
    qs = blocks[..., 2:].reshape(n, k // GROUP, 1, 16)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, k)
    return Q4_0Weights(torch.from_numpy(q), _scales(blocks))


def _check(n: int, k: int, what: str) -> None:
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"a {what} kernel matrix needs rows % 16 == 0 and width % 32 == 0, "
                         f"got {n} x {k}")


def pack_q8_0(w: Q8_0Weights) -> dict[str, torch.Tensor]:
    """The kernel's layout (``Q8Group``): operand o of a group holds q[r][4 o + j] + 128 at
    byte 4 r + j; d [n/16, k/32, 16]."""
    n, k = w.q.shape
    _check(n, k, "Q8_0")
    b, g = n // BLOCK_ROWS, k // GROUP
    q = (w.q.to(torch.int16) + 128).to(torch.uint8).view(b, BLOCK_ROWS, g, 8, 4)
    return {"qs8": q.permute(0, 2, 3, 1, 4).contiguous().view(-1), "d": rows_last(w.d.float())}


def pack_q4_0(w: Q4_0Weights) -> dict[str, torch.Tensor]:
    """The kernel's layout: Q4_K's nibbles (``Q4KGroup``), d [n/16, k/32, 16]."""
    n, k = w.q.shape
    _check(n, k, "Q4_0")
    return {"qs4": pack_nibbles(w.q).view(-1), "d": rows_last(w.d.float())}


def quantize_q8_0(weight: torch.Tensor) -> Q8_0Weights:
    """Q8_0 weights of a float matrix [n, k] (k % 32 == 0) by ggml's rule: d = amax / 127 (then
    fp16), q = w * (1 / d) rounded half away from zero (C's roundf). For tests."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    d = w.abs().amax(-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d.clamp(min=1e-30), 0.0)
    scaled = w * inverse[..., None]
    whole = scaled.abs().floor()  # then + 1 where the fraction is >= 0.5, exactly
    q = (scaled.sign() * (whole + torch.floor(2.0 * (scaled.abs() - whole)))).clamp(-127, 127)
    return Q8_0Weights(q.to(torch.int8).view(n, k), d.half().float())


def quantize_q4_0(weight: torch.Tensor) -> Q4_0Weights:
    """Q4_0 weights of a float matrix [n, k] (k % 32 == 0) by ggml's rule: d = (the value of
    largest magnitude) / -8 (then fp16), q = trunc(w / d + 8.5) clamped to 0..15. For tests, and
    for a draft's cut LM head (``weight_formats.cut_linear``)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]
    d = extreme / -8.0
    inverse = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.trunc(w * inverse[..., None] + 8.5).clamp(0, 15)
    return Q4_0Weights(q.to(torch.uint8).view(n, k), d.half().float())
