"""A real model in the GGUF types people download, served natively end to end.

The built-in SmolLM2-135M (a ``llama`` GGUF in Q4_1) is written again with its layer matrices
re-quantized: Q8_0 (a Q8_0 file), Q5_K for the down projections (a Q5_K_M file's type; the
others are 576 wide, not whole 256-blocks) and Q4_0 for the v projections, with gguf-py's
``GGUFWriter`` and every other tensor and metadata key copied. Loaded with ``w4a8``, those
matrices must be served by their own kernels (not the int8 fallback), and greedy speculation
must give plain greedy decoding's tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_helpers import q5k_bytes

from localspec.config import ModelSpec
from localspec.models import packed_store
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import assemble_builtin, kernel_dir
from localspec.models.loading import ModelLoadError
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.runtime.kernels import KernelUnavailable, quantize_q5k, serving_kernels
from localspec.runtime.quant import Q4_0Linear, Q5KLinear, Q8_0Linear
from localspec.runtime.weight_formats import ConcatLinear

pytestmark = pytest.mark.real_model
gguf = pytest.importorskip("gguf")


def _requantized(reader: gguf.GGUFReader, name: str, kind: str) -> np.ndarray:
    """The tensor ``name`` of ``reader`` dequantized and quantized again as ``kind``."""
    tensor = next(t for t in reader.tensors if t.name == name)
    k, n = (int(s) for s in tensor.shape[:2])
    w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                   dtype=np.float32).reshape(n, k)
    if kind == "Q5_K":
        return q5k_bytes(quantize_q5k(torch.from_numpy(w)))
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def write_requantized(source: Path, out: Path, kinds: dict[str, str]) -> Path:
    """``source`` written to ``out`` with each layer matrix named in ``kinds`` (``attn_v``:
    "Q4_0", ``*``: every other one) re-quantized; metadata and other tensors as they are."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        layer_matrix = len(parts) == 4 and parts[0] == "blk" and parts[2] in (
            "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        kind = kinds.get(parts[2], kinds.get("*")) if layer_matrix else None
        if kind is None:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        else:
            writer.add_tensor(tensor.name, _requantized(reader, tensor.name, kind),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_q8_0_q5_k_q4_0_file_is_served_natively_and_speculation_is_lossless(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 o/gate/up, Q5_K down and Q4_0 v of a real model run in their kernels, with no
    line about unserved types; ngram speculation gives plain greedy decoding's tokens."""
    try:
        source = assemble_builtin(BUILTIN_MODELS["smollm2-135m-instruct"])
    except ModelLoadError as exc:
        pytest.skip(f"the built-in SmolLM2 is not available: {exc}")
    kernels = kernel_dir()  # the cache's build, keyed on the sources: compiled once
    try:
        serving_kernels(kernels)
    except KernelUnavailable as exc:
        pytest.skip(f"no native kernels here: {exc}")
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))  # its conversion and pack
    monkeypatch.setattr(packed_store, "kernel_dir", lambda: kernels)
    path = write_requantized(source, tmp_path / "smollm2-mixed.gguf",
                             {"*": "Q8_0", "ffn_down": "Q5_K", "attn_v": "Q4_0"})
    preset = load_preset("cpu-smollm2-ngram")
    preset = preset.model_copy(update={"target": preset.target.model_copy(
        update={"model": str(path), "quantization": "w4a8"})})
    messages: list[str] = []
    pipeline = Pipeline.load(preset, progress=lambda message, _: messages.append(message))
    assert pipeline.preset.target_spec() == ModelSpec(str(path), dtype=preset.target.dtype,
                                                      quantization="w4a8")
    layers = pipeline.target.decoder.layers
    for layer in layers:
        assert type(layer.o) is Q8_0Linear and type(layer.down) is Q5KLinear
        assert type(layer.gate_up) is Q8_0Linear  # gate and up: one fused Q8_0 matrix
        # llama's q/k rows, permuted in a GGUF, put back in order and kept as stored too
        assert isinstance(layer.qkv, ConcatLinear)
        assert [type(p) for p in layer.qkv.parts] == [Q8_0Linear, Q4_0Linear]
    assert pipeline.target.decoder.native is not None  # the whole stack in one native call
    assert not any("no native kernel" in m for m in messages), messages
    ids = pipeline.encode_prompt("Repeat exactly: the cat sat on the mat. The cat sat on the")
    plain = pipeline.run(pipeline.request(ids, max_new_tokens=32), "none")
    ngram = pipeline.run(pipeline.request(ids, max_new_tokens=32, adaptive=False), "ngram")
    assert ngram.token_ids == plain.token_ids
    assert ngram.stats.mean_accepted_length > 1.0  # some drafts were accepted
