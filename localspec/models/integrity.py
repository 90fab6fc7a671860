"""Integrity of cached files: fingerprints, manifests, and the temp files of killed writers.

A disk error or a killed copy can leave a cached file damaged, even at the same size, and that
must neither give garbage answers nor crash every later start. A manifest records per file its
size, a fingerprint (SHA-256 of 16 sampled 64 KiB blocks, first and last included), a CRC32 and
a SHA-256 of the whole file. The fingerprint is checked at every load (1 MiB read, milliseconds
even for 7 GB); a file a load reads whole is checked whole first (``full``), by its CRC32
(~3-6 GB/s here, against ~1-1.6 for SHA-256). Not caught by the fingerprint alone: same-size
damage between the sampled blocks; so no file may be read without a ``full`` check unless its
reader checks what it reads (the packed weights carry a CRC32 per tensor, ``packed_store``).
CRC32 finds every burst of up to 32 bits and any other damage but one in 2^32: disk damage,
not tampering (the built-in GGUF's pinned SHA-256 is checked where it is assembled).

A manifest written before CRC32s were recorded is checked by its SHA-256, and the CRC32s found
on the way are added to it.

Temporary files carry their writer's PID and start time (``<name>.pid<PID>-<start>.<random>
.part``): a killed writer's are removed at the start of the next assembly or conversion, a
live one's are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

MANIFEST_NAME = "localspec-manifest.json"  # inside a converted folder
_MANIFEST_FORMAT = 1  # bump when the fingerprint's sampling changes: old manifests then fail
_BLOCKS, _BLOCK_SIZE = 16, 64 * 1024  # the fingerprint: 1 MiB read from 16 places
_CHUNK = 8 * 1024 * 1024  # a whole-file check's reads
_ENTRY_KEYS = frozenset({"size", "blocks_sha256", "sha256"})  # and "crc32" where recorded
_TEMP_NAME = re.compile(r"\.pid(?P<pid>\d+)-(?P<started>\d+)\.\w+\.part$")  # see _writer_tag
_LEGACY_TEMP_NAME = re.compile(r"^tmp\w{8}\.part$|\.tmp\w{8}$")  # written before PIDs were
_LEGACY_STALE_SECONDS = 3600.0


def _block_offsets(size: int) -> list[int]:
    """Where the fingerprint reads: the whole file if small, else first, last and evenly
    spaced blocks in between (deterministic, so writer and checker agree)."""
    if size <= _BLOCKS * _BLOCK_SIZE:
        return list(range(0, size, _BLOCK_SIZE))
    last = size - _BLOCK_SIZE
    return [last * i // (_BLOCKS - 1) for i in range(_BLOCKS)]


def fingerprint(path: Path) -> dict[str, int | str]:
    """Size plus SHA-256 of sampled blocks: catches truncation and most damage for the cost
    of reading 1 MiB, so it can run at every load."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in _block_offsets(size):
            f.seek(offset)
            digest.update(f.read(_BLOCK_SIZE))
    return {"size": size, "blocks_sha256": digest.hexdigest()}


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _whole_file(path: Path, sha256: bool) -> tuple[int, str | None]:
    """CRC32 of the file, and its SHA-256 when ``sha256`` (one read for both)."""
    digest = hashlib.sha256() if sha256 else None
    crc = 0
    buffer = bytearray(_CHUNK)
    with path.open("rb") as f:
        while size := f.readinto(buffer):
            chunk = memoryview(buffer)[:size]
            crc = zlib.crc32(chunk, crc)
            if digest is not None:
                digest.update(chunk)
    return crc, None if digest is None else digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that readers see the old file or the new one, never half of it."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False,
                                     prefix=f"{path.name}.{writer_tag()}.",
                                     suffix=".part") as out:
        tmp = Path(out.name)
        try:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(path)


def write_manifest(manifest: Path, names: Iterable[str],
                   sha256: Mapping[str, str] | None = None) -> None:
    """Record size, fingerprint, CRC32 and SHA-256 of ``names`` (relative to the manifest's
    folder); ``sha256`` supplies digests already known (the file is read once all the same,
    for its CRC32)."""
    known = sha256 or {}
    files = {}
    for name in names:
        path = manifest.parent / name
        crc, digest = _whole_file(path, name not in known)
        files[name] = {**fingerprint(path), "crc32": crc, "sha256": digest or known[name]}
    _write_entries(manifest, files)


def _write_entries(manifest: Path, files: Mapping[str, Mapping[str, object]]) -> None:
    data = {"format": _MANIFEST_FORMAT, "block_size": _BLOCK_SIZE, "blocks": _BLOCKS,
            "files": files}
    _write_atomic(manifest, json.dumps(data, indent=1, sort_keys=True) + "\n")


def _content_differs(path: Path, entry: dict[str, object]) -> str | None:
    """Which whole-file digest of ``entry`` the file fails, or None: the CRC32 where recorded,
    else the SHA-256 (whose pass then records the CRC32 in ``entry``)."""
    if "crc32" in entry:
        crc, _ = _whole_file(path, sha256=False)
        return None if crc == entry["crc32"] else "CRC32"
    crc, digest = _whole_file(path, sha256=True)
    if digest != entry["sha256"]:
        return "SHA-256"
    entry["crc32"] = crc
    return None


def verify_manifest(manifest: Path, full: bool | Callable[[str], bool] = False,
                    pinned: Mapping[str, str] | None = None) -> str | None:
    """Why the files a manifest lists are not as written, or None if they are: the cheap
    fingerprint always, the whole content of the files ``full`` names (True: all of them).
    ``pinned`` digests must be the ones recorded (a built-in GGUF of another version is not
    the one we want)."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = {name: dict(entry) for name, entry in data["files"].items()}
        if any(not entry.keys() >= _ENTRY_KEYS or not isinstance(entry.get("crc32", 0), int)
               for entry in files.values()):
            raise KeyError("file entry")
        if data["format"] != _MANIFEST_FORMAT or not files:
            return "manifest of another format"
    except FileNotFoundError:
        return "no manifest"
    # bad UTF-8 or JSON (ValueError), or JSON of another shape (the other three)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"manifest unreadable ({exc.__class__.__name__})"
    for name, digest in (pinned or {}).items():
        if files.get(name, {}).get("sha256") != digest:
            return f"{name}: recorded SHA-256 is not the expected one"
    learned = False
    for name, entry in files.items():
        path = manifest.parent / name
        try:
            actual = fingerprint(path)
            if actual["size"] != entry["size"]:
                return f"{name}: size differs ({actual['size']} bytes, {entry['size']} written)"
            if actual["blocks_sha256"] != entry["blocks_sha256"]:
                return f"{name}: sampled blocks differ"
            if full is True or (callable(full) and full(name)):
                learned |= "crc32" not in entry
                differs = _content_differs(path, entry)
                if differs is not None:
                    return f"{name}: {differs} differs"
        except OSError as exc:
            return f"{name} unreadable ({exc.__class__.__name__})"
    if learned:
        try:
            _write_entries(manifest, files)
        except OSError as exc:  # a read-only cache: checked by SHA-256 again next time
            logger.info("could not add CRC32s to %s: %s", manifest, exc)
    return None


def writer_tag() -> str:
    """``pid<PID>-<start time>``: the start time tells a reused PID apart (a restarted
    container often gets the same PID as the killed one)."""
    return f"pid{os.getpid()}-{int(psutil.Process().create_time())}"


def _writer_alive(pid: int, started: int) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 2  # boot-time jitter
    except psutil.NoSuchProcess:  # zombies included
        return False
    except psutil.AccessDenied:  # alive, someone else's
        return True


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete the temporary files and folders of killed writers in ``directory``: those whose
    recorded PID is gone, and PID-less (older) ones untouched for an hour."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        match = _TEMP_NAME.search(entry.name)
        try:
            if match is not None:
                stale = not _writer_alive(int(match["pid"]), int(match["started"]))
            elif _LEGACY_TEMP_NAME.search(entry.name):
                stale = time.time() - entry.stat().st_mtime > _LEGACY_STALE_SECONDS
            else:
                continue
            if not stale:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except FileNotFoundError:  # another process cleaned it first
            continue
        except OSError as exc:
            logger.warning("could not remove stale temporary %s: %s", entry, exc)
            continue
        logger.info("removed stale temporary %s (its writer is gone)", entry)
        removed.append(entry)
    return removed
