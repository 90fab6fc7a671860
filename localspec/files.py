"""Reading a file the user named: the one place that bounds the read and explains failures.

A user's file (a prompts set, a preset, a text to score, a training document, a head's
config.json) may be missing, a directory, a device or pipe that never ends (``/dev/zero``, a
FIFO), far larger than any such file should be, or not UTF-8. Each is an error of the caller's
family (``error``: ``InputFileError`` by default) that names the file, what it was for and what
to do. Only regular files are opened, so a pipe without a writer cannot hang the read, and no
more than ``limit`` bytes are ever read.

What is parsed from the user's text is checked the same way: JSON nested deeper than the
parser's recursion allows, or an integer longer than Python converts
(``sys.get_int_max_str_digits``), is an error that says so (``parse_json``, ``parse_failure``),
not an internal error; and text holding lone surrogates is refused (``check_unicode``). Those
come from bytes that are not UTF-8 in a command-line argument (Python keeps each as a
surrogate escape, U+DC80-U+DCFF) or from a JSON ``\ud800`` escape, and no tokenizer, JSON
encoder or UTF-8 terminal takes them. Torch-free.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

from localspec.config import MAX_USER_FILE_BYTES
from localspec.errors import InputFileError, LocalSpecError


def _size(size: int) -> str:
    """Whole MiB as MiB, anything else in bytes: a limit and a file one byte over it must not
    read the same."""
    return f"{size // 2**20} MiB" if size and size % 2**20 == 0 else f"{size:,} bytes"


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
            raise error(f"{path}: the {what} is {_size(info.st_size)}, more than the "
                        f"{_size(limit)} a {what} may be")
        with where.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:  # missing, no permission, a path through a file
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}") from exc
    if len(data) > limit:  # grew while we read it
        raise error(f"{path}: the {what} is more than the {_size(limit)} a {what} may be")
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


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _describe(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, kept as a surrogate escape
        return f"the byte 0x{code - 0xDC00:02x} is not UTF-8"
    return f"U+{code:04X} is a lone surrogate, not a character"


def check_unicode(text: str, where: str, error: type[LocalSpecError] = InputFileError) -> str:
    """``text`` when it holds no lone surrogate; else ``error`` naming ``where``, the first
    one's position (1-based) and what it was."""
    found = LONE_SURROGATE.search(text)
    if found is None:
        return text
    count = count_lone_surrogates(text)
    others = f" (and {count - 1} more)" if count > 1 else ""
    raise error(f"{where}: {_describe(found.group())} (character {found.start() + 1}){others}; "
                "give UTF-8 text")


def count_lone_surrogates(text: str) -> int:
    return len(LONE_SURROGATE.findall(text))


def replace_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD, the replacement character."""
    return LONE_SURROGATE.sub("\ufffd", text)


def parse_failure(exc: RecursionError | ValueError) -> str:
    """What is wrong with a text whose parser raised ``exc``: nesting deeper than the parser's
    recursion allows, or an integer longer than Python converts; else the parser's message."""
    if isinstance(exc, RecursionError):
        return "nested too deeply to read (lists or objects inside one another)"
    if "integer string conversion" in str(exc):
        return (f"holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                "longer than any setting or count")
    return str(exc)


def parse_json(text: str, where: str, error: type[LocalSpecError] = InputFileError) -> object:
    """``json.loads(text)`` with each failure an ``error`` naming ``where`` (``parse_failure``),
    and every string in it, keys too, checked by ``check_unicode``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not JSON: {exc}") from exc
    except (RecursionError, ValueError) as exc:
        raise error(f"{where}: not JSON that can be read: {parse_failure(exc)}") from exc
    pending = [value]  # a loop, not recursion: the parser allowed the depth, a walk might not
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            check_unicode(item, where, error)
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            pending += item
    return value
