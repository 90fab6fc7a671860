"""EAGLE / EAGLE-3 drafter: a one-layer head drafts from the target's own hidden features.

Where the features come from: the drafter asks the target's runner to record, for every token
it feeds, the hidden states the head reads (``ModelRunner.record_features``): the final normed
state for EAGLE, the states entering three layers (low, middle, high) for EAGLE-3. The engine's
verify pass feeds the pending token and the drafts; after it, the runner holds the features of
every token it kept. So the next ``propose`` reads the features of exactly the accepted tokens
from the pass the engine already ran: no extra target forward. The prompt's features come from
the engine's prefill the same way (the runner records every row, whatever ``logits_to_keep``).

How the head keeps in step: head position i reads the feature of token i and the embedding of
token i + 1, and stands in for the feature of token i + 1. Its own KV cache holds the positions
built from real target features; on each ``propose`` it drops its speculative positions, feeds
the real features it has not seen (the accepted tokens; the whole prompt the first time, timed
as ``sync_time``), and then drafts autoregressively, feeding its own output back in place of
the feature it cannot have. Like the draft-model drafter it finds what it may keep by comparing
token lists, so the engine never tells it what was rejected.

EAGLE-3's layers are those vLLM and the EAGLE authors read: the states entering layers 2,
L // 2 and L - 3 of an L-layer target (or ``eagle_config.eagle_aux_hidden_state_layer_ids``).
Drafting is one chain (for a greedy request with ``[localspec] tree_width`` > 1, plus the next
best first guesses beside its first token: ``DraftChain``; no EAGLE-2 dynamic tree); sampled
drafts come from the head's distribution, the q the verifier needs, so output is exact. The
drafter does not load checkpoints (``head_layouts``) and does not verify.
"""

from __future__ import annotations

import torch

from localspec.drafters.base import CATCH_UP_SPLIT, BuildContext, DraftChain, ModelDrafter
from localspec.drafters.eagle_head import EagleHead, HeadCache, eagle3_layers
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_eagle_head
from localspec.runtime.runner import ModelRunner


class EagleDrafter(ModelDrafter):
    """Drafts k tokens with an EAGLE or EAGLE-3 head over ``target``'s recorded features."""

    def __init__(self, head: EagleHead, target: ModelRunner,
                 aux_layers: tuple[int, ...] | None = None,
                 confidence_threshold: float = 0.0) -> None:
        # kind "eagle" | "eagle3"; an EAGLE-3 head picks among its own vocabulary's rows
        super().__init__(head.spec.kind, confidence_threshold,
                         None if head.lm_head is None else (head.draft_ids(), target.vocab_size))
        self.head = head
        self.target = target
        if head.spec.kind == "eagle3":
            self.feature_layers = aux_layers or eagle3_layers(target.num_layers)
        else:
            self.feature_layers = (target.num_layers,)
        self.cache = HeadCache(head.spec, head.fc.weight.dtype, head.fc.weight.device)
        # The context at the last propose: head positions 0..len - 2 hold real features.
        self._tokens: list[int] = []
        target.record_features(self.feature_layers)

    def _forget(self, keep_cache: bool) -> None:
        """Forget the sequence; ask the target (again: it may serve other drafters) for the
        features this head reads, before the engine's prefill."""
        self.target.record_features(self.feature_layers)
        self._tokens = []

    def _keep(self, context: list[int], last: int) -> int:
        """How many head positions built from real features are still right for ``context``
        (position i read tokens 0..i+1), leaving at least one to feed for an output. Those
        past it, the drafts', are overwritten."""
        common = 0
        limit = min(len(self._tokens), len(context))
        while common < limit and self._tokens[common] == context[common]:
            common += 1
        return max(0, min(common - 1, last))

    def _step(self, hidden: torch.Tensor, ids: list[int], start: int,
              from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Head pass over len(ids) positions from ``start``; (for logits, next input) rows."""
        embeds = self.head.embed(torch.tensor(ids, device=self.cache.device),
                                 self.target.embedding_weight())
        return self.head(hidden, embeds, start, self.cache, from_target)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, h] -> float32 logits [vocab_target] (EAGLE), or over the head's own vocabulary
        (EAGLE-3: ``_cut``)."""
        if self.head.lm_head is None:
            return self.target.head_logits(hidden)[0]
        return self.head.draft_logits(hidden)[0]

    @torch.inference_mode()
    def _draft(self, context: list[int], k: int, chain: DraftChain) -> float | None:
        last = len(context) - 2  # the target holds context[:-1]: features up to position last
        if last < 0 or self.target.length <= last:
            return None
        start = self._keep(context, last)
        features = self.target.features(start, last + 1)  # [last + 1 - start, width]
        ids = context[start + 1 : last + 2]
        sync_time = 0.0
        if len(ids) > CATCH_UP_SPLIT:  # a prompt: timed apart from the drafting
            sync_time = self._catch_up(
                lambda: self._step(features[:-1], ids[:-1], start, from_target=True),
                len(ids) - 1)
            features, ids, start = features[-1:], ids[-1:], last
        for_logits, hidden = self._step(features, ids, start, from_target=True)
        self._tokens = list(context)
        for_logits, hidden = for_logits[-1:], hidden[-1:]  # [1, h] each
        for j in range(k):
            token = chain.pick(self._logits(for_logits))
            if chain.done or j + 1 == k:
                break
            # its own output stands in for the feature it cannot have
            for_logits, hidden = self._step(hidden, [token], last + 1 + j, from_target=False)
        return sync_time


def _build(ctx: BuildContext, kind: str) -> EagleDrafter:
    """An EAGLE (``kind`` "eagle") or EAGLE-3 ("eagle3") drafter over the target's runner, its
    head read from ``Preset.head_source()`` (ModelLoadError if it is not such a head for
    this target)."""
    files = read_head(ctx.preset.head_source())
    runner = ctx.target_runner()
    head, layers = load_eagle_head(files, kind, runner)
    return EagleDrafter(head, runner, layers, ctx.preset.localspec.draft_confidence_threshold)


def build_eagle(ctx: BuildContext) -> EagleDrafter:
    """The drafter of method "eagle"."""
    return _build(ctx, "eagle")


def build_eagle3(ctx: BuildContext) -> EagleDrafter:
    """The drafter of method "eagle3"."""
    return _build(ctx, "eagle3")
