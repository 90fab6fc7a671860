"""What the CPU-forward (``CpuDecoder``) test modules share: random token ids and a tiny random
Llama in float32."""

from __future__ import annotations

import torch
from conftest import MAX_POSITIONS, VOCAB
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel


def _tokens(count: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tiny_llama(seed: int, **overrides: object) -> PreTrainedModel:
    """A random Llama of tiny_config's sizes in float32. Weights 5x larger than transformers'
    default init: attention is then peaked and depends on position (with the default, RoPE
    changes the logits by under 1e-3 and a RoPE bug could hide under the tolerance)."""
    settings: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.1)
    settings.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32).eval()
