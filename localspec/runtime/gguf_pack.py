"""The CPU forward's weights made straight from a GGUF file: no float copy of the model on disk.

A GGUF model's pack (``models.packed_store``) is made from a skeleton (the model's modules on
the meta device, ``models.gguf_meta.skeleton``) whose weights are filled from the file one
tensor at a time (``fill_from_gguf``):

- the matrices the pack keeps as the file stores them (w4a8: every type with a native kernel,
  ``NATIVE_GGUF_TYPES``) are not dequantized at all:
  they are handed to ``export_weights`` as stored (``FileMatrices``), their rows put in
  transformers' order where its GGUF reader reorders them (llama's q and k projections: a
  permutation of whole rows, and a quantized row is a run of blocks of its own);
- every other tensor (embedding, norms, biases, matrices of other types, which w8a8 quantizes,
  and the matrices requant-q4k quantizes again) is dequantized with ``gguf.quants.dequantize``,
  reordered by transformers' own tensor processor and cast to the model's dtype: the numbers a
  model loaded by transformers from the same file holds, so the pack is bit for bit the one
  made from a converted model (tests/test_gguf_pack.py checks both built-in families).

What is deliberately not here: where packs and the config-and-tokenizer folder live (the cache,
``models``), and the float conversion (``models.cache.convert_gguf``), which the paths that read
float weights (quantization "none", int8-weight-only, bitsandbytes) still make.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from localspec.config import NATIVE_GGUF_TYPES
from localspec.runtime.gguf_header import TensorInfo, read_gguf_header
from localspec.runtime.gguf_kquants import (
    FLOAT_TYPES,
    PARSERS,
    hf_module_name,
    unserved_message,
)
from localspec.runtime.kernels import KQuantWeights

logger = logging.getLogger(__name__)

# The GGUF types each kind keeps as stored (export_weights): w4a8 the layer matrices of every
# type with a native kernel and a Q6_K head; requant-q4k the Q4_K matrices (it quantizes the
# others to Q4_K, from floats); requant-q3m none (it quantizes every matrix to Q3_M).
_KEPT = {"w4a8": NATIVE_GGUF_TYPES, "requant-q4k": ("Q4_K",), "requant-q3m": ()}
_KEPT_HEAD = {"w4a8": ("Q6_K",)}
_VOCABULARY_TENSORS = ("token_embd.weight", "output.weight")  # dequantized _ROWS at a time
_ROWS = 16384


class FileMatrices(Mapping[str, KQuantWeights]):
    """Matrices of a GGUF file in native types by Hugging Face module name, as stored (rows in
    transformers' order), each read from the file when asked for (plain reads: pages of a map
    would count as this process's memory while it is open, 1.1 GB for the 1.5B).
    ``unserved``: the quantized types of the file's other layer matrices (no native kernel)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw: dict[str, tuple[int, int, int, int, str, np.ndarray | None]] = {}
        self.unserved: tuple[str, ...] = ()

    def add(self, name: str, offset: int, size: int, n: int, k: int, kind: str,
            order: np.ndarray | None) -> None:
        """The matrix of ``size`` bytes at ``offset`` of the file, [n, k], of GGUF type
        ``kind``; ``order``: the file's row for each row of the model's weight (None: the
        same order)."""
        self._raw[name] = (offset, size, n, k, kind, order)

    def __getitem__(self, name: str) -> KQuantWeights:
        """The matrix parsed ``_ROWS`` rows at a time (each row is parsed on its own): the
        parser's temporaries for the 1.5B's 151,936-row head would be 0.6 GB at once."""
        offset, size, n, k, kind, order = self._raw[name]
        rows = _read(self.path, offset, size).reshape(n, -1)
        rows = rows if order is None else rows[order]
        parse = PARSERS[kind]
        if n <= _ROWS:
            return parse(rows, n, k)
        out: dict[str, torch.Tensor] = {}
        for start in range(0, n, _ROWS):
            part = parse(rows[start:start + _ROWS], min(_ROWS, n - start), k)
            for field in dataclasses.fields(part):
                value = getattr(part, field.name)
                if field.name not in out:
                    out[field.name] = value.new_empty((n, *value.shape[1:]))
                out[field.name][start:start + len(value)] = value
        return type(part)(**out)

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def _read(path: Path, offset: int, size: int) -> np.ndarray:
    """``size`` bytes of the file at ``offset``, read into memory of this process's own."""
    data = np.empty(size, dtype=np.uint8)
    with path.open("rb") as f:
        if os.preadv(f.fileno(), [data], offset) != size:
            raise ValueError(f"{path}: truncated")
    return data


def _row_order(processor: object, gguf_name: str, n: int) -> np.ndarray | None:
    """Which file row each row of the model's weight is, as transformers' tensor processor
    reorders them (None: unchanged); ValueError if it does more than reorder rows."""
    rows = np.arange(n, dtype=np.int64).reshape(n, 1)
    out = processor.process(weights=rows, name=gguf_name).weights  # type: ignore[attr-defined]
    order = np.asarray(out).reshape(-1)
    if order.shape != (n,) or not np.array_equal(np.sort(order), rows[:, 0]):
        raise ValueError(f"{gguf_name}: transformers changes it beyond an order of its rows")
    return None if np.array_equal(order, rows[:, 0]) else order


def _set(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(module_name), attribute,
            nn.Parameter(tensor, requires_grad=False))


def _dequantized(path: Path, tensor: TensorInfo, at: int, processor: object,
                 dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    """A tensor (its bytes at ``at``) as transformers loads it: dequantized in float32, its
    processor applied, cast to ``dtype``; with its processed name. A vocabulary-sized one goes
    ``_ROWS`` rows at a time, which its processor leaves in place: the float32 copy of the
    1.5B's embedding (0.9 GB) is never whole."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[tensor.type_name]
    raw = _read(path, at, tensor.nbytes)
    rows = tuple(reversed(tensor.shape[1:]))  # the byte layout GGUFReader gives: rows first
    raw = raw.reshape(*rows, tensor.nbytes // max(1, int(np.prod(rows))))
    step = _ROWS if tensor.name in _VOCABULARY_TENSORS and raw.ndim == 2 else max(len(raw), 1)
    out, name = None, tensor.name
    for start in range(0, max(len(raw), 1), step):
        result = processor.process(  # type: ignore[attr-defined]
            weights=dequantize(raw[start:start + step], qtype), name=tensor.name)
        name = result.name
        part = torch.from_numpy(np.array(result.weights, dtype=np.float32)).to(dtype)
        if step >= len(raw):
            return name, part
        if out is None:
            out = torch.empty((len(raw), *part.shape[1:]), dtype=dtype)
        out[start:start + len(part)] = part
    assert out is not None
    return name, out


def fill_from_gguf(model: PreTrainedModel, gguf: Path, kind: str) -> FileMatrices:
    """Fill ``model`` (a ``skeleton``) from ``gguf`` for a ``kind`` pack: every weight the pack
    computes from floats, as transformers would load it in the model's dtype; returns the
    matrices ``export_weights`` takes as stored, whose modules stay empty. ValueError when
    the file lacks a weight of the model. The tensor table is read with ``gguf_header`` (the
    ``gguf`` package's reader holds 0.5 GB of Python objects for the 1.5B's vocabulary)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    header = read_gguf_header(gguf)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(
        config=model.config.to_dict())
    hf_names = get_gguf_hf_weights_map(model, processor)
    stored = FileMatrices(gguf)
    unserved = set()
    for tensor in header.tensors:
        at = header.data_start + tensor.offset
        module = hf_module_name(tensor.name)
        k, n = tensor.shape[:2] if len(tensor.shape) >= 2 else (0, 0)
        kept = _KEPT_HEAD if module == "lm_head" else _KEPT
        if module is not None and tensor.type_name in kept.get(kind, ()) and n % 16 == 0:
            stored.add(module, at, tensor.nbytes, n, k, tensor.type_name,
                       _row_order(processor, tensor.name, n))
            continue
        if kind == "w4a8" and module not in (None, "lm_head") \
                and tensor.type_name not in FLOAT_TYPES:
            unserved.add(tensor.type_name)
        name, weight = _dequantized(gguf, tensor, at, processor, model.dtype)
        if name in hf_names:
            _set(model, hf_names[name], weight)
        del weight
    if model.config.tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    missing = [name for name, param in model.named_parameters()
               if param.numel() == 0 and name.removesuffix(".weight") not in stored]
    if missing:
        raise ValueError(f"{gguf.name} has no tensor for {', '.join(missing[:3])}")
    stored.unserved = tuple(sorted(unserved))
    if stored.unserved:
        logger.warning("%s", unserved_message(gguf, stored.unserved))
    return stored
