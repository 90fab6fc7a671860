"""The quantized matrices of a GGUF file, as the file stores them (for the ``w4a8`` forward).

transformers reads a GGUF by dequantizing it; the CPU forward wants the quantized numbers
themselves, so that it reads 4.5 (Q4_K, Q4_0), 5.5 (Q5_K), 6.6 (Q6_K) or 8.5 (Q8_0) bits a
weight and computes with exactly the weights the file holds. Only Llama-family names are mapped
(the CPU forward's families), and only the types of ``config.NATIVE_GGUF_TYPES`` are taken:
others (Q5_0, Q4_1, IQ4_XS, ...) stay with the int8 path, which ``unserved_types`` names.

Whether a matrix really is the loaded model's weight is checked by the caller
(``localspec.runtime.weight_formats.export_weights`` compares it with the dequantized copy); a
mismatch (a layout this mapping does not know, such as llama's permuted q/k rows) falls back to
int8 for that matrix, never to a different model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from localspec.config import NATIVE_GGUF_TYPES
from localspec.runtime.kernels import (
    KQuantWeights,
    parse_q4_0,
    parse_q4k,
    parse_q5k,
    parse_q6k,
    parse_q8_0,
)

logger = logging.getLogger(__name__)

# GGUF tensor name (inside blk.N) -> Hugging Face module name (inside model.layers.N)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# The parser of each type in config.NATIVE_GGUF_TYPES (a test checks they are the same).
PARSERS = {"Q4_K": parse_q4k, "Q5_K": parse_q5k, "Q6_K": parse_q6k, "Q8_0": parse_q8_0,
           "Q4_0": parse_q4_0}
# Types that mean a float matrix, not a quantized one the kernels could take.
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# What a damaged or foreign file makes the gguf reader raise.
_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, EOFError, OverflowError, TypeError)


def hf_module_name(gguf_name: str) -> str | None:
    """``blk.3.ffn_up.weight`` -> ``model.layers.3.mlp.up_proj``; ``output.weight`` ->
    ``lm_head``; None for other tensors."""
    parts = gguf_name.split(".")
    if gguf_name == "output.weight":
        return "lm_head"
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


class KQuantMatrices(Mapping[str, KQuantWeights]):
    """The linear weights of a GGUF file in a native type, by Hugging Face module name, each
    decoded when asked for (the file is memory-mapped: the 1.5B's would take 1.3 GB decoded at
    once). ``unserved``: the quantized types of its other layer matrices (sorted)."""

    def __init__(self, raw: dict[str, tuple[np.ndarray, int, int, str]],
                 unserved: tuple[str, ...] = ()) -> None:
        self._raw = raw  # name -> (bytes, n, k, type name)
        self.unserved = unserved

    def __getitem__(self, name: str) -> KQuantWeights:
        data, n, k, kind = self._raw[name]
        return PARSERS[kind](data, n, k)

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def read_kquant_matrices(path: Path) -> KQuantMatrices:
    """Every linear weight of the GGUF at ``path`` in a type of NATIVE_GGUF_TYPES; empty (with
    the reason logged) when the file cannot be read, which costs speed, not correctness. A
    file with layer matrices of other quantized types says so in one logged line."""
    from gguf import GGUFReader

    raw = {}
    unserved: set[str] = set()
    try:
        for tensor in GGUFReader(str(path)).tensors:
            name = hf_module_name(tensor.name)
            kind = tensor.tensor_type.name
            if name is not None and kind in NATIVE_GGUF_TYPES:
                k, n = (int(x) for x in tensor.shape[:2])
                raw[name] = (np.asarray(tensor.data), n, k, kind)
            elif name not in (None, "lm_head") and kind not in FLOAT_TYPES:
                unserved.add(kind)
    except _READ_ERRORS as exc:
        logger.warning("could not read the quantized matrices of %s (%s): int8 instead", path,
                       exc)
        raw, unserved = {}, set()
    matrices = KQuantMatrices(raw, tuple(sorted(unserved)))
    if matrices.unserved:
        logger.warning("%s", unserved_message(path, matrices.unserved))
    return matrices


def unserved_message(path: Path, types: tuple[str, ...]) -> str:
    """One line: ``path``'s layer matrices of ``types`` have no native kernel, and the cost."""
    return (f"{path.name}: {', '.join(types)} matrices have no native kernel (native: "
            f"{', '.join(NATIVE_GGUF_TYPES)}): they are served in int8 (w8a8), which reads 8 bits "
            "a weight, and the model runs layer by layer in Python instead of one native call")
