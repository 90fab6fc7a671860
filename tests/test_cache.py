"""The model cache without real checkpoints: fake built-in packages, tiny GGUF files written
with the ``gguf`` package and converted for real, and every kind of damage a cache meets on
disk (same-size corruption, truncation, lost or garbled manifests, killed writers' leftovers,
truncated user files)."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from model_files import damage, fake_builtin, first_load, patch_find_spec, same_weights, weights

import localspec.models.cache as cache
import localspec.models.integrity as integrity
from localspec.config import ModelSpec, cache_root
from localspec.errors import ModelLoadError
from localspec.models.loading import audit_cache, load_model


@pytest.fixture(autouse=True)
def isolated(own_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No real cache is touched and relative names resolve in an empty directory."""
    monkeypatch.chdir(tmp_path)


def test_fingerprint_samples_blocks_and_full_check_sees_the_rest(tmp_path: Path) -> None:
    """The fingerprint sees the size and the first and last blocks but reads only 16 blocks,
    so damage between them needs ``full``; a small file is covered entirely."""
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(0).bytes(8 * 1024 * 1024))
    integrity.write_manifest(tmp_path / "m.json", ["big.bin"])
    original = integrity.fingerprint(path)
    assert original["size"] == 8 * 1024 * 1024
    data = path.read_bytes()
    for offset in (0, len(data) - 1):
        path.write_bytes(data[:offset] + bytes([data[offset] ^ 1]) + data[offset + 1:])
        assert integrity.fingerprint(path) != original
        assert integrity.verify_manifest(tmp_path / "m.json") == "big.bin: sampled blocks differ"
    between = 64 * 1024 + 10  # past the first block, far before the second
    path.write_bytes(data[:between] + bytes([data[between] ^ 1]) + data[between + 1:])
    assert integrity.fingerprint(path) == original
    assert integrity.verify_manifest(tmp_path / "m.json") is None
    assert integrity.verify_manifest(tmp_path / "m.json", full=True) == "big.bin: CRC32 differs"


def test_manifest_without_crc32s_is_checked_by_sha256_and_learns_them(tmp_path: Path) -> None:
    """A manifest written before CRC32s were recorded: a whole-file check compares the SHA-256
    and adds the CRC32s it computed on the way; damage is found either way."""
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(1).bytes(3 * 1024 * 1024))
    manifest = tmp_path / "m.json"
    integrity.write_manifest(manifest, ["big.bin"])
    data = json.loads(manifest.read_text())
    crc = data["files"]["big.bin"].pop("crc32")
    manifest.write_text(json.dumps(data))
    assert integrity.verify_manifest(manifest, full=lambda name: name != "big.bin") is None
    assert "crc32" not in json.loads(manifest.read_text())["files"]["big.bin"]
    assert integrity.verify_manifest(manifest, full=True) is None
    assert json.loads(manifest.read_text())["files"]["big.bin"]["crc32"] == crc
    manifest.write_text(json.dumps(data))
    original = path.read_bytes()
    between = 64 * 1024 + 10  # no sampled block covers it
    path.write_bytes(original[:between] + bytes([original[between] ^ 1]) + original[between + 1:])
    assert integrity.verify_manifest(manifest, full=True) == "big.bin: SHA-256 differs"
    assert "crc32" not in json.loads(manifest.read_text())["files"]["big.bin"]


@pytest.mark.parametrize(
    ("manifest_text", "reason"),
    [(None, "no manifest"), ("{", "manifest unreadable (JSONDecodeError)"),
     ("[]", "manifest unreadable (TypeError)"), ('{"files": 3}', "manifest unreadable"),
     (b"\xff\xfe", "manifest unreadable (UnicodeDecodeError)")],
)
def test_verify_manifest_refuses_bad_manifests(manifest_text: str | bytes | None, reason: str,
                                               tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    manifest = tmp_path / integrity.MANIFEST_NAME
    integrity.write_manifest(manifest, ["config.json"])
    assert integrity.verify_manifest(manifest) is None
    if manifest_text is None:
        manifest.unlink()
    elif isinstance(manifest_text, bytes):
        manifest.write_bytes(manifest_text)
    else:
        manifest.write_text(manifest_text)
    assert integrity.verify_manifest(manifest).startswith(reason)


def test_verify_manifest_names_the_damaged_file(tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(name.encode() * 100)
    manifest = tmp_path / integrity.MANIFEST_NAME
    integrity.write_manifest(manifest, ["config.json", "model.safetensors"])
    damage(tmp_path / "model.safetensors", "same-size")
    assert integrity.verify_manifest(manifest) == "model.safetensors: sampled blocks differ"
    damage(tmp_path / "model.safetensors", "truncated")
    assert integrity.verify_manifest(manifest) == \
        "model.safetensors: size differs (850 bytes, 1700 written)"
    (tmp_path / "model.safetensors").unlink()
    assert integrity.verify_manifest(manifest) == "model.safetensors unreadable (FileNotFoundError)"


# ----------------------------------------------------------------------------- built-in GGUF

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 50, b"tail"]


def gguf_manifest() -> Path:
    return cache_root() / "gguf" / "fake-model.gguf.manifest.json"


def test_assemble_builtin_concatenates_and_records(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts are concatenated in order, the manifest records the pinned digest, progress
    reaches 1, and a second call uses the cached file without reading the packages again."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    fractions: list[float] = []
    dest = cache.assemble_builtin(builtin, lambda message, fraction: fractions.append(fraction))
    assert dest == cache_root() / "gguf" / "fake-model.gguf"
    assert dest.read_bytes() == b"".join(PARTS)
    recorded = json.loads(gguf_manifest().read_text())["files"]["fake-model.gguf"]
    assert recorded["sha256"] == builtin.sha256 and recorded["size"] == builtin.size
    assert fractions and fractions[-1] == 1.0
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name, gguf_manifest().name]
    patch_find_spec(monkeypatch, {p.replace("-", "_"): None for p in builtin.packages})
    assert cache.assemble_builtin(builtin) == dest  # cached: packages no longer needed


def test_assemble_builtin_single_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in stored whole inside one package is copied and verified the same way."""
    builtin = fake_builtin([b"".join(PARTS)], tmp_path, monkeypatch, member=True)
    assert cache.assemble_builtin(builtin).read_bytes() == b"".join(PARTS)


@pytest.mark.parametrize("corruption", ["sha", "size"])
def test_assemble_builtin_refuses_corrupt_parts(corruption: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest or size mismatch raises with the reinstall command and leaves no file."""
    kwargs = {"sha256": "0" * 64} if corruption == "sha" else {"size": 12345}
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch, **kwargs)
    with pytest.raises(ModelLoadError) as info:
        cache.assemble_builtin(builtin)
    message = str(info.value)
    assert "pip install --force-reinstall fake-model-part1 fake-model-part2 fake-model-part3" \
        in message
    assert hashlib.sha256(b"".join(PARTS)).hexdigest() in message
    assert list((cache_root() / "gguf").iterdir()) == []


def test_assemble_builtin_missing_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package without its data file: reinstall that package."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    (tmp_path / "site-packages" / "fake_model_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"lacks part02\.bin") as info:
        cache.assemble_builtin(builtin)
    assert "pip install --force-reinstall fake-model-part2" in str(info.value)


@pytest.mark.parametrize("damaged", ["same-size", "truncated", "no-manifest", "bad-manifest",
                                     "other-version"])
def test_damaged_assembled_gguf_is_reassembled(damaged: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Damage to the cached file or its manifest is seen at the next call and the file is
    assembled again from the packages, with a warning and a progress message."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    dest = cache.assemble_builtin(builtin)
    if damaged in ("same-size", "truncated"):
        damage(dest, damaged)
    if damaged == "no-manifest":  # and damaged file: it cannot be adopted
        gguf_manifest().unlink()
        damage(dest, "same-size")
    elif damaged == "bad-manifest":
        gguf_manifest().write_text('{"format": 1, "files": ')
    elif damaged == "other-version":
        text = gguf_manifest().read_text().replace(builtin.sha256, "e" * 64)
        gguf_manifest().write_text(text)
    messages: list[str] = []
    with caplog.at_level(logging.WARNING, logger="localspec.models.cache"):
        assert cache.assemble_builtin(builtin, lambda m, f: messages.append(m)) == dest
    assert dest.read_bytes() == b"".join(PARTS)
    assert integrity.verify_manifest(gguf_manifest(), full=True) is None
    warning = f"cached {dest} failed its integrity check ("
    assert any(warning in record.getMessage() for record in caplog.records)
    assert any(m.startswith(warning) and m.endswith("): rebuilding") for m in messages)


def test_gguf_cached_before_manifests_is_adopted_after_a_full_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An intact file from before manifests (with its old .sha256 marker) is kept without the
    packages once its whole SHA-256 matches; the old marker cannot vouch for a damaged one."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    dest = cache_root() / "gguf" / "fake-model.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"".join(PARTS))
    dest.with_suffix(".sha256").write_text(builtin.sha256 + "\n")
    patch_find_spec(monkeypatch, {p.replace("-", "_"): None for p in builtin.packages})
    assert cache.assemble_builtin(builtin) == dest
    assert integrity.verify_manifest(gguf_manifest(), pinned={dest.name: builtin.sha256}) is None
    gguf_manifest().unlink()
    damage(dest, "same-size")
    with pytest.raises(ModelLoadError, match="needs the package 'fake-model-part1'"):
        cache.assemble_builtin(builtin)


def test_damaged_gguf_with_damaged_package_says_force_reinstall(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the rebuild's own source is bad, the error says how to reinstall it."""
    builtin = fake_builtin(PARTS, tmp_path, monkeypatch)
    damage(cache.assemble_builtin(builtin), "same-size")
    damage(tmp_path / "site-packages" / "fake_model_part2" / "data" / "part02.bin", "same-size")
    with pytest.raises(ModelLoadError, match="pip install --force-reinstall fake-model-part1"):
        cache.assemble_builtin(builtin)
    assert not list((cache_root() / "gguf").glob("*.part"))


# ----------------------------------------------------------------------------- converted folders


@pytest.mark.parametrize(
    ("source", "damaged"),
    [("builtin", "same-size"), ("builtin", "truncated"), ("builtin", "no-manifest"),
     ("builtin", "config"), ("user-gguf", "same-size"), ("user-gguf", "truncated")],
)
def test_damaged_converted_folder_is_rebuilt(source: str, damaged: str, tiny_gguf: bytes,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Same-size damage would give garbage answers and truncation a SafetensorError at every
    start: both are seen by the fingerprint and the folder is converted again."""
    spec, folder = first_load(source, tiny_gguf, tmp_path, monkeypatch)
    written = weights(folder)
    if damaged == "no-manifest":  # a folder cached before manifests, or a killed writer
        (folder / integrity.MANIFEST_NAME).unlink()
        damage(folder / "model.safetensors", "same-size")
    elif damaged == "config":
        (folder / "config.json").write_text("{")
    else:
        damage(folder / "model.safetensors", damaged)
    messages: list[str] = []
    with caplog.at_level(logging.WARNING, logger="localspec.models.cache"):
        loaded = load_model(spec, lambda m, f: messages.append(m))
    assert loaded.folder == folder
    assert same_weights(weights(folder), written)
    assert same_weights({k: v for k, v in loaded.model.state_dict().items() if k in written},
                        written)
    warning = f"cached {folder} failed its integrity check ("
    assert any(warning in record.getMessage() for record in caplog.records)
    assert any(m.startswith(warning) for m in messages)


# ----------------------------------------------------------------------------- stale temporaries


def temp_name(base: str, pid: int, started: int) -> str:
    return f"{base}.pid{pid}-{started}.x1y2z3.part"


def test_remove_stale_temps_keeps_live_writers(tmp_path: Path) -> None:
    """A dead writer's temporaries go (also when its PID now names another process); a live
    writer's stay, whatever their age; PID-less ones go after an hour; nothing else goes."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", ""])
        dead.wait()
        me = psutil.Process()
        started = int(me.create_time())
        live = [temp_name("a.gguf", os.getpid(), started),
                temp_name("b", sleeper.pid, int(psutil.Process(sleeper.pid).create_time())),
                "tmpabcd1234.part", "qwen.tmpabcd1234"]
        gone = [temp_name("c.gguf", dead.pid, started), temp_name("d", os.getpid(), 1000),
                "tmpzzzz9999.part", "qwen.tmpzzzz9999", temp_name("e", dead.pid, 1000)]
        others = ["fake-model.gguf", "fake-model.gguf.manifest.json", "mine-0123456789ab",
                  "smollm2-135m-instruct"]
        for name in live + gone + others:
            if name.endswith(".gguf") or name.endswith(".json") or name.endswith(".part"):
                (tmp_path / name).write_bytes(b"x")
            else:
                (tmp_path / name).mkdir()
                (tmp_path / name / "model.safetensors").write_bytes(b"x")
        hour_ago = time.time() - 3700
        for name in [*others, *live[:2], *gone]:
            os.utime(tmp_path / name, (hour_ago, hour_ago))
        removed = integrity.remove_stale_temps(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(p.name for p in removed) == sorted(gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(live + others)


def test_assembly_and_conversion_clear_killed_writers_leftovers(
        tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a killed assembly or conversion left is removed when the next one starts, while
    the running one's own temporary file survives a concurrent cleanup."""
    builtin = fake_builtin([tiny_gguf], tmp_path, monkeypatch)
    gguf_dir, models_dir = cache_root() / "gguf", cache_root() / "models"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    leftovers = [gguf_dir / temp_name("fake-model.gguf", os.getpid(), 1000),  # PID reused
                 gguf_dir / "tmpabcd1234.part", models_dir / temp_name("fake-model", dead.pid, 1)]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
    hour_ago = time.time() - 3700
    os.utime(leftovers[1], (hour_ago, hour_ago))
    own_temps: list[str] = []

    def concurrent_cleanup(message: str, fraction: float) -> None:
        if message.startswith("assembling"):
            integrity.remove_stale_temps(gguf_dir)  # what another process starting now would do
            own_temps.extend(p.name for p in gguf_dir.glob("fake-model.gguf.pid*.part"))

    cache.builtin_model_dir(builtin, concurrent_cleanup)
    assert own_temps and all(f".pid{os.getpid()}-" in name for name in own_temps)
    assert not any(path.exists() for path in leftovers)
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["fake-model.gguf",
                                                          "fake-model.gguf.manifest.json"]
    assert sorted(p.name for p in models_dir.iterdir()) == ["fake-model"]


def test_full_audit_finds_damage_between_sampled_blocks(tiny_gguf: bytes, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage the start-up fingerprint cannot see (between its sampled blocks) is found by the
    app's background full check, which makes the next load rebuild the folder."""
    monkeypatch.setattr(integrity, "_BLOCK_SIZE", 1024)  # the tiny file is sampled, not read
    spec, folder = first_load("gguf", tiny_gguf, tmp_path, monkeypatch)
    loaded = load_model(spec)
    assert audit_cache(loaded) is None
    weights_file = folder / "model.safetensors"
    size = weights_file.stat().st_size
    sampled = integrity._block_offsets(size)
    gap = next(o + integrity._BLOCK_SIZE for o, n in itertools.pairwise(sampled)
               if n - o > integrity._BLOCK_SIZE)  # a byte no sampled block covers
    data = bytearray(weights_file.read_bytes())
    data[gap] ^= 0xFF
    weights_file.write_bytes(bytes(data))
    assert integrity.verify_manifest(folder / integrity.MANIFEST_NAME) is None  # unseen at start-up
    assert audit_cache(loaded) == "model.safetensors: CRC32 differs"
    assert not (folder / integrity.MANIFEST_NAME).exists()
    reloaded = load_model(spec)  # rebuilt: the damaged byte is gone
    assert (reloaded.folder / integrity.MANIFEST_NAME).is_file()
    assert audit_cache(reloaded) is None


def test_weights_are_stored_in_the_dtype_they_are_loaded_in(tiny_gguf: bytes,
                                                            tmp_path: Path) -> None:
    """bfloat16 is stored as bfloat16 (no float32 copy read and cast at every start); float32
    keeps the exact dequantized values in a folder of its own."""
    from safetensors import safe_open

    (tmp_path / "mine.gguf").write_bytes(tiny_gguf)
    folders = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(ModelSpec(str(tmp_path / "mine.gguf"), dtype=dtype))
        folders[dtype] = loaded.folder
        with safe_open(loaded.folder / "model.safetensors", "pt") as f:
            stored = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        assert stored == {"F32" if dtype == "float32" else "BF16"}
        assert {p.dtype for p in loaded.model.parameters()} == {getattr(torch, dtype)}
    assert folders["bfloat16"] == folders["float32"].with_name(folders["float32"].name
                                                               + ".bfloat16")
