"""ModelRunner: the only thing the engine and the drafters need from a language model.

A runner owns one sequence's KV cache and offers three operations: feed new tokens and get
their logits (and last hidden states, for feature-level drafters), roll the cache back to a
length, and reset. Anything that can do that — a Hugging Face causal LM here, a future module
with 4/8-bit weight-only kernels — can sit under the speculation.

Why the logits are computed in float32 on request: in bfloat16 a batched verify pass and
one-token-at-a-time decoding can pick different argmaxes when two logits are close (bf16 logits
are spaced 0.125 apart at magnitude 16-32). Running the final norm and the LM head in float32
removes most of those near-ties, so greedy speculation stays token-for-token equal to plain
decoding; ``localspec verify`` measures what remains.

The runner deliberately does not sample, verify or tokenize.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel


class _Float32Input(nn.Module):
    """Runs a norm on float32 input; RMSNorm/LayerNorm then return float32 too."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden.float())


class ModelRunner:
    """One sequence, one cache, logits for the tokens just fed."""

    def __init__(self, model: PreTrainedModel, *, logits_fp32: bool = False) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.logits_fp32 = logits_fp32
        self.backbone = model.base_model
        self.lm_head = model.get_output_embeddings()
        self._lm_head_weight: torch.Tensor | None = None
        if logits_fp32 and model.dtype != torch.float32:
            weight = getattr(self.lm_head, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16):
                self._lm_head_weight = weight.detach().float()
            norm = getattr(self.backbone, "norm", None)
            if isinstance(norm, nn.Module) and not isinstance(norm, _Float32Input):
                self.backbone.norm = _Float32Input(norm)
        self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.last_hidden: torch.Tensor | None = None  # [n, hidden] of the last forward

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.last_hidden = None

    @torch.inference_mode()
    def forward(self, token_ids: list[int], logits_to_keep: int | None = None) -> torch.Tensor:
        """Append ``token_ids`` to the cache; return float logits [n_kept, vocab].

        ``logits_to_keep`` limits the LM head to the last positions (prefill needs one).
        """
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + len(token_ids), device=self.device)
        out = self.backbone(
            input_ids=ids,
            cache=self.cache,
            use_cache=True,
            position_ids=positions.unsqueeze(0),
        )
        self.length += len(token_ids)
        hidden = out.last_hidden_state[0]  # [n, hidden]
        if logits_to_keep is not None:
            hidden = hidden[-logits_to_keep:]
        self.last_hidden = hidden
        if self._lm_head_weight is not None:
            return torch.nn.functional.linear(hidden.float(), self._lm_head_weight)
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first ``length`` tokens."""
        if length < self.length:
            self.cache.crop(-(self.length - length))  # transformers >= 5: a negative count
            self.length = length
