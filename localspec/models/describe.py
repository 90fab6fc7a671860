"""What a model on disk is, read from its files without loading it: a ``.gguf`` file's header
or a folder's config.json and safetensors headers.

``describe`` answers what the model library lists for each entry (architecture, size on disk,
quantization, context length) and whether the fast native CPU path serves it; ``check_model``
is the same reading with every problem that makes a model unusable raised as a
``ModelLoadError`` (a folder that is not a model, a truncated GGUF, an architecture LocalSpec
cannot load), so that nothing is added to the library that would fail at its first start.

The native path is decided by ``native_reason`` alone, from the names the loader itself uses:
``config.NATIVE_ARCHITECTURES`` (which ``runtime.decoder`` runs) and ``config.NATIVE_GGUF_TYPES``
(the matrix types ``w4a8`` keeps as stored), over the layer matrices ``runtime.gguf_kquants`` maps.
A draft head (EAGLE, EAGLE-3, Medusa: any registered head method) is a folder too; it is told
apart by its config (``registry.head_method``) and described as a head for its target.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from localspec.config import NATIVE_ARCHITECTURES, NATIVE_GGUF_TYPES
from localspec.errors import InputFileError, ModelLoadError
from localspec.files import parse_json, read_user_text
from localspec.registry import head_method
from localspec.runtime.gguf_header import GGUFHeader, read_gguf_header
from localspec.runtime.gguf_kquants import hf_module_name

MAX_CONFIG_BYTES = 2**20  # a config.json is a few dozen settings
MAX_SAFETENSORS_HEADER = 100 * 2**20  # what the safetensors format itself allows
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# GGUF architectures transformers reads besides the native ones are only known to it (a 4 s
# import); these are the keys of its mapping that are not model architectures.
_NOT_ARCHITECTURES = frozenset({"general", "tokenizer", "t5", "umt5"})


@dataclass(frozen=True)
class ModelFacts:
    """What the library shows of one model."""

    kind: str  # "gguf" | "folder" | "head"
    architecture: str | None
    size_bytes: int
    quantization: str | None  # "Q4_K_M (Q4_K, Q6_K)", "BF16", "bnb 4-bit", ...
    context_length: int | None
    native_reason: str | None  # why the native CPU path does not serve it; None: it does
    head_for: str | None = None  # a head: the target it was trained for

    @property
    def native(self) -> bool:
        return self.native_reason is None


def native_reason(architecture: str | None, layer_types: set[str] | None) -> str | None:
    """Why the fast native CPU path (every layer matrix as the GGUF stores it, one native call
    per pass) does not serve a model; None when it does. ``layer_types``: the GGUF types of its
    layer matrices, None for a model that is not a GGUF."""
    if architecture not in NATIVE_ARCHITECTURES:
        return (f"architecture '{architecture}' runs through transformers (native: "
                f"{', '.join(NATIVE_ARCHITECTURES)})")
    if layer_types is None:
        return "not a GGUF: quantized to int8 when loaded (w8a8)"
    other = sorted(layer_types - set(NATIVE_GGUF_TYPES))
    if other:
        return (f"{', '.join(other)} matrices are served in int8 (native: "
                f"{', '.join(NATIVE_GGUF_TYPES)}; requant-q4k makes a draft native, lossy)")
    return None


def folder_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed: what deleting it frees)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


# ----------------------------------------------------------------------------- GGUF


def _file_type(header: GGUFHeader) -> str | None:
    from gguf import LlamaFileType

    value = header.fields.get("general.file_type")
    try:
        name = LlamaFileType(int(value)).name  # type: ignore[arg-type]
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return None


def layer_types(header: GGUFHeader) -> Counter[str]:
    """How many layer matrices (q, k, v, o, gate, up, down) the file holds of each type."""
    return Counter(t.type_name for t in header.tensors
                   if hf_module_name(t.name) not in (None, "lm_head"))


def gguf_architecture(header: GGUFHeader) -> str:
    """The file's architecture, refused (ModelLoadError) when transformers cannot load it."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = header.architecture
    known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES)
    if arch not in known:
        raise ModelLoadError(f"{header.path}: architecture '{arch}' is not supported (a GGUF "
                             f"loads as one of: {', '.join(known)})")
    return arch


def describe_gguf(path: Path, strict: bool = False, header: GGUFHeader | None = None
                  ) -> ModelFacts:
    """The facts of a ``.gguf`` file from its header (``header``: already read); ``strict``
    also refuses an architecture LocalSpec cannot load."""
    header = header or read_gguf_header(path)
    arch = gguf_architecture(header) if strict else header.architecture
    types = layer_types(header)
    if not types:
        raise ModelLoadError(f"{path}: a GGUF file without decoder layers (blk.N.attn_q and the "
                             "like): not a language model LocalSpec can run")
    file_type = _file_type(header)
    listed = ", ".join(name for name, _ in types.most_common())
    quantization = f"{file_type} ({listed})" if file_type else listed
    context = header.arch_field("context_length")
    return ModelFacts("gguf", arch, header.file_size, quantization,
                      int(context) if isinstance(context, int) else None,
                      native_reason(arch, set(types)))


# ----------------------------------------------------------------------------- folders


def read_config(folder: Path) -> dict[str, object]:
    """A folder's config.json as a dict; ModelLoadError when it is missing or unreadable."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: not a model: it has no config.json (a model folder "
                             "holds config.json, tokenizer files and *.safetensors, as "
                             "save_pretrained writes them; or give a .gguf file)")
    try:
        config = parse_json(read_user_text(path, "config.json", limit=MAX_CONFIG_BYTES),
                            str(path))
    except InputFileError as exc:
        raise ModelLoadError(str(exc)) from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a model config (a JSON object of settings)")
    return config


def _safetensors_dtypes(folder: Path) -> Counter[str]:
    """The dtypes of the tensors in the folder's safetensors files, from their headers."""
    found: Counter[str] = Counter()
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                if size > min(MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
                    raise ValueError("header larger than the file")
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"{path}: not a complete safetensors file ({exc}); download "
                                 "or copy it again") from exc
        found.update(entry["dtype"] for key, entry in header.items()
                     if key != "__metadata__" and isinstance(entry, dict) and "dtype" in entry)
    return found


def _head_target(config: dict[str, object]) -> str | None:
    """The target a draft head's config names, or None for a model that is not a head."""
    if head_method(config) is not None:
        return str(config.get("base_model_name_or_path") or "unknown")
    return None


def _folder_architecture(folder: Path, config: dict[str, object]) -> str:
    """The folder's model_type, refused when transformers has no causal LM for it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{folder}: architecture {model_type!r} is not supported: "
                             "transformers has no causal language model of that type")
    return model_type


def describe_folder(folder: Path, strict: bool = False) -> ModelFacts:
    """The facts of a save_pretrained folder (or a draft head's folder); ``strict`` also refuses
    a folder without weights or tokenizer, or of an architecture transformers cannot load."""
    config = read_config(folder)
    head_for = _head_target(config)
    dtypes = _safetensors_dtypes(folder)
    weights = [p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if strict and not weights:
        raise ModelLoadError(f"{folder}: not a model: config.json but no weights (*.safetensors)")
    if strict and head_for is None and not any((folder / n).is_file() for n in TOKENIZER_FILES):
        raise ModelLoadError(f"{folder}: no tokenizer (tokenizer.json or the like): copy the "
                             "model's tokenizer files beside its weights")
    if head_for is not None:
        arch = str((config.get("architectures") or ["head"])[0])
    elif strict:
        arch = _folder_architecture(folder, config)
    else:
        arch = str(config.get("model_type") or "unknown")
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        quantization = str(quant.get("quant_method") or "quantized")
    else:
        quantization = "/".join(sorted(dtypes, key=lambda d: -dtypes[d])) or None
    context = config.get("max_position_embeddings")
    return ModelFacts("head" if head_for else "folder", arch, folder_size(folder), quantization,
                      context if isinstance(context, int) else None,
                      "a draft head, not a model" if head_for else native_reason(arch, None),
                      head_for)


def describe(path: Path, strict: bool = False) -> ModelFacts:
    """The facts of a ``.gguf`` file or a model folder (``strict``: refuse what cannot run)."""
    if path.is_dir():
        return describe_folder(path, strict)
    if path.suffix.lower() == ".gguf" or path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: not a model: give a .gguf file or a model folder")
        return describe_gguf(path, strict)
    raise ModelLoadError(f"{path}: no such file or folder")


def check_model(path: Path) -> ModelFacts:
    """``describe`` with every problem that would make the model fail to start raised."""
    return describe(path, strict=True)
