"""``localspec models [list | add PATH | remove NAME]``: the model library on the command
line (``localspec.models.library``).

Thin: each action calls the library and prints a table (or one JSON object with ``--json``).
Every expected failure is a ``LocalSpecError``, which ``main`` turns into one line and exit
status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from localspec.config import library_path, models_root
from localspec.errors import InputFileError
from localspec.models.library import LibraryEntry

Log = Callable[[str], None]


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _native(entry: LibraryEntry) -> str:
    if entry.error is not None:
        return f"unreadable: {entry.error}"
    if entry.facts is None:
        return entry.note or ""
    return "native" if entry.facts.native else f"not native: {entry.facts.native_reason}"


def format_entries(entries: list[LibraryEntry]) -> str:
    """The library as a table, one model a row, what decides its path last."""
    rows = [("NAME", "SOURCE", "ARCH", "SIZE", "QUANTIZATION", "CONTEXT", "CPU PATH")]
    for e in entries:
        f = e.facts
        rows.append((e.name, e.source, (f.architecture or "?") if f else "?", _size(e.size),
                     (f.quantization or "?") if f else "?",
                     str(f.context_length or "?") if f else "?", _native(e)))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:6], widths, strict=True))
                     + "  " + row[6] for row in rows)


def _where() -> str:
    from huggingface_hub import constants

    return (f"models folder: {models_root()} (LOCALSPEC_MODELS); added paths: {library_path()};"
            f" Hugging Face cache: {constants.HF_HUB_CACHE}")


def _list(args: argparse.Namespace) -> int:
    from localspec.models.library import list_library

    entries = list_library()
    if args.json:
        print(json.dumps({"models_folder": str(models_root()),
                          "models": [e.to_json() for e in entries]}, ensure_ascii=False))
        return 0
    print(format_entries(entries))
    print(f"\n{_where()}")
    return 0


def _added(entries: list[LibraryEntry], args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"added": [e.to_json() for e in entries]}, ensure_ascii=False))
        return 0
    print(format_entries(entries))
    return 0


def _add(args: argparse.Namespace, log: Log) -> int:
    from localspec.models.library import add_path

    source = args.source
    if not Path(source).expanduser().exists():
        raise InputFileError(f"{source}: no such file or folder")
    return _added([add_path(source)], args)


def _remove(args: argparse.Namespace) -> int:
    from localspec.models.library import remove_entry

    removal = remove_entry(args.name, args.yes)
    print(removal.message)
    return 0


def run_models(args: argparse.Namespace, log: Log) -> int:
    """Run ``localspec models ACTION`` (no action: list)."""
    action = args.models_action or "list"
    if action == "list":
        return _list(args)
    if action == "add":
        return _add(args, log)
    return _remove(args)
