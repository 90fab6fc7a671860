"""Reading a file the user named: the one place that bounds the read and explains failures.

A user's file (a prompts set, a preset, a text to score, a training document, a head's
config.json) may be missing, a directory, a device or pipe that never ends (``/dev/zero``, a
FIFO), far larger than any such file should be, or not UTF-8. Each is an error of the caller's
family (``error``: ``InputFileError`` by default) that names the file, what it was for and what
to do. Only regular files are opened, so a pipe without a writer cannot hang the read, and no
more than ``limit`` bytes are ever read. Torch-free.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from localspec.config import MAX_USER_FILE_BYTES
from localspec.errors import InputFileError, LocalSpecError


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def read_user_bytes(path: str | Path, what: str, *, limit: int = MAX_USER_FILE_BYTES,
                    error: type[LocalSpecError] = InputFileError) -> bytes:
    """The bytes of the regular file ``path`` (``~`` expanded), at most ``limit`` of them;
    ``error`` when it is missing, not a regular file, unreadable or larger than ``limit``."""
    where = Path(path).expanduser()
    try:
        info = os.stat(where)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise error(f"{path}: cannot read the {what}: it is {kind}")
        if info.st_size > limit:
            raise error(f"{path}: the {what} is {_mib(info.st_size)}, more than the "
                        f"{_mib(limit)} a {what} may be")
        with where.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:  # missing, no permission, a path through a file
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}") from exc
    if len(data) > limit:  # grew while we read it
        raise error(f"{path}: the {what} is more than the {_mib(limit)} a {what} may be")
    return data


def decode_text(data: bytes, where: str, error: type[LocalSpecError] = InputFileError) -> str:
    """UTF-8 text (an editor's byte-order mark is no error); ``error`` names the line of the
    first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise error(f"{where} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save "
                    "the file as UTF-8") from exc


def read_user_text(path: str | Path, what: str, *, limit: int = MAX_USER_FILE_BYTES,
                   error: type[LocalSpecError] = InputFileError) -> str:
    """``read_user_bytes`` decoded as UTF-8 (``decode_text``)."""
    return decode_text(read_user_bytes(path, what, limit=limit, error=error), str(path), error)
