"""Medusa drafter: K heads on the target's last hidden state, head i guessing i + 1 tokens past
the one the target is about to consume.

Medusa (Cai et al., 2024) puts K small heads on the target's final hidden state. The target's
own LM head at the last verified token predicts the next token (the "pending" token the
engine feeds next); head i predicts the token after that plus i more. Each head is a stack of
residual blocks ``x + SiLU(W x + b)``, initialised to the identity (W = 0, b = 0), and an LM
head of its own (or, in the earliest checkpoints, the target's). A draft costs K small matmuls
and no pass of any model, so its heads cannot see the drafts before them: acceptance falls
with the head index. ``token_map`` (vLLM's name) cuts the vocabulary a head guesses from to
the ids it lists: the rows of its own LM heads, or of the target's when it has none (the heads
this project trains: the target's full head costs each draft a read of its whole vocabulary, a
4,096-row cut of it a small fraction of that (docs/heads.md), and those heads are trained over
exactly that cut). The features come from the
target's verify pass through ``ModelRunner.record_features`` (its final normed output, what
the LM head reads).

Lossless like every drafter here: the drafts are verified by the target as usual. Medusa's
own "typical acceptance" (accept what is merely plausible) is NOT used, nor are its large
candidate trees: one chain of the heads' best (or sampled) guesses, or, for a greedy request
with ``[localspec] tree_width`` > 1, that chain and the first head's next best guesses beside
its first token (``DraftChain``). Sampled drafts are drawn from each head's distribution, which
is the q the verifier needs.
"""

from __future__ import annotations

import torch

from localspec.drafters.base import BuildContext, DraftChain, ModelDrafter
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_medusa_heads
from localspec.drafters.medusa_head import MedusaHeads
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import spread_logits


class MedusaDrafter(ModelDrafter):
    """Drafts ``min(k, K)`` tokens from the target's last verified feature."""

    def __init__(self, heads: MedusaHeads, target: ModelRunner,
                 confidence_threshold: float = 0.0) -> None:
        super().__init__("medusa", confidence_threshold)
        self.heads = heads
        self.target = target
        self.feature_layers = (target.num_layers,)  # the final normed hidden state
        target.record_features(self.feature_layers)
        # Without LM heads of their own the heads read the target's, cut to token_map if any.
        self._target_head = (target.head_logits if heads.token_map is None
                             else target.head_cut(heads.token_map))

    def _forget(self, keep_cache: bool) -> None:
        """Ask the target (again: it may serve other drafters) for its final features."""
        self.target.record_features(self.feature_layers)

    def _logits(self, i: int, feature: torch.Tensor) -> torch.Tensor:
        """Head i's float32 logits [vocab_target] from the feature [1, hidden] (-inf outside
        ``token_map``)."""
        hidden = self.heads.head_hidden(i, feature)
        if self.heads.lm_heads is None:
            return self._target_head(hidden)[0]
        sub = self.heads.lm_heads[i](hidden)[0].float()
        rows = self.heads.token_map
        return sub if rows is None else spread_logits(sub, rows, self.heads.vocab_size)

    @torch.inference_mode()
    def _draft(self, context: list[int], k: int, chain: DraftChain) -> float | None:
        # The target holds context[:-1]; the feature of context[-2] predicted context[-1].
        last = len(context) - 2
        if last < 0 or self.target.length <= last:
            return None
        feature = self.target.features(last, last + 1)  # [1, hidden]
        for i in range(min(k, self.heads.num_heads)):
            chain.pick(self._logits(i, feature))
            if chain.done:
                break
        return 0.0


def build(ctx: BuildContext) -> MedusaDrafter:
    """The drafter of method "medusa" over the target's runner, its heads read from
    ``[speculative_config] model`` (ModelLoadError if they are not heads for this target)."""
    files = read_head(ctx.preset.head_source())
    runner = ctx.target_runner()
    heads = load_medusa_heads(files, runner)
    return MedusaDrafter(heads, runner, ctx.preset.localspec.draft_confidence_threshold)
