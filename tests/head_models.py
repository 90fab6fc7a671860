"""Tiny targets for draft heads, and small head checkpoints in exactly the published layouts.

``llama_target`` is a random Llama (the published EAGLE heads are Llama-shaped) deep enough
for EAGLE-3's three layers; ``clock_target`` always continues token x with x + 1, so that heads
can be built to be right and their acceptance predicted.

Key names and config fields are spelled out here as the public checkpoints have them
(``yuhuili/EAGLE-LLaMA3-Instruct-8B``, ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``,
``FasterDecoding/medusa-vicuna-7b-v1.3``), not derived from LocalSpec's modules, so a loader
that drifted from them fails. Values are random, drawn from an explicit generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

VOCAB = 97
HIDDEN = 32
DRAFT_VOCAB = 40  # an EAGLE-3 head's own vocabulary, part of the target's


def llama_target(layers: int = 8, seed: int = 0, vocab: int = VOCAB) -> PreTrainedModel:
    """A random tiny Llama in float32, LM head scaled so that logits are peaked."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def unit_embeddings(model: PreTrainedModel) -> torch.Tensor:
    """The target's embedding rows scaled to length 1: [vocab, hidden]."""
    emb = model.get_input_embeddings().weight.detach()
    return emb / emb.norm(dim=-1, keepdim=True)


def embeddings_through(model: PreTrainedModel) -> None:
    """Zero every layer's output projections and set the final norm to 1, so that the hidden
    state entering any layer is the current token's embedding (the final one a positive
    multiple of it): what the LM head then scores is chosen by hand."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)


def clock_target(layers: int = 8) -> PreTrainedModel:
    """A target that continues x with x + 1 (mod vocab), whatever came before.

    Every layer's output projections are zero, so the hidden state entering any layer is the
    current token's embedding (and the final one a positive multiple of it); LM head row x + 1
    is embedding x made unit length, which scores highest against embedding x (Cauchy-Schwarz).
    """
    model = llama_target(layers)
    embeddings_through(model)
    with torch.no_grad():
        model.lm_head.weight.copy_(20.0 * unit_embeddings(model).roll(1, dims=0))
    return model


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return 0.2 * torch.randn(shape, generator=generator)


def _norm(generator: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=generator)


def llama_config(hidden: int, vocab: int, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 64, **extra: object) -> dict[str, object]:
    """The Llama-format config.json the EAGLE heads ship with (one decoder layer)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": intermediate,
            "max_position_embeddings": 2048, "num_attention_heads": heads,
            "num_hidden_layers": 1, "num_key_value_heads": kv_heads, "pad_token_id": 0,
            "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": vocab, **extra}


def _attention_and_mlp(prefix: str, generator: torch.Generator, hidden: int, in_width: int,
                       heads: int, kv_heads: int, intermediate: int) -> dict[str, torch.Tensor]:
    head_dim = hidden // heads
    return {
        f"{prefix}.self_attn.q_proj.weight": _randn(generator, heads * head_dim, in_width),
        f"{prefix}.self_attn.k_proj.weight": _randn(generator, kv_heads * head_dim, in_width),
        f"{prefix}.self_attn.v_proj.weight": _randn(generator, kv_heads * head_dim, in_width),
        f"{prefix}.self_attn.o_proj.weight": _randn(generator, hidden, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": _randn(generator, intermediate, hidden),
        f"{prefix}.mlp.up_proj.weight": _randn(generator, intermediate, hidden),
        f"{prefix}.mlp.down_proj.weight": _randn(generator, hidden, intermediate),
        f"{prefix}.post_attention_layernorm.weight": _norm(generator, hidden),
    }


def eagle1_tensors(hidden: int, vocab: int, seed: int = 0, heads: int = 4, kv_heads: int = 2,
                   intermediate: int = 64) -> dict[str, torch.Tensor]:
    """EAGLE-1: fc over [embedding; feature] with a bias, one layer without input norm."""
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": _randn(g, hidden, 2 * hidden), "fc.bias": _randn(g, hidden),
            **_attention_and_mlp("layers.0", g, hidden, hidden, heads, kv_heads, intermediate),
            "embed_tokens.weight": _randn(g, vocab, hidden)}


def eagle3_tensors(hidden: int, vocab: int, draft_vocab: int, seed: int = 0, heads: int = 4,
                   kv_heads: int = 2, intermediate: int = 64) -> dict[str, torch.Tensor]:
    """EAGLE-3: fc over three fused layers, ``midlayer`` reading [embedding; feature], its own
    norm and LM head over ``draft_vocab`` ids, d2t offsets and the t2d mask."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return {"fc.weight": _randn(g, hidden, 3 * hidden),
            "midlayer.hidden_norm.weight": _norm(g, hidden),
            "midlayer.input_layernorm.weight": _norm(g, hidden),
            **_attention_and_mlp("midlayer", g, hidden, 2 * hidden, heads, kv_heads,
                                 intermediate),
            "norm.weight": _norm(g, hidden), "lm_head.weight": _randn(g, draft_vocab, hidden),
            "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d}


def medusa_tensors(hidden: int, vocab: int, num_heads: int = 3, seed: int = 0,
                   lm_heads: bool = True) -> dict[str, torch.Tensor]:
    """Original Medusa (``medusa_lm_head.pt``): head i is nn.Sequential(ResBlock, Linear):
    ``{i}.0.linear.weight/bias`` and ``{i}.1.weight``."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        tensors[f"{i}.0.linear.weight"] = _randn(g, hidden, hidden)
        tensors[f"{i}.0.linear.bias"] = _randn(g, hidden)
        tensors[f"{i}.1.weight"] = 3.0 * _randn(g, vocab, hidden)
    if not lm_heads:  # the earliest heads: residual blocks only (drawn alike all the same)
        tensors = {k: v for k, v in tensors.items() if "linear" in k}
    return tensors


def medusa_config(num_heads: int = 3) -> dict[str, object]:
    return {"medusa_num_heads": num_heads, "medusa_num_layers": 1,
            "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
            "architectures": ["MedusaModel"]}


def write_head(folder: Path, config: dict[str, object] | None, tensors: dict[str, torch.Tensor],
               filename: str) -> Path:
    """config.json plus ``filename``: safetensors by its suffix, else a torch.save pickle."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if filename.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / filename)
    else:
        torch.save(tensors, folder / filename)
    return folder
