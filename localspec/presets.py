"""Presets as data: the shipped ``presets/*.toml`` (and the built-in draft heads,
``localspec/data/heads/``, found through ``importlib.resources``).

This module finds and reads preset files; what a preset may say is ``localspec.config``'s
schema. A preset is named by its file stem (``cpu-qwen-coder-draft``) or by a path to any
``.toml`` file: a name with a ``/`` or ending in ``.toml`` that exists is that file (read as
any user's file: a folder or a pipe is refused, the size bounded), one that does not exist is
"no such file" (or a shipped preset of that stem); a bare name is a shipped preset or an error
that lists them. Every error names the file, the key and what would be accepted. Torch-free.

The user's own presets (written by ``localspec models drafters --make-preset``, or by hand) live
in ``user_presets_root()`` (``presets/`` in the user data folder). A bare name that is
not a shipped preset names one of them; they are listed after the shipped ones, and one may not
take a shipped preset's name (``save_user_preset`` refuses it; a file placed there by hand under
such a name is never read in the shipped one's place).
"""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from localspec.config import DEFAULT_PRESET, Preset, data_root, parse_preset
from localspec.errors import PresetError
from localspec.files import parse_failure, read_user_text

MAX_PRESET_BYTES = 2**20  # a preset is a few dozen lines
# A user preset's name: a file stem that reads the same on every system.
USER_PRESET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

__all__ = ["DEFAULT_PRESET", "Preset", "PresetError", "builtin_head_folder", "list_preset_names",
           "load_preset", "parse_preset", "preset_path", "presets_dir", "save_user_preset",
           "user_preset_names"]


def presets_dir() -> Traversable:
    """The shipped presets: the copy an installed wheel carries in ``localspec/data/presets/``,
    else (a source checkout, an editable install) the checkout's top-level ``presets/``;
    pyproject.toml maps the one onto the other."""
    packaged = resources.files("localspec").joinpath("data", "presets")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "presets"


def user_presets_root() -> Path:
    """The folder of the user's own presets: ``presets/`` in the user data folder."""
    return data_root() / "presets"


def builtin_head_folder(name: str) -> Path:
    """Where the package keeps built-in draft head ``name`` (a name of ``BUILTIN_HEADS``)."""
    return Path(str(resources.files("localspec").joinpath("data", "heads", name)))


def shipped_preset_names() -> list[str]:
    return sorted(entry.name.removesuffix(".toml") for entry in presets_dir().iterdir()
                  if entry.name.endswith(".toml"))


def user_preset_names() -> list[str]:
    """The user's presets (``<data>/presets/*.toml``) that do not take a shipped name."""
    folder = user_presets_root()
    if not folder.is_dir():
        return []
    shipped = set(shipped_preset_names())
    return sorted(path.stem for path in folder.glob("*.toml")
                  if path.is_file() and path.stem not in shipped)


def list_preset_names() -> list[str]:
    """The shipped presets, then the user's own."""
    return shipped_preset_names() + user_preset_names()


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
    own = user_presets_root() / f"{stem}.toml"
    if os.sep not in name_or_path and not is_path and stem in user_preset_names():
        return own
    shipped = ", ".join(shipped_preset_names()) or "none"
    own_names = user_preset_names()
    if own_names:
        shipped += f"; yours ({user_presets_root()}) are {', '.join(own_names)}"
    if os.sep in name_or_path:
        raise PresetError(f"{name_or_path}: no such file")
    if is_path:
        raise PresetError(f"{name_or_path}: no such file, and no shipped preset is called "
                          f"{stem} (they are {shipped})")
    raise PresetError(f"unknown preset '{name_or_path}': the shipped presets are {shipped}; "
                      "a preset of your own is named by a path ending in .toml, or saved in "
                      f"{user_presets_root()}")


def user_preset_file(name: str) -> Path:
    """Where the user's preset ``name`` is saved; PresetError for a name that is not a plain
    file stem or is a shipped preset's."""
    if not USER_PRESET_NAME.match(name):
        raise PresetError(f"preset name {name!r}: use letters, digits, '.', '_' and '-' (up to "
                          "64, starting with a letter or digit)")
    if name in shipped_preset_names():
        raise PresetError(f"'{name}' is a shipped preset's name: choose another name for yours")
    return user_presets_root() / f"{name}.toml"


def save_user_preset(name: str, text: str, replace: bool = False) -> Path:
    """Write ``text`` (a preset's TOML) as the user's preset ``name``, once it parses and
    validates; PresetError for a name that is not a plain file stem, is a shipped preset's
    or is taken (unless ``replace``), or for text that is not a valid preset."""
    path = user_preset_file(name)
    if path.exists() and not replace:
        raise PresetError(f"a preset '{name}' already exists ({path}): choose another name, or "
                          "delete that file first")
    parse_preset(tomllib.loads(text), where=f"preset '{name}'")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
