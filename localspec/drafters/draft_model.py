"""Draft-model drafter: a separate small LM with its own KV cache guesses k tokens.

The draft cache is kept in step with the context by comparing token lists: on each
``propose`` it rolls back to the longest common prefix of what it has seen and the new
context, then feeds the rest (usually the target's own token, plus the last draft when all
drafts were accepted — the classic corner case handled without a special branch). A longer
catch-up (the prompt, or tokens generated while adaptive k had drafting off) goes in a pass of
its own whose time is reported as ``sync_time``: a one-off cost that must not make each draft
token look expensive to adaptive k.

Drafting stops early when the draft is unsure: once the chance that its chain so far is kept
whole falls below ``confidence_threshold`` it runs no further pass (``DraftChain``), since each
costs a sizeable fraction of a target pass on a CPU and earns only if the chain survives.
Vocabularies padded to different sizes are handled by padding q to the target's vocabulary.
"""

from __future__ import annotations

import torch

from localspec.drafters.base import CATCH_UP_SPLIT, BuildContext, DraftChain, ModelDrafter
from localspec.runtime.runner import ModelRunner, common_prefix


def frequent_token_rows(tokenizer: object, count: int, vocab_size: int) -> torch.Tensor | None:
    """Ids the draft may propose when its LM head is cut to ``count`` rows (0 = all).

    Byte-level BPE ids are in merge order, and early merges are the frequent pieces, so the
    first ``count`` ids approximate the most frequent tokens (as FR-Spec does with counts);
    special and added tokens (EOS, chat markers) are always kept. Restricting the draft changes
    only what is guessed, never what the target outputs.
    """
    if count <= 0 or count >= vocab_size:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {int(i) for i in added if int(i) < vocab_size}
    return torch.tensor(sorted(set(range(count)) | special), dtype=torch.long)


class DraftModelDrafter(ModelDrafter):
    """Autoregressive drafting with a small model of the same tokenizer."""

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        tokenizer_vocab_size: int,
        confidence_threshold: float = 0.0,
    ) -> None:
        # A cut head's logits stay over its rows while picking (``DraftChain``'s cut).
        rows = runner.vocab_rows
        super().__init__("draft_model", confidence_threshold,
                         None if rows is None else (rows, target_vocab_size))
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        # Rows past the tokenizer's vocabulary are padding: never draft them; a cut head masks
        # them among its rows (``_invalid``), as ``_to_target_vocab`` does in a whole vocabulary.
        self.valid_vocab = min(tokenizer_vocab_size, runner.vocab_size, target_vocab_size)
        invalid = None if rows is None else rows >= self.valid_vocab
        self._invalid = invalid if invalid is not None and bool(invalid.any()) else None
        self._seen: list[int] = []  # tokens whose K/V sit in the draft cache

    def _forget(self, keep_cache: bool) -> None:
        """An exact cache may be kept: the next ``propose`` keeps the prefix its context
        shares with ``_seen`` and feeds the rest."""
        if not (keep_cache and self.runner.row_exact):
            self.runner.reset()
            self._seen = []

    def _common(self, context: list[int]) -> int:
        """Tokens at the start of ``context`` whose K/V the draft cache holds (always one fewer
        than ``context``: the last token is fed for its logits)."""
        return common_prefix(self._seen, context[:-1])

    def _backlog(self, context: list[int]) -> int:
        return len(context) - self._common(context)

    def _sync(self, context: list[int]) -> list[int]:
        """Crop the cache to the common prefix with ``context``; return tokens still to feed."""
        common = self._common(context)
        self.runner.crop(common)
        self._seen = self._seen[:common]
        return context[common:]

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[vocab_draft] -> [vocab_target] logits, padding rows masked out."""
        out = torch.full((self.target_vocab_size,), float("-inf"), device=logits.device)
        out[: self.valid_vocab] = logits[: self.valid_vocab]
        return out

    def _draft(self, context: list[int], k: int, chain: DraftChain) -> float:
        feed = self._sync(context)
        sync_time = 0.0
        if len(feed) > CATCH_UP_SPLIT:  # a prefill: timed apart from the drafting
            sync_time = self._catch_up(
                lambda: self.runner.forward(feed[:-1], logits_to_keep=1), len(feed) - 1)
            self._seen.extend(feed[:-1])
            feed = feed[-1:]
        for _ in range(k):
            logits = self.runner.forward(feed, logits_to_keep=1, spread=self._cut is None)[-1]
            if self._cut is None:
                logits = self._to_target_vocab(logits)
            elif self._invalid is not None:
                logits = logits.masked_fill(self._invalid, float("-inf"))
            self._seen.extend(feed)
            token = chain.pick(logits)
            if chain.done:
                break
            feed = [token]
        return sync_time


def build(ctx: BuildContext) -> DraftModelDrafter:
    """The drafter of method "draft_model": the preset's draft model, its LM head cut to
    ``[localspec] draft_vocab_size`` frequent tokens (0: all)."""
    settings = ctx.preset.localspec
    rows = frequent_token_rows(ctx.tokenizer, settings.draft_vocab_size, ctx.draft_vocab_size())
    return DraftModelDrafter(ctx.draft_runner(rows),
                             target_vocab_size=ctx.target_runner().vocab_size,
                             tokenizer_vocab_size=len(ctx.tokenizer),
                             confidence_threshold=settings.draft_confidence_threshold)
