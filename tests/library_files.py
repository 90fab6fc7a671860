"""Model files for the model library's tests: GGUF files written with the ``gguf`` package
(any architecture, any matrix types, a tokenizer that can be changed by one token, bulk for the
download tests) and save_pretrained folders whose tokenizer differs in one token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
from conftest import TOKENIZER_TEXTS, train_tokenizer

# where each block of a k-quant holds its fp16 scales (d, dmin): random bytes there may be NaN
_KQUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tiny_tokens() -> tuple[list[str], list[str]]:
    """The tests' byte-level BPE as GGUF stores it: tokens by id, and merges."""
    data = json.loads(train_tokenizer(TOKENIZER_TEXTS).backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


def write_gguf(path: Path, arch: str = "qwen2", layers: int = 1, hidden: int = 32,
               types: dict[str, str] | None = None, tokens: list[str] | None = None,
               bulk: int = 0, padding: int = 0) -> Path:
    """A random decoder in GGUF: F32 weights, or for the matrices named in ``types``
    (``{"attn_q": "Q4_K"}``, ``{"*": "Q6_K"}`` for all) raw bytes of that type (``hidden``
    must then be a multiple of the type's block, 256 for k-quants); ``tokens`` replaces the
    tokenizer's tokens (same length); ``bulk`` adds a tensor of that many float32 zeros (a
    large file for the download tests); ``padding`` appends that many [PAD<id>] rows to the
    vocabulary, as llama.cpp does."""
    base, merges = tiny_tokens()
    tokens = list(tokens or base)
    kinds = [3 if t == "<|endoftext|>" else 1 for t in tokens]
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(padding)]
    kinds += [5] * padding
    heads, kv_heads, ff = 4, 2, 2 * hidden
    kv = kv_heads * hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if types else gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(kinds)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "output.weight": (len(tokens), hidden)}
    for n in range(layers):
        shapes |= {f"blk.{n}.attn_norm.weight": (hidden,), f"blk.{n}.ffn_norm.weight": (hidden,),
                   f"blk.{n}.attn_q.weight": (hidden, hidden), f"blk.{n}.attn_q.bias": (hidden,),
                   f"blk.{n}.attn_k.weight": (kv, hidden), f"blk.{n}.attn_k.bias": (kv,),
                   f"blk.{n}.attn_v.weight": (kv, hidden), f"blk.{n}.attn_v.bias": (kv,),
                   f"blk.{n}.attn_output.weight": (hidden, hidden),
                   f"blk.{n}.ffn_gate.weight": (ff, hidden), f"blk.{n}.ffn_up.weight": (ff, hidden),
                   f"blk.{n}.ffn_down.weight": (hidden, ff)}
    if bulk:
        shapes["bulk.weight"] = (bulk,)
    for name, shape in shapes.items():
        kind = (types or {}).get(name.split(".")[2] if name.startswith("blk.") else "",
                                 (types or {}).get("*") if name.endswith("weight") and
                                 name.split(".")[-2] in LAYER_MATRICES else None)
        if kind is None or len(shape) != 2:
            writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32)
                              if name != "bulk.weight" else np.zeros(shape, np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 255, (shape[0], shape[1] // block * size), dtype=np.uint8)
        raw[:, :2] = 0  # a small fp16 scale where the type has one first: finite numbers
        blocks = raw.reshape(shape[0], -1, size)
        for at in _KQUANT_SCALES.get(kind, ()):  # every block's fp16 scales finite and small
            blocks[..., at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)  # the shape from the bytes per row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_token_changed(tokens: list[str], index: int = 100) -> list[str]:
    """``tokens`` with the token at ``index`` replaced by a string no tokenizer here has."""
    changed = list(tokens)
    changed[index] = changed[index] + "\u00a7"
    return changed


def copy_with_changed_token(source: Path, dest: Path, token: str) -> Path:
    """A copy of the model folder ``source`` whose tokenizer.json has ``token`` renamed (same
    id, other text): a tokenizer that differs from the original in exactly one token."""
    shutil.copytree(source, dest)
    data = json.loads((dest / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab[token + "\u00a7"] = vocab.pop(token)
    (dest / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return dest
