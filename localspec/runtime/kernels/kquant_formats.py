"""The GGUF Q4_K and Q6_K weight formats on the Python side: matrices read from a file
(``parse_q4k``, ``parse_q6k``), made from float weights (``quantize_q4k`` for models that do not
come as Q4_K, ``quantize_q6k`` for tests), and packed into the layout the native kernels read
(``pack_q4k``, ``pack_q6k``; see ``kernels.h`` for both layouts, whose sizes the loader checks
against the constants here). No native code runs here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

BLOCK_ROWS = 16  # output rows interleaved per block
GROUP = 32  # inputs per (scale, min) pair
SUPER = 256  # inputs per (d, dmin) pair: one Q4_K block
Q4K_PACKED = ("qs", "sc", "mn", "d", "dmin")  # the kernel's tensors, in its argument order
Q4K_BLOCK_BYTES = 144  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
Q6K_PACKED = ("qs", "qh", "sc", "d")
Q6K_GROUP = 16  # inputs per signed 8-bit scale
Q6K_BLOCK_BYTES = 210  # 128 bytes of low nibbles, 64 of top 2 bits, 16 int8 scales, d (fp16)


@dataclass(frozen=True)
class Q4KWeights:
    """One matrix [n, k] in Q4_K form: q (0..15) [n, k] uint8, sc and mn [n, k/32] uint8,
    d and dmin [n, ceil(k/256)] float32; w = d * sc * q - dmin * mn. A GGUF file's k is a
    multiple of 256; a requantized matrix's may end in a partial super-block (k % 32 == 0)."""

    q: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] (exact: every product is representable in float32)."""
        n, k = self.q.shape
        scale = self.d.repeat_interleave(SUPER // GROUP, 1)[:, :k // GROUP] * self.sc.float()
        low = self.dmin.repeat_interleave(SUPER // GROUP, 1)[:, :k // GROUP] * self.mn.float()
        q = self.q.float().view(n, k // GROUP, GROUP)
        return (q * scale[..., None] - low[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Q4KWeights]) -> Q4KWeights:
        """Rows of several matrices of the same width, one under the other (fused layers)."""
        return Q4KWeights(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("q", "sc", "mn", "d", "dmin")))


def parse_q4k(raw: np.ndarray, n: int, k: int) -> Q4KWeights:
    """GGUF Q4_K bytes of an [n, k] matrix (row-major, k % 256 == 0) as ``Q4KWeights``;
    decoding follows ggml's ``dequantize_row_q4_K`` and ``get_scale_min_k4``."""
    if k % SUPER or raw.size != n * (k // SUPER) * Q4K_BLOCK_BYTES:
        raise ValueError(f"{raw.size} bytes are not a Q4_K matrix of {n} x {k}")
    blocks = np.ascontiguousarray(raw).reshape(n, k // SUPER, Q4K_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16].astype(np.uint8)
    sc = np.empty((n, k // SUPER, 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:].reshape(n, k // SUPER, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=3)  # [n, S, chunk, low/high, 32]
    return Q4KWeights(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(sc.reshape(n, -1)),
                      torch.from_numpy(mn.reshape(n, -1)), torch.from_numpy(d),
                      torch.from_numpy(dmin))


def pack_q4k(w: Q4KWeights) -> dict[str, torch.Tensor]:
    """The kernel's layout (``Q4KGroup`` in kernels.h): rows in blocks of 16, two nibbles a
    byte."""
    n, k = w.q.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"a Q4_K kernel matrix needs rows % 16 == 0 and width % 32 == 0, "
                         f"got {n} x {k}")
    b, g = n // BLOCK_ROWS, k // GROUP
    q = w.q.view(b, BLOCK_ROWS, g, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # b g i r h j
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).contiguous().view(-1)

    def rows_last(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, BLOCK_ROWS, -1).transpose(1, 2).contiguous()

    return {"qs": qs, "sc": rows_last(w.sc), "mn": rows_last(w.mn),
            "d": rows_last(w.d.float()), "dmin": rows_last(w.dmin.float())}


def quantize_q4k(weight: torch.Tensor) -> Q4KWeights:
    """Q4_K weights of a float matrix [n, k] (k % 32 == 0), as llama.cpp's simplest
    quantizer makes them: per group of 32, w ~ scale * q - low with q in 0..15 and low >= 0,
    scales and lows as 6-bit multiples of a per-256 ``d`` and ``dmin`` (fp16, as in the file).
    For models that do not come as Q4_K (a draft) and for tests."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q4_K needs a width divisible by {GROUP}, got {k}")
    groups, per = k // GROUP, SUPER // GROUP
    w = weight.detach().float().view(n, groups, GROUP)
    low = (-w.amin(-1)).clamp(min=0.0)  # [n, G]
    scale = (w.amax(-1) + low) / 15.0
    pad = -groups % per  # a partial last super-block: padded with zero scales

    def per_super(t: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.pad(t, (0, pad)).view(n, -1, per).amax(-1) / 63.0
                ).half().float()

    d, dmin = per_super(scale), per_super(low)
    d_g = d.repeat_interleave(per, 1)[:, :groups]
    dmin_g = dmin.repeat_interleave(per, 1)[:, :groups]
    sc = torch.where(d_g > 0, torch.round(scale / d_g.clamp(min=1e-30)), 0).clamp(0, 63)
    mn = torch.where(dmin_g > 0, torch.round(low / dmin_g.clamp(min=1e-30)), 0).clamp(0, 63)
    step = (d_g * sc)[..., None]
    q = torch.where(step > 0, torch.round((w + (dmin_g * mn)[..., None]) / step.clamp(min=1e-30)),
                    0).clamp(0, 15)
    return Q4KWeights(q.to(torch.uint8).view(n, k), sc.to(torch.uint8), mn.to(torch.uint8), d,
                      dmin)


@dataclass(frozen=True)
class Q6KWeights:
    """One matrix [n, k] in Q6_K form: q (0..63) [n, k] uint8, sc [n, k/16] int8 and d
    [n, k/256] float32; w = d * sc * (q - 32). Only read from files (k % 256 == 0)."""

    q: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k], computed as gguf-py does ((d * sc) * (q - 32)), so that
        the same file gives the same floats."""
        n, k = self.q.shape
        scale = self.d.repeat_interleave(SUPER // Q6K_GROUP, 1) * self.sc.float()
        q = (self.q.to(torch.int16) - 32).float().view(n, k // Q6K_GROUP, Q6K_GROUP)
        return (scale[..., None] * q).view(n, k)

    @staticmethod
    def cat(parts: list[Q6KWeights]) -> Q6KWeights:
        return Q6KWeights(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "sc", "d")))


KQuantWeights = Q4KWeights | Q6KWeights  # what a GGUF's k-quant matrix is read as


def parse_q6k(raw: np.ndarray, n: int, k: int) -> Q6KWeights:
    """GGUF Q6_K bytes of an [n, k] matrix as ``Q6KWeights``; decoding follows ggml's
    ``dequantize_row_q6_K``: per half of 128, byte l of ``ql`` holds elements l and l + 64
    (l + 32 and l + 96 for the next 32 bytes), byte l of ``qh`` their top bits."""
    if k % SUPER or raw.size != n * (k // SUPER) * Q6K_BLOCK_BYTES:
        raise ValueError(f"{raw.size} bytes are not a Q6_K matrix of {n} x {k}")
    blocks = np.ascontiguousarray(raw).reshape(n, k // SUPER, Q6K_BLOCK_BYTES)
    ql = blocks[..., :128].reshape(n, -1, 2, 2, 32)  # [n, S, half, l or l + 32, 32]
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=3)  # [n, S, half, 4, 32]: 32 elements each
    top = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = (low | (top << 4)).reshape(n, k)
    sc = blocks[..., 192:208].copy().view(np.int8).reshape(n, -1)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return Q6KWeights(torch.from_numpy(q), torch.from_numpy(sc), torch.from_numpy(d))


def pack_q6k(w: Q6KWeights) -> dict[str, torch.Tensor]:
    """The kernel's layout (``Q6KTop`` in kernels.h): Q4_K's nibble layout for the low 4 bits
    of q, the top 2 bits four to a byte."""
    n, k = w.q.shape
    if n % BLOCK_ROWS or k % SUPER:
        raise ValueError(f"a Q6_K kernel matrix needs rows % 16 == 0 and width % 256 == 0, "
                         f"got {n} x {k}")
    b, g = n // BLOCK_ROWS, k // GROUP
    q = w.q.view(b, BLOCK_ROWS, g, 2, 2, 2, 4).permute(0, 2, 3, 4, 1, 5, 6)  # b g t ii r s j
    low, top = q & 0xF, q >> 4
    qs = (low[..., 0, :] | (low[..., 1, :] << 4)).contiguous().view(-1)
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).view(1, 1, 1, 2, 1, 2, 1)
    qh = (top << shifts).sum((3, 5), dtype=torch.uint8).contiguous().view(-1)  # b g t r j

    def rows_last(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, BLOCK_ROWS, -1).transpose(1, 2).contiguous()

    return {"qs": qs, "qh": qh, "sc": rows_last(w.sc), "d": rows_last(w.d.float())}


def unpack_q6k(packed: Mapping[str, torch.Tensor]) -> Q6KWeights:
    """``pack_q6k``'s inverse (an LM head kept packed, asked for some of its rows)."""
    blocks, _, rows = packed["d"].shape
    groups = packed["qs"].numel() // (blocks * 256)
    qs = packed["qs"].view(blocks, groups, 2, 2, rows, 1, 4)  # b g t ii r s j
    low = torch.cat([qs & 0xF, qs >> 4], dim=5)
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).view(1, 1, 1, 2, 1, 2, 1)
    top = (packed["qh"].view(blocks, groups, 2, 1, rows, 1, 4) >> shifts) & 3
    q = (low | (top << 4)).permute(0, 4, 1, 2, 3, 5, 6).reshape(blocks * rows, groups * GROUP)

    def rows_first(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(blocks * rows, -1)

    return Q6KWeights(q, rows_first(packed["sc"]), rows_first(packed["d"]))


def quantize_q6k(weight: torch.Tensor) -> Q6KWeights:
    """Q6_K weights of a float matrix [n, k] (k % 256 == 0) by the simplest rule: per 16,
    w ~ step * (q - 32) with q in 0..63, steps as int8 multiples of a per-256 fp16 ``d``.
    For tests: LocalSpec serves Q6_K only as a file stores it."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // Q6K_GROUP, Q6K_GROUP)
    step = w.abs().amax(-1) / 31.0  # [n, k/16]
    d = (step.view(n, k // SUPER, -1).amax(-1) / 127.0).half().float()  # [n, k/256]
    d_g = d.repeat_interleave(SUPER // Q6K_GROUP, 1)
    sc = torch.where(d_g > 0, torch.round(step / d_g.clamp(min=1e-30)), 0).clamp(-127, 127)
    unit = (d_g * sc)[..., None]
    q = torch.where(unit != 0, torch.round(w / torch.where(unit != 0, unit, 1.0)), 0)
    return Q6KWeights((q.clamp(-32, 31) + 32).to(torch.uint8).view(n, k), sc.to(torch.int8), d)
