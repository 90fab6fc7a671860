"""ModelRunner: the only thing the engine and the drafters need from a language model.

A runner owns one sequence's KV cache: feed new tokens and get their logits (and last hidden
states, for feature-level drafters), roll the cache back to a length, keep the prefix a new
request shares with it (``keep_prefix``), reset. Where the native CPU decoder runs, new tokens
may form a tree (each sees its root path only) of which ``keep_path`` keeps one. Under it sits
a Hugging Face causal LM (any architecture, any device) or ``CpuDecoder`` (Llama-family models
on a CPU: native kernels, a static cache whose rollback is a length change). It does not
sample, verify or tokenize.

The Hugging Face forward keeps a ``DynamicCache``, or with ``static_cache=N`` a ``StaticCache``
of N positions allocated once: rollback and reset move its length only (later positions are
masked and overwritten), and its tensors keep the addresses CUDA graphs need.
``cuda_graphs=True`` (with a static cache) runs each forward of up to ``GRAPH_WIDTHS[-1]``
tokens as a CUDA graph compiled once per width bucket, padded with copies of its last token
whose cache entries land past the length (docs/design.md, "The GPU path").

Why ``logits_fp32``: in bfloat16 a batched verify pass and one-token decoding can pick
different argmaxes at near-ties (bf16 logits are 0.125 apart at magnitude 16-32). The final
norm runs in float32, the LM head in bf16 (a float32 head over the whole vocabulary: 0.4 s for
16 rows of the 1.5B, against 0.07 s), and only the logits near each row's maximum again in
float32 (``refine_top_logits``): the argmax and the top of the distribution are float32-exact;
``localspec verify`` measures what near-ties remain.

Feature-level drafters (EAGLE, EAGLE-3, Medusa) draft from the target's hidden states of
verified tokens: every forward keeps the rows of the layers ``record_features`` names per
position, like keys and values, so a drafter reads the verify pass the engine already ran.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel, StaticCache

from localspec.runtime.decoder import CpuDecoder, KVCache
from localspec.runtime.weight_formats import refine_top_logits, spread_logits

FEATURE_BLOCK = 256  # the feature store grows by at least this many positions
GRAPH_WIDTHS = (1, 2, 4, 8, 16, 32)  # CUDA graph buckets of tokens per forward; wider: eager
GRAPHED_RUNNERS = 4  # compiled variants are budgeted for this many runners in a process
PREFILL_CHUNK = 512  # a longer feed whose leading logits are not wanted runs in pieces


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start (compared in C when all are)."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


class ModelRunner:
    """One sequence, one cache, logits for the tokens just fed."""

    def __init__(self, model: PreTrainedModel, *, logits_fp32: bool = False,
                 vocab_rows: torch.Tensor | None = None,
                 decoder: CpuDecoder | None = None, static_cache: int = 0,
                 cuda_graphs: bool = False) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.logits_fp32 = logits_fp32
        self.decoder = decoder
        self.length = 0
        self._held: list[int] = []  # the tokens fed; the first ``length`` are in the cache
        self.last_hidden: torch.Tensor | None = None  # [n, hidden] of the last forward
        self.feature_layers: tuple[int, ...] | None = None  # see record_features
        self._features: torch.Tensor | None = None  # [capacity, len(feature_layers) * hidden]
        self._features_from = 0  # positions before this were fed while not recording
        self._graphed = None  # the compiled step (cuda_graphs; Hugging Face forward only)
        self._tree: tuple[int, list[int]] | None = None  # the last tree fed: start, parents
        if decoder is not None:
            # int8 logits are exact int32 sums, the same in any batch: no float32 refinement.
            self.kv_cache: KVCache = decoder.new_cache()
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
        self.static_capacity = static_cache
        if cuda_graphs and not static_cache:
            raise ValueError("cuda_graphs needs a static cache (static_cache=N)")
        self.cache = self._new_cache()
        self._kept: dict[str, torch.Tensor] = {}  # the final norm's input (graphed runs)
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
        if not self.static_capacity:
            return DynamicCache(config=self.config)
        cache = StaticCache(config=self.config, max_cache_len=self.static_capacity)
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
        if self.decoder is not None:
            return self.decoder.head.vocab_size
        return int(self.lm_head.weight.shape[0])

    @property
    def max_length(self) -> int:
        limit = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        if self.decoder is None and self.static_capacity:
            return min(limit, self.static_capacity) if limit else self.static_capacity
        return limit

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def reset(self) -> None:
        if self.decoder is None and self.static_capacity:
            self.crop(0)  # the same tensors, at length 0
        elif self.decoder is None:
            self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.last_hidden = None
        self._features_from = 0
        self._tree = None

    @property
    def row_exact(self) -> bool:
        """Whether a token's keys and logits are the same bits however it was fed (the native
        stack's steps, verify passes, prompt pieces): a kept cache is a fresh prefill's."""
        return self.decoder is not None and self.decoder.native is not None

    def keep_prefix(self, tokens: list[int]) -> int:
        """Keep the cached tokens ``tokens`` starts with (a conversation's earlier turns); how
        many. None (a reset) unless ``row_exact`` and no head records features from the prompt."""
        exact = self.row_exact and self.feature_layers is None
        kept = common_prefix(self._held[:self.length], tokens) if exact else 0
        if kept:
            self.crop(kept)
        else:
            self.reset()
        return kept

    def record_features(self, layers: tuple[int, ...] | None) -> None:
        """From the next forward on, keep for every token fed the hidden states entering each of
        ``layers``, concatenated (numbered as Hugging Face's ``hidden_states``: 0 is the
        embeddings, ``num_layers`` the final normed output the LM head reads). None stops."""
        if layers is not None and (not layers or any(
                not 0 <= i <= self.num_layers for i in layers)):
            raise ValueError(f"feature layers must be 0..{self.num_layers}, got {layers}")
        if layers != self.feature_layers:
            self._features = None
            self._features_from = self.length
        self.feature_layers = layers

    def features(self, start: int, end: int) -> torch.Tensor:
        """Recorded features [end - start, len(feature_layers) * hidden] of the cached
        positions start..end-1."""
        if self._features is None or not self._features_from <= start <= end <= self.length:
            raise ValueError(f"no recorded features for positions {start}..{end - 1} (recorded "
                             f"from {self._features_from} to {self.length - 1})")
        return self._features[start:end]

    def _keep_features(self, start: int, rows: torch.Tensor) -> None:
        """Write ``rows`` [n, width] at positions start..; the store grows by doubling."""
        end = start + rows.shape[0]
        store = self._features
        if store is None or store.shape[0] < end:
            capacity = max(end, FEATURE_BLOCK, 2 * store.shape[0] if store is not None else 0)
            grown = rows.new_empty((capacity, rows.shape[1]))
            if store is not None:
                grown[: store.shape[0]] = store
            self._features = store = grown
        store[start:end] = rows.to(store.dtype)

    def embedding_weight(self) -> torch.Tensor:
        """The input embedding table [vocab, hidden] (a drafter embeds its tokens with it)."""
        if self.decoder is not None:
            return self.decoder.embed
        return self.model.get_input_embeddings().weight

    @property
    def vocab_rows(self) -> torch.Tensor | None:
        """The token ids a cut LM head computes (None: the whole vocabulary)."""
        return self._rows

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [n, hidden] that did not come from a forward (an EAGLE
        head's predicted features): float32 logits [n, vocab]; no cache is touched."""
        if self.decoder is not None:
            return self.decoder.head.logits(hidden.float(), self._rows, self._head)
        if self._rows_weight is not None:
            sub = torch.nn.functional.linear(hidden.to(self._rows_weight.dtype),
                                             self._rows_weight).float()
            return spread_logits(sub, self._rows, self.vocab_size)
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    def head_cut(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``head_logits`` over ``rows`` only (a head's draft vocabulary; the rest -inf), made
        once: the CPU's head packs the cut now, not in the first reply, and no call looks it
        up again (hashing 4,096 ids costs 0.2 ms)."""
        if self.decoder is not None:
            head, part = self.decoder.head, self.decoder.head.part(rows)
            return lambda hidden: head.logits(hidden.float(), rows, part)
        return lambda hidden: spread_logits(self.head_logits(hidden)[:, rows], rows,
                                            self.vocab_size)

    @property
    def supports_trees(self) -> bool:
        """Whether ``forward`` takes a tree (``parents``): where the native CPU decoder's row
        attention runs; a Hugging Face forward (any device) feeds chains only."""
        return self.decoder is not None and self.decoder.supports_trees

    @torch.inference_mode()
    def forward(self, token_ids: list[int], logits_to_keep: int | None = None,
                parents: list[int] | None = None, spread: bool = True) -> torch.Tensor:
        """Append ``token_ids`` to the cache; return float logits [n_kept, vocab].

        ``logits_to_keep`` limits the LM head to the last positions (prefill needs one).
        ``spread=False``: a head cut to ``vocab_rows`` returns its logits over those rows only,
        [n_kept, len(vocab_rows)] (a drafter picks among them without a full-vocabulary pass).
        ``parents`` (``supports_trees`` only): the tokens form a tree, ``parents[j]`` the index
        of j's parent among them (-1 for token 0, the root, then earlier tokens); token j sits
        at position length + its depth and sees the cache and its root path, so its logits are
        those its path fed as a chain gives. Its keys and values go to cache row length + j
        until ``keep_path`` keeps one path.
        """
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        layers = self.feature_layers
        self._held[self.length:] = token_ids
        tree, self._tree = None, None
        if parents is not None:
            if not self.supports_trees:
                raise ValueError("this runner feeds chains only (supports_trees is False)")
            if len(parents) != len(token_ids) or not parents or parents[0] != -1 or any(
                    not 0 <= parent < j for j, parent in enumerate(parents) if j):
                raise ValueError(f"parents must be -1, then earlier indices; got {parents}")
            tree = torch.tensor(parents, dtype=torch.long)
            self._tree = (self.length, list(parents))
        if self.decoder is not None:
            ids = torch.tensor(token_ids, dtype=torch.long)
            if layers is None:
                hidden = self.decoder.forward(ids, self.kv_cache, self.length, tree)
            else:
                hidden, features = self.decoder.forward_features(ids, self.kv_cache,
                                                                 self.length, layers, tree)
                self._keep_features(self.length, features)
            self.length += len(token_ids)
            self.last_hidden = hidden[keep]
            return self.decoder.head.logits(self.last_hidden, self._rows if spread else None,
                                            self._head)
        if self.static_capacity and self.length + len(token_ids) > self.static_capacity:
            raise ValueError(f"{self.length + len(token_ids)} positions do not fit the static "
                             f"cache of {self.static_capacity}")
        # A long prompt is fed in pieces: the activations of one piece at a time, so that
        # the peak stays near the weights plus the cache.
        while logits_to_keep and len(token_ids) - PREFILL_CHUNK >= logits_to_keep:
            self._feed(token_ids[:PREFILL_CHUNK])
            token_ids = token_ids[PREFILL_CHUNK:]
        last, pre_norm = self._feed(token_ids)
        self.last_hidden = last[keep]  # [n, hidden]
        if self._norm is not None and pre_norm is not None:
            normed = self._norm(pre_norm[keep].float()).float()  # [n, hidden] float32
            return refine_top_logits(normed, self.lm_head.weight)
        if self._rows_weight is not None:
            sub = torch.nn.functional.linear(self.last_hidden, self._rows_weight).float()
            return spread_logits(sub, self._rows, self.vocab_size) if spread else sub
        return self.lm_head(self.last_hidden).float()

    def _feed(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The backbone over ``token_ids``, features kept, the length advanced: its output
        [n, hidden] and the final norm's input (see ``_backbone``)."""
        layers = self.feature_layers
        last, hidden_states, pre_norm = self._backbone(token_ids, layers is not None and any(
            i < self.num_layers for i in layers))
        if layers is not None:  # hidden_states[num_layers] is last_hidden_state
            self._keep_features(self.length, torch.cat(
                [last if i == self.num_layers else hidden_states[i] for i in layers], dim=-1))
        self.length += len(token_ids)
        return last, pre_norm

    def _backbone(self, token_ids: list[int], hidden: bool
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The Hugging Face backbone over ``token_ids`` at the cache's length: its output
        [n, hidden], the hidden states entering each layer (when ``hidden``), and the final
        norm's input [n, hidden] (when float32 logits need it)."""
        n = len(token_ids)
        width = next((w for w in GRAPH_WIDTHS if w >= n), 0) if self._graphed else 0
        if width and self.length + width <= self.static_capacity:
            ids = torch.tensor([token_ids + [token_ids[-1]] * (width - n)], dtype=torch.long,
                               device=self.device)
            positions = torch.arange(self.length, self.length + width, device=self.device)
            self._kept.clear()
            last, states = self._graphed(ids, positions.unsqueeze(0), hidden)
            if width > n:
                self.cache.crop(-(width - n))  # the padding's keys and values: stale
            # Copies: a graph's outputs are overwritten by its next replay.
            pre_norm = self._kept.get("pre_norm")
            return (last[0, :n].clone(), tuple(h[0, :n].clone() for h in states),
                    None if pre_norm is None else pre_norm[0, :n].clone())
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self.length, self.length + n, device=self.device)
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

    @torch.inference_mode()
    def compile_graphs(self) -> None:
        """Compile the graphed step for every width bucket, with and without hidden states,
        now: on a GPU each capture takes seconds (about a minute in all), better paid while a
        preset loads than inside the first answer. Only on an empty runner; leaves it empty."""
        if self._graphed is None or self.length:
            return
        for width in GRAPH_WIDTHS:
            for hidden in (False, True):
                self._backbone([0] * width, hidden)
                self.cache.crop(-width)

    @torch.inference_mode()
    def keep_path(self, rows: list[int]) -> None:
        """After a tree ``forward``: keep the tokens ``rows`` (indices into it, a root path in
        depth order: 0, a child of 0, ...) at positions start, start + 1, ... with their keys,
        values and features, and drop the rest: the cache a chain of those tokens leaves."""
        if self._tree is None or self._tree[0] + len(self._tree[1]) != self.length:
            raise ValueError("keep_path follows a tree forward, before any other change")
        start, parents = self._tree
        if not rows or rows[0] != 0 or any(parents[b] != a for a, b in pairwise(rows)):
            raise ValueError(f"rows {rows} are not a root path of the tree {parents}")
        source = torch.tensor(rows) + start
        target = torch.arange(start, start + len(rows))
        if not torch.equal(source, target):  # only an off-chain path has rows to move
            for store in (self.kv_cache.keys, self.kv_cache.values):
                store[:, :, target] = store[:, :, source]  # the right side is a copy
            if self._features is not None and self._features_from <= start:
                self._features[target] = self._features[source]
        self._held[start:] = [self._held[start + r] for r in rows]
        self.length = start + len(rows)
        self._tree = None

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first ``length`` tokens."""
        if length < self.length and self.decoder is not None:
            self.length = length  # stale positions are overwritten by the next forward
        elif length < self.length:
            self.cache.crop(-(self.length - length))  # transformers >= 5: a negative count
            self.length = length
        self._features_from = min(self._features_from, self.length)
