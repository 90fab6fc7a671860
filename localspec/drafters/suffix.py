"""Suffix drafter (SuffixDecoding): continue the context as this request and earlier answers did.

Two indexes (``drafters.suffix_index``): one over this request's context (prompt and answer so
far), grown by the tokens each step appends, and one over the user's earlier answers
(``AnswerHistory``, shared by every engine of a pipeline; None when history drafts are off).
Each step finds the longest suffix of the context, up to ``max_depth`` tokens, that occurs in
either, and drafts what followed it there, the index with the longer match winning (this
request's on a tie: it is the more specific). As in the paper and vLLM's ``method: "suffix"``:

- the draft is at most ``max_spec_factor`` times the match's length (a long match is strong
  evidence of a long repeat; a one-token match is weak), and never longer than asked (k);
- among the occurrences of the match, the continuation seen most often is drafted, token by
  token, while the chance of the chain so far (the product of each token's empirical share
  among the occurrences that agree with the chain up to it) stays at or above
  ``min_token_prob``;
- with ``width`` > 1 (greedy only) the proposal is a tree: nodes added best first by that
  chance, at most ``width`` children per node and ``k + width - 1`` nodes, the most likely
  chain first (``Proposal.parents``).

Free and deterministic (``q_draft`` None: a one-hot draft), so the verifier's output is the
target's exactly, greedy or sampled. ``outlook`` grades its evidence by the match's length, as
n-gram lookup does (``Outlook.sure``), so auto's estimators learn its sure guesses apart.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from localspec.drafters.base import BuildContext
from localspec.drafters.suffix_index import (
    MAX_DEPTH,
    NO_MATCH,
    SEP,
    AnswerHistory,
    Match,
    TokenIndex,
    tail_of,
)
from localspec.engine.drafter import Drafter, DrafterTraits, Outlook, Proposal
from localspec.sampling import SamplingParams

# Evidence grades (``Outlook.sure``) by the match's length: as n-gram lookup's (its longest
# n-gram, 4 by default, and LONG_MATCH, a copy under way).
SURE_MATCH, LONG_MATCH = 4, 8
# The shortest match it drafts from (shorter ones: n-gram lookup's ground, weak evidence)
MIN_MATCH = 1


def grow_tree(rows: np.ndarray, depth: int, budget: int, width: int, min_prob: float
              ) -> list[tuple[int, int, float]]:
    """Draft tokens from the continuations ``rows`` [occurrences, >= depth] (``SEP`` ends a
    row): (token, parent's index in the result or -1 for the root, chance) in the order added,
    best chance first, each node's parent before it. A node's chance is its parent's times the
    share of its token among the rows that reach its parent; at most ``width`` children a node,
    ``budget`` nodes, ``depth`` deep, none below ``min_prob``."""
    added: list[tuple[int, int, float]] = []
    # (-chance, order offered, parent's index, the child's level, its token, rows reaching it)
    heap: list[tuple[float, int, int, int, int, np.ndarray]] = []
    order = 0

    def offer(parent: int, level: int, chance: float, reaching: np.ndarray) -> None:
        nonlocal order
        if level >= depth or reaching.shape[0] == 0:
            return
        column = reaching[:, level]
        tokens, counts = np.unique(column[column != SEP], return_counts=True)
        for i in np.argsort(-counts, kind="stable")[:width]:
            child = chance * float(counts[i]) / reaching.shape[0]
            if child >= min_prob:
                heapq.heappush(heap, (-child, order, parent, level, int(tokens[i]), reaching))
                order += 1

    offer(-1, 0, 1.0, rows)
    while heap and len(added) < budget:
        negative, _, parent, level, token, reaching = heapq.heappop(heap)
        added.append((token, parent, -negative))
        offer(len(added) - 1, level + 1, -negative, reaching[reaching[:, level] == token])
    return added


def chain_first(nodes: list[tuple[int, int, float]]) -> Proposal:
    """``grow_tree``'s nodes as a proposal: the chain of likeliest children first, then the
    other nodes in the order added (so every parent comes before its children)."""
    children: dict[int, list[int]] = {}
    for i, (_, parent, _) in enumerate(nodes):
        children.setdefault(parent, []).append(i)
    chain, at = [], -1
    while at in children:
        at = max(children[at], key=lambda i: nodes[i][2])
        chain.append(at)
    if len(chain) == len(nodes):
        return Proposal([nodes[i][0] for i in chain], None, tuple(1.0 for _ in chain))
    on_chain = set(chain)
    order = chain + [i for i in range(len(nodes)) if i not in on_chain]
    place = {node: row + 1 for row, node in enumerate(order)}  # feed rows: 0 is pending
    place[-1] = 0
    return Proposal([nodes[i][0] for i in order], None, tuple(1.0 for _ in order),
                    parents=tuple(place[nodes[i][1]] for i in order))


class SuffixDrafter(Drafter):
    """Suffix-tree style lookup over this request and earlier answers (module docstring)."""

    traits = DrafterTraits("suffix", free=True)

    def __init__(self, history: AnswerHistory | None = None, max_depth: int = 24,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if not 1 <= max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be between 1 and {MAX_DEPTH}, got {max_depth}")
        if max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need max_spec_factor > 0 and 0 <= min_token_prob <= 1, got "
                             f"{max_spec_factor} and {min_token_prob}")
        self.history = history
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._index = TokenIndex(fresh_tokens=None)
        self._tokens: list[int] = []  # the context the index holds
        self._checked = False  # whether that context was compared whole with the caller's
        self._found: tuple[tuple[int, int], Match] | None = None  # the last match, by key

    def reset(self, keep_cache: bool = False) -> None:
        """Forget this request's context; with ``keep_cache`` keep it for a next turn that
        starts with it (checked at the next call). The history is never forgotten here."""
        if not keep_cache:
            self._index, self._tokens = TokenIndex(fresh_tokens=None), []
        self._checked = False
        self._found = None

    def _sync(self, context: Sequence[int]) -> None:
        """Bring this request's index up to ``context``: append what is new; start again if
        the context is not the held one continued (compared whole once after a reset, then by
        its length and last held token: within one answer the context only grows)."""
        held = len(self._tokens)
        if self._checked:
            same = len(context) >= held and (held == 0 or context[held - 1] == self._tokens[-1])
        else:
            same = list(context[:held]) == self._tokens
            self._checked = True
        if not same:
            self._index, self._tokens, held = TokenIndex(fresh_tokens=None), [], 0
            self._found = None
        if len(context) > held:
            new = list(context[held:])
            if held == 0:
                self._index.add(new)
            else:
                self._index.append(new)
            self._tokens.extend(new)

    def match(self, context: Sequence[int]) -> Match:
        """The longest match of the context's tail in this request or the history."""
        self._sync(context)
        key = (len(context), -1 if self.history is None else self.history.version)
        if self._found is not None and self._found[0] == key:
            return self._found[1]
        tail = tail_of(context, self.max_depth)
        found = self._index.match(tail, self.max_depth, before=self._index.end - 1)
        if self.history is not None and self.history.answers:
            earlier = self.history.match(tail, self.max_depth)
            found = earlier if earlier.length > found.length else found
        self._found = (key, found)
        return found

    def outlook(self, context: list[int]) -> Outlook:
        """Evidence by the match's length: 2 from LONG_MATCH tokens, 1 from SURE_MATCH."""
        length = self.match(context).length
        return Outlook(sure=2 if length >= LONG_MATCH else 1 if length >= SURE_MATCH else 0)

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        found = self.match(context) if k > 0 else NO_MATCH
        if found.length < max(1, MIN_MATCH):
            return Proposal([])
        depth = min(k, self.max_depth, max(1, int(found.length * self.max_spec_factor)))
        width = width if params.greedy else 1
        nodes = grow_tree(found.rows, depth, depth + width - 1, width, self.min_token_prob)
        return chain_first(nodes) if nodes else Proposal([])


def build(ctx: BuildContext) -> SuffixDrafter:
    """The drafter of method "suffix": the preset's ``suffix_decoding_*`` keys, and the
    pipeline's history of earlier answers (None when ``[localspec] history_drafts`` is off)."""
    sc = ctx.preset.speculative_config
    return SuffixDrafter(ctx.answer_history(), sc.suffix_decoding_max_tree_depth,
                         sc.suffix_decoding_max_spec_factor, sc.suffix_decoding_min_token_prob)
