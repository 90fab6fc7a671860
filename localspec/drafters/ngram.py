"""N-gram / prompt-lookup drafter: copy what followed the last time the context's tail appeared.

Looks for the most recent earlier occurrence of the context's last n tokens, trying n from
``prompt_lookup_max`` down to ``prompt_lookup_min`` (longest match first, as vLLM does), and
proposes the tokens that followed it: up to k of them, but at most SINGLE_TOKEN_MATCH_DRAFTS
after a match of one token (a newline, a space: weak evidence for a long copy, and a wrong long
draft costs a verify pass over all of it; the replay that set the cap is in
docs/research-log.md). Costs no model pass, so it shines when the
answer repeats the prompt (code editing, summaries quoting the source) and proposes nothing
otherwise.
Deterministic: ``q_draft`` is None (a one-hot draft).
"""

from __future__ import annotations

import numpy as np
import torch

from localspec.drafters.base import BuildContext
from localspec.engine.drafter import Drafter, DrafterTraits, Outlook, Proposal
from localspec.sampling import SamplingParams

SINGLE_TOKEN_MATCH_DRAFTS = 3
# A match this long is a copy under way (``NgramDrafter.sure``'s second grade): the longer the
# match, the likelier its next guess is kept, and past a few tokens it is kept almost always
# (docs/research-log.md, "Lookup's evidence in two grades").
LONG_MATCH = 8


def latest_match(tokens: np.ndarray, max_n: int, min_n: int) -> tuple[int, int]:
    """(n, start): the longest n in max_n..min_n whose tail of n tokens occurred earlier, and
    where what followed its latest earlier occurrence starts; (0, 0) when none did."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence of the tail.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            return n, int(hits[-1]) + n
    return 0, 0


def find_ngram_continuation(
    context: list[int] | np.ndarray, k: int, max_n: int, min_n: int
) -> list[int]:
    """Up to ``k`` tokens (SINGLE_TOKEN_MATCH_DRAFTS after a one-token match) that followed the
    latest earlier match of the context's tail."""
    tokens = np.asarray(context, dtype=np.int64)
    n, start = latest_match(tokens, max_n, min_n)
    count = k if n > 1 else min(k, SINGLE_TOKEN_MATCH_DRAFTS)
    return tokens[start : start + count].tolist() if n else []


class NgramDrafter(Drafter):
    """Prompt lookup over prompt + generated text."""

    traits = DrafterTraits("ngram", free=True)

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"min={prompt_lookup_min}, max={prompt_lookup_max}"
            )
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless: the context is searched afresh each step."""

    def outlook(self, context: list[int]) -> Outlook:
        """Its evidence (``Outlook.sure``) from the context alone (``sure``)."""
        return Outlook(sure=self.sure(context))

    def sure(self, context: list[int]) -> int:
        """1 when the context's last ``prompt_lookup_max`` tokens occurred before: the next
        guess copies a long match (kept far more often than a guess after a one-token match;
        docs/research-log.md), so adaptive k may probe it at once; 2
        when that occurrence's match reaches back ``LONG_MATCH`` tokens, a copy under way; else
        0."""
        tokens = np.asarray(context, dtype=np.int64)
        n = self.prompt_lookup_max
        found, start = latest_match(tokens, n, n)
        if found != n:
            return 0
        matched, end = n, len(tokens)  # extend the match back from its n tokens
        while (matched < LONG_MATCH and start - 1 - matched >= 0
               and tokens[start - 1 - matched] == tokens[end - 1 - matched]):
            matched += 1
        return 2 if matched >= LONG_MATCH else 1

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        width: int = 1,
    ) -> Proposal:
        if k <= 0:
            return Proposal([])
        tokens = find_ngram_continuation(context, k, self.prompt_lookup_max, self.prompt_lookup_min)
        return Proposal(tokens, None, tuple(1.0 for _ in tokens))


def build(ctx: BuildContext) -> NgramDrafter:
    """The drafter of method "ngram", with the preset's ``prompt_lookup_max`` and ``_min``."""
    sc = ctx.preset.speculative_config
    return NgramDrafter(sc.prompt_lookup_max, sc.prompt_lookup_min)
