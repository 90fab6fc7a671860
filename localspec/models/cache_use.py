"""What the cache holds for one model, and freeing it (``localspec models list`` / ``free``).

Everything under ``cache_root()`` is made from a model's own files and is made again when it
is missing: an assembled built-in GGUF (from its packages), float conversions, the small
config-and-tokenizer folders of GGUF models (``gguf_meta``) and the CPU forward's packs
(``packed_store``). Each is found by the name it is kept under: a built-in model's name, a
user's .gguf file's ``gguf_cache_name`` (its stem and a key of its path, size and modification
time), or, for a model folder, the pack folders its path keys (``store_dir``). Freeing deletes
only those; the user's own files (a .gguf, a model folder, the Hugging Face cache) are never
touched, nor are the compiled kernels, which every model shares.
"""

from __future__ import annotations

import glob
import shutil
from dataclasses import dataclass
from pathlib import Path

from localspec.config import CPU_QUANTIZATIONS, cache_root
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import builtin_gguf_path, gguf_cache_name
from localspec.models.gguf_meta import META_FOLDER
from localspec.models.packed_store import store_dir

STORED_DTYPES = ("float32", "bfloat16", "float16")  # a folder per dtype (``cache.stored_as``)
_KEY = "?" * 12  # the hex key a pack folder's name ends in (``store_dir``)


def _bytes(path: Path) -> int:
    """Bytes of a file, or of the files under a folder (links not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@dataclass(frozen=True)
class CacheUse:
    """The cache's files for one model, by kind (each a file or folder that exists)."""

    gguf: tuple[Path, ...] = ()  # an assembled built-in GGUF and its manifest
    packs: tuple[Path, ...] = ()  # the CPU forward's packed weights
    conversions: tuple[Path, ...] = ()  # float conversions; config-and-tokenizer folders

    @property
    def paths(self) -> tuple[Path, ...]:
        return self.gguf + self.packs + self.conversions

    def sizes(self) -> dict[str, int]:
        """Bytes by kind ("gguf", "packs", "conversions") and in all ("total")."""
        out = {kind: sum(_bytes(p) for p in getattr(self, kind))
               for kind in ("gguf", "packs", "conversions")}
        return out | {"total": sum(out.values())}


def cache_cell(sizes: dict[str, int]) -> str:
    """``CacheUse.sizes()`` in words: "1.38 GiB packs + 12.0 MiB converted", "-" for none."""
    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    parts = [f"{size(sizes[kind])} {label}" for kind, label in
             (("gguf", "GGUF"), ("packs", "packs"), ("conversions", "converted")) if sizes[kind]]
    return " + ".join(parts) or "-"


def _folders(base: Path) -> list[Path]:
    """``base`` as stored in each dtype: ``base`` (float32), ``base.bfloat16``, ..."""
    return [base if dtype == "float32" else base.with_name(f"{base.name}.{dtype}")
            for dtype in STORED_DTYPES]


def _packs_of(folders: list[Path]) -> list[Path]:
    """Pack folders keyed by any of ``folders`` (whatever the key: files since changed)."""
    root = cache_root()
    return sorted({p for kind in CPU_QUANTIZATIONS for folder in folders
                   for p in (root / kind).glob(f"{glob.escape(folder.name)}-{_KEY}")
                   if p.is_dir()})


def cache_use(model: str, path: Path | None = None) -> CacheUse:
    """What the cache holds for ``model`` (a built-in name, a .gguf path, a model folder;
    ``path``: its file or folder where known)."""
    root = cache_root()
    if model in BUILTIN_MODELS:
        gguf = builtin_gguf_path(BUILTIN_MODELS[model])
        derived = _folders(root / "models" / model) + _folders(root / META_FOLDER / model)
        assembled = (gguf, gguf.with_name(gguf.name + ".manifest.json"))
        return CacheUse(tuple(p for p in assembled if p.exists()), tuple(_packs_of(derived)),
                        tuple(p for p in derived if p.is_dir()))
    path = path or Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        name = gguf_cache_name(path)
        derived = _folders(root / "converted" / name) + _folders(root / META_FOLDER / name)
        return CacheUse((), tuple(_packs_of(derived)), tuple(p for p in derived if p.is_dir()))
    if path.is_dir():
        return CacheUse((), tuple(p for kind in CPU_QUANTIZATIONS
                                  if (p := store_dir(path, kind)).is_dir()))
    return CacheUse()


def free_cache(use: CacheUse) -> int:
    """Delete what ``use`` lists; the bytes freed (what is gone already counts nothing)."""
    freed = 0
    for path in use.paths:
        size = _bytes(path) if path.exists() else 0
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        freed += size if not path.exists() else 0
    return freed
