"""Prompt lookup: which continuation ``find_ngram_continuation`` picks, and NgramDrafter's API."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localspec.drafters.ngram import LONG_MATCH, NgramDrafter, find_ngram_continuation
from localspec.sampling import SamplingParams

# (context, k, max_n, min_n, expected, what it proves)
CASES = [
    # tail [1, 2, 3]: the 3-gram at 0 wins over the more recent 1-gram [3] at 6 (-> 8)
    ([1, 2, 3, 9, 7, 7, 3, 8, 5, 1, 2, 3], 2, 3, 1, [9, 7], "longest match first"),
    # same context, max_n=1: only 1-grams are tried, so the most recent [3] is used
    ([1, 2, 3, 9, 7, 7, 3, 8, 5, 1, 2, 3], 2, 1, 1, [8, 5], "max_n caps the n-gram size"),
    # tail [1, 2] occurs at 0 and at 3: the latest (3) is copied, running into the tail
    ([1, 2, 5, 1, 2, 6, 1, 2], 3, 2, 1, [6, 1, 2], "most recent occurrence of the same n"),
    ([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, 1, [6], "continuation capped at k"),
    ([4, 9, 9, 9, 9, 9, 4, 9], 10, 2, 1, [9, 9, 9, 9, 4, 9], "up to k: fewer at the end"),
    ([4, 9, 9, 9, 9, 9, 4], 10, 1, 1, [9, 9, 9], "a one-token match drafts at most 3"),
    ([1, 2, 3, 4, 5], 3, 4, 1, [], "no match"),
    ([3, 8, 1, 3], 2, 4, 1, [8, 1], "a 1-gram match is found with min_n=1"),
    ([3, 8, 1, 3], 2, 4, 2, [], "min_n respected: the 1-gram match is ignored"),
    ([1, 2, 3], 3, 3, 1, [], "the tail never matches itself"),
    ([7], 3, 3, 1, [], "a single token has nothing earlier to match"),
    ([7, 7, 7, 7], 3, 3, 1, [7], "overlapping repeats: the 3-gram at 0 is followed by one 7"),
]


@pytest.mark.parametrize(("context", "k", "max_n", "min_n", "expected", "why"), CASES,
                         ids=[case[-1] for case in CASES])
def test_find_ngram_continuation(context: list[int], k: int, max_n: int, min_n: int,
                                 expected: list[int], why: str) -> None:
    """Each table row states the rule it checks."""
    assert find_ngram_continuation(context, k, max_n, min_n) == expected
    assert find_ngram_continuation(np.array(context), k, max_n, min_n) == expected


COPY = list(range(20, 20 + LONG_MATCH))  # a run as long as a long match


@pytest.mark.parametrize(("context", "grade"), [
    ([1, 2, 3, 9, 1, 2, 3], 1),  # the last 3 tokens occurred before
    ([1, 2, 3, 9, 4, 2, 3], 0),  # only the last 2 did: a weaker match
    ([5, 5, 5, 5], 1),  # an overlapping earlier occurrence counts
    ([1, 2], 0),  # too short to hold an earlier 3-gram
    ([*COPY, 7, 9, *COPY], 2),  # the match reaches back LONG_MATCH tokens: a copy under way
    ([*COPY, 7, 9, 8, *COPY[1:]], 1),  # one token short of it
    ([*COPY, 7, 9, *COPY[1:], 7, *COPY], 1),  # the latest occurrence (the one copied) counts
])
def test_sure_grades_the_match(context: list[int], grade: int) -> None:
    """``sure``: 1 (a probe while drafting is off) only for a match of the longest n-gram, 2
    once that match reaches back ``LONG_MATCH`` tokens."""
    assert NgramDrafter(prompt_lookup_max=3).sure(context) == grade


def test_ngram_drafter_proposal_is_one_hot() -> None:
    """NgramDrafter returns the lookup result as a deterministic (q=None) proposal."""
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    context = [1, 2, 3, 9, 7, 7, 3, 8, 5, 1, 2, 3]
    proposal = drafter.propose(context, 2, SamplingParams(), torch.Generator())
    assert proposal.tokens == [9, 7]
    assert proposal.q_draft is None
    assert proposal.confidences == (1.0, 1.0)
    assert drafter.propose(context, 0, SamplingParams(), torch.Generator()).tokens == []


def test_ngram_drafter_keeps_nothing_across_sequences() -> None:
    """The drafter is stateless: a second sequence gets what a fresh drafter proposes, whether
    or not ``reset()`` came between, and the first sequence proposes the same after a reset.
    The second sequence's tail [4, 2] occurs only in the first: a drafter that remembered the
    earlier tokens would propose [6, 6] where a fresh one proposes nothing."""
    first = [4, 2, 6, 6, 1, 2, 3, 1, 2]
    second = [9, 8, 4, 2]
    assert find_ngram_continuation(first + second, 2, 3, 1) == [6, 6]  # what a leak would give

    def propose(drafter: NgramDrafter, context: list[int]) -> list[int]:
        return drafter.propose(context, 2, SamplingParams(), torch.Generator()).tokens

    fresh = {name: propose(NgramDrafter(3, 1), ctx) for name, ctx in
             [("first", first), ("second", second)]}
    assert fresh == {"first": [3, 1], "second": []}
    used = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    assert propose(used, first) == fresh["first"]
    assert propose(used, second) == fresh["second"]  # no reset in between
    used.reset()
    assert propose(used, first) == fresh["first"]
    used.reset()
    assert propose(used, second) == fresh["second"]


@pytest.mark.parametrize(("max_n", "min_n"), [(2, 3), (4, 0), (0, 0)])
def test_ngram_drafter_validation(max_n: int, min_n: int) -> None:
    """min > max or min < 1 is refused with both values in the message."""
    with pytest.raises(ValueError, match=r"prompt_lookup_min <= prompt_lookup_max") as info:
        NgramDrafter(prompt_lookup_max=max_n, prompt_lookup_min=min_n)
    assert f"min={min_n}" in str(info.value) and f"max={max_n}" in str(info.value)
