"""Presets as data: ``localspec/data/presets/*.toml`` (and the built-in draft heads beside them,
``localspec/data/heads/``), found through ``importlib.resources``.

This module finds and reads preset files; what a preset may say is ``localspec.config``'s
schema. A preset is named by its file stem (``cpu-qwen-coder-draft``) or by a path to any
``.toml`` file. Every error names the file, the key and what would be accepted. Torch-free.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from localspec.config import DEFAULT_PRESET, Preset, parse_preset
from localspec.errors import PresetError

__all__ = ["DEFAULT_PRESET", "Preset", "PresetError", "builtin_head_folder", "list_preset_names",
           "load_preset", "parse_preset", "preset_path", "presets_dir"]


def presets_dir() -> Traversable:
    """The shipped presets, inside the installed package."""
    return resources.files("localspec").joinpath("data", "presets")


def builtin_head_folder(name: str) -> Path:
    """Where the package keeps built-in draft head ``name`` (a name of ``BUILTIN_HEADS``)."""
    return Path(str(resources.files("localspec").joinpath("data", "heads", name)))


def list_preset_names() -> list[str]:
    return sorted(entry.name.removesuffix(".toml") for entry in presets_dir().iterdir()
                  if entry.name.endswith(".toml"))


def preset_path(name_or_path: str) -> Path | Traversable:
    """A name from the shipped presets (with or without .toml) or a path to a file."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" and path.is_file():
        return path
    candidate = presets_dir().joinpath(f"{name_or_path.removesuffix('.toml')}.toml")
    if "/" not in name_or_path and candidate.is_file():
        return candidate
    if path.suffix == ".toml" and path.exists():
        raise PresetError(f"preset '{name_or_path}' is not a file")
    raise PresetError(f"unknown preset '{name_or_path}': not a .toml file, and the shipped "
                      f"presets are {', '.join(list_preset_names()) or 'none'}")


def load_preset(name_or_path: str) -> Preset:
    path = preset_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PresetError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:
        raise PresetError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return parse_preset(data, where=str(path)).model_copy(update={"path": path})
