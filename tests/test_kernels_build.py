"""Building and loading the native kernels (``localspec.runtime.kernels.library``, ``abi``).

What a user needs from it: the kernels load on any machine with a C compiler (the best variant
this CPU runs, else the portable one), a cached library is used only when it is intact and a
build of these sources with the interface ctypes expects (anything else is rebuilt, saying
so), and what cannot work is a ``KernelUnavailable`` with the reason, never a crash.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from kernel_helpers import kernel_lib, random_inputs, random_weights

from localspec.runtime.kernels import (
    KERNELS_ENV,
    KernelUnavailable,
    abi,
    library,
    load_kernels,
    pick_variant,
    quantize_q4k,
    runnable_variants,
)
from localspec.runtime.quant import Q4KLinear

AVX512 = {"avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni", "fma3", "avx2"}


@pytest.fixture(autouse=True)
def _no_forced_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests choose variants themselves (a forced LOCALSPEC_KERNELS would override)."""
    monkeypatch.delenv(KERNELS_ENV, raising=False)


def _variant(lib: ctypes.CDLL) -> str:
    lib.kernels_variant.restype = ctypes.c_char_p
    return lib.kernels_variant().decode()


def test_load_kernels_builds_once_per_cache(tmp_path: Path) -> None:
    """The first load compiles into the cache (the .so and its digest, no temporary left
    over); the next one reuses it (a rebuild would replace the file: new inode and mtime); a
    damaged library is rebuilt, never loaded."""
    cache = tmp_path / "kernels"
    first = load_kernels(cache)
    built = sorted(cache.iterdir())
    assert [p.suffix for p in built] == [".so", ".sha256"], built
    library_file = built[0]
    assert library_file.name.startswith(f"kernels-{_variant(first)}-")
    before = library_file.stat()
    second = load_kernels(cache)
    after = library_file.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert sorted(cache.iterdir()) == built
    assert first.q4k_linear is not None and second.q4k_linear is not None

    # a damaged copy in a cache this process never loaded from (writing into a library that
    # is mapped would crash the process that mapped it, which is why builds replace files)
    other = tmp_path / "other"
    shutil.copytree(cache, other)
    damaged = other / library_file.name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    third = load_kernels(other)
    assert third.q4k_linear is not None
    assert damaged.read_bytes() != bytes(data)  # rebuilt, not loaded as it was


def test_a_foreign_library_in_the_cache_is_rebuilt(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A valid shared library that is not ours, at the exact path the loader uses and with a
    matching digest (a copy from elsewhere, another build's leftovers): it is rebuilt, with a
    logged reason, and the kernels work, never an undefined-symbol error on first use."""
    ours = tmp_path / "ours"
    load_kernels(ours)
    name = next(ours.glob("*.so")).name
    source = tmp_path / "foreign.c"
    source.write_text("int not_our_kernels(void) { return 7; }\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    foreign = cache / name
    subprocess.run([library.find_compiler().path, "-shared", "-fPIC", str(source), "-o",
                    str(foreign)], check=True)
    foreign_bytes = foreign.read_bytes()
    (cache / (name + ".sha256")).write_text(hashlib.sha256(foreign_bytes).hexdigest())
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        lib = load_kernels(cache)
    assert "not a build of these kernels" in caplog.text and "rebuilding" in caplog.text
    assert foreign.read_bytes() != foreign_bytes
    weights = quantize_q4k(random_weights(16, 256, seed=1))
    x = random_inputs(2, 256, seed=2)
    assert torch.equal(Q4KLinear.from_weights(weights, None, lib)(x),
                       Q4KLinear.from_weights(weights, None, load_kernels(ours))(x))


@pytest.mark.parametrize("broken", ["version", "layout"])
def test_an_interface_mismatch_is_rebuilt_then_refused(tmp_path: Path, broken: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A library whose ABI version or struct layout disagrees with the ctypes mirror is never
    called: it is rebuilt, and when the fresh build still disagrees (the mirror itself is
    wrong), KernelUnavailable shows both sides."""
    built = abi.ABI_VERSION  # what the C side reports (kernels.h's KERNELS_ABI_VERSION)
    if broken == "version":
        monkeypatch.setattr(abi, "ABI_VERSION", built + 1)
    else:
        monkeypatch.setattr(abi, "expected_layout", lambda: "KPart=72 kind@0;")
    with caplog.at_level(logging.WARNING, logger=library.__name__), \
            pytest.raises(KernelUnavailable, match="rebuilt, but") as caught:
        load_kernels(tmp_path / "kernels", "portable")
    assert "rebuilding" in caplog.text
    assert (f"ABI version is {built}" if broken == "version" else "KPart=72") in str(caught.value)


def test_the_loaded_library_matches_the_ctypes_mirror(tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    """The check the loader makes, made explicitly: C's constants, struct sizes and offsets
    are the mirror's (all five structs and both GGUF block sizes are in the text)."""
    lib = kernel_lib(tmp_path_factory)
    assert abi.mismatch(lib, _variant(lib)) is None
    layout = abi.expected_layout()
    for item in ("GgufBlockQ4K)=144", "GgufBlockQ6K)=210", "KPart=64", "KFused=264",
                 "KLayer=1088", "KModel=64", "KStep=96"):
        assert item in layout


def test_load_kernels_in_an_unwritable_place_says_why(tmp_path: Path) -> None:
    """A cache that cannot take the library (here: a file where the folder should be) is
    KernelUnavailable with the reason, which callers turn into a w8a8 fallback."""
    blocker = tmp_path / "kernels"
    blocker.write_text("not a folder")
    with pytest.raises(KernelUnavailable, match="building"):
        load_kernels(blocker)


def test_variants_follow_the_cpu_features() -> None:
    """The best variant a CPU's features allow; every CPU runs the portable one."""
    assert pick_variant(AVX512) == "avx512"
    assert runnable_variants(AVX512) == ["avx512", "avx2", "portable"]
    assert pick_variant({"avx2", "fma3", "sse4_2"}) == "avx2"
    assert pick_variant({"avx512_f", "avx512_bw", "avx512_vl", "avx2", "fma3"}) == "avx2"
    assert pick_variant({"avx2"}) == "portable"  # AVX2 without FMA
    assert pick_variant({"neon", "sve"}) == "portable"
    assert pick_variant(set()) == "portable"


def test_cpu_features_come_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The features are torch's cpuinfo report (no /proc/cpuinfo, which macOS, Windows and
    ARM Linux do not fill alike); a torch without it gives what its dispatch level implies."""
    reported = {name for name, value in torch.cpu.get_capabilities().items() if value is True}
    assert library.cpu_features() == reported
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True, raising=False)
    for level, variant in (("AVX512", "avx512"), ("AVX2", "avx2"), ("DEFAULT", "portable"),
                           ("SVE256", "portable")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda level=level: level)
        assert pick_variant(library.cpu_features()) == variant, level


def test_a_forced_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          caplog: pytest.LogCaptureFixture) -> None:
    """LOCALSPEC_KERNELS picks the variant (the portable one says it is slower); a name that
    is not a variant, or one this CPU cannot run, is KernelUnavailable before anything is
    built (no illegal instruction)."""
    monkeypatch.setenv(KERNELS_ENV, "portable")
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert _variant(load_kernels(tmp_path / "a")) == "portable"
    assert "slower" in caplog.text
    monkeypatch.setenv(KERNELS_ENV, "avx1024")
    with pytest.raises(KernelUnavailable, match="not a kernel variant"):
        load_kernels(tmp_path / "b")
    monkeypatch.setenv(KERNELS_ENV, "avx2")
    monkeypatch.setattr(library, "cpu_features", lambda: frozenset({"sse4_2"}))
    with pytest.raises(KernelUnavailable, match="this CPU lacks"):
        load_kernels(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_simd_build_that_fails_falls_back_to_the_portable_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A compiler that cannot build the SIMD variants (too old for -mavx512vnni, say): the
    portable kernels serve, and the log says why."""
    monkeypatch.setattr(library, "cpu_features", lambda: frozenset(AVX512))
    broken = {name: library.Variant(v.needs, (*v.flags, "-mno-such-instruction-set"))
              for name, v in library.VARIANTS.items() if name != "portable"}
    monkeypatch.setattr(library, "VARIANTS", {**library.VARIANTS, **broken})
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        lib = load_kernels(tmp_path / "kernels")
    assert _variant(lib) == "portable"
    assert "the avx512 kernels are unavailable" in caplog.text
    assert "no-such-instruction-set" in caplog.text


def test_when_nothing_builds_the_kernel_tests_fail_with_the_compilers_message(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """When even the portable build fails, load_kernels says what the compiler said, and the
    kernel tests' fixture fails on it (a skip would let a CI pass while testing nothing)."""
    monkeypatch.setattr(library, "CFLAGS", (*library.CFLAGS, "-DKERNELS_AVX512",
                                            "-DKERNELS_AVX2"))  # kernels.h's #error
    monkeypatch.setattr(library, "cpu_features", lambda: frozenset())
    with pytest.raises(pytest.fail.Exception, match="build one variant"):
        kernel_lib(tmp_path_factory)


def test_the_cache_key_follows_the_compiler(tmp_path: Path) -> None:
    """Another compiler, or another version of it, builds under another name."""
    gcc12 = library.Compiler("/usr/bin/cc", "cc (Debian 12.2.0-14) 12.2.0")
    gcc13 = library.Compiler("/usr/bin/cc", "cc (Debian 13.1.0-1) 13.1.0")
    clang = library.Compiler("/usr/bin/clang", "clang version 16.0.6")
    paths = {library.library_path(tmp_path, "avx2", c) for c in (gcc12, gcc13, clang)}
    assert len(paths) == 3
    assert library.library_path(tmp_path, "avx2", gcc12) == library.library_path(
        tmp_path, "avx2", library.Compiler(gcc12.path, gcc12.version))
    assert library.library_path(tmp_path, "avx2", gcc12).name.startswith("kernels-avx2-")


def test_the_portable_build_is_plain_c_without_openmp(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The portable sources build as strict C11 with every warning an error and without
    OpenMP (its pragmas ignored, as a compiler without it does), and give the same bits as
    the portable build with OpenMP."""
    out = tmp_path / "plain.so"
    result = subprocess.run([library.find_compiler().path, "-std=c11", "-pedantic-errors",
                             "-Wall", "-Wextra", "-Werror", *library.CFLAGS,
                             *(str(p) for p in sorted(library.SOURCE_DIR.glob("*.c"))),
                             "-o", str(out), "-lm"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    plain = ctypes.CDLL(str(out))
    assert abi.mismatch(plain, "portable") is None
    threaded = kernel_lib(tmp_path_factory, "portable")
    weights = quantize_q4k(random_weights(32, 896, seed=3))
    x = random_inputs(9, 896, seed=4)
    assert torch.equal(Q4KLinear.from_weights(weights, None, plain)(x),
                       Q4KLinear.from_weights(weights, None, threaded)(x))


def test_a_compiler_without_openmp_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Where -fopenmp fails (Apple's clang), the kernels build without it, on one thread."""
    monkeypatch.setattr(library, "OPENMP", ("-fno-such-openmp",))
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        lib = load_kernels(tmp_path / "kernels", "portable")
    assert "without OpenMP" in caplog.text
    assert lib.q4k_linear is not None


def test_an_x86_cpu_without_simd_is_served_the_int8_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On x86 without AVX2 the portable build would emulate every FMA (slower than int8):
    ``serving_kernels`` refuses it, so a w4a8 preset falls back to w8a8; on ARM it serves, and
    LOCALSPEC_KERNELS=portable serves it anywhere (the same bits, for tests and comparisons)."""
    real_features = library.cpu_features
    monkeypatch.setattr(library, "cpu_features", lambda: frozenset({"sse4_2"}))
    with pytest.raises(KernelUnavailable, match="portable kernels would be"):
        library.serving_kernels(tmp_path / "kernels", machine="x86_64")
    assert library.built_variant(
        library.serving_kernels(tmp_path / "kernels", machine="aarch64")) == "portable"
    monkeypatch.setenv(KERNELS_ENV, "portable")
    assert library.built_variant(
        library.serving_kernels(tmp_path / "kernels", machine="x86_64")) == "portable"
    # This CPU, as it is: a SIMD variant it runs serves on x86 too.
    monkeypatch.delenv(KERNELS_ENV)
    monkeypatch.setattr(library, "cpu_features", real_features)
    best = pick_variant(library.cpu_features())
    if best != "portable":
        assert library.built_variant(
            library.serving_kernels(tmp_path / "kernels", machine="x86_64")) == best
