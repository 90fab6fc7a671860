"""The Q4_K and Q6_K matrices of a GGUF file, as the file stores them (for the ``w4a8`` forward).

transformers reads a GGUF by dequantizing it; the CPU forward wants the quantized numbers
themselves, so that it reads 4.5 (Q4_K) or 6.6 (Q6_K) bits a weight instead of 8 and computes
with exactly the weights the file holds. Only Llama-family names are mapped (the CPU forward's
families), and only those two types are taken: others (Q5_0, Q8_0, ...) stay with the int8 path.

Whether a matrix really is the loaded model's weight is checked by the caller
(``localspec.runtime.decoder.export_weights`` compares it with the dequantized copy); a
mismatch (a layout this mapping does not know, such as llama's permuted q/k rows) falls back to
int8 for that matrix, never to a different model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from localspec.runtime.kernels import KQuantWeights, parse_q4k, parse_q6k

logger = logging.getLogger(__name__)

# GGUF tensor name (inside blk.N) -> Hugging Face module name (inside model.layers.N)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
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
    """The Q4_K and Q6_K linear weights of a GGUF file by Hugging Face module name, each decoded
    when asked for (the file is memory-mapped: the 1.5B's would take 1.3 GB decoded at once)."""

    def __init__(self, raw: dict[str, tuple[np.ndarray, int, int, bool]]) -> None:
        self._raw = raw  # name -> (bytes, n, k, is Q6_K)

    def __getitem__(self, name: str) -> KQuantWeights:
        data, n, k, six = self._raw[name]
        return (parse_q6k if six else parse_q4k)(data, n, k)

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def read_kquant_matrices(path: Path) -> KQuantMatrices:
    """Every Q4_K and Q6_K linear weight of the GGUF at ``path``; empty (with the reason
    logged) when the file cannot be read, which costs speed, not correctness."""
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {GGMLQuantizationType.Q4_K: False, GGMLQuantizationType.Q6_K: True}
    raw = {}
    try:
        for tensor in GGUFReader(str(path)).tensors:
            name = hf_module_name(tensor.name)
            if name is not None and tensor.tensor_type in kinds:
                k, n = (int(x) for x in tensor.shape[:2])
                raw[name] = (np.asarray(tensor.data), n, k, kinds[tensor.tensor_type])
    except _READ_ERRORS as exc:
        logger.warning("could not read the k-quant matrices of %s (%s): int8 instead", path,
                       exc)
        raw = {}
    return KQuantMatrices(raw)
