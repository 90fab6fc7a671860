"""Integrity of cached files: fingerprints, manifests, and the temp files of killed writers.

A disk error or a killed copy can leave a cached file damaged, even at the same size, and that
must neither give garbage answers nor crash every later start. A manifest records per file its
size, full SHA-256 and a fingerprint (SHA-256 of 16 sampled blocks, first and last included).
The fingerprint is checked at every load (milliseconds, even for 7 GB); the full SHA-256 where
the whole file is read anyway, or in the background (``loading.audit_cache``). Not caught at
load: same-size damage between the sampled blocks.

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
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

MANIFEST_NAME = "localspec-manifest.json"  # inside a converted folder
_MANIFEST_FORMAT = 1  # bump when the fingerprint's sampling changes: old manifests then fail
_BLOCKS, _BLOCK_SIZE = 16, 64 * 1024  # the fingerprint: 1 MiB read from 16 places
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
    """Record size, fingerprint and full SHA-256 of ``names`` (relative to the manifest's
    folder); ``sha256`` supplies digests already known, saving a re-read."""
    known = sha256 or {}
    files = {}
    for name in names:
        path = manifest.parent / name
        files[name] = {**fingerprint(path), "sha256": known.get(name) or sha256_file(path)}
    data = {"format": _MANIFEST_FORMAT, "block_size": _BLOCK_SIZE, "blocks": _BLOCKS,
            "files": files}
    _write_atomic(manifest, json.dumps(data, indent=1, sort_keys=True) + "\n")


def verify_manifest(manifest: Path, full: bool = False,
                    pinned: Mapping[str, str] | None = None) -> str | None:
    """Why the files a manifest lists are not as written, or None if they are: the cheap
    fingerprint always, the full SHA-256 with ``full``. ``pinned`` digests must be the ones
    recorded (a built-in GGUF of another version is not the one we want)."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = {name: (entry["size"], entry["blocks_sha256"], entry["sha256"])
                 for name, entry in data["files"].items()}
        if data["format"] != _MANIFEST_FORMAT or not files:
            return "manifest of another format"
    except FileNotFoundError:
        return "no manifest"
    # bad UTF-8 or JSON (ValueError), or JSON of another shape (the other three)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"manifest unreadable ({exc.__class__.__name__})"
    for name, digest in (pinned or {}).items():
        if files.get(name, (0, "", ""))[2] != digest:
            return f"{name}: recorded SHA-256 is not the expected one"
    for name, (size, blocks_sha256, sha256) in files.items():
        path = manifest.parent / name
        try:
            actual = fingerprint(path)
        except OSError as exc:
            return f"{name} unreadable ({exc.__class__.__name__})"
        if actual["size"] != size:
            return f"{name}: size differs ({actual['size']} bytes, {size} written)"
        if actual["blocks_sha256"] != blocks_sha256:
            return f"{name}: sampled blocks differ"
        if full and sha256_file(path) != sha256:
            return f"{name}: SHA-256 differs"
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
