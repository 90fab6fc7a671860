"""Native CPU kernels, built on first use with the system's C compiler and loaded with ctypes.

Why a kernel of our own: on a 2-core CPU a decode step reads every weight once, so its time is
the bytes read. The built-in target's GGUF stores most matrices as Q4_K (4.5 bits a weight);
served as int8 it reads 1.8x the bytes. PyTorch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``) takes float activations and costs 8x more at 16 rows than at
one, which ruins verification, and torchao's W4A8 CPU kernels are not in its PyPI wheel. So
``q4k.c`` multiplies Q4_K weights, exactly as the file holds them, by int8 activations with
VNNI (or AVX2 on CPUs without AVX-512, with the same bits), flat up to several rows and
bit-identical whatever the number of rows (see the C file).

The library is compiled once per source and flags into the LocalSpec cache (``kernels/``);
where there is no compiler or neither AVX-512 VNNI nor AVX2, ``load_q4k`` says why and
callers keep the oneDNN int8 path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("q4k.c")
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


def load_q4k(cache_dir: Path, variant: str | None = None) -> ctypes.CDLL:
    """The compiled Q4_K kernel (built into ``cache_dir`` on first use, and again when the
    cached copy fails its digest); ``variant`` (default: the best this CPU runs) names one of
    VARIANTS. KernelUnavailable when this CPU or system cannot have it."""
    variant = variant or pick_variant(cpu_flags())
    if variant not in VARIANTS:
        raise KernelUnavailable(f"unknown kernel variant {variant!r}")
    flags = (*CFLAGS, *VARIANTS[variant][1])
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    path = cache_dir / f"q4k-{variant}-{key}.so"
    if not _intact(path):
        try:
            _build(path, flags)
        except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, hung compiler
            raise KernelUnavailable(f"building {path} failed: {exc}") from exc
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"loading {path} failed: {exc}") from exc
    lib.q4k_linear.restype = ctypes.c_int
    lib.q4k_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int]
    return lib


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
    """The kernel's layout (see q4k.c): rows in blocks of 16, two nibbles a byte."""
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
