"""``localspec models [list | add PATH_OR_REPO | remove NAME | free NAME | drafters TARGET]``:
the model library on the command line (``localspec.models.library``, ``hub``, ``drafter_finder``).

Thin: each action calls the library and prints a table (or one JSON object with ``--json``).
A download shows huggingface_hub's byte progress bar (tqdm, on stderr); Ctrl-C keeps what
arrived and says how to continue. Every expected failure is a ``LocalSpecError``, which ``main``
turns into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from localspec.config import models_root
from localspec.errors import InputFileError
from localspec.models.library import LibraryEntry

Log = Callable[[str], None]
EXIT_INTERRUPTED = 130


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
    from localspec.models.cache_use import cache_cell
    from localspec.models.library import entry_cache_use

    rows = [("NAME", "SOURCE", "ARCH", "SIZE", "QUANTIZATION", "CONTEXT", "CACHE", "CPU PATH")]
    for e in entries:
        f = e.facts
        rows.append((e.name, e.source, (f.architecture or "?") if f else "?", _size(e.size),
                     (f.quantization or "?") if f else "?",
                     str(f.context_length or "?") if f else "?",
                     cache_cell(entry_cache_use(e).sizes()), _native(e)))
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:7], widths, strict=True))
                     + "  " + row[7] for row in rows)


def _where() -> str:
    from huggingface_hub import constants

    from localspec.models.library import library_path

    return (f"models folder: {models_root()} (LOCALSPEC_MODELS); added paths: {library_path()};"
            f" Hugging Face cache: {constants.HF_HUB_CACHE}")


def _list(args: argparse.Namespace) -> int:
    from localspec.models.library import list_library

    entries = list_library()
    if args.json:
        from localspec.models.library import entry_cache_use

        models = [e.to_json() | {"cache_bytes": entry_cache_use(e).sizes()} for e in entries]
        print(json.dumps({"models_folder": str(models_root()), "models": models},
                         ensure_ascii=False))
        return 0
    print(format_entries(entries))
    print(f"\n{_where()}\nCACHE: what the cache made from a model (packs for the CPU forward, "
          "conversions); `localspec models free NAME` deletes it")
    return 0


def _added(entries: list[LibraryEntry], args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"added": [e.to_json() for e in entries]}, ensure_ascii=False))
        return 0
    print(format_entries(entries))
    names = " or ".join(e.name for e in entries[:2])
    print(f"\nadded; its drafters: localspec models drafters {names}")
    return 0


def _add(args: argparse.Namespace, log: Log) -> int:
    from localspec.models.hub import looks_like_repo_id
    from localspec.models.library import add_path

    source = args.source
    if Path(source).expanduser().exists():
        if args.include or args.revision:
            raise InputFileError("--include and --revision are for a Hub repo, not a path")
        return _added([add_path(source)], args)
    if not looks_like_repo_id(source):
        raise InputFileError(f"{source}: no such file or folder, and not a Hugging Face repo id "
                             "(org/name)")
    return _download(source, args, log)


def _download(repo_id: str, args: argparse.Namespace, log: Log) -> int:
    from tqdm.auto import tqdm

    from localspec.models.hub import download, partial_bytes
    from localspec.models.library import models_folder_entries

    try:
        paths = download(repo_id, args.include, args.revision, tqdm_class=tqdm, log=log)
    except KeyboardInterrupt:
        kept = partial_bytes(repo_id)
        log(f"localspec: interrupted: {_size(kept)} of {repo_id} kept; run the same command "
            "again to continue the download")
        return EXIT_INTERRUPTED
    wanted = {p.resolve() for p in paths}
    entries = [e for e in models_folder_entries()
               if e.path is not None and e.path.resolve() in wanted]
    return _added(entries, args)


def _remove(args: argparse.Namespace) -> int:
    from localspec.models.library import remove_entry

    removal = remove_entry(args.name, args.yes)
    print(removal.message)
    return 0


def _free(args: argparse.Namespace) -> int:
    from localspec.models.library import free_entry

    removal = free_entry(args.name)
    if args.json:
        print(json.dumps({"name": removal.entry.name, "freed_bytes": removal.freed_bytes,
                          "deleted": [str(p) for p in removal.deleted]}, ensure_ascii=False))
        return 0
    print(removal.message)
    return 0


def _drafters(args: argparse.Namespace) -> int:
    from localspec.models.drafter_finder import find_drafters, make_preset
    from localspec.presets import user_presets_root

    if args.drafter and not args.make_preset:
        raise InputFileError("--drafter chooses the drafter of --make-preset NAME: give both")
    report = find_drafters(args.target)
    made = make_preset(args.make_preset, report, args.drafter) if args.make_preset else None
    if args.json:
        print(json.dumps({"target": report.target.to_json(), "quantization": report.quantization,
                          "drafters": [c.to_json() for c in report.choices],
                          "not_offered": [{"name": n, "why": w} for n, w in report.refused],
                          "preset": str(made) if made else None}, ensure_ascii=False))
        return 0
    print(f"Drafters for {report.target.name} (served as {report.quantization} on the CPU):")
    rows = [(c.key, c.method, c.quantization if c.method == "draft_model" else "",
             "fits" if c.fits else "--", c.reason) for c in report.choices]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True))
              + "  " + row[4])
    for name, why in report.refused:
        print(f"  not offered: {name}: {why}")
    if made is not None:
        print(f"\nsaved preset {args.make_preset}: {made}\nrun it: localspec generate --preset "
              f"{args.make_preset} --prompt ...  (the app lists it too)")
    else:
        print(f"\nmake a preset: localspec models drafters {args.target} --make-preset NAME "
              f"[--drafter KEY] (saved in {user_presets_root()})")
    return 0


def run_models(args: argparse.Namespace, log: Log) -> int:
    """Run ``localspec models ACTION`` (no action: list)."""
    action = args.models_action or "list"
    if action == "list":
        return _list(args)
    if action == "add":
        return _add(args, log)
    if action == "remove":
        return _remove(args)
    if action == "free":
        return _free(args)
    return _drafters(args)
