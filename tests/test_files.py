"""Reading a file the user named (``localspec.files``): only regular files are opened, never
more than the limit is read, and each failure is one error naming the file: a pipe with no
writer (which would block forever), an endless device, a folder, a file over the limit, bytes
that are not UTF-8 (with their line), a missing file. Parsed text the parser cannot hold
(nesting, endless integers) and text that is not Unicode are errors that say so."""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import pytest

from localspec.config import MAX_USER_FILE_BYTES
from localspec.errors import InputFileError, PresetError
from localspec.files import (
    check_unicode,
    parse_json,
    read_user_bytes,
    read_user_text,
    replace_lone_surrogates,
)


def _refused_within(path: Path, seconds: float = 10.0) -> str:
    """The message read_user_bytes refuses ``path`` with, in a thread that must end in time:
    a read that blocks (a FIFO opened with no writer) fails the test instead of hanging it."""
    result: dict[str, str] = {}

    def read() -> None:
        try:
            read_user_bytes(path, "prompts file")
            result["message"] = "read without an error"
        except InputFileError as exc:
            result["message"] = str(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"reading {path} blocked"
    return result["message"]


def test_fifo_without_writer_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    assert _refused_within(fifo) == (f"{fifo}: cannot read the prompts file: it is not a "
                                     "regular file")


def test_endless_device_is_refused() -> None:
    assert _refused_within(Path("/dev/zero")) == ("/dev/zero: cannot read the prompts file: it "
                                                  "is not a regular file")


def test_folder_and_missing_file(tmp_path: Path) -> None:
    assert _refused_within(tmp_path) == f"{tmp_path}: cannot read the prompts file: it is a folder"
    missing = tmp_path / "gone.jsonl"
    assert "No such file or directory" in _refused_within(missing)


def test_file_over_the_limit_is_refused_unread(tmp_path: Path) -> None:
    """Checked against the file's size before reading: a sparse file one byte over the default
    limit costs nothing to refuse."""
    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:
        f.truncate(MAX_USER_FILE_BYTES + 1)
    assert _refused_within(big) == (f"{big}: the prompts file is {MAX_USER_FILE_BYTES + 1:,} "
                                    "bytes, more than the 64 MiB a prompts file may be")
    small = tmp_path / "small.toml"
    small.write_bytes(b"x" * 11)
    with pytest.raises(PresetError, match="is 11 bytes, more than the 10 bytes a preset may be"):
        read_user_bytes(small, "preset", limit=10, error=PresetError)
    assert read_user_bytes(small, "preset", limit=11) == b"x" * 11


def test_text_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(b"one\ntwo\nthr\xe9e\n")
    with pytest.raises(InputFileError, match=r"text.txt line 3: not UTF-8 text \(byte 0xe9\)"):
        read_user_text(path, "text file")
    path.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\n")  # an editor's byte-order mark is fine
    assert read_user_text(path, "text file") == "caf\u00e9\n"


def test_check_unicode_names_the_first_lone_surrogate() -> None:
    assert check_unicode("caf\u00e9 \U0001f600", "x") == "caf\u00e9 \U0001f600"
    with pytest.raises(InputFileError, match=r"^--prompt: the byte 0xff is not UTF-8 "
                                             r"\(character 3\); give UTF-8 text$"):
        check_unicode("ab\udcff", "--prompt")
    with pytest.raises(PresetError, match=r"U\+D800 is a lone surrogate, not a character "
                                          r"\(character 1\) \(and 1 more\)"):
        check_unicode("\ud800\udfff", "x", PresetError)
    assert replace_lone_surrogates("a\ud800b\udcff") == "a\ufffdb\ufffd"


@pytest.mark.parametrize(("text", "needle"), [
    ("{", "not JSON: Expecting property name"),
    ("[" * 100_000 + "]" * 100_000, "not JSON that can be read: nested too deeply"),
    ("1" * 5000, "not JSON that can be read: holds an integer of more than "
                 f"{sys.get_int_max_str_digits()} digits"),
    ('{"\\ud800": 1}', "U+D800 is a lone surrogate"),
    ('[[["\\udc80"]]]', "the byte 0x80 is not UTF-8"),
], ids=["syntax", "deep-nesting", "5000-digits", "surrogate-key", "surrogate-deep"])
def test_parse_json_failures_are_errors_that_say_why(text: str, needle: str) -> None:
    with pytest.raises(InputFileError, match="^" + re.escape(f"x: {needle}")):
        parse_json(text, "x")


def test_parse_json_takes_what_json_takes() -> None:
    deep = "[" * 500 + "]" * 500  # deep, but within what the parser allows: no walk fails
    assert parse_json('{"a": [1, 2.5, "\\u00e9", null]}', "x") == {"a": [1, 2.5, "\u00e9", None]}
    assert parse_json(deep, "x") == parse_json(deep, "y")
