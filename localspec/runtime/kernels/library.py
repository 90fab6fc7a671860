"""Building and loading the native kernels: the C sources of this folder, compiled on first use
with the system's C compiler into the LocalSpec cache (``kernels/``) and loaded with ctypes.

Variants, best first (``VARIANTS``): "avx512" (AVX-512 VNNI), "avx2" (AVX2 with FMA) and
"portable" (plain C11, no intrinsics, for any CPU and any C compiler, with or without OpenMP).
All three give the same bits (``kernels.h`` says how; the tests check each against
"portable"), so the served model is the same model on every machine. ``load_kernels`` takes
the best variant this CPU runs, as torch's cpuinfo reports its features (never
/proc/cpuinfo, which macOS and Windows lack and ARM Linux fills differently); when that
variant cannot be built here it tries the next one, ending with "portable", which is slower
(``PORTABLE_COST``).

``LOCALSPEC_KERNELS=avx512|avx2|portable`` (``KERNELS_ENV``) forces a variant; one this CPU
cannot run is a ``KernelUnavailable`` that says so, never an illegal instruction.

A library is cached as ``kernels-<variant>-<key>.so``, the key a hash of the sources, the
flags and the compiler (its path and ``--version``), with its SHA-256 beside it: a damaged
file is rebuilt, never loaded. A file that loads but is not a build of these sources with the
interface ``abi.py`` expects (another program's library, a stale build) is rebuilt with a
logged message; if the rebuilt one still disagrees, ``KernelUnavailable`` says how.
"""

from __future__ import annotations

import _ctypes  # ctypes' own module: its dlclose is what unloads a rejected library
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from localspec.runtime.kernels.abi import mismatch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
KERNELS_ENV = "LOCALSPEC_KERNELS"
CFLAGS = ("-O3", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off", "-fvisibility=hidden",
          "-Wno-unknown-pragmas")
OPENMP = ("-fopenmp",)  # left out where the compiler has no OpenMP: the same bits, one thread
PORTABLE = "portable"
# What the warnings tell a user the portable build costs: on x86 without -mfma every fused
# multiply-add is emulated (vec16.h's fma32); the measurement is in docs/research-log.md.
PORTABLE_COST = "about 12x slower than AVX2 per one-token step and 16x per 16-token pass on x86"
# Machines whose baseline instruction set has no fused multiply-add: the portable build
# emulates each one there, slower than the int8 path a w4a8 preset otherwise falls back to.
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


@dataclass(frozen=True)
class Variant:
    """A build of the kernels: the CPU features it needs (as ``cpu_features`` names them) and
    the compiler flags that make it."""

    needs: tuple[str, ...]
    flags: tuple[str, ...]


VARIANTS: Mapping[str, Variant] = MappingProxyType({
    "avx512": Variant(("avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni", "fma3"),
                      ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma",
                       "-DKERNELS_AVX512")),
    "avx2": Variant(("avx2", "fma3"), ("-mavx2", "-mfma", "-DKERNELS_AVX2")),
    PORTABLE: Variant((), ()),
})


class KernelUnavailable(RuntimeError):
    """The native kernels cannot run here (the message says why)."""


def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set features as torch reports them (``torch.cpu.get_capabilities``,
    from the cpuinfo library: "avx2", "fma3", "avx512_vnni", "neon", ...). A torch without that
    report gives what its dispatch level (``torch.backends.cpu.get_cpu_capability``) and its
    VNNI check imply."""
    report = getattr(torch.cpu, "get_capabilities", None)
    if report is not None:
        return frozenset(name for name, value in report().items() if value is True)
    level = torch.backends.cpu.get_cpu_capability()
    features = {"avx2", "fma3"} if level in ("AVX2", "AVX512") else set()
    vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    if level == "AVX512":  # torch's AVX512 level needs AVX-512 F, BW, VL and DQ
        features |= {"avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"}
        if vnni is not None and vnni():
            features.add("avx512_vnni")
    return frozenset(features)


def runnable_variants(features: frozenset[str] | set[str]) -> list[str]:
    """The variants a CPU with ``features`` runs, best first ("portable" always, last)."""
    return [name for name, v in VARIANTS.items() if all(f in features for f in v.needs)]


def pick_variant(features: frozenset[str] | set[str]) -> str:
    """The best variant a CPU with ``features`` runs."""
    return runnable_variants(features)[0]


def requested_variant() -> str | None:
    """The variant ``LOCALSPEC_KERNELS`` forces (None when unset or empty)."""
    name = os.environ.get(KERNELS_ENV, "").strip().lower()
    if name and name not in VARIANTS:
        raise KernelUnavailable(f"{KERNELS_ENV}={name!r} is not a kernel variant "
                                f"(choose one of {', '.join(VARIANTS)})")
    return name or None


@dataclass(frozen=True)
class Compiler:
    """The C compiler builds use, and its ``--version`` line (part of the cache key)."""

    path: str
    version: str


def find_compiler() -> Compiler:
    """``$CC``, else cc, else gcc; KernelUnavailable when there is none that runs."""
    path = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if path is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH")
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {path} does not run: {exc}") from exc
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines:
        raise KernelUnavailable(f"the C compiler {path} does not run: {result.stderr[-300:]}")
    return Compiler(path, lines[0].strip())


def library_path(cache_dir: Path, variant: str, compiler: Compiler) -> Path:
    """Where ``variant`` built by ``compiler`` is cached: keyed on the sources (every .c and .h
    here), the flags and the compiler."""
    key = hashlib.sha256()
    for source in sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.h")]):
        key.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    key.update("\0".join([*CFLAGS, *OPENMP, *VARIANTS[variant].flags, compiler.path,
                          compiler.version]).encode())
    return cache_dir / f"kernels-{variant}-{key.hexdigest()[:16]}.so"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(compiler: Compiler, flags: tuple[str, ...], out: Path
             ) -> subprocess.CompletedProcess[str]:
    sources = [str(p) for p in sorted(SOURCE_DIR.glob("*.c"))]
    return subprocess.run([compiler.path, *flags, *sources, "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=600)


def build(out: Path, variant: str, compiler: Compiler) -> None:
    """Compile ``variant`` into ``out``, with its SHA-256 beside it (``<name>.sha256``); with
    OpenMP where the compiler has it."""
    flags = (*CFLAGS, *VARIANTS[variant].flags)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            built = Path(tmp) / out.name
            result = _compile(compiler, (*flags, *OPENMP), built)
            if result.returncode != 0:
                plain = _compile(compiler, flags, built)
                if plain.returncode != 0:
                    raise KernelUnavailable(f"compiling the {variant} kernels with "
                                            f"{compiler.path} failed: {plain.stderr[-800:]}")
                logger.warning("%s builds the kernels without OpenMP (%s): they run on one "
                               "thread", compiler.path, result.stderr.strip()[-200:])
            digest = Path(tmp) / "digest"
            digest.write_text(_digest(built))
            built.replace(out)  # atomic: a concurrent or interrupted build never leaves half
            digest.replace(out.with_name(out.name + ".sha256"))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, hung compiler
        raise KernelUnavailable(f"building {out} failed: {exc}") from exc


def _intact(path: Path) -> bool:
    """Whether the library is there and matches the digest written when it was built (a
    damaged file in the cache is rebuilt, never loaded: it would be native code)."""
    try:
        return _digest(path) == path.with_name(path.name + ".sha256").read_text().strip()
    except OSError:
        return False


def _open(path: Path, variant: str) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``path`` with its functions declared, or None and why it is not ours."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"it does not load: {exc}"
    problem = mismatch(lib, variant)
    if problem is not None:
        _close(lib)
        return None, problem
    return lib, None


def _close(lib: ctypes.CDLL) -> None:
    """Unload a rejected library: the dynamic loader hands back a library already loaded from
    the same path, so the rebuilt file is only read once the rejected one is gone."""
    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        close(lib._handle)


def load_variant(cache_dir: Path, variant: str) -> ctypes.CDLL:
    """``variant``'s library from ``cache_dir``, built there when it is missing, damaged or
    not a build of these sources; KernelUnavailable when that fails."""
    compiler = find_compiler()
    path = library_path(cache_dir, variant, compiler)
    if not _intact(path):
        build(path, variant, compiler)
    lib, problem = _open(path, variant)
    if lib is not None:
        return lib
    logger.warning("%s is not a usable build of the %s kernels (%s): rebuilding it", path,
                   variant, problem)
    build(path, variant, compiler)
    lib, problem = _open(path, variant)
    if lib is None:
        raise KernelUnavailable(f"{path} was rebuilt, but {problem}")
    return lib


def load_kernels(cache_dir: Path, variant: str | None = None) -> ctypes.CDLL:
    """The kernels' library for this CPU, from ``cache_dir`` (built there on first use).
    ``variant`` (else ``LOCALSPEC_KERNELS``) forces one of VARIANTS; otherwise the best one
    this CPU runs that builds here. KernelUnavailable says why none can run."""
    features = cpu_features()
    forced = variant if variant else requested_variant()
    if forced is not None:
        if forced not in VARIANTS:
            raise KernelUnavailable(f"unknown kernel variant {forced!r} "
                                    f"(choose one of {', '.join(VARIANTS)})")
        missing = [f for f in VARIANTS[forced].needs if f not in features]
        if missing:
            raise KernelUnavailable(f"the {forced} kernels need {', '.join(missing)}, which "
                                    "this CPU lacks")
        candidates = [forced]
    else:
        candidates = runnable_variants(features)
    failures: list[str] = []
    for name in candidates:
        try:
            lib = load_variant(cache_dir, name)
        except KernelUnavailable as exc:
            failures.append(f"{name}: {exc}")
            if name != candidates[-1]:
                logger.warning("the %s kernels are unavailable (%s); trying the next variant",
                               name, exc)
            continue
        if name == PORTABLE:
            logger.warning("using the portable kernels (%s): the same results, %s",
                           f"{KERNELS_ENV} or the caller asked for them" if forced
                           else "no SIMD variant runs or builds here", PORTABLE_COST)
        return lib
    raise KernelUnavailable("; ".join(failures))


def built_variant(lib: ctypes.CDLL) -> str:
    """The variant ``lib`` was built as (its ``kernels_variant``)."""
    lib.kernels_variant.restype, lib.kernels_variant.argtypes = ctypes.c_char_p, []
    return (lib.kernels_variant() or b"").decode(errors="replace")


def serving_kernels(cache_dir: Path, machine: str | None = None) -> ctypes.CDLL:
    """The kernels to serve a quantized model with: ``load_kernels``' choice, except that on
    an x86 CPU with no SIMD variant (``machine``: default, this one) the portable build is not
    served unless ``LOCALSPEC_KERNELS`` asks for it: there it emulates every fused
    multiply-add, and the int8 path callers fall back to is faster. On ARM and other CPUs with
    FMA in their baseline it serves."""
    lib = load_kernels(cache_dir)
    emulated = (machine or platform.machine()).lower() in X86_MACHINES
    if built_variant(lib) == PORTABLE and emulated and requested_variant() is None:
        raise KernelUnavailable(f"no SIMD variant runs or builds here, and the portable "
                                f"kernels would be {PORTABLE_COST}")
    return lib
