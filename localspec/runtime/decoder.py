"""A CPU forward for Llama-family decoders (Llama, Qwen2, Qwen3) over a preallocated KV cache.

Why not the Hugging Face forward: on a 2-core CPU a 0.5B draft step spent about half its time
in Python, masks and ``DynamicCache`` bookkeeping, and its linear layers are ``nn.Linear`` in
bfloat16 (3 GB read per token of the 1.5B). Here each layer is seven tensor calls deep: fused
q/k/v and fused gate/up projections in int8 (``W8A8Linear``) or in a GGUF's own Q4_K and Q6_K
(``Q4KLinear``, ``Q6KLinear``: native kernels; formats in ``weight_formats``), RoPE from the
model's own rotary module (so every ``rope_scaling`` transformers knows is honoured; Qwen3
first RMS-norms every query and key head, ``q_norm`` / ``k_norm``), the new
keys and values written in place into a static cache, and attention (the native kernel
``RowAttention`` over a bf16 cache, else PyTorch's SDPA with grouped-query heads). Rolling the
cache back is a length change: stale positions are simply overwritten by the next pass. Where
every layer is Q4_K / Q6_K, all of this runs in one native call instead (``native.py``), a
longer feed (a prompt) in pieces of ROW_ATTENTION_MAX rows.

In int8, the down projection's input (SiLU(gate) * up: heavy-tailed, a few channels far
larger than the rest) is first turned by a block Hadamard rotation, and the weight by the same
one offline, so the product is unchanged in exact arithmetic; the rotation spreads each
outlier over a block, and per-token int8 then keeps the other channels' precision (QuaRot's
online rotation): it is what brings top-1 agreement with bf16 on the quality texts up to the
goal (docs/models.md).

The residual stream and norms run in float32 (cheap for the few rows a decode step feeds);
keys and values are stored in the model's dtype. The weights are taken from a loaded
transformers model, which is then emptied of its layer weights so that memory holds one copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel

from localspec.config import CPU_QUANTIZATIONS, NATIVE_ARCHITECTURES
from localspec.runtime.kernels.row_attention import RowAttention
from localspec.runtime.native import NativeStack, StackRows
from localspec.runtime.quant import W8A8Linear
from localspec.runtime.weight_formats import (
    ROW_ATTENTION_MAX,
    Linear,
    LMHead,
    export_weights,
    layer_linear,
    release_weights,
    rotate,
)

CPU_MODEL_TYPES = NATIVE_ARCHITECTURES  # config: what the model library calls native too
CACHE_BLOCK = 256  # the KV cache grows in blocks of this many positions
# What CpuDecoder's ``linear`` takes: the quantizations config serves on the CPU, and "dense"
# (the loaded dtype, for tests and references).
LINEAR_KINDS = (*CPU_QUANTIZATIONS, "dense")


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the CPU forward cannot run ``model`` (None when it can)."""
    config = model.config
    if config.model_type not in CPU_MODEL_TYPES:
        return f"architecture '{config.model_type}' (supported: {', '.join(CPU_MODEL_TYPES)})"
    if model.device.type != "cpu":
        return f"device {model.device} (the CPU forward is for CPUs)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation '{config.hidden_act}'"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    return None


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: Linear
    o: Linear
    norm2: torch.Tensor
    gate_up: Linear
    down: Linear
    down_rotated: bool  # the down projection's input is turned first (its weight was)
    q_norm: torch.Tensor | None = None  # [head_dim] float32: Qwen3's per-head norms, applied
    k_norm: torch.Tensor | None = None  # to every query and key head before RoPE


@dataclass(frozen=True)
class BatchFeed:
    """One sequence's feed in ``CpuDecoder.forward_batch``: token ids [n], its cache, the
    position of its first token, the layers whose input it records (as ``forward_features``)
    and its tree (``parents``; None: a chain)."""

    ids: torch.Tensor
    cache: KVCache
    start: int
    layers: tuple[int, ...] = ()
    parents: torch.Tensor | None = None


class KVCache:
    """Keys and values of one sequence: [layers, kv_heads, capacity, head_dim] each."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_length: int) -> None:
        self.shape = (layers, kv_heads, 0, head_dim)
        self.dtype, self.max_length = dtype, max_length
        self.keys = torch.empty(self.shape, dtype=dtype)
        self.values = torch.empty(self.shape, dtype=dtype)

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions, growing by whole blocks (copies are rare)."""
        capacity = self.keys.shape[2]
        if length <= capacity:
            return
        new = min(max(length, 2 * capacity, CACHE_BLOCK), max(self.max_length, length))
        new = -(-new // CACHE_BLOCK) * CACHE_BLOCK
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.empty((*self.shape[:2], new, self.shape[3]), dtype=self.dtype)
            grown[:, :, :capacity] = old
            setattr(self, name, grown)


class CpuDecoder:
    """Hidden states of a Llama-family model, computed with the given linear-layer kind.

    ``linear`` is "w8a8" (int8 weights, per-token int8 activations), "w4a8" / "requant-q4k" /
    "requant-q3m" (a GGUF's native types, Q4_K or Q3_M weights where there are some, see
    ``weight_formats``) or "dense" (the loaded dtype).
    ``head`` computes logits; a runner asks it for the rows it needs.
    """

    def __init__(self, model: PreTrainedModel, linear: str = "w8a8",
                 weights: Mapping[str, torch.Tensor] | None = None,
                 kernel_lib: object | None = None) -> None:
        """Take ``model``'s weights (quantizing them) or ``weights`` as ``export_weights``
        names them (then the model's own are never read); either way the model is emptied.
        ``kernel_lib`` (``localspec.runtime.kernels.load_kernels``) runs layers stored in Q4_K
        or Q6_K, attention over a bf16 cache, and all layers at once where it can."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the CPU forward does not support {reason}")
        if linear not in LINEAR_KINDS:
            raise ValueError(f"linear must be one of {', '.join(LINEAR_KINDS)}, got {linear!r}")
        if weights is None:
            weights = export_weights(model, linear)
        config = model.config
        self.embed = weights["embed"]
        self.dtype = self.embed.dtype
        self.rotary = model.base_model.rotary_emb
        self.eps = float(config.rms_norm_eps)

        rotation = weights.get("down_rotation")  # see the module docstring
        self.down_rotation = rotation
        first = model.base_model.layers[0].self_attn
        head_norms = hasattr(first, "q_norm")  # Qwen3; a store without them: KeyError

        def layer(i: int) -> _Layer:
            down = layer_linear(weights, f"layers.{i}.down", kernel_lib)
            q_norm, k_norm = (weights[f"layers.{i}.q_norm"], weights[f"layers.{i}.k_norm"]
                              ) if head_norms else (None, None)
            return _Layer(norm1=weights[f"layers.{i}.norm1"],
                          qkv=layer_linear(weights, f"layers.{i}.qkv", kernel_lib),
                          o=layer_linear(weights, f"layers.{i}.o", kernel_lib),
                          norm2=weights[f"layers.{i}.norm2"],
                          gate_up=layer_linear(weights, f"layers.{i}.gate_up", kernel_lib),
                          down=down,
                          down_rotated=rotation is not None and isinstance(down, W8A8Linear),
                          q_norm=q_norm, k_norm=k_norm)

        # oneDNN packs a weight on about one core and lets go of the GIL meanwhile, so layers
        # are packed side by side (docs/research-log.md).
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            self.layers = list(pool.map(layer, range(config.num_hidden_layers)))
        self.head_dim = int(first.head_dim)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = float(first.scaling)
        self.row_attention = RowAttention(kernel_lib, self.heads, self.kv_heads, self.head_dim,
                                          self.scaling) \
            if kernel_lib is not None and RowAttention.fits(self.heads, self.kv_heads,
                                                         self.head_dim, self.dtype) else None
        self.norm = weights["norm"]
        self.max_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.intermediate = config.intermediate_size
        # every layer in one native call where all of them are Q4_K / Q6_K (see native.py)
        self.native = None if kernel_lib is None else NativeStack.build(
            kernel_lib, self.layers, config.hidden_size, self.heads, self.kv_heads, self.head_dim,
            self.intermediate, self.eps, self.scaling, self.dtype)
        # keys first: items() of a stored file would read (and check) every tensor again
        self.head = LMHead({key.removeprefix("head."): weights[key] for key in weights
                            if key.startswith("head.")}, kernel_lib)
        release_weights(model)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype,
                       self.max_length)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [heads, n, d] at positions start.. over the cached keys/values."""
        gqa = self.heads != self.kv_heads
        n = q.shape[1]
        if mask is not None:
            end = start + n
            return F.scaled_dot_product_attention(
                q[None], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                scale=self.scaling, enable_gqa=gqa)[0]
        rows = [F.scaled_dot_product_attention(
            q[None, :, j:j + 1], keys[None, :, :start + j + 1], values[None, :, :start + j + 1],
            scale=self.scaling, enable_gqa=gqa)[0] for j in range(n)]
        return rows[0] if n == 1 else torch.cat(rows, dim=1)

    @property
    def supports_trees(self) -> bool:
        """Whether ``forward`` takes ``parents`` (the native row attention serves the layers)."""
        return self.row_attention is not None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, start: int,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``ids`` [n] at positions start..start+n-1; return final-normed hidden [n, d]
        in float32. Rows from ``start`` on are overwritten in ``cache``. ``parents`` [n]
        (-1, then each row's parent, an earlier row): the rows form a tree, row j at position
        start + its depth, attending the prefix and its root path (``supports_trees``)."""
        return self.forward_features(ids, cache, start, (), parents)[0]

    @torch.inference_mode()
    def forward_features(self, ids: torch.Tensor, cache: KVCache, start: int,
                         layers: tuple[int, ...], parents: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, plus the hidden states entering each of ``layers`` (numbered as Hugging
        Face's ``hidden_states``: 0 the embeddings, ``len(self.layers)`` the final normed
        output), concatenated: [n, len(layers) * d] float32, None when ``layers`` is empty.
        What a feature-level drafter (EAGLE-3's low, middle and high layers) reads."""
        n = ids.shape[0]
        if self.native is not None and parents is None and n > ROW_ATTENTION_MAX:
            return self._in_pieces(ids, cache, start, layers)
        end = start + n
        cache.reserve(end)
        x = F.embedding(ids, self.embed).float()
        cos, sin = self._rope_rows(x, start, parents)
        entering: dict[int, torch.Tensor] = {}
        if self.native is not None and n <= ROW_ATTENTION_MAX:
            inner = [i for i in layers if i < len(self.layers)]
            # x (the embedding's fresh copy) is rewritten in place by every layer
            features = self.native(x, cos, sin, cache.keys, cache.values, start, inner,
                                   parents)
            width = x.shape[1]
            entering = {i: features[:, slot * width:(slot + 1) * width]  # type: ignore[index]
                        for slot, i in enumerate(inner)}
        else:
            x = self._layers(x, cos, sin, cache, start, layers, entering, parents)
        hidden = self._rms(x, self.norm)
        if not layers:
            return hidden, None
        entering[len(self.layers)] = hidden
        return hidden, torch.cat([entering[i] for i in layers], dim=-1)

    def _rope_rows(self, x: torch.Tensor, start: int, parents: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, head_dim] float32 of rows x fed at ``start`` (a tree's rows at
        start + their depth)."""
        n = x.shape[0]
        positions = torch.arange(start, start + n).unsqueeze(0)
        if parents is not None:
            if not self.supports_trees or n > ROW_ATTENTION_MAX:
                raise ValueError(f"a tree of {n} rows needs the native row attention and at "
                                 f"most {ROW_ATTENTION_MAX} rows")
            depth = [0] * n
            for j in range(1, n):
                depth[j] = depth[int(parents[j])] + 1
            positions = (start + torch.tensor(depth)).unsqueeze(0)
        cos, sin = self.rotary(x, positions)
        return cos[0].float(), sin[0].float()

    @torch.inference_mode()
    def forward_batch(self, feeds: Sequence[BatchFeed]
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``forward_features`` of several sequences (each ``BatchFeed`` its own cache) in one
        native call where the stack runs and every feed has at most ROW_ATTENTION_MAX rows:
        the projections over all rows at once, each row's result the bits its feed alone
        gives. Elsewhere the feeds run one after another (the same results, no saving)."""
        if self.native is None or any(f.ids.shape[0] > ROW_ATTENTION_MAX for f in feeds):
            return [self.forward_features(f.ids, f.cache, f.start, f.layers, f.parents)
                    for f in feeds]
        depth = len(self.layers)
        x = F.embedding(torch.cat([f.ids for f in feeds]), self.embed).float()
        rows: list[StackRows] = []
        at = 0
        for f in feeds:
            n = f.ids.shape[0]
            f.cache.reserve(f.start + n)
            cos, sin = self._rope_rows(x[at:at + n], f.start, f.parents)
            rows.append(StackRows(n, cos, sin, f.cache.keys, f.cache.values, f.start,
                                  tuple(i for i in f.layers if i < depth), f.parents))
            at += n
        features = self.native.batch(x, rows)
        results: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        at = 0
        for f, r, inner in zip(feeds, rows, features, strict=True):
            mine = self._rms(x[at:at + r.n], self.norm)  # each feed's own call, as alone
            at += r.n
            if not f.layers:
                results.append((mine, None))
                continue
            width = x.shape[1]
            entering = {i: inner[:, slot * width:(slot + 1) * width]  # type: ignore[index]
                        for slot, i in enumerate(r.feature_layers)}
            entering[depth] = mine
            results.append((mine, torch.cat([entering[i] for i in f.layers], dim=-1)))
        return results

    def _in_pieces(self, ids: torch.Tensor, cache: KVCache, start: int, layers: tuple[int, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_features`` of a long feed (a prompt, a catch-up) through the native stack,
        ROW_ATTENTION_MAX rows a call. Each row's result there does not depend on the other
        rows of its call, so the cache and outputs are those of feeding the rows one at a time
        (as decoding does); it is also faster than the tensor calls and masked SDPA
        (docs/design.md)."""
        pieces = [self.forward_features(ids[at:at + ROW_ATTENTION_MAX], cache, start + at, layers)
                  for at in range(0, ids.shape[0], ROW_ATTENTION_MAX)]
        hidden = torch.cat([h for h, _ in pieces])
        features = [f for _, f in pieces if f is not None]
        return hidden, torch.cat(features) if features else None

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                start: int, layers: tuple[int, ...], entering: dict[int, torch.Tensor],
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """The layers in tensor calls (int8 or dense layers); the output before
        the final norm. ``entering`` receives the inputs of ``layers``; ``parents``: a tree
        (row attention only)."""
        n = x.shape[0]
        end = start + n
        half = self.head_dim // 2
        mask = None
        if n > ROW_ATTENTION_MAX:  # a long prompt: one masked call, query i sees keys 0..start+i
            mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
        q_size = self.heads * self.head_dim
        kv_size = self.kv_heads * self.head_dim

        def rope(t: torch.Tensor) -> torch.Tensor:  # [heads, n, head_dim]
            rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
            return t * cos + rotated * sin

        for i, layer in enumerate(self.layers):
            if i in layers:
                entering[i] = x  # x is rebound below, never written in place
            qkv = layer.qkv(self._rms(x, layer.norm1))
            q = qkv[:, :q_size].view(n, self.heads, self.head_dim).transpose(0, 1)
            k = qkv[:, q_size:q_size + kv_size].view(n, self.kv_heads, self.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:  # per head, before RoPE
                q, k = self._rms(q, layer.q_norm), self._rms(k, layer.k_norm)
            v = qkv[:, q_size + kv_size:].view(n, self.kv_heads, self.head_dim)
            cache.keys[i, :, start:end] = rope(k.transpose(0, 1))
            cache.values[i, :, start:end] = v.transpose(0, 1)
            if self.row_attention is not None and mask is None:
                out = self.row_attention(rope(q), cache.keys[i], cache.values[i], start,
                                         parents)
            else:
                out = self._attend(rope(q).to(self.dtype), cache.keys[i], cache.values[i],
                                   start, mask).transpose(0, 1).reshape(n, q_size).float()
            x = x + layer.o(out)
            gate_up = layer.gate_up(self._rms(x, layer.norm2))
            hidden_mlp = F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
            if layer.down_rotated:
                hidden_mlp = rotate(hidden_mlp, self.down_rotation)
            x = x + layer.down(hidden_mlp)
        return x
