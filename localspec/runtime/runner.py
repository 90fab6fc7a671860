"""ModelRunner: the only thing the engine and the drafters need from a language model.

A runner owns one sequence: feed new tokens and get their logits (and last hidden states, for
feature-level drafters), roll the cache back to a length, keep the prefix a new request shares
with it (``keep_prefix``), reset. Where the native CPU decoder runs, new tokens may form a tree
(each sees its root path only) of which ``keep_path`` keeps one. It does not sample, verify or
tokenize.

What is the same for every model lives here: the tokens held and the length, the checks on
what is fed, the recorded features. The forward itself, its cache and its LM head belong to a
backend behind the small ``Backend`` interface: ``HfForward`` (``hf_forward.py``: a Hugging
Face causal LM, any architecture, any device; a static cache, CUDA graphs, float32 logits) or
``CpuForward`` (``cpu_forward.py``: ``CpuDecoder`` on Llama-family models on a CPU, native
kernels, a static cache whose rollback is a length change).

Feature-level drafters (EAGLE, EAGLE-3, Medusa) draft from the target's hidden states of
verified tokens: every forward keeps the rows of the layers ``record_features`` names per
position (a ``FeatureStore``), like keys and values, so a drafter reads the verify pass the
engine already ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from localspec.runtime.cpu_forward import CpuFeed, CpuForward
from localspec.runtime.decoder import CpuDecoder, KVCache
from localspec.runtime.features import FeatureStore
from localspec.runtime.hf_forward import HfForward


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start (compared in C when all are)."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


class Backend(Protocol):
    """A runner's backend: one sequence's forward, cache and LM head. It is told where each
    feed starts and which positions to drop; the runner keeps the length and the tokens."""

    capacity: int  # the positions its cache holds at most; 0: as many as the model's context
    rows: torch.Tensor | None  # the token ids a cut LM head computes (None: all)

    @property
    def vocab_size(self) -> int: ...
    @property
    def row_exact(self) -> bool: ...
    @property
    def supports_trees(self) -> bool: ...
    def embedding_weight(self) -> torch.Tensor: ...
    def forward(self, token_ids: list[int], start: int, logits_to_keep: int | None,
                layers: tuple[int, ...] | None, features: FeatureStore,
                tree: torch.Tensor | None, spread: bool
                ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def head_cut(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]: ...
    def move_rows(self, target: torch.Tensor, source: torch.Tensor) -> None: ...
    def crop(self, dropped: int) -> None: ...
    def reset(self, length: int) -> None: ...
    def compile_graphs(self) -> None: ...


@dataclass(frozen=True)
class Feed:
    """One runner's part of ``forward_batch``: ``ModelRunner.forward``'s arguments."""

    runner: ModelRunner
    token_ids: list[int]
    logits_to_keep: int | None = None
    parents: list[int] | None = None
    spread: bool = True


@torch.inference_mode()
def forward_batch(feeds: Sequence[Feed]) -> list[torch.Tensor]:
    """Each feed's ``forward`` (distinct runners, each its own cache), in one pass of the
    model where they ``batches_with`` each other: the weights are read once for every row,
    and each runner's logits, cache and features are the bits its own ``forward`` gives (the
    native stack is row-exact). Runners that do not batch run one after another."""
    runners = [f.runner for f in feeds]
    if len({id(r) for r in runners}) < len(runners):
        raise ValueError("a batched forward feeds each runner once")
    if len(feeds) < 2 or not all(runners[0].batches_with(r) for r in runners):
        return [f.runner.forward(f.token_ids, f.logits_to_keep, f.parents, f.spread)
                for f in feeds]
    cpu = []
    for f in feeds:
        r = f.runner
        tree = r._take(f.token_ids, f.parents)
        cpu.append(CpuFeed(r._backend, f.token_ids, r.length, f.logits_to_keep,  # type: ignore[arg-type]
                           r.feature_layers, r._features, tree, f.spread))
    outputs = CpuForward.forward_batch(cpu)
    for f, (_, last) in zip(feeds, outputs, strict=True):
        f.runner.last_hidden = last
        f.runner.length += len(f.token_ids)
    return [logits for logits, _ in outputs]


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
        self._features = FeatureStore()
        self._tree: tuple[int, list[int]] | None = None  # the last tree fed: start, parents
        self._backend: Backend = (
            CpuForward(decoder, vocab_rows) if decoder is not None
            else HfForward(model, logits_fp32=logits_fp32, vocab_rows=vocab_rows,
                           static_cache=static_cache, cuda_graphs=cuda_graphs))

    @property
    def cache(self) -> DynamicCache | StaticCache:
        """The Hugging Face forward's cache (that backend only)."""
        if not isinstance(self._backend, HfForward):
            raise AttributeError("a CPU decoder's runner has no Hugging Face cache (kv_cache)")
        return self._backend.cache

    @property
    def kv_cache(self) -> KVCache:
        """The CPU decoder's cache (that backend only)."""
        if not isinstance(self._backend, CpuForward):
            raise AttributeError("a Hugging Face runner has no CPU decoder cache (cache)")
        return self._backend.kv_cache

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def max_length(self) -> int:
        limit = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        capacity = self._backend.capacity
        if capacity:
            return min(limit, capacity) if limit else capacity
        return limit

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def reset(self) -> None:
        self._backend.reset(self.length)
        self.length = 0
        self.last_hidden = None
        self._features.start = 0
        self._tree = None

    @property
    def row_exact(self) -> bool:
        """Whether a token's keys and logits are the same bits however it was fed (the native
        stack's steps, verify passes, prompt pieces): a kept cache is a fresh prefill's."""
        return self._backend.row_exact

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
            self._features.restart(self.length)
        self.feature_layers = layers

    def features(self, start: int, end: int) -> torch.Tensor:
        """Recorded features [end - start, len(feature_layers) * hidden] of the cached
        positions start..end-1."""
        return self._features.read(start, end, self.length)

    def embedding_weight(self) -> torch.Tensor:
        """The input embedding table [vocab, hidden] (a drafter embeds its tokens with it)."""
        return self._backend.embedding_weight()

    @property
    def vocab_rows(self) -> torch.Tensor | None:
        """The token ids a cut LM head computes (None: the whole vocabulary)."""
        return self._backend.rows

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [n, hidden] that did not come from a forward (an EAGLE
        head's predicted features): float32 logits [n, vocab]; no cache is touched."""
        return self._backend.head_logits(hidden)

    def head_cut(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``head_logits`` over ``rows`` only (a head's draft vocabulary; the rest -inf), made
        once: the CPU's head packs the cut now, not in the first reply, and no call looks it
        up again (hashing 4,096 ids costs 0.2 ms)."""
        return self._backend.head_cut(rows)

    @property
    def supports_trees(self) -> bool:
        """Whether ``forward`` takes a tree (``parents``): where the native CPU decoder's row
        attention runs; a Hugging Face forward (any device) feeds chains only."""
        return self._backend.supports_trees

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
        tree = self._take(token_ids, parents)
        logits, self.last_hidden = self._backend.forward(
            token_ids, self.length, logits_to_keep, self.feature_layers, self._features, tree,
            spread)
        self.length += len(token_ids)
        return logits

    def _take(self, token_ids: list[int], parents: list[int] | None) -> torch.Tensor | None:
        """Check a feed and hold its tokens; its tree's parents as a tensor (None: a chain)."""
        self._held[self.length:] = token_ids
        self._tree = None
        if parents is None:
            return None
        if not self.supports_trees:
            raise ValueError("this runner feeds chains only (supports_trees is False)")
        if len(parents) != len(token_ids) or not parents or parents[0] != -1 or any(
                not 0 <= parent < j for j, parent in enumerate(parents) if j):
            raise ValueError(f"parents must be -1, then earlier indices; got {parents}")
        self._tree = (self.length, list(parents))
        return torch.tensor(parents, dtype=torch.long)

    def batches_with(self, other: ModelRunner) -> bool:
        """Whether ``forward_batch`` runs this runner and ``other`` in one native call: both
        serve the same CPU decoder's weights through the native stack (each its own cache)."""
        return (isinstance(self._backend, CpuForward) and isinstance(other._backend, CpuForward)
                and self._backend.decoder is other._backend.decoder and self.row_exact)

    @torch.inference_mode()
    def compile_graphs(self) -> None:
        """Compile the graphed step for every width bucket, with and without hidden states,
        now: on a GPU each capture takes seconds (about a minute in all), better paid while a
        preset loads than inside the first answer. Only on an empty runner; leaves it empty."""
        if not self.length:
            self._backend.compile_graphs()

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
            self._backend.move_rows(target, source)
            self._features.move(target, source, start)
        self._held[start:] = [self._held[start + r] for r in rows]
        self.length = start + len(rows)
        self._tree = None

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds the first ``length`` tokens."""
        if length < self.length:
            self._backend.crop(self.length - length)
            self.length = length
        self._features.clamp(self.length)
