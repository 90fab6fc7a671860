"""Presets as data: the shipped ``presets/*.toml`` (and the built-in draft heads,
``localspec/data/heads/``, found through ``importlib.resources``).

This module finds and reads preset files; what a preset may say is ``localspec.config``'s
schema. A preset is named by its file stem (``cpu-qwen-coder-draft``) or by a path to any
``.toml`` file: a name with a ``/`` or ending in ``.toml`` that exists is that file (read as
any user's file: a folder or a pipe is refused, the size bounded), one that does not exist is
"no such file" (or a shipped preset of that stem); a bare name is a shipped preset or an error
that lists them. Every error names the file, the key and what would be accepted. Torch-free.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from localspec.config import DEFAULT_PRESET, Preset, parse_preset
from localspec.errors import PresetError
from localspec.files import parse_failure, read_user_text

MAX_PRESET_BYTES = 2**20  # a preset is a few dozen lines

__all__ = ["DEFAULT_PRESET", "Preset", "PresetError", "builtin_head_folder", "list_preset_names",
           "load_preset", "parse_preset", "preset_path", "presets_dir"]


def presets_dir() -> Traversable:
    """The shipped presets: the copy an installed wheel carries in ``localspec/data/presets/``,
    else (a source checkout, an editable install) the checkout's top-level ``presets/``;
    pyproject.toml maps the one onto the other."""
    packaged = resources.files("localspec").joinpath("data", "presets")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "presets"


def builtin_head_folder(name: str) -> Path:
    """Where the package keeps built-in draft head ``name`` (a name of ``BUILTIN_HEADS``)."""
    return Path(str(resources.files("localspec").joinpath("data", "heads", name)))


def list_preset_names() -> list[str]:
    return sorted(entry.name.removesuffix(".toml") for entry in presets_dir().iterdir()
                  if entry.name.endswith(".toml"))


def preset_path(name_or_path: str) -> Path | Traversable:
    """A name from the shipped presets (with or without .toml) or a path to a file; a path
    that exists is returned as it is (``load_preset`` reads it as a user's file)."""
    path = Path(name_or_path).expanduser()
    is_path = path.suffix == ".toml" or os.sep in name_or_path
    if is_path and os.path.lexists(path):
        return path
    stem = name_or_path.removesuffix(".toml")
    candidate = presets_dir().joinpath(f"{stem}.toml")
    if os.sep not in name_or_path and candidate.is_file():
        return candidate
    shipped = ", ".join(list_preset_names()) or "none"
    if os.sep in name_or_path:
        raise PresetError(f"{name_or_path}: no such file")
    if is_path:
        raise PresetError(f"{name_or_path}: no such file, and no shipped preset is called "
                          f"{stem} (they are {shipped})")
    raise PresetError(f"unknown preset '{name_or_path}': the shipped presets are {shipped}; "
                      "a preset of your own is named by a path ending in .toml")


def load_preset(name_or_path: str) -> Preset:
    path = preset_path(name_or_path)
    if isinstance(path, Path):  # a user's file
        text = read_user_text(path, "preset", limit=MAX_PRESET_BYTES, error=PresetError)
    else:
        text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{path}: not valid TOML: {exc}") from exc
    except (RecursionError, ValueError) as exc:  # what the TOML parser cannot hold
        raise PresetError(f"{path}: not TOML that can be read: {parse_failure(exc)}") from exc
    return parse_preset(data, where=str(path)).model_copy(update={"path": path})
