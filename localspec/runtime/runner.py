"""ModelRunner: the only thing the engine and the drafters need from a language model.

A runner owns one sequence's KV cache and offers three operations: feed new tokens and get
their logits (and last hidden states, for feature-level drafters), roll the cache back to a
length, and reset. Two forwards can sit under it: a Hugging Face causal LM with a
``DynamicCache`` (any architecture, any device), or ``LeanDecoder`` (Llama-family models on a
CPU: int8 kernels, a static cache whose rollback is a length change).

Why ``logits_fp32``: in bfloat16 a batched verify pass and one-token-at-a-time decoding can
pick different argmaxes when two logits are close (bf16 logits are spaced 0.125 apart at
magnitude 16-32). We run the final norm in float32 and, instead of a float32 LM head over the
whole vocabulary (0.4 s for 16 rows of the 1.5B here, against 0.07 s in bf16), compute the bf16
LM head and then recompute in float32 only the logits within a safe margin of each row's
maximum. The argmax and the top of the distribution are then float32-exact at bf16 cost;
``localspec verify`` measures what near-ties remain.

The runner deliberately does not sample, verify or tokenize.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from localspec.runtime.decoder import KVCache, LeanDecoder


def refine_top_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LM head in the weight's dtype, then float32-exact logits near each row's maximum.

    hidden: [n, d] float32; weight: [vocab, d] bf16/fp16. Returns [n, vocab] float32. The
    margin covers bf16 rounding of the inputs and of the output (2^-8 relative) many times over.
    """
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()
    top = logits.max(dim=-1, keepdim=True).values
    margin = torch.clamp(top.abs() * 2.0**-5, min=0.25)
    rows, cols = torch.nonzero(logits >= top - margin, as_tuple=True)
    logits[rows, cols] = (hidden[rows] * weight[cols].float()).sum(dim=-1)
    return logits


class ModelRunner:
    """One sequence, one cache, logits for the tokens just fed."""

    def __init__(self, model: PreTrainedModel, *, logits_fp32: bool = False,
                 vocab_rows: torch.Tensor | None = None,
                 decoder: LeanDecoder | None = None) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.logits_fp32 = logits_fp32
        self.decoder = decoder
        self.length = 0
        self.last_hidden: torch.Tensor | None = None  # [n, hidden] of the last forward
        if decoder is not None:
            # int8 logits are exact int32 sums, the same in any batch: no float32 refinement.
            self.lean_cache: KVCache = decoder.new_cache()
            self._rows = vocab_rows
            self._head = decoder.head.part(vocab_rows)
            return
        self.backbone = model.base_model
        self.lm_head = model.get_output_embeddings()
        # float32 logits: re-run the final norm on its float32 input, refine the top logits.
        self._norm: nn.Module | None = None
        weight = getattr(self.lm_head, "weight", None)
        norm = getattr(self.backbone, "norm", None)
        if (logits_fp32 and isinstance(norm, nn.Module) and isinstance(weight, torch.Tensor)
                and weight.dtype in (torch.bfloat16, torch.float16)
                and getattr(self.lm_head, "bias", None) is None):
            self._norm = norm
        # A drafter may restrict its LM head to frequent tokens (FR-Spec): the head is the
        # largest single matmul of a small model. Other logits are -inf.
        self._rows: torch.Tensor | None = None
        self._rows_weight: torch.Tensor | None = None
        if vocab_rows is not None and self._norm is None:
            self._rows = vocab_rows.to(self.device)
            self._rows_weight = self.lm_head.weight.detach()[self._rows].contiguous()
        self.cache = DynamicCache(config=self.config)

    @property
    def vocab_size(self) -> int:
        if self.decoder is not None:
            return self.decoder.head.vocab_size
        return int(self.lm_head.weight.shape[0])

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    def reset(self) -> None:
        if self.decoder is None:
            self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.last_hidden = None

    @torch.inference_mode()
    def forward(self, token_ids: list[int], logits_to_keep: int | None = None) -> torch.Tensor:
        """Append ``token_ids`` to the cache; return float logits [n_kept, vocab].

        ``logits_to_keep`` limits the LM head to the last positions (prefill needs one).
        """
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        if self.decoder is not None:
            ids = torch.tensor(token_ids, dtype=torch.long)
            hidden = self.decoder.forward(ids, self.lean_cache, self.length)
            self.length += len(token_ids)
            self.last_hidden = hidden[keep]
            return self.decoder.head.logits(self.last_hidden, self._rows, self._head)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + len(token_ids), device=self.device)
        captured: list[torch.Tensor] = []
        hook = (self._norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
                if self._norm is not None else None)
        try:
            out = self.backbone(input_ids=ids, cache=self.cache, use_cache=True,
                                position_ids=positions.unsqueeze(0))
        finally:
            if hook is not None:
                hook.remove()
        self.length += len(token_ids)
        self.last_hidden = out.last_hidden_state[0, keep]  # [n, hidden]
        if self._norm is not None:
            normed = self._norm(captured[-1][0, keep].float()).float()  # [n, hidden] float32
            return refine_top_logits(normed, self.lm_head.weight)
        if self._rows_weight is not None:
            sub = torch.nn.functional.linear(self.last_hidden, self._rows_weight).float()
            logits = torch.full((sub.shape[0], self.vocab_size), float("-inf"), device=self.device)
            logits[:, self._rows] = sub
            return logits
        return self.lm_head(self.last_hidden).float()

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first ``length`` tokens."""
        if length < self.length and self.decoder is not None:
            self.length = length  # stale positions are overwritten by the next forward
        elif length < self.length:
            self.cache.crop(-(self.length - length))  # transformers >= 5: a negative count
            self.length = length
