"""The model library: every model this machine has, found where models live.

Four sources, listed in this order:

- **built-in**: the GGUF checkpoints LocalSpec ships (``models.builtin``), described from the
  assembled file in the cache once a first start has made it;
- **models folder**: ``config.models_root()`` (``LOCALSPEC_MODELS``, else ``models/`` in the
  user data folder), where downloads from the Hub land; every ``.gguf`` file and every folder
  with a config.json in it, named by its path relative to the folder (``org/name``);
- **added**: ``.gguf`` files and model folders the user added by path, remembered in a small
  JSON file in the data folder (``library_path()``); the files stay where they are;
- **hf cache**: the Hugging Face cache (``huggingface_hub.scan_cache_dir``), each repo with a
  config.json and weights as ``hf:org/name``, each ``.gguf`` in a repo as
  ``hf:org/name/file.gguf``.

An entry says what a preset's ``model`` key takes for it (a built-in name, a repo id or a path)
and what ``models.describe`` reads from its files, and what the cache holds for it
(``cache_use``: packs, conversions). An entry whose files cannot be read is listed with the
reason, never hidden. Adding checks the model first (``describe.check_model``)
and records nothing if it would not start. Removing forgets an added path (its files stay),
deletes a models-folder entry or a Hugging Face cache repo only when told ``yes`` (and says what
that frees), and never touches a built-in model. Freeing deletes only what the cache
derived from a model (``free_entry``), never its own files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from localspec.config import data_root, models_root
from localspec.errors import InputFileError, LocalSpecError, ModelLoadError
from localspec.files import parse_json, read_user_text
from localspec.models.builtin import BUILTIN_MODELS, BuiltinModel
from localspec.models.cache import builtin_gguf_path, builtin_header
from localspec.models.cache_use import CacheUse, cache_use, free_cache
from localspec.models.describe import ModelFacts, check_model, describe, describe_gguf

SOURCES = ("built-in", "models folder", "added", "hf cache")
MAX_LIBRARY_PATHS = 10_000  # paths the library remembers; a bound on what its file may hold
MAX_LIBRARY_FILE_BYTES = 4 * 2**20
MAX_DEPTH = 4  # how deep the models folder is searched (org/name/file.gguf is 3)
DOWNLOADS_FOLDER = ".downloads"  # in the models folder: downloads under way (``models.hub``)


@dataclass(frozen=True)
class LibraryEntry:
    """One model of the library."""

    name: str  # how ``models remove`` and ``models drafters`` name it
    source: str  # one of SOURCES
    model: str  # what a preset's ``model`` key takes for it
    path: Path | None  # its file or folder (None: a built-in not assembled yet)
    facts: ModelFacts | None = None
    error: str | None = None  # why its files cannot be read
    size_bytes: int | None = None  # on disk, where it differs from facts' (a cache repo)
    note: str | None = None

    @property
    def size(self) -> int | None:
        if self.size_bytes is not None:
            return self.size_bytes
        return self.facts.size_bytes if self.facts is not None else None

    def to_json(self) -> dict[str, object]:
        f = self.facts
        return {"name": self.name, "source": self.source, "model": self.model,
                "path": str(self.path) if self.path else None, "size_bytes": self.size,
                "kind": f.kind if f else None, "architecture": f.architecture if f else None,
                "quantization": f.quantization if f else None,
                "context_length": f.context_length if f else None,
                "native": f.native if f else None,
                "native_note": f.native_reason if f else None,
                "head_for": f.head_for if f else None, "error": self.error, "note": self.note}


def _entry(name: str, source: str, model: str, path: Path | None,
           facts: Callable[[], ModelFacts] | None = None, **extra: object) -> LibraryEntry:
    """An entry described from its files (``facts``: how, else ``describe(path)``); one whose
    files cannot be read carries the reason."""
    try:
        found = facts() if facts is not None else describe(path)  # type: ignore[arg-type]
        return LibraryEntry(name, source, model, path, found, **extra)  # type: ignore[arg-type]
    except (LocalSpecError, OSError) as exc:
        return LibraryEntry(name, source, model, path, error=str(exc), **extra)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- sources


def builtin_entries() -> list[LibraryEntry]:
    entries = []
    for model in BUILTIN_MODELS.values():
        path = builtin_gguf_path(model)
        if path.is_file():
            entries.append(_entry(model.name, "built-in", model.name, path))
        else:  # described from the header in its packages' first bytes
            entries.append(_entry(model.name, "built-in", model.name, None,
                                  partial(_builtin_facts, model, path),
                                  size_bytes=model.size,
                                  note=f"read from its packages ({model.description})"))
    return entries


def _builtin_facts(model: BuiltinModel, path: Path) -> ModelFacts:
    return describe_gguf(path, header=builtin_header(model))


def _walk_models(root: Path, folder: Path, depth: int) -> Iterable[Path]:
    """Model folders (with a config.json) and .gguf files under ``folder``, skipping hidden
    entries (downloads under way) and not descending into a model folder."""
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return
    for child in children:
        if child.name.startswith("."):
            continue
        if child.is_dir():
            if (child / "config.json").is_file():
                yield child
            elif depth < MAX_DEPTH:
                yield from _walk_models(root, child, depth + 1)
        elif child.suffix.lower() == ".gguf" and child.is_file():
            yield child


def models_folder_entries(root: Path | None = None) -> list[LibraryEntry]:
    root = root or models_root()
    return [_entry(path.relative_to(root).as_posix(), "models folder", str(path), path)
            for path in _walk_models(root, root, 1)]


def hf_cache_entries(cache_dir: Path | None = None) -> list[LibraryEntry]:
    """The Hugging Face cache's model repos: each with a config.json and weights in its newest
    revision, and each .gguf file in one."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir or constants.HF_HUB_CACHE)
    except (CacheNotFound, OSError):
        return []
    entries = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified)
        snapshot = revision.snapshot_path
        names = {f.file_name for f in revision.files}
        if "config.json" in names and any(n.endswith(".safetensors") for n in names):
            entries.append(_entry(f"hf:{repo.repo_id}", "hf cache", repo.repo_id, snapshot,
                                  size_bytes=repo.size_on_disk))
        for file in sorted(revision.files, key=lambda f: str(f.file_path)):
            if file.file_name.lower().endswith(".gguf"):
                inner = file.file_path.relative_to(snapshot).as_posix()
                entries.append(_entry(f"hf:{repo.repo_id}/{inner}", "hf cache",
                                      str(file.file_path), file.file_path,
                                      size_bytes=file.size_on_disk))
    return entries


# ----------------------------------------------------------------------------- added paths


def library_path() -> Path:
    """The JSON file of the paths added to the library, in the user data folder."""
    return data_root() / "library.json"


def read_added_paths(path: Path | None = None) -> list[Path]:
    """The paths added to the library, in the order they were added."""
    path = path or library_path()
    if not path.exists():
        return []
    where = f"the model library's list of added paths ({path})"
    text = read_user_text(path, "library file", limit=MAX_LIBRARY_FILE_BYTES)
    data = parse_json(text, str(path))
    paths = data.get("paths") if isinstance(data, dict) else None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise InputFileError(f"{where} is damaged: it should be {{\"paths\": [...]}}; fix it, "
                             "or delete it to forget the added paths (the models stay)")
    return [Path(p) for p in paths]


def write_added_paths(paths: list[Path], path: Path | None = None) -> None:
    """Replace the list of added paths, atomically (a temp file renamed into place)."""
    path = path or library_path()
    if len(paths) > MAX_LIBRARY_PATHS:
        raise InputFileError(f"the model library holds at most {MAX_LIBRARY_PATHS} added paths")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputFileError(f"cannot write the model library's list of added paths "
                             f"({path}): {exc.strerror or exc}; check LOCALSPEC_DATA") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"paths": [str(p) for p in paths]}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def added_entries(taken: set[str]) -> list[LibraryEntry]:
    """The added paths, named by their file or folder name (by the whole path where ``taken``
    already has that name)."""
    entries = []
    for path in read_added_paths():
        name = path.name if path.name not in taken else str(path)
        taken.add(name)
        if not path.exists():
            entries.append(LibraryEntry(name, "added", str(path), path,
                                        error=f"{path}: no longer there (moved or deleted); "
                                              f"`localspec models remove {name}` forgets it"))
        else:
            entries.append(_entry(name, "added", str(path), path))
    return entries


# ----------------------------------------------------------------------------- the library


def list_library(hf_cache: Path | None = None) -> list[LibraryEntry]:
    """Every model of the library: built-in, models folder, added, Hugging Face cache."""
    entries = builtin_entries() + models_folder_entries()
    entries += added_entries({e.name for e in entries})
    return entries + hf_cache_entries(hf_cache)


def find_entry(name: str, entries: list[LibraryEntry]) -> LibraryEntry:
    """The entry called ``name`` (or whose model or path is ``name``); InputFileError listing
    the names when there is none."""
    for entry in entries:
        if name == entry.name:
            return entry
    resolved = Path(name).expanduser().resolve() if name else None
    for entry in entries:
        if name == entry.model or (entry.path is not None and resolved == entry.path.resolve()):
            return entry
    names = ", ".join(e.name for e in entries) or "none"
    raise InputFileError(f"no model '{name}' in the library (`localspec models list`): it has "
                         f"{names}")


def _owner(path: Path, entries: list[LibraryEntry]) -> LibraryEntry | None:
    """The entry that already covers ``path``: the same file or folder, or one inside it."""
    for entry in entries:
        if entry.path is not None and (path == entry.path.resolve()
                                       or path.is_relative_to(entry.path.resolve())):
            return entry
    return None


def add_path(given: str, hf_cache: Path | None = None) -> LibraryEntry:
    """Add a ``.gguf`` file or a model folder by path, once it is checked to be a model that
    can run; nothing is recorded otherwise."""
    path = Path(given).expanduser().resolve()
    if not path.exists():
        raise InputFileError(f"{given}: no such file or folder")
    entries = list_library(hf_cache)
    owner = _owner(path, entries)
    if owner is not None:
        raise InputFileError(f"{given} is already in the library as '{owner.name}' "
                             f"({owner.source})")
    if path.is_relative_to(models_root().resolve()):
        raise InputFileError(f"{given} is inside the models folder ({models_root()}), which the "
                             "library lists by itself: put a model folder or a .gguf there")
    facts = check_model(path)
    write_added_paths([*read_added_paths(), path])
    taken = {e.name for e in entries}
    name = path.name if path.name not in taken else str(path)
    return LibraryEntry(name, "added", str(path), path, facts)


# ----------------------------------------------------------------------------- removing


@dataclass(frozen=True)
class Removal:
    """What ``remove`` did."""

    entry: LibraryEntry
    freed_bytes: int
    message: str
    deleted: list[Path] = field(default_factory=list)


def _gib(size: int | None) -> str:
    return "an unknown size" if size is None else f"{size / 2**30:.2f} GiB"


def _delete_path(path: Path) -> int:
    """Delete a file or folder; the bytes it held."""
    size = path.stat().st_size if path.is_file() else sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return size


def _prune_empty(folder: Path, root: Path) -> None:
    """Remove ``folder`` and its parents below ``root`` while they are empty."""
    while folder != root and folder.is_relative_to(root):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def remove_entry(name: str, yes: bool, hf_cache: Path | None = None) -> Removal:
    """Forget an added path, or (``yes``) delete a models-folder entry or a Hugging Face cache
    repo; a built-in model is never removed. InputFileError says what deleting would free
    when ``yes`` is missing."""
    entries = list_library(hf_cache)
    entry = find_entry(name, entries)
    if entry.source == "built-in":
        model = BUILTIN_MODELS[entry.name]
        more = ", ..." if len(model.packages) > 2 else ""
        raise InputFileError(f"'{entry.name}' is a built-in model: it ships in the packages "
                             f"{', '.join(model.packages[:2])}{more} (`pip uninstall` them to "
                             "remove it); nothing was deleted")
    if entry.source == "added":
        write_added_paths([p for p in read_added_paths() if p != entry.path])
        return Removal(entry, 0, f"forgot {entry.path} (its files stay where they are; "
                                 "nothing freed)")
    if not yes:
        what = (f"deletes {entry.path}" if entry.source == "models folder" else
                f"deletes repo {_repo_of(entry)} from the Hugging Face cache (every revision, "
                "every file)")
        raise InputFileError(f"removing '{entry.name}' {what}, freeing {_gib(entry.size)}: "
                             "run again with --yes to delete it")
    if entry.source == "models folder":
        assert entry.path is not None
        freed = _delete_path(entry.path)
        _prune_empty(entry.path.parent, models_root())
        return Removal(entry, freed, f"deleted {entry.path}, freed {_gib(freed)}", [entry.path])
    return _delete_cached_repo(entry, hf_cache)


def entry_cache_use(entry: LibraryEntry) -> CacheUse:
    """What the cache holds for ``entry`` (its packs, conversions, an assembled GGUF)."""
    return cache_use(entry.model, None if entry.source == "built-in" else entry.path)


def free_entry(name: str, hf_cache: Path | None = None) -> Removal:
    """Delete what the cache holds for the model ``name``: its packs and conversions, and a
    built-in's assembled GGUF (made again from its packages at its next start). The model's
    own files stay; its next start packs it again."""
    entry = find_entry(name, list_library(hf_cache))
    use = entry_cache_use(entry)
    freed = free_cache(use)
    if not use.paths:
        return Removal(entry, 0, f"the cache holds nothing for {entry.name}: nothing freed")
    return Removal(entry, freed, f"freed {_gib(freed)} of the cache for {entry.name} "
                                 f"({len(use.packs)} packs, {len(use.conversions)} converted "
                                 f"folders{', its assembled GGUF' if use.gguf else ''}); its "
                                 "own files stay, and its next start packs it again",
                   list(use.paths))


def _repo_of(entry: LibraryEntry) -> str:
    """The repo id of a Hugging Face cache entry (``hf:org/name[/file.gguf]``)."""
    return "/".join(entry.name.removeprefix("hf:").split("/")[:2])


def _delete_cached_repo(entry: LibraryEntry, hf_cache: Path | None) -> Removal:
    from huggingface_hub import constants, scan_cache_dir

    repo_id = _repo_of(entry)
    info = scan_cache_dir(hf_cache or constants.HF_HUB_CACHE)
    repos = [r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"]
    if not repos:
        raise ModelLoadError(f"{repo_id} is no longer in the Hugging Face cache")
    strategy = info.delete_revisions(*(rev.commit_hash for rev in repos[0].revisions))
    strategy.execute()
    return Removal(entry, strategy.expected_freed_size,
                   f"deleted {repo_id} from the Hugging Face cache ({repos[0].repo_path}), "
                   f"freed {_gib(strategy.expected_freed_size)}", [repos[0].repo_path])
