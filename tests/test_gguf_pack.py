"""Packs made straight from a GGUF file (``runtime.gguf_pack``) against packs made the other way,
from the model transformers converts the same file into (``export_weights`` over its weights,
the file's Q4_K and Q6_K matrices kept where they are exactly those weights).

The two must hold the same tensors, bit for bit (``torch.equal``, dtypes included): the floats
are dequantized by the same ``gguf.quants.dequantize``, reordered by transformers' own tensor
processor and cast to the same dtype. A llama file with Q4_K q and k projections (rows permuted
by llama.cpp's converter) checks the row order of the matrices taken as stored: the other way
compares each with the converted weight and keeps it only when equal, so a wrong order shows
as a matrix served in int8 on one side only (the negative control breaks the order on purpose).
The real tests do the same for SmolLM2-135M (llama, every matrix Q4_1: w8a8) and the built-in
Qwen2.5-Coder 0.5B (qwen2 with biases; Q5_0, Q8_0, Q4_K and Q6_K: w4a8 and requant-q4k).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from library_files import write_gguf
from transformers import AutoModelForCausalLM

from localspec.config import ModelSpec
from localspec.errors import ModelLoadError
from localspec.models import gguf_meta
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import assemble_builtin, convert_gguf
from localspec.models.loading import load_model
from localspec.runtime import gguf_pack
from localspec.runtime.gguf_kquants import read_kquant_matrices
from localspec.runtime.weight_formats import export_weights


def pack_from_gguf(gguf: Path, kind: str, dtype: torch.dtype, tmp: Path
                   ) -> tuple[dict[str, torch.Tensor], gguf_pack.FileMatrices]:
    """The pack as a first start makes it now: a skeleton filled from the file."""
    meta = gguf_meta.write_meta(gguf, tmp / "meta")
    model = gguf_meta.skeleton(meta, dtype)
    assert model is not None
    stored = gguf_pack.fill_from_gguf(model, gguf, kind)
    return export_weights(model, kind, stored), stored


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"


@pytest.fixture(scope="module")
def llama_q4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer llama whose q and k projections are Q4_K, down Q6_K, the rest F32."""
    path = tmp_path_factory.mktemp("llama") / "llama-q4k.gguf"
    return write_gguf(path, arch="llama", layers=2, hidden=256,
                      types={"attn_q": "Q4_K", "attn_k": "Q4_K", "ffn_down": "Q6_K"})


@pytest.mark.parametrize("kind", ["w4a8", "requant-q4k", "requant-q3m", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_pack_from_gguf_is_the_pack_from_the_converted_model(
        llama_q4k: Path, kind: str, dtype: torch.dtype, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Permuted q/k rows in Q4_K: taken as stored in their model order, everything else as
    transformers loads it (the embedding and head a few rows at a time, as the real ones go);
    the same pack as from the converted model."""
    monkeypatch.setattr(gguf_pack, "_ROWS", 7)
    new, stored = pack_from_gguf(llama_q4k, kind, dtype, tmp_path)
    folder = convert_gguf(llama_q4k, tmp_path / "converted", dtype=str(dtype).split(".")[1])
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    assert_same(new, export_weights(converted, kind, None if kind == "w8a8" else stored))
    if kind == "w4a8":  # q and k of every layer stay Q4_K, down Q6_K
        assert all(f"layers.{i}.qkv.0.qs" in new and f"layers.{i}.down.0.qh" in new
                   for i in range(2))


def test_a_wrong_row_order_is_caught(llama_q4k: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: q and k in the file's (permuted) order are not the converted model's
    weights, and the comparison above tells them apart."""
    monkeypatch.setattr(gguf_pack, "_row_order", lambda processor, name, n: None)
    new, stored = pack_from_gguf(llama_q4k, "w4a8", torch.float32, tmp_path)
    folder = convert_gguf(llama_q4k, tmp_path / "converted", dtype="float32")
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    old = export_weights(converted, "w4a8", stored)
    assert "layers.0.qkv.0.qs" in new and "layers.0.qkv.0.q" in old  # int8 on one side only


def test_a_gguf_model_served_on_the_cpu_is_never_converted(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The CPU forward of a GGUF model reads the file, a small config-and-tokenizer folder and
    its pack: no float conversion is written, at the first start or later."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "mine.gguf", arch="llama", hidden=256,
                      types={"attn_q": "Q4_K", "attn_k": "Q4_K"})
    spec = ModelSpec(str(gguf), dtype="float32", quantization="w8a8")
    first = load_model(spec)
    again = load_model(spec)
    assert first.folder == again.folder and first.folder.parent.name == gguf_meta.META_FOLDER
    assert not (tmp_path / "cache" / "converted").exists()
    assert not list((tmp_path / "cache").rglob("model.safetensors"))
    ids = torch.tensor([3, 7, 11, 5])
    assert torch.equal(first.runner().forward(ids), again.runner().forward(ids))


@pytest.mark.real_model
@pytest.mark.parametrize(("name", "kind"), [("smollm2-135m-instruct", "w8a8"),
                                            ("qwen2.5-coder-0.5b-instruct", "requant-q4k"),
                                            ("qwen2.5-coder-0.5b-instruct", "w4a8")])
def test_real_pack_from_gguf_is_the_pack_from_the_converted_model(
        name: str, kind: str, tmp_path: Path) -> None:
    """The built-in models: the same tensors as the pack made from the bfloat16 conversion
    (how the first start packed them before), with the file's matrices read as that did."""
    gguf = assemble_builtin(BUILTIN_MODELS[name])
    new, _ = pack_from_gguf(gguf, kind, torch.bfloat16, tmp_path)
    converted = load_model(ModelSpec(name, dtype="bfloat16", quantization="none")).model
    old = export_weights(converted, kind, None if kind == "w8a8" else read_kquant_matrices(gguf))
    assert_same(new, old)


@pytest.mark.parametrize("cut", ["first-1000", "half", "all-but-1", "text"])
def test_a_damaged_gguf_on_the_cpu_path_is_a_clear_error(llama_q4k: Path, cut: str,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Truncated or not GGUF at all: one ModelLoadError naming the file, no traceback of the
    readers, nothing half-written left as a pack."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    data = llama_q4k.read_bytes()
    blob = {"first-1000": data[:1000], "half": data[:len(data) // 2],
            "all-but-1": data[:-1], "text": b"not a gguf " * 20}[cut]
    path = tmp_path / "broken.gguf"
    path.write_bytes(blob)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf"):
        load_model(ModelSpec(str(path), dtype="float32", quantization="w8a8"))
    assert not list((tmp_path / "cache").glob("w8a8/*"))
