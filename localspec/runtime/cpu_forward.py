"""CpuForward: one sequence's side of the native CPU decoder, as a ``ModelRunner`` backend.

A ``CpuDecoder`` holds a model's weights and may serve several runners; what belongs to one
sequence sits here: its ``KVCache`` and its LM head, perhaps cut to a drafter's frequent
tokens (FR-Spec) and packed once. The cache is static, so rollback and reset are a change of
the runner's length only: stale positions are overwritten by the next forward. Int8 logits are
exact int32 sums, the same in any batch, so no float32 refinement is needed; where the native
stack runs, a token's keys and logits are the same bits however it was fed (``row_exact``) and
new tokens may form a tree. This class does not track lengths, tokens or features' validity:
``ModelRunner`` does, for both backends alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from localspec.runtime.decoder import BatchFeed, CpuDecoder, KVCache
from localspec.runtime.features import FeatureStore


@dataclass(frozen=True)
class CpuFeed:
    """One runner's feed in ``CpuForward.forward_batch``: ``forward``'s arguments."""

    backend: CpuForward
    token_ids: list[int]
    start: int
    logits_to_keep: int | None
    layers: tuple[int, ...] | None
    features: FeatureStore
    tree: torch.Tensor | None
    spread: bool


class CpuForward:
    """The CPU decoder's forward, cache and LM head for one runner."""

    capacity = 0  # the cache grows as it is fed: no limit but the model's context

    def __init__(self, decoder: CpuDecoder, vocab_rows: torch.Tensor | None) -> None:
        self.decoder = decoder
        self.kv_cache: KVCache = decoder.new_cache()
        self.rows = vocab_rows
        self._head = decoder.head.part(vocab_rows)

    @property
    def vocab_size(self) -> int:
        return self.decoder.head.vocab_size

    @property
    def row_exact(self) -> bool:
        """Whether the native stack runs (see ``ModelRunner.row_exact``)."""
        return self.decoder.native is not None

    @property
    def supports_trees(self) -> bool:
        return self.decoder.supports_trees

    def embedding_weight(self) -> torch.Tensor:
        return self.decoder.embed

    def forward(self, token_ids: list[int], start: int, logits_to_keep: int | None,
                layers: tuple[int, ...] | None, features: FeatureStore,
                tree: torch.Tensor | None, spread: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``token_ids`` at ``start`` (a tree when ``tree`` holds parents), writing the
        rows of ``layers`` to ``features``: the logits and last hidden states of the last
        ``logits_to_keep`` tokens (all when None)."""
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        ids = torch.tensor(token_ids, dtype=torch.long)
        if layers is None:
            hidden = self.decoder.forward(ids, self.kv_cache, start, tree)
        else:
            hidden, rows = self.decoder.forward_features(ids, self.kv_cache, start, layers, tree)
            features.write(start, rows)
        last = hidden[keep]
        return self.decoder.head.logits(last, self.rows if spread else None, self._head), last

    @staticmethod
    def forward_batch(feeds: Sequence[CpuFeed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``forward`` of several runners of one decoder at once (``CpuDecoder.forward_batch``:
        one native call, each row the bits it gets alone); the LM head over the kept rows of
        every feed that shares a head at once (a row's logits do not depend on the others)."""
        decoder = feeds[0].backend.decoder
        if any(f.backend.decoder is not decoder for f in feeds):
            raise ValueError("a batched forward runs runners of one decoder")
        outputs = decoder.forward_batch([
            BatchFeed(torch.tensor(f.token_ids, dtype=torch.long), f.backend.kv_cache, f.start,
                      f.layers or (), f.tree) for f in feeds])
        lasts = []
        for f, (hidden, rows) in zip(feeds, outputs, strict=True):
            if f.layers is not None:
                f.features.write(f.start, rows)
            lasts.append(hidden[-f.logits_to_keep:] if f.logits_to_keep else hidden)
        groups: dict[tuple[int, bool], list[int]] = {}  # one head call per (cut, spread)
        for i, f in enumerate(feeds):  # a cut is packed once per set of rows: one object
            key = (id(f.backend._head), f.spread)
            groups.setdefault(key, []).append(i)
        logits: list[torch.Tensor | None] = [None] * len(feeds)
        for members in groups.values():
            first = feeds[members[0]].backend
            rows = first.rows if feeds[members[0]].spread else None
            joined = decoder.head.logits(torch.cat([lasts[i] for i in members]), rows,
                                         first._head)
            at = 0
            for i in members:
                logits[i] = joined[at:at + lasts[i].shape[0]]
                at += lasts[i].shape[0]
        return [(out, last) for out, last in zip(logits, lasts, strict=True)]  # type: ignore[misc]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.head.logits(hidden.float(), self.rows, self._head)

    def head_cut(self, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The head over ``rows`` only, packed now rather than in the first reply."""
        head, part = self.decoder.head, self.decoder.head.part(rows)
        return lambda hidden: head.logits(hidden.float(), rows, part)

    def move_rows(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the keys and values at positions ``source`` to ``target`` (a tree's path)."""
        for store in (self.kv_cache.keys, self.kv_cache.values):
            store[:, :, target] = store[:, :, source]  # the right side is a copy

    def crop(self, dropped: int) -> None:
        """Nothing to do: stale positions are overwritten by the next forward."""

    def reset(self, length: int) -> None:
        """Nothing to do: the runner's length going to 0 empties the cache."""

    def compile_graphs(self) -> None:
        """Nothing to compile: the native kernels are built when first loaded."""
