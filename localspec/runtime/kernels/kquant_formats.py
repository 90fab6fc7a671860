"""The GGUF Q4_K, Q5_K and Q6_K weight formats on the Python side: matrices read from a file
(``parse_q4k``, ``parse_q5k``, ``parse_q6k``), made from float weights (``quantize_q4k`` for
models that do not come as Q4_K, ``quantize_q5k`` and ``quantize_q6k`` for tests), and packed
into the layout the native kernels read (``pack_q4k``, ``pack_q5k``, ``pack_q6k``; see
``kernels.h`` for the layouts, whose sizes the loader checks against the constants here).
Q3_M, LocalSpec's own 3-bit form for a draft's matrices (no GGUF type), is made only here
(``quantize_q3m``, ``pack_q3m``). Q8_0 and Q4_0 (one scale per 32) are in ``q32_formats``. No
native code runs here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TypeVar

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
Q5K_PACKED = ("qs5", "sc", "mn", "d", "dmin")  # qs5: the nibbles and fifth bits together
Q5K_BLOCK_BYTES = 176  # Q4_K's fields and 32 bytes of fifth bits before the nibbles
Q3M_PACKED = ("qs3", "sc", "mn", "d", "dmin")  # qs3: the low 2 bits and the third together
Q3M_FIT_STEPS = 20  # candidate scales per group tried by quantize_q3m (llama.cpp's make_qkx2)


W = TypeVar("W")


def cat_rows(parts: list[W]) -> W:
    """Several matrices of one form (``Q4KWeights``, ``Q8_0Weights``, ...) and the same width,
    one under the other (a fused layer): every field of theirs is rows first."""
    return type(parts[0])(*(torch.cat([getattr(p, f.name) for p in parts])
                            for f in fields(parts[0])))  # type: ignore[arg-type]


@dataclass(frozen=True)
class _ScalesAndMins:
    """The fields of Q4_K and its kin (Q5_K, Q3_M): q [n, k] uint8, sc and mn [n, k/32] uint8,
    d and dmin [n, ceil(k/256)] float32; w = d * sc * q - dmin * mn."""

    q: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] (exact: every product is representable in float32), as
        gguf-py computes it."""
        return _dequantize_k(self.q, self.sc, self.mn, self.d, self.dmin)


class Q4KWeights(_ScalesAndMins):
    """One matrix [n, k] in Q4_K form: q in 0..15, sc and mn in 0..63. A GGUF file's k is a
    multiple of 256; a requantized matrix's may end in a partial super-block (k % 32 == 0)."""


def _dequantize_k(q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor,
                  dmin: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's weights [n, k]: (d * sc) * q - dmin * mn per group, as gguf-py."""
    n, k = q.shape
    scale = d.repeat_interleave(SUPER // GROUP, 1)[:, :k // GROUP] * sc.float()
    low = dmin.repeat_interleave(SUPER // GROUP, 1)[:, :k // GROUP] * mn.float()
    return (q.float().view(n, k // GROUP, GROUP) * scale[..., None] - low[..., None]).view(n, k)


def _scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """d, dmin (float32 [n, S]) and the eight 6-bit scales and mins ([n, S, 8] each) of Q4_K
    or Q5_K blocks [n, S, bytes] (ggml's ``get_scale_min_k4``)."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16].astype(np.uint8)
    sc = np.empty((*blocks.shape[:2], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return d, dmin, sc, mn


def parse_q4k(raw: np.ndarray, n: int, k: int) -> Q4KWeights:
    """GGUF Q4_K bytes of an [n, k] matrix (row-major, k % 256 == 0) as ``Q4KWeights``;
    decoding follows ggml's ``dequantize_row_q4_K`` and ``get_scale_min_k4``."""
    if k % SUPER or raw.size != n * (k // SUPER) * Q4K_BLOCK_BYTES:
        raise ValueError(f"{raw.size} bytes are not a Q4_K matrix of {n} x {k}")
    blocks = np.ascontiguousarray(raw).reshape(n, k // SUPER, Q4K_BLOCK_BYTES)
    d, dmin, sc, mn = _scales_mins(blocks)
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
    return {"qs": pack_nibbles(w.q).view(-1), "sc": rows_last(w.sc), "mn": rows_last(w.mn),
            "d": rows_last(w.d.float()), "dmin": rows_last(w.dmin.float())}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """The low 4 bits of q [n, k] (uint8) as ``Q4KGroup``s: [n/16 * k/32, 256] uint8."""
    n, k = q.shape
    b, g = n // BLOCK_ROWS, k // GROUP
    q = (q & 0xF).view(b, BLOCK_ROWS, g, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # b g i r h j
    return (q[..., 0, :] | (q[..., 1, :] << 4)).contiguous().view(b * g, -1)


def rows_last(t: torch.Tensor) -> torch.Tensor:
    """A per-row field [n, F] as the kernels read it: [n/16, F, 16] (rows in blocks of 16)."""
    return t.view(t.shape[0] // BLOCK_ROWS, BLOCK_ROWS, -1).transpose(1, 2).contiguous()


def quantize_q4k(weight: torch.Tensor) -> Q4KWeights:
    """Q4_K weights of a float matrix [n, k] (k % 32 == 0), as llama.cpp's simplest
    quantizer makes them: per group of 32, w ~ scale * q - low with q in 0..15 and low >= 0,
    scales and lows as 6-bit multiples of a per-256 ``d`` and ``dmin`` (fp16, as in the file).
    For models that do not come as Q4_K (a draft) and for tests."""
    return Q4KWeights(*_quantize_k(weight, 15, "Q4_K"))


def _quantize_k(weight: torch.Tensor, top: int, what: str) -> tuple[torch.Tensor, ...]:
    """q (0..top), sc, mn, d, dmin of a float matrix by ``quantize_q4k``'s rule."""
    k = weight.shape[1]
    if k % GROUP:
        raise ValueError(f"{what} needs a width divisible by {GROUP}, got {k}")
    w = weight.detach().float().view(weight.shape[0], k // GROUP, GROUP)
    low = (-w.amin(-1)).clamp(min=0.0)  # [n, G]
    return _grid(weight, (w.amax(-1) + low) / float(top), low, top, 63)


class Q5KWeights(_ScalesAndMins):
    """One matrix [n, k] in Q5_K form: Q4_K's fields with q in 0..31 (a fifth bit)."""


def parse_q5k(raw: np.ndarray, n: int, k: int) -> Q5KWeights:
    """GGUF Q5_K bytes of an [n, k] matrix as ``Q5KWeights``; decoding follows ggml's
    ``dequantize_row_q5_K``: Q4_K's scales and nibbles, and bit i of ``qh`` byte l the fifth
    bit of element 32 i + l."""
    if k % SUPER or raw.size != n * (k // SUPER) * Q5K_BLOCK_BYTES:
        raise ValueError(f"{raw.size} bytes are not a Q5_K matrix of {n} x {k}")
    blocks = np.ascontiguousarray(raw).reshape(n, k // SUPER, Q5K_BLOCK_BYTES)
    d, dmin, sc, mn = _scales_mins(blocks)
    qh = blocks[..., 16:48].reshape(n, k // SUPER, 1, 32)
    top = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [n, S, 8, 32]
    qs = blocks[..., 48:].reshape(n, k // SUPER, 4, 1, 32)
    low = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(n, k // SUPER, 8, 32)
    return Q5KWeights(torch.from_numpy((low | (top << 4)).reshape(n, k)),
                      torch.from_numpy(sc.reshape(n, -1)), torch.from_numpy(mn.reshape(n, -1)),
                      torch.from_numpy(d), torch.from_numpy(dmin))


def pack_q5k(w: Q5KWeights) -> dict[str, torch.Tensor]:
    """The kernel's layout (``Q5KGroup`` in kernels.h): per group, Q4_K's nibbles, then the
    fifth bit of operand o (inputs 4 o .. 4 o + 3) at bit o of byte 4 r + j."""
    n, k = w.q.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"a Q5_K kernel matrix needs rows % 16 == 0 and width % 32 == 0, "
                         f"got {n} x {k}")
    b, g = n // BLOCK_ROWS, k // GROUP
    top = (w.q >> 4).view(b, BLOCK_ROWS, g, 8, 4).permute(0, 2, 3, 1, 4)  # b g o r j
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1, 1)
    bits = (top << shifts).sum(2, dtype=torch.uint8).view(b * g, 64)
    return {"qs5": torch.cat([pack_nibbles(w.q), bits], 1).view(-1), "sc": rows_last(w.sc),
            "mn": rows_last(w.mn), "d": rows_last(w.d.float()), "dmin": rows_last(w.dmin.float())}


class Q3MWeights(_ScalesAndMins):
    """One matrix [n, k] in Q3_M form: Q4_K's fields with q in 0..7 and sc, mn in 0..255."""


def quantize_q3m(weight: torch.Tensor, rows_at_a_time: int = 4096) -> Q3MWeights:
    """Q3_M weights of a float matrix [n, k] (k % 32 == 0). Three bits leave a coarse grid, so
    each group's (scale, low) is fitted rather than spanned from min to max: for
    ``Q3M_FIT_STEPS`` + 1 candidate scales around the span's, the group is rounded onto the
    grid and (scale, low) refit by least squares weighted by ``|w| + rms(w)`` (llama.cpp's
    ``make_qkx2_quants``), keeping the fit of least weighted error. Scales and lows are then
    8-bit multiples of a per-256 ``d`` and ``dmin``, as Q4_K's are 6-bit ones. On random
    matrices with outliers the relative error is 0.18 against the span's 0.21; what it does
    to the 0.5B draft's guesses is in docs/research-log.md ("A 3-bit draft")."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q3_M needs a width divisible by {GROUP}, got {k}")
    scale, low = torch.cat([
        torch.stack(_fit_groups(weight[r:r + rows_at_a_time].detach().float()
                                .reshape(-1, GROUP), 7))
        for r in range(0, n, rows_at_a_time)], 1).view(2, n, k // GROUP)
    return Q3MWeights(*_grid(weight, scale, low, 7, 255))


def _fit_groups(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [G, 32]: scale > 0 and low >= 0 with x ~ scale * q - low, q in 0..top
    (see ``quantize_q3m``). Each candidate's weighted error comes from its sums in closed
    form, so a candidate costs five passes over x."""
    weight = x.pow(2).mean(-1, keepdim=True).sqrt() + x.abs()
    lo = x.amin(-1, keepdim=True).clamp(max=0.0)
    span = (x.amax(-1, keepdim=True) - lo).clamp(min=1e-30)
    sw, swx = weight.sum(-1, keepdim=True), (weight * x).sum(-1, keepdim=True)
    swxx = (weight * x * x).sum(-1, keepdim=True)
    best_scale, best_low = span / top, -lo
    best_err = torch.full_like(lo, float("inf"))
    for step in range(Q3M_FIT_STEPS + 1):
        inverse = (top - 1 + 2 * step / Q3M_FIT_STEPS) / span
        q = torch.round((x - lo) * inverse).clamp_(0, top)
        wq = weight * q
        swq, swqq = wq.sum(-1, keepdim=True), (wq * q).sum(-1, keepdim=True)
        swqx = (wq * x).sum(-1, keepdim=True)
        det = sw * swqq - swq * swq
        scale = (sw * swqx - swx * swq) / det.clamp(min=1e-30)
        offset = (swqq * swx - swq * swqx) / det.clamp(min=1e-30)  # x ~ scale * q + offset
        above = offset > 0  # a low below 0: refit the scale with the low at 0
        scale = torch.where(above, swqx / swqq.clamp(min=1e-30), scale)
        offset = torch.where(above, torch.zeros_like(offset), offset)
        err = (scale * scale * swqq + offset * offset * sw + swxx + 2 * scale * offset * swq
               - 2 * scale * swqx - 2 * offset * swx)  # sum of weight * (scale q + offset - x)^2
        better = (err < best_err) & (det > 0) & (scale > 0)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_low = torch.where(better, -offset, best_low)
    return best_scale.squeeze(-1), best_low.squeeze(-1)


def _grid(weight: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, top: int,
          levels: int) -> tuple[torch.Tensor, ...]:
    """q (0..top), sc, mn (0..levels), d, dmin of ``weight`` [n, k] for each group's float
    ``scale`` and ``low`` [n, k/32]: those as integer multiples of a per-256 fp16 ``d`` and
    ``dmin``, then every weight rounded onto its group's grid."""
    n, k = weight.shape
    groups, per = k // GROUP, SUPER // GROUP
    w = weight.detach().float().view(n, groups, GROUP)
    pad = -groups % per  # a partial last super-block: padded with zero scales

    def per_super(t: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.pad(t, (0, pad)).view(n, -1, per).amax(-1) / float(levels)
                ).half().float()

    d, dmin = per_super(scale), per_super(low)
    d_g = d.repeat_interleave(per, 1)[:, :groups]
    dmin_g = dmin.repeat_interleave(per, 1)[:, :groups]
    sc = torch.where(d_g > 0, torch.round(scale / d_g.clamp(min=1e-30)), 0).clamp(0, levels)
    mn = torch.where(dmin_g > 0, torch.round(low / dmin_g.clamp(min=1e-30)), 0).clamp(0, levels)
    step = (d_g * sc)[..., None]
    q = torch.where(step > 0, torch.round((w + (dmin_g * mn)[..., None]) / step.clamp(min=1e-30)),
                    0).clamp(0, top)
    return q.to(torch.uint8).view(n, k), sc.to(torch.uint8), mn.to(torch.uint8), d, dmin


def pack_q3m(w: Q3MWeights) -> dict[str, torch.Tensor]:
    """The kernel's layout (``Q3MGroup`` in kernels.h): per group, the low 2 bits of operand
    o = 4 i + s (inputs 4 o .. 4 o + 3) at bits 2 s of load i's byte 4 r + j, then the third
    bit of operand o at bit o of byte 4 r + j."""
    n, k = w.q.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"a Q3_M kernel matrix needs rows % 16 == 0 and width % 32 == 0, "
                         f"got {n} x {k}")
    b, g = n // BLOCK_ROWS, k // GROUP
    q = w.q.view(b, BLOCK_ROWS, g, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # b g i s r j
    low = ((q & 3) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1, 1)
           ).sum(3, dtype=torch.uint8).view(b * g, 128)
    third = ((q >> 2) & 1).reshape(b, g, 8, BLOCK_ROWS, 4)  # b g o r j
    top = (third << torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1, 1)
           ).sum(2, dtype=torch.uint8).view(b * g, 64)
    return {"qs3": torch.cat([low, top], 1).view(-1), "sc": rows_last(w.sc),
            "mn": rows_last(w.mn), "d": rows_last(w.d.float()), "dmin": rows_last(w.dmin.float())}


def quantize_q5k(weight: torch.Tensor) -> Q5KWeights:
    """Q5_K weights of a float matrix [n, k] (k % 32 == 0) by ``quantize_q4k``'s rule with
    q in 0..31. For tests (GGUF files of Q5_K matrices are written from these)."""
    return Q5KWeights(*_quantize_k(weight, 31, "Q5_K"))


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
