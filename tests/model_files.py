"""Model files for the cache and loading tests: fake built-in packages, tiny GGUF files written
with the ``gguf`` package, damage as a disk does it, and weights to compare."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import TOKENIZER_TEXTS, train_tokenizer

import localspec.models.cache as cache
import localspec.models.integrity as integrity
from localspec.config import ModelSpec, cache_root
from localspec.models.builtin import BUILTIN_MODELS, BuiltinModel
from localspec.models.loading import load_model


def patch_find_spec(monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any]) -> None:
    """importlib.util.find_spec answers ``overrides[name]`` for the names given, else as usual."""
    original = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in overrides:
            return overrides[name]
        return original(name, package)

    monkeypatch.setattr(cache.importlib.util, "find_spec", find_spec)


def fake_builtin(parts: list[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 sha256: str | None = None, size: int | None = None,
                 member: bool = False) -> BuiltinModel:
    """A BuiltinModel 'fake-model' over fake installed packages holding ``parts``, also
    registered as a built-in name for ``load_model``."""
    whole = b"".join(parts)
    packages = tuple(f"fake-model-part{i}" for i in range(1, len(parts) + 1))
    overrides: dict[str, Any] = {}
    for index, (package, data) in enumerate(zip(packages, parts, strict=True), start=1):
        root = tmp_path / "site-packages" / package.replace("-", "_")
        target = root / "whole.gguf" if member else root / "data" / f"part{index:02d}.bin"
        target.parent.mkdir(parents=True)
        target.write_bytes(data)
        overrides[package.replace("-", "_")] = SimpleNamespace(
            submodule_search_locations=[str(root)])
    patch_find_spec(monkeypatch, overrides)
    model = BuiltinModel(
        name="fake-model",
        description="a fake built-in for tests",
        packages=packages,
        gguf_name="fake-model.gguf",
        member="whole.gguf" if member else None,
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
    )
    monkeypatch.setitem(BUILTIN_MODELS, model.name, model)
    return model


def write_tiny_gguf(path: Path, hidden: int = 32) -> None:
    """A random one-layer Qwen2 in F32 GGUF with a byte-level BPE tokenizer: what llama.cpp
    writes, small enough for transformers to dequantize in a fraction of a second."""
    data = json.loads(train_tokenizer(TOKENIZER_TEXTS).backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    heads, kv_heads, ff = 4, 2, 64
    kv = kv_heads * hidden // heads
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * len(tokens))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "output.weight": (len(tokens), hidden), "blk.0.attn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_q.bias": (hidden,),
              "blk.0.attn_k.weight": (kv, hidden), "blk.0.attn_k.bias": (kv,),
              "blk.0.attn_v.weight": (kv, hidden), "blk.0.attn_v.bias": (kv,),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
              "blk.0.ffn_down.weight": (hidden, ff)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def damage(path: Path, how: str) -> None:
    """Same-size damage flips the last 64 bytes (tensor data); truncation keeps half."""
    data = path.read_bytes()
    if how == "same-size":
        data = data[:-64] + bytes(255 - b for b in data[-64:])
    elif how == "truncated":
        data = data[: len(data) // 2]
    path.write_bytes(data)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights, copied: load_file maps the file, and the tests damage it."""
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(folder / "model.safetensors").items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- fingerprints


def first_load(source: str, tiny_gguf: bytes, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> tuple[ModelSpec, Path]:
    """Load a built-in made of the tiny GGUF, or the tiny GGUF as a user's file, once."""
    if source == "builtin":
        fake_builtin([tiny_gguf[:5000], tiny_gguf[5000:]], tmp_path, monkeypatch)
        spec = ModelSpec("fake-model", dtype="float32")
    else:
        (tmp_path / "mine.gguf").write_bytes(tiny_gguf)
        spec = ModelSpec(str(tmp_path / "mine.gguf"), dtype="float32")
    folder = load_model(spec).folder
    expected = cache_root() / ("models" if source == "builtin" else "converted")
    assert folder.parent == expected and (folder / integrity.MANIFEST_NAME).is_file()
    return spec, folder
