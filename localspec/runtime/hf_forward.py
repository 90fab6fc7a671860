"""HfForward: a Hugging Face causal LM (any architecture, any device) as a ``ModelRunner`` backend.

It keeps a ``DynamicCache``, or with ``static_cache=N`` a ``StaticCache`` of N positions
allocated once: rollback and reset move its length only (later positions are masked and
overwritten), and its tensors keep the addresses CUDA graphs need. ``cuda_graphs=True`` (with
a static cache) runs each forward of up to ``GRAPH_WIDTHS[-1]`` tokens as a CUDA graph compiled
once per width bucket, padded with copies of its last token whose cache entries land past the
length (docs/design.md, "The GPU path").

Why ``logits_fp32``: in bfloat16 a batched verify pass and one-token decoding can pick
different argmaxes at near-ties (bf16 logits are 0.125 apart at magnitude 16-32). The final
norm runs in float32, the LM head in bf16 (a float32 head over the whole vocabulary: 0.4 s for
16 rows of the 1.5B, against 0.07 s), and only the logits near each row's maximum again in
float32 (``refine_top_logits``): the argmax and the top of the distribution are float32-exact;
``localspec verify`` measures what near-ties remain.

It feeds chains only (no trees) and does not track the sequence's tokens, length or recorded
features' validity: ``ModelRunner`` does, for both backends alike, and passes the start.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel, StaticCache

from localspec.runtime.features import FeatureStore
from localspec.runtime.weight_formats import refine_top_logits, spread_logits

GRAPH_WIDTHS = (1, 2, 4, 8, 16, 32)  # CUDA graph buckets of tokens per forward; wider: eager
GRAPHED_RUNNERS = 4  # compiled variants are budgeted for this many runners in a process
PREFILL_CHUNK = 512  # a longer feed whose leading logits are not wanted runs in pieces


class HfForward:
    """A Hugging Face model's backbone, cache and LM head for one runner."""

    row_exact = False  # a batch may round otherwise than the tokens fed one at a time
    supports_trees = False

    def __init__(self, model: PreTrainedModel, *, logits_fp32: bool,
                 vocab_rows: torch.Tensor | None, static_cache: int, cuda_graphs: bool) -> None:
        self.config = model.config
        self.device = model.device
        self.num_layers = int(self.config.num_hidden_layers)
        self.model = model
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
        self.rows: torch.Tensor | None = None
        self._rows_weight: torch.Tensor | None = None
        if vocab_rows is not None and self._norm is None:
            self.rows = vocab_rows.to(self.device)
            self._rows_weight = self.lm_head.weight.detach()[self.rows].contiguous()
        self.capacity = static_cache
        if cuda_graphs and not static_cache:
            raise ValueError("cuda_graphs needs a static cache (static_cache=N)")
        self.cache = self._new_cache()
        self._kept: dict[str, torch.Tensor] = {}  # the final norm's input (graphed runs)
        self._graphed = None  # the compiled step (cuda_graphs)
        if cuda_graphs:
            # A hook that stays registered: a compiled graph is traced with its hooks, and
            # one added per call would recompile it.
            if self._norm is not None:
                self._norm.register_forward_pre_hook(
                    lambda _m, args: self._kept.__setitem__("pre_norm", args[0]))
            # Every runner, width bucket and features-or-not is one compiled variant of the
            # same function: more than dynamo's default 8, past which it silently runs eager.
            limit = len(GRAPH_WIDTHS) * 2 * GRAPHED_RUNNERS
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       limit)
            self._graphed = (torch.compile(self._backbone_step, mode="reduce-overhead",
                                           dynamic=False) if self.device.type == "cuda"
                             else torch.compile(self._backbone_step, backend="eager",
                                                dynamic=False))

    def _new_cache(self) -> DynamicCache | StaticCache:
        if not self.capacity:
            return DynamicCache(config=self.config)
        cache = StaticCache(config=self.config, max_cache_len=self.capacity)
        # Allocated now, not lazily inside the first forward: a first forward that runs
        # compiled would leave its tensors unmarked as static, and CUDA graphs would skip.
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        cache.early_initialization(1, getattr(c, "num_key_value_heads", None)
                                   or c.num_attention_heads, head_dim,
                                   self.embedding_weight().dtype, self.device)
        return cache

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def forward(self, token_ids: list[int], start: int, logits_to_keep: int | None,
                layers: tuple[int, ...] | None, features: FeatureStore,
                tree: torch.Tensor | None, spread: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``token_ids`` at ``start`` (a chain: ``tree`` is None), writing the rows of
        ``layers`` to ``features``: the logits and last hidden states of the last
        ``logits_to_keep`` tokens (all when None)."""
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        if self.capacity and start + len(token_ids) > self.capacity:
            raise ValueError(f"{start + len(token_ids)} positions do not fit the static "
                             f"cache of {self.capacity}")
        # A long prompt is fed in pieces: the activations of one piece at a time, so that
        # the peak stays near the weights plus the cache.
        while logits_to_keep and len(token_ids) - PREFILL_CHUNK >= logits_to_keep:
            self._feed(token_ids[:PREFILL_CHUNK], start, layers, features)
            token_ids, start = token_ids[PREFILL_CHUNK:], start + PREFILL_CHUNK
        last, pre_norm = self._feed(token_ids, start, layers, features)
        last = last[keep]  # [n, hidden]
        if self._norm is not None and pre_norm is not None:
            normed = self._norm(pre_norm[keep].float()).float()  # [n, hidden] float32
            return refine_top_logits(normed, self.lm_head.weight), last
        if self._rows_weight is not None:
            sub = torch.nn.functional.linear(last, self._rows_weight).float()
            return (spread_logits(sub, self.rows, self.vocab_size) if spread else sub), last
        return self.lm_head(last).float(), last

    def _feed(self, token_ids: list[int], start: int, layers: tuple[int, ...] | None,
              features: FeatureStore) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The backbone over ``token_ids`` at ``start``, features kept: its output [n, hidden]
        and the final norm's input (see ``_backbone``)."""
        last, hidden_states, pre_norm = self._backbone(token_ids, start, layers is not None and any(
            i < self.num_layers for i in layers))
        if layers is not None:  # hidden_states[num_layers] is last_hidden_state
            features.write(start, torch.cat(
                [last if i == self.num_layers else hidden_states[i] for i in layers], dim=-1))
        return last, pre_norm

    def _backbone(self, token_ids: list[int], start: int, hidden: bool
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The Hugging Face backbone over ``token_ids`` at ``start`` (the cache's length): its
        output [n, hidden], the hidden states entering each layer (when ``hidden``), and the
        final norm's input [n, hidden] (when float32 logits need it)."""
        n = len(token_ids)
        width = next((w for w in GRAPH_WIDTHS if w >= n), 0) if self._graphed else 0
        if width and start + width <= self.capacity:
            ids = torch.tensor([token_ids + [token_ids[-1]] * (width - n)], dtype=torch.long,
                               device=self.device)
            positions = torch.arange(start, start + width, device=self.device)
            self._kept.clear()
            last, states = self._graphed(ids, positions.unsqueeze(0), hidden)
            if width > n:
                self.cache.crop(-(width - n))  # the padding's keys and values: stale
            # Copies: a graph's outputs are overwritten by its next replay.
            pre_norm = self._kept.get("pre_norm")
            return (last[0, :n].clone(), tuple(h[0, :n].clone() for h in states),
                    None if pre_norm is None else pre_norm[0, :n].clone())
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        captured: list[torch.Tensor] = []
        hook = (self._norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
                if self._norm is not None and self._graphed is None else None)
        try:
            self._kept.clear()
            last, states = self._backbone_step(ids, positions.unsqueeze(0), hidden)
        finally:
            if hook is not None:
                hook.remove()
        pre_norm = captured[-1] if captured else self._kept.get("pre_norm")
        return (last[0], tuple(h[0] for h in states),
                None if pre_norm is None else pre_norm[0])

    def _backbone_step(self, ids: torch.Tensor, positions: torch.Tensor, hidden: bool
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = self.backbone(input_ids=ids, cache=self.cache, use_cache=True,
                            position_ids=positions, output_hidden_states=hidden)
        return out.last_hidden_state, tuple(out.hidden_states) if hidden else ()

    def compile_graphs(self) -> None:
        """Compile the graphed step for every width bucket, with and without hidden states,
        on an empty cache, which it leaves empty (see ``ModelRunner.compile_graphs``)."""
        if self._graphed is None:
            return
        for width in GRAPH_WIDTHS:
            for hidden in (False, True):
                self._backbone([0] * width, 0, hidden)
                self.cache.crop(-width)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._rows_weight is not None:
            sub = torch.nn.functional.linear(hidden.to(self._rows_weight.dtype),
                                             self._rows_weight).float()
            return spread_logits(sub, self.rows, self.vocab_size)
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    def head_cut(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The full head's logits at ``rows``, the rest -inf."""
        return lambda hidden: spread_logits(self.head_logits(hidden)[:, rows], rows,
                                            self.vocab_size)

    def move_rows(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Never called: this backend feeds no trees whose rows a kept path would move."""
        raise ValueError("this runner feeds chains only (supports_trees is False)")

    def crop(self, dropped: int) -> None:
        """Drop the last ``dropped`` positions of the cache."""
        self.cache.crop(-dropped)  # transformers >= 5: a negative count

    def reset(self, length: int) -> None:
        """Empty a cache of ``length`` positions: a static one keeps its tensors."""
        if not self.capacity:
            self.cache = DynamicCache(config=self.config)
        elif length:
            self.cache.crop(-length)  # the same tensors, at length 0
