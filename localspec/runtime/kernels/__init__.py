"""Native CPU kernels, built on first use with the system's C compiler and loaded with ctypes.

Why a kernel of our own: on a 2-core CPU a decode step reads every weight once, so its time is
the bytes read. The built-in target's GGUF stores most matrices as Q4_K (4.5 bits a weight);
served as int8 it reads 1.8x the bytes. PyTorch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``) takes float activations and costs 8x more at 16 rows than at
one, which ruins verification, and torchao's W4A8 CPU kernels are not in its PyPI wheel. So
``lean.c`` multiplies Q4_K weights, exactly as the file holds them, by int8 activations with
VNNI (or AVX2 on CPUs without AVX-512, with the same bits), flat up to several rows and
bit-identical whatever the number of rows (see the C file); it does the same for the file's
Q6_K matrices (the LM head, half the v and down projections of a Q4_K_M file), which int8
would read at 8 bits instead of 6.6. The same file holds the attention of new rows over a bf16
KV cache (``RowAttention``) and the whole decoder stack in one call (``lean_forward``, used by
``localspec.runtime.native``): once the matrices were fast, the tensor calls between them were
a sixth of a step.

The library is compiled once per source and flags into the LocalSpec cache (``kernels/``);
where there is no compiler or neither AVX-512 VNNI nor AVX2, ``load_kernels`` says why and
callers keep the oneDNN int8 path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("lean.c")
CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp")
# variant -> (CPU flags it needs, its compiler flags), best first; both give the same bits
VARIANTS = {"avx512": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                       ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma")),
            "avx2": (("avx2", "fma"), ("-mavx2", "-mfma", "-DQ4K_AVX2"))}
BLOCK_ROWS = 16  # output rows interleaved per block
GROUP = 32  # inputs per (scale, min) pair
SUPER = 256  # inputs per (d, dmin) pair: one Q4_K block
Q4K_PACKED = ("qs", "sc", "mn", "d", "dmin")  # the kernel's tensors, in its argument order
Q4K_BLOCK_BYTES = 144  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
Q6K_PACKED = ("qs", "qh", "sc", "d")
Q6K_GROUP = 16  # inputs per signed 8-bit scale
Q6K_BLOCK_BYTES = 210  # 128 bytes of low nibbles, 64 of top 2 bits, 16 int8 scales, d (fp16)


class KernelUnavailable(RuntimeError):
    """The native kernel cannot run here (the message says why)."""


def cpu_flags() -> set[str]:
    """The CPU feature flags /proc/cpuinfo lists (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(out: Path, flags: tuple[str, ...]) -> None:
    """Compile into ``out``, with its SHA-256 beside it (``<name>.sha256``)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {result.stderr[-500:]}")
        digest = Path(tmp) / "digest"
        digest.write_text(_digest(built))
        built.replace(out)  # atomic: a concurrent or interrupted build never leaves half a file
        digest.replace(out.with_name(out.name + ".sha256"))


def _intact(path: Path) -> bool:
    """Whether the library is there and matches the digest written when it was built (a
    damaged file in the cache is rebuilt, never loaded: it would be native code)."""
    try:
        return _digest(path) == path.with_name(path.name + ".sha256").read_text().strip()
    except OSError:
        return False


def pick_variant(flags: set[str]) -> str:
    """The best kernel variant a CPU with ``flags`` (as /proc/cpuinfo names them) can run."""
    for name, (needed, _) in VARIANTS.items():
        if all(f in flags for f in needed):
            return name
    raise KernelUnavailable("this CPU has neither AVX-512 VNNI nor AVX2 with FMA")


def load_kernels(cache_dir: Path, variant: str | None = None) -> ctypes.CDLL:
    """The compiled kernels of ``lean.c`` (built into ``cache_dir`` on first use, and again when the
    cached copy fails its digest); ``variant`` (default: the best this CPU runs) names one of
    VARIANTS. KernelUnavailable when this CPU or system cannot have it."""
    variant = variant or pick_variant(cpu_flags())
    if variant not in VARIANTS:
        raise KernelUnavailable(f"unknown kernel variant {variant!r}")
    flags = (*CFLAGS, *VARIANTS[variant][1])
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    path = cache_dir / f"lean-{variant}-{key}.so"
    if not _intact(path):
        try:
            _build(path, flags)
        except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, hung compiler
            raise KernelUnavailable(f"building {path} failed: {exc}") from exc
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"loading {path} failed: {exc}") from exc
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.q4k_linear.restype = lib.q6k_linear.restype = ctypes.c_int
    # x, rows, width, the packed tensors (Q4K_PACKED / Q6K_PACKED), n, y, threads
    lib.q4k_linear.argtypes = [pointer, size, size, *[pointer] * len(Q4K_PACKED), size, pointer,
                               ctypes.c_int]
    lib.q6k_linear.argtypes = [pointer, size, size, *[pointer] * len(Q6K_PACKED), size, pointer,
                               ctypes.c_int]
    lib.attend_rows.restype = lib.lean_forward.restype = ctypes.c_int
    # layers, count, x, n, hidden, heads, kv_heads, head_dim, intermediate, eps, scale, cos,
    # sin, keys, values, capacity, start, features, feature layers, their count, threads
    lib.lean_forward.argtypes = [pointer, size, pointer, *[size] * 6, ctypes.c_float,
                                 ctypes.c_float, *[pointer] * 4, size, size, pointer, pointer,
                                 size, ctypes.c_int]
    # q, keys, values, capacity, start, n, heads, kv_heads, head_dim, scale, out, threads
    lib.attend_rows.argtypes = [pointer, pointer, pointer, *[size] * 5, size, ctypes.c_float,
                                pointer, ctypes.c_int]
    return lib


class RowAttention:
    """``attend_rows`` of the C file: attention of new query rows over a bfloat16 KV cache, each
    row over exactly the keys it may see and bit for bit the same whatever the number of rows
    (what per-row SDPA calls gave, at about a third of their cost: one call per layer instead
    of one per row). Only for shapes it takes (``fits``)."""

    def __init__(self, lib: ctypes.CDLL, heads: int, kv_heads: int, head_dim: int,
                 scale: float) -> None:
        self._kernel = lib.attend_rows
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale

    @staticmethod
    def fits(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """The kernel's limits (see the C file): bf16 cache, head_dim % 32, <= 256, ..."""
        return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
                and heads % kv_heads == 0 and heads // kv_heads <= 16)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 start: int) -> torch.Tensor:
        """q [heads, n, head_dim] float32 at positions start..start+n-1; keys and values
        [kv_heads, capacity, head_dim] bf16 holding them; returns [n, heads * head_dim]."""
        q = q.float().contiguous()
        n = q.shape[1]
        if keys.shape != values.shape or not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("keys and values must be contiguous and of one shape")
        if start + n > keys.shape[1]:  # the kernel would read past the cache
            raise ValueError(f"positions up to {start + n} but the cache holds {keys.shape[1]}")
        out = torch.empty(n, self.heads * self.head_dim)
        status = self._kernel(q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[1],
                              start, n, self.heads, self.kv_heads, self.head_dim, self.scale,
                              out.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError("the attention kernel could not allocate its scratch memory")
        return out


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
    """The kernel's layout (see lean.c): rows in blocks of 16, two nibbles a byte."""
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
    """The kernel's layout (see lean.c): Q4_K's nibble layout for the low 4 bits of q, the top
    2 bits four to a byte."""
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
