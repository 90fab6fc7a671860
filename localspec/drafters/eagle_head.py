"""The EAGLE and EAGLE-3 draft heads as PyTorch modules: one decoder layer over the target's
features, with a KV cache of its own.

EAGLE (Li et al., 2024) drafts the target's next *feature* rather than its next token: at
position i the head reads the target's final hidden state f_i and the embedding of token
x_{i+1}, and its output stands in for f_{i+1}; the target's own LM head turns it into a token.
The next draft step feeds that output back as if it were a feature. EAGLE-3 differs in three
ways: the feature is a fusion (``fc``) of three of the target's layers, low, middle and high;
the decoder layer's attention reads the normed embedding and the normed feature side by side
(so its q/k/v projections take 2 * hidden inputs); and it has its own final norm and an LM head
over a reduced draft vocabulary, whose ids map to the target's through ``d2t``.

Module and parameter names follow the published checkpoints (``fc``, ``layers.N.self_attn.
q_proj``, ``norm``, ``lm_head``, ``d2t``), with EAGLE-3's ``midlayer`` read as ``layers.0``, as
vLLM's ``llama_eagle.py`` and ``llama_eagle3.py`` do; ``localspec.drafters.head_layouts``
reads and checks those files. This module holds no weights loader and no sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from localspec.runtime.weight_formats import spread_logits


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 fuses by default: low, middle, high (vLLM's choice)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class EagleSpec:
    """The shape of a head (a Llama-style decoder layer), as its config.json gives it."""

    kind: str  # "eagle" | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    vocab_size: int = 0  # the target's vocabulary (the embedding's rows)
    draft_vocab_size: int = 0  # EAGLE-3: rows of its own LM head
    target_hidden_size: int = 0  # EAGLE-3: width of each fused target layer (0: hidden_size)
    attention_bias: bool = False
    fc_bias: bool = False
    norm_before_residual: bool = False  # EAGLE-3 variant: the residual is the normed feature
    rope: Mapping[str, object] = field(default_factory=dict)  # LlamaConfig's rope keys

    @property
    def fused_width(self) -> int:
        """Width of the target features ``fc`` reads: 2h (EAGLE: embedding + feature) or 3h
        (EAGLE-3: low, middle and high layers)."""
        if self.kind == "eagle3":
            return 3 * (self.target_hidden_size or self.hidden_size)
        return 2 * self.hidden_size

    @classmethod
    def for_target(cls, config: object, kind: str, draft_vocab_size: int = 0) -> EagleSpec:
        """A one-layer head shaped like a layer of the target ``config`` (a transformers
        config): what a head trained for that target looks like."""
        heads = int(config.num_attention_heads)
        return cls(kind=kind, hidden_size=int(config.hidden_size),
                   intermediate_size=int(config.intermediate_size), num_heads=heads,
                   num_kv_heads=int(getattr(config, "num_key_value_heads", heads) or heads),
                   head_dim=int(getattr(config, "head_dim", 0) or config.hidden_size // heads),
                   rms_norm_eps=float(config.rms_norm_eps), vocab_size=int(config.vocab_size),
                   draft_vocab_size=draft_vocab_size or int(config.vocab_size),
                   rope={"rope_theta": rope_theta(config),
                         "max_position_embeddings":
                             int(getattr(config, "max_position_embeddings", 2048))})


def rope_theta(config: object) -> float:
    """RoPE's base of a transformers config: ``rope_parameters["rope_theta"]`` in transformers
    5, the ``rope_theta`` attribute before (10000 when neither says)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", 0) or 10000.0)


class RMSNorm(nn.Module):
    """Llama's RMS norm: computed in float32, returned in the input's dtype."""

    def __init__(self, size: int, eps: float, **factory: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class HeadCache:
    """Keys and values of the head's layers, [kv_heads, capacity, head_dim] each, written by
    position: rolling back is the caller forgetting positions, which the next write replaces."""

    def __init__(self, spec: EagleSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        self.shape = (spec.num_kv_heads, 0, spec.head_dim)
        self.dtype, self.device = dtype, device
        self.keys = [torch.empty(self.shape, dtype=dtype, device=device)
                     for _ in range(spec.num_layers)]
        self.values = [torch.empty(self.shape, dtype=dtype, device=device)
                       for _ in range(spec.num_layers)]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim] at positions start..start+n-1."""
        end = start + k.shape[1]
        capacity = self.keys[layer].shape[1]
        if end > capacity:
            new = max(end, 2 * capacity, 64)
            for store in (self.keys, self.values):
                grown = torch.empty((self.shape[0], new, self.shape[2]), dtype=self.dtype,
                                    device=self.device)
                grown[:, :capacity] = store[layer]
                store[layer] = grown
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v


class HeadAttention(nn.Module):
    """Grouped-query attention with RoPE over the head's own cache."""

    def __init__(self, spec: EagleSpec, in_features: int, **factory: object) -> None:
        super().__init__()
        self.spec = spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_proj = nn.Linear(in_features, q, bias=spec.attention_bias, **factory)
        self.k_proj = nn.Linear(in_features, kv, bias=spec.attention_bias, **factory)
        self.v_proj = nn.Linear(in_features, kv, bias=spec.attention_bias, **factory)
        self.o_proj = nn.Linear(q, spec.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: HeadCache, layer: int, start: int) -> torch.Tensor:
        """x: [n, in_features] at positions start..; rope: cos, sin [n, head_dim]."""
        n, s = x.shape[0], self.spec
        cos, sin = rope

        def rotate(t: torch.Tensor) -> torch.Tensor:  # [heads, n, head_dim]
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

        q = rotate(self.q_proj(x).view(n, s.num_heads, s.head_dim).transpose(0, 1))
        k = rotate(self.k_proj(x).view(n, s.num_kv_heads, s.head_dim).transpose(0, 1))
        v = self.v_proj(x).view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        cache.write(layer, start, k, v)
        end = start + n
        mask = None
        if n > 1:  # query j (position start + j) sees keys 0..start + j
            mask = torch.arange(end, device=x.device)[None] <= torch.arange(
                start, end, device=x.device)[:, None]
        out = F.scaled_dot_product_attention(
            q[None], cache.keys[layer][None, :, :end], cache.values[layer][None, :, :end],
            attn_mask=mask, enable_gqa=s.num_heads != s.num_kv_heads)[0]  # [heads, n, head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(n, s.num_heads * s.head_dim))


class HeadMLP(nn.Module):
    def __init__(self, spec: EagleSpec, **factory: object) -> None:
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=False, **factory)
        self.up_proj = nn.Linear(h, m, bias=False, **factory)
        self.down_proj = nn.Linear(m, h, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    """A Llama decoder layer, as EAGLE varies it: EAGLE's first layer has no input norm (``fc``
    already mixed its input); EAGLE-3's first layer norms the embedding (``input_layernorm``)
    and the feature (``hidden_norm``) apart and attends over both side by side."""

    def __init__(self, spec: EagleSpec, index: int, **factory: object) -> None:
        super().__init__()
        self.index = index
        self.two_inputs = spec.kind == "eagle3" and index == 0
        self.norm_before_residual = spec.norm_before_residual
        h, eps = spec.hidden_size, spec.rms_norm_eps
        if spec.kind == "eagle3" or index > 0:
            self.input_layernorm = RMSNorm(h, eps, **factory)
        if self.two_inputs:
            self.hidden_norm = RMSNorm(h, eps, **factory)
        self.self_attn = HeadAttention(spec, 2 * h if self.two_inputs else h, **factory)
        self.post_attention_layernorm = RMSNorm(h, eps, **factory)
        self.mlp = HeadMLP(spec, **factory)

    def forward(self, x: torch.Tensor, embeds: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], cache: HeadCache,
                start: int) -> torch.Tensor:
        """x: [n, h] the feature (or previous layer's output); embeds: [n, h]."""
        residual = x
        if self.two_inputs:
            feature = self.hidden_norm(x)
            residual = feature if self.norm_before_residual else x
            attn_in = torch.cat((self.input_layernorm(embeds), feature), dim=-1)
        elif hasattr(self, "input_layernorm"):
            attn_in = self.input_layernorm(x)
        else:
            attn_in = x
        x = residual + self.self_attn(attn_in, rope, cache, self.index, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """``fc`` + decoder layer(s) (+ EAGLE-3's norm, LM head and id map).

    ``embed_tokens`` is None unless a checkpoint brings its own (EAGLE-3 may): the target's
    embedding table is used otherwise. ``lm_head`` is None for EAGLE, which reads its output
    with the target's LM head.
    """

    def __init__(self, spec: EagleSpec, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.spec = spec
        self.fc = nn.Linear(spec.fused_width, spec.hidden_size, bias=spec.fc_bias, **factory)
        self.layers = nn.ModuleList(HeadLayer(spec, i, **factory)
                                    for i in range(spec.num_layers))
        self.embed_tokens: nn.Embedding | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        if spec.kind == "eagle3":
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **factory)
            self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False,
                                     **factory)
            # target id of draft id i is i + d2t[i] (the published offset form)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long,
                                                    device=device))
        # Not a submodule: its float32 inv_freq must not follow the head's dtype.
        self._rotary = (LlamaRotaryEmbedding(LlamaConfig(
            hidden_size=spec.num_heads * spec.head_dim, num_attention_heads=spec.num_heads,
            head_dim=spec.head_dim, **spec.rope)),)

    def rope(self, start: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] for positions start..start+n-1."""
        positions = torch.arange(start, start + n, device=self.fc.weight.device)[None]
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        cos, sin = self._rotary[0](probe, positions)
        return cos[0].to(dtype), sin[0].to(dtype)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, start: int,
                cache: HeadCache, from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over n positions start..start+n-1.

        hidden: [n, fused_width] target features when ``from_target`` (EAGLE-3's fused
        layers), else [n, h] the head's own previous outputs; embeds: [n, h], the embedding of
        the token that follows each feature. Returns (for the LM head [n, h], the next draft
        step's input [n, h]).
        """
        dtype = self.fc.weight.dtype
        hidden, embeds = hidden.to(dtype), embeds.to(dtype)
        if self.spec.kind == "eagle":
            x = self.fc(torch.cat((embeds, hidden), dim=-1))
        else:
            x = self.fc(hidden) if from_target else hidden
        rope = self.rope(start, x.shape[0], dtype)
        for layer in self.layers:
            x = layer(x, embeds, rope, cache, start)
        return (x if self.norm is None else self.norm(x)), x

    def draft_ids(self) -> torch.Tensor:
        """EAGLE-3: the target's id of each row of its LM head, [draft_vocab]."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def draft_logits(self, hidden: torch.Tensor, target_vocab: int | None = None
                     ) -> torch.Tensor:
        """EAGLE-3: float32 logits from its own LM head: over the draft vocabulary [n,
        draft_vocab] (``draft_ids`` names them), or with ``target_vocab`` spread to [n,
        target_vocab], ids outside it -inf."""
        assert self.lm_head is not None, "EAGLE reads its output with the target's LM head"
        sub = self.lm_head(hidden).float()  # [n, draft_vocab]
        return sub if target_vocab is None else spread_logits(sub, self.draft_ids(),
                                                              target_vocab)

    def embed(self, ids: torch.Tensor, target_table: torch.Tensor) -> torch.Tensor:
        """[n] ids -> [n, h] with the head's own embedding if it has one, else the target's."""
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return F.embedding(ids.to(target_table.device), target_table)
