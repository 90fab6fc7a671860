"""A GGUF model's config and tokenizer, and the model skeleton its weights are filled into.

A GGUF model served by the CPU forward (w8a8, w4a8, requant-q4k) needs, besides its pack
(``packed_store``, made from the file by ``runtime.gguf_pack``), only its config and tokenizer.
Those come from the file's metadata (transformers reads them without touching a tensor) and are
kept in a small folder, ``<cache>/meta/<model>[.<dtype>]/`` with its manifest; the pack is keyed
by that folder as by any other. ``skeleton`` builds the model's modules on the meta device from
that folder, for ``runtime.gguf_pack.fill_from_gguf`` to fill one tensor at a time.

Kept apart from the filling itself: this part knows the cache (where the folder lives, the
built-in models' assembly); the filling knows only the file and the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from localspec.config import GGUF_META_FOLDER, cache_root
from localspec.errors import ModelLoadError
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import (
    GGUF_READ_ERRORS,
    Progress,
    assemble_builtin,
    cached_dir_ok,
    gguf_cache_name,
    gguf_read_error,
    stored_as,
    write_folder,
)
from localspec.runtime.weight_formats import release_weights

META_FOLDER = GGUF_META_FOLDER  # under cache_root(): config and tokenizer, no weights


def gguf_file(model: str, progress: Progress) -> Path | None:
    """The GGUF file of a model name (a built-in one assembled, checked by its fingerprint),
    else None."""
    if model in BUILTIN_MODELS:
        return assemble_builtin(BUILTIN_MODELS[model], progress)
    path = Path(model).expanduser()
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return path


def meta_dir(model: str, gguf: Path | None, dtype: str) -> Path:
    """Where the config and tokenizer of ``model`` (its file ``gguf``; None for a built-in, named
    by its model name) are kept; one per dtype, as the packs keyed by it differ by dtype."""
    name = model if model in BUILTIN_MODELS or gguf is None else gguf_cache_name(gguf)
    return stored_as(cache_root() / META_FOLDER / name, dtype)


def write_meta(gguf: Path, out_dir: Path) -> Path:
    """The config, generation config and tokenizer of ``gguf`` in ``out_dir`` (with a manifest),
    read from the file's metadata: no tensor is read."""
    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except GGUF_READ_ERRORS as exc:
        raise gguf_read_error(gguf, exc) from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_folder(out_dir, fill)


def gguf_meta(model: str, progress: Progress, dtype: str) -> Path | None:
    """The config-and-tokenizer folder of a GGUF model, written on first use and whenever it
    fails its check; None for a model that is not a GGUF file. A built-in's sound folder is
    taken without its GGUF: that is assembled only to write the folder or a pack."""
    builtin = model in BUILTIN_MODELS
    if builtin and cached_dir_ok(meta_dir(model, None, dtype), progress):
        return meta_dir(model, None, dtype)
    gguf = gguf_file(model, progress)
    if gguf is None:
        return None
    out_dir = meta_dir(model, gguf, dtype)
    if builtin or not cached_dir_ok(out_dir, progress):
        write_meta(gguf, out_dir)
    return out_dir


def skeleton(folder: Path, dtype: torch.dtype) -> PreTrainedModel | None:
    """The model's module tree with empty weights (its config, rotary tables and generation
    settings are real), for a forward whose weights come from elsewhere; None when the model
    holds state the CPU forward would miss (a buffer other than the rotary tables)."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    backbone = model.base_model
    rotary = getattr(backbone, "rotary_emb", None)
    if rotary is None:
        return None
    backbone.rotary_emb = type(rotary)(config=config)  # its tables computed on the CPU
    if any(buffer.is_meta for buffer in model.buffers()):
        return None
    release_weights(model)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()
