"""The on-disk model cache: built-in GGUF files assembled from their packages, GGUF files
converted into safetensors folders for the paths that read float weights, and a manifest that
proves each is still intact.

The CPU forward packs a GGUF model straight from its file (``gguf_pack``) and never reads a
conversion. The other paths (quantization "none", int8-weight-only, bitsandbytes) load float
weights: transformers dequantizes a GGUF on load, which is slow (~80 s for a 1.5B model on 2
CPU cores), so the result is cached once, when such a path first asks, as a plain safetensors
folder. A GGUF-loaded model refuses ``save_pretrained`` ("not serializable"), so we write its
config, tokenizer and state dict ourselves.

Layout under ``cache_root()`` (``LOCALSPEC_CACHE`` moves it):
  gguf/<file>.gguf (+ .manifest.json)    assembled built-in checkpoints
  meta/<name or stem-key>[.<dtype>]/     config and tokenizer of a GGUF model (``gguf_meta``)
  models/<built-in name>/                converted built-in models (manifest inside)
  converted/<stem>-<key>/                converted user .gguf files (manifest inside)
  w8a8/, w4a8/, requant-q4k/<folder>-<key>/  the CPU forward's packed weights (``packed_store``)
  kernels/kernels-<variant>-<key>.so     the CPU forward's compiled kernels (``runtime.kernels``),
                                         keyed on their sources, flags and compiler

Every load checks the artefact's manifest (``integrity``); a mismatch, or a missing or
unreadable manifest, rebuilds the artefact from its source, saying so. What a load reads whole
is checked whole, by its CRC32: a converted or meta folder's config and tokenizer files at
every load (a few MB), a conversion's weights before a load reads them (``weights_intact``: the
1.5B's 3.5 GB in ~1.3 s here), a built-in GGUF before each conversion and before a pack is made
from it. The packed weights check each tensor as they read it (``packed_store``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from localspec.config import cache_root
from localspec.errors import ModelLoadError
from localspec.models.builtin import BuiltinModel
from localspec.models.integrity import (
    MANIFEST_NAME,
    remove_stale_temps,
    sha256_file,
    verify_manifest,
    write_manifest,
    writer_tag,
)
from localspec.runtime.gguf_header import GGUFHeader, read_gguf_header, read_gguf_header_parts

logger = logging.getLogger(__name__)

Progress = Callable[[str, float], None]  # (message, fraction done in [0, 1])
_CHUNK = 16 * 1024 * 1024
# What a truncated or garbled GGUF makes transformers' reader raise (found by fuzzing 5.24).
GGUF_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, EOFError, OverflowError,
                     RuntimeError, struct.error)


def no_progress(message: str, fraction: float) -> None:
    logger.info("%s (%.0f%%)", message, 100 * fraction)


def _rebuilding(artefact: Path, problem: str, progress: Progress) -> None:
    message = f"cached {artefact} failed its integrity check ({problem}): rebuilding"
    logger.warning(message)
    progress(message, 0.0)


# ----------------------------------------------------------------------------- built-in GGUF


def _package_dir(package: str, model: BuiltinModel) -> Path:
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"built-in model '{model.name}' needs the package '{package}', which is not "
            f"installed. Fix: {model.pip_install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _source_files(model: BuiltinModel) -> list[Path]:
    if model.member is not None:
        return [_package_dir(model.packages[0], model) / model.member]
    files = []
    for index, package in enumerate(model.packages, start=1):
        path = _package_dir(package, model) / "data" / f"part{index:02d}.bin"
        if not path.is_file():
            raise ModelLoadError(f"'{package}' is installed but lacks {path.name}. Fix: "
                                 f"pip install --force-reinstall {package}")
        files.append(path)
    return files


def _gguf_manifest(dest: Path) -> Path:
    return dest.with_name(dest.name + ".manifest.json")


def _cached_gguf_ok(model: BuiltinModel, dest: Path, full: bool, progress: Progress) -> bool:
    """Whether the assembled file is intact; a file from before manifests is adopted only
    after its full SHA-256 matches the pinned one."""
    if not dest.is_file():
        return False
    manifest = _gguf_manifest(dest)
    problem = verify_manifest(manifest, full=full, pinned={dest.name: model.sha256})
    if problem is None:
        return True
    if (not manifest.exists() and dest.stat().st_size == model.size
            and sha256_file(dest) == model.sha256):
        write_manifest(manifest, [dest.name], {dest.name: model.sha256})
        return True
    _rebuilding(dest, problem, progress)
    return False


def kernel_dir() -> Path:
    """Where native kernels are compiled to (``localspec.runtime.kernels``)."""
    return cache_root() / "kernels"


def builtin_gguf_path(model: BuiltinModel) -> Path:
    """Where the assembled GGUF of a built-in model lives in the cache."""
    return cache_root() / "gguf" / model.gguf_name


def assemble_builtin(model: BuiltinModel, progress: Progress = no_progress,
                     full: bool = False) -> Path:
    """Concatenate the parts into the cache once; verify size and SHA-256; return the .gguf.
    A cached file is checked by its fingerprint (``full``: by its whole SHA-256)."""
    dest = builtin_gguf_path(model)
    if _cached_gguf_ok(model, dest, full, progress):
        return dest
    sources = _source_files(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest.parent)
    digest = hashlib.sha256()
    done = 0
    with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False, suffix=".part",
                                     prefix=f"{dest.name}.{writer_tag()}.") as out:
        tmp = Path(out.name)
        try:
            for source in sources:
                with source.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        progress(f"assembling {model.name}", min(1.0, done / model.size))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if done != model.size or digest.hexdigest() != model.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"assembled {model.name} is {done} bytes with SHA-256 {digest.hexdigest()}, expected "
            f"{model.size} bytes and {model.sha256}: a package is corrupt or of another "
            f"version. Fix: pip install --force-reinstall {' '.join(model.packages)}"
        )
    tmp.replace(dest)
    write_manifest(_gguf_manifest(dest), [dest.name], {dest.name: model.sha256})
    dest.with_suffix(".sha256").unlink(missing_ok=True)  # the marker before manifests
    return dest


def builtin_header(model: BuiltinModel, arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    """The GGUF header of a built-in model: from its assembled file when there is one, else
    from its packages' first bytes (never assembling 1.1 GB to read a few MB)."""
    dest = builtin_gguf_path(model)
    if dest.is_file():
        return read_gguf_header(dest, arrays)
    return read_gguf_header_parts(_source_files(model), dest, model.size, arrays)


def release_assembled(model: BuiltinModel) -> None:
    """Delete the assembled GGUF of a built-in model once a pack holds what is served from it:
    its packages stay the source, and it is assembled again (seconds) only when a path reads
    it (another pack, a float conversion, the drafter finder's tokenizer check). The cache then
    holds the packs, not the file a second time beside its packages."""
    dest = builtin_gguf_path(model)
    for path in (dest, _gguf_manifest(dest)):
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:  # e.g. a file still open elsewhere on Windows: kept, as before
            logger.info("kept %s: %s", path, exc)
            return


# ----------------------------------------------------------------------------- conversion


def _read_gguf(gguf_path: Path, dtype: str) -> tuple[object, PreTrainedModel]:
    """Tokenizer and model (in ``dtype``) of a GGUF file; a truncated or non-GGUF file is a
    ModelLoadError that names it and its size, not a parser traceback."""
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=getattr(torch, dtype))
    except GGUF_READ_ERRORS as exc:
        raise gguf_read_error(gguf_path, exc) from exc
    return tokenizer, model


def gguf_read_error(gguf_path: Path, exc: Exception) -> ModelLoadError:
    """The message for a GGUF file the reader fails on: it names the file and its size."""
    size = gguf_path.stat().st_size if gguf_path.is_file() else 0
    return ModelLoadError(
        f"{gguf_path} ({size:,} bytes) is not a valid, complete GGUF model file "
        f"(the reader says: {str(exc)[:200]}). It may be truncated (an interrupted "
        "download or copy) or not a GGUF file at all. Fix: download or copy it again, or "
        "point the preset at another model.")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = no_progress,
                 dtype: str = "float32") -> Path:
    """Dequantize a GGUF checkpoint into a safetensors folder (config, tokenizer, weights and
    a manifest), replacing whatever ``out_dir`` held."""
    from safetensors.torch import save_file

    progress(f"converting {gguf_path.name} (done once; a minute or two)", 0.0)
    tokenizer, model = _read_gguf(gguf_path, dtype)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt", "source": gguf_path.name})

    write_folder(out_dir, fill)
    progress(f"converted {gguf_path.name}", 1.0)
    return out_dir


def write_folder(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Replace ``out_dir`` atomically by what ``fill`` writes into a temporary folder beside
    it, with a manifest of every file: a reader sees the old folder or the whole new one."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, suffix=".part",
                                prefix=f"{out_dir.name}.{writer_tag()}."))
    try:
        fill(tmp)
        write_manifest(tmp / MANIFEST_NAME, sorted(p.name for p in tmp.iterdir()))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.replace(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors")


def _is_read_at_every_load(name: str) -> bool:
    """Config, generation config and tokenizer files: read whole by every load of the folder,
    the quick start from packed weights included."""
    return not _is_weights(name)


def cached_dir_ok(out_dir: Path, progress: Progress) -> bool:
    """Whether a cached folder passes its manifest (its non-weight files checked whole); when
    not, says why (the caller writes it again)."""
    if not out_dir.exists():
        return False
    problem = verify_manifest(out_dir / MANIFEST_NAME, full=_is_read_at_every_load)
    if problem is None:
        return True
    _rebuilding(out_dir, problem, progress)
    return False


def weights_intact(folder: Path, progress: Progress = no_progress) -> bool:
    """Whether a converted folder's weights are whole as written, for a load about to read
    them all (CRC32 at a few GB/s); when not, says why (the caller converts again)."""
    problem = verify_manifest(folder / MANIFEST_NAME, full=_is_weights)
    if problem is None:
        return True
    _rebuilding(folder, problem, progress)
    return False


def gguf_cache_name(gguf_path: Path) -> str:
    """The name of what the cache derives from a user's .gguf file: its stem and a key of its
    path, size and modification time."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def _gguf_cache_dir(gguf_path: Path) -> Path:
    return cache_root() / "converted" / gguf_cache_name(gguf_path)


def stored_as(folder: Path, dtype: str) -> Path:
    """The folder holding the weights in ``dtype``: float32 (exact GGUF values) in ``folder``,
    others beside it (``<folder>.bfloat16``), so a model is loaded as it is stored, never
    through a float32 copy (a 1.5B model: 3 GB read instead of 7, no 11 GB peak)."""
    return folder if dtype == "float32" else folder.with_name(f"{folder.name}.{dtype}")


def builtin_model_dir(model: BuiltinModel, progress: Progress = no_progress,
                      rebuild: bool = False, dtype: str = "float32") -> Path:
    """The converted folder of a built-in model in ``dtype``, assembled and converted on first
    use and whenever it fails its integrity check (or ``rebuild``)."""
    out_dir = stored_as(cache_root() / "models" / model.name, dtype)
    if not rebuild and cached_dir_ok(out_dir, progress):
        return out_dir
    # the whole GGUF is about to be read anyway: check all of it, not just the fingerprint
    return convert_gguf(assemble_builtin(model, progress, full=True), out_dir, progress, dtype)


def converted_gguf_dir(gguf_path: Path, progress: Progress = no_progress,
                       rebuild: bool = False, dtype: str = "float32") -> Path:
    """The converted folder of a user's .gguf file in ``dtype`` (keyed by its path, size and
    mtime)."""
    out_dir = stored_as(_gguf_cache_dir(gguf_path), dtype)
    if not rebuild and cached_dir_ok(out_dir, progress):
        return out_dir
    return convert_gguf(gguf_path, out_dir, progress, dtype)
