"""The suffix drafter (SuffixDecoding): its index against a brute-force reference (longest match,
continuation counts, sequence boundaries, the sorted and the scanned parts, incremental growth),
the history's cap and eviction, the drafter's chain, tree, grades and reset; and through the
engine: greedy output is plain greedy output alone, in a tree and inside auto, a history of the
answer makes it draft the answer, and sampled output follows the target's distribution (with a
negative control)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import test_engine_sampling
import torch
from conftest import collect, decode, draft_drafter
from engine_helpers import GREEDY, HOT, PROMPTS, plain_tokens, request
from test_engine_sampling import STAT_PROMPT, chi_square, chi_square_critical, first_two_counts
from transformers import PreTrainedModel

import localspec.engine.verify as verify_module
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.suffix import SuffixDrafter, chain_first, grow_tree
from localspec.drafters.suffix_index import SEP, AnswerHistory, TokenIndex, tail_of
from localspec.engine.drafter import Proposal
from localspec.engine.engine import SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

stat_models = test_engine_sampling.stat_models  # the 13-token target, p1 and p2

# ----------------------------------------------------------------------------- the index


def reference_match(sequences: list[list[int]], context: list[int], depth: int,
                    own: bool = False) -> tuple[int, list[list[int]]]:
    """Brute force: the longest length <= depth of the context's tail that occurs in one of
    ``sequences`` (ending before the context's own last token where ``own``: the context is
    the last sequence), and the ``depth`` tokens after each such occurrence (SEP-padded)."""
    best, rows = 0, []
    for s, seq in enumerate(sequences):
        last = len(seq) - 1 if own and s == len(sequences) - 1 else len(seq)
        for end in range(last):
            length = 0
            while (length < depth and length <= end and length < len(context)
                   and seq[end - length] == context[-1 - length]):
                length += 1
            if length == 0 or length < best:
                continue
            row = (seq[end + 1 : end + 1 + depth] + [SEP] * depth)[:depth]
            if length > best:
                best, rows = length, []
            rows.append(row)
    return best, rows


def sorted_rows(rows: np.ndarray | list[list[int]]) -> list[list[int]]:
    return sorted(list(map(int, row)) for row in rows)


@pytest.mark.parametrize("fresh_tokens", [None, 7, 1_000])
def test_index_matches_the_brute_force_reference(fresh_tokens: int | None) -> None:
    """Random small-alphabet sequences (many repeats), added in pieces: every query's longest
    match and its continuations equal the reference's, whether positions sit in the sorted
    keys (fresh_tokens 7: re-sorted as it grows), the scanned part, or both."""
    rng = random.Random(3)
    for trial in range(40):
        sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))]
                     for _ in range(rng.randrange(1, 6))]
        index = TokenIndex(max_candidates=10_000, fresh_tokens=fresh_tokens)
        for seq in sequences:
            cut = rng.randrange(len(seq) + 1)
            index.add(seq[:cut])
            index.append(seq[cut:])
        for _ in range(10):
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
            depth = rng.randrange(1, 9)
            found = index.match(tail_of(context, depth), depth)
            length, rows = reference_match(sequences, context, depth)
            assert found.length == length, (trial, context)
            assert sorted_rows(found.rows) == sorted_rows(rows), (trial, context)


def test_a_requests_own_context_never_matches_its_tail_itself() -> None:
    """``before = end - 1``: the context's last token is no earlier occurrence of itself;
    continuations stop at the context's end."""
    context = [7, 1, 2, 3, 9, 1, 2, 3]
    index = TokenIndex(fresh_tokens=None)
    index.add(context)
    found = index.match(tail_of(context, 8), 8, before=index.end - 1)
    assert found.length == 3
    assert sorted_rows(found.rows) == [[9, 1, 2, 3, SEP, SEP, SEP, SEP]]
    assert (found.length, sorted_rows(found.rows)) == (
        reference_match([context], context, 8, own=True)[0],
        sorted_rows(reference_match([context], context, 8, own=True)[1]))


def test_matches_never_cross_from_one_answer_into_the_next() -> None:
    """[1, 2] ends one answer and [3] starts the next: the tail [1, 2, 3] matches only 1 token,
    and a continuation ends at its answer's end."""
    index = TokenIndex()
    index.add([5, 1, 2])
    index.add([3, 4])
    found = index.match(tail_of([1, 2, 3], 4), 4)
    assert found.length == 1 and sorted_rows(found.rows) == [[4, SEP, SEP, SEP]]
    found = index.match(tail_of([5, 1], 4), 4)
    assert found.length == 2 and sorted_rows(found.rows) == [[2, SEP, SEP, SEP]]


@pytest.mark.parametrize("fresh_tokens", [4, 10_000])
def test_the_history_keeps_its_cap_and_forgets_the_oldest(fresh_tokens: int) -> None:
    """At most cap_tokens tokens: the oldest answers go first, at once from every query
    (whether sorted or scanned), and the index is compacted once the evicted outweigh the kept
    (matches stay exact)."""
    history = AnswerHistory(cap_tokens=10, fresh_tokens=fresh_tokens)
    history.add([1, 2, 3, 4])
    history.add([5, 6, 7, 8])
    assert (history.answers, history.tokens) == (2, 8)
    assert history.match(tail_of([1, 2], 4), 4).length == 2
    history.add([9, 10, 11])  # 11 tokens: [1, 2, 3, 4] goes
    assert (history.answers, history.tokens) == (2, 7)
    assert history.match(tail_of([1, 2], 4), 4).length == 0
    assert history.match(tail_of([5, 6], 4), 4).length == 2
    for n in range(20):  # many evictions: compactions along the way
        history.add([100 + n, 200 + n, 300 + n])
    assert history.tokens <= 10 and history.answers == 3
    assert history.match(tail_of([119, 219], 4), 4).rows.tolist() == [[319, SEP, SEP, SEP]]
    assert history.match(tail_of([100, 200], 4), 4).length == 0
    assert history.nbytes() < 20_000  # the evicted tokens' memory was given back
    history.add(list(range(11)))  # longer than the cap: never held
    assert history.answers == 3


def test_replace_forgets_everything_first() -> None:
    history = AnswerHistory(cap_tokens=100)
    history.add([1, 2, 3])
    version = history.version
    history.replace([[4, 5, 6]])
    assert history.version > version and history.answers == 1
    assert history.match(tail_of([1, 2], 4), 4).length == 0
    assert history.match(tail_of([4, 5], 4), 4).rows.tolist() == [[6, SEP, SEP, SEP]]


# ----------------------------------------------------------------------------- the drafter

PARAMS, GENERATOR = GREEDY, torch.Generator()


def test_the_most_frequent_continuation_is_drafted() -> None:
    """After [1, 2]: 3 twice, 4 once (4 the most recent): the suffix drafter drafts 3, where
    n-gram lookup copies the latest occurrence."""
    context = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    drafter = SuffixDrafter()
    assert drafter.propose(context, 1, PARAMS, GENERATOR).tokens == [3]
    assert NgramDrafter(2, 1).propose(context, 1, PARAMS, GENERATOR).tokens == [4]


def test_the_draft_grows_with_the_match_and_stops_below_min_prob() -> None:
    """Its length is at most max_spec_factor times the match's; the chain stops where its
    empirical chance falls below min_token_prob."""
    history = AnswerHistory(cap_tokens=1000)
    history.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    one = SuffixDrafter(history)
    assert one.propose([0, 2], 8, PARAMS, GENERATOR).tokens == [3]  # match 1: 1 token
    assert one.propose([0, 1, 2], 8, PARAMS, GENERATOR).tokens == [3, 4]
    assert SuffixDrafter(history, max_spec_factor=2.0).propose(
        [0, 1, 2], 8, PARAMS, GENERATOR).tokens == [3, 4, 5, 6]
    history.extend([[1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 8], [1, 2, 3, 9]])
    # after [1, 2, 3]: 4 three times in four (0.75), then 5 twice in three (0.75 * 2/3 = 0.5),
    # then 6 or 0 (0.25 each)
    for least, expected in ((0.8, []), (0.6, [4]), (0.3, [4, 5])):
        assert SuffixDrafter(history, min_token_prob=least).propose(
            [1, 2, 3], 8, PARAMS, GENERATOR).tokens == expected, least
    assert one.propose([1, 2, 3], 0, PARAMS, GENERATOR).tokens == []


def test_the_request_index_wins_a_tie_and_the_longer_match_wins() -> None:
    history = AnswerHistory(cap_tokens=1000)
    history.add([8, 1, 2, 6, 6, 6])
    drafter = SuffixDrafter(history)
    assert drafter.propose([1, 2, 5, 8, 1, 2], 8, PARAMS, GENERATOR).tokens[0] == 6  # 3 > 2
    drafter.reset()
    assert drafter.propose([1, 2, 5, 9, 1, 2], 8, PARAMS, GENERATOR).tokens[0] == 5  # a tie


def test_proposals_are_one_hot_and_graded_by_the_match() -> None:
    history = AnswerHistory(cap_tokens=1000)
    history.add(list(range(20, 40)))
    drafter = SuffixDrafter(history)
    proposal = drafter.propose([1, 20, 21, 22], 8, PARAMS, GENERATOR)
    assert proposal.q_draft is None and proposal.confidences == (1.0, 1.0, 1.0)
    assert [drafter.outlook(list(range(20, 20 + n))).sure for n in (1, 3, 4, 7, 8, 12)] == \
        [0, 0, 1, 1, 2, 2]
    assert drafter.outlook([99]).sure == 0


def test_reset_forgets_the_request_and_keep_cache_checks_the_next_context() -> None:
    """A second request does not see the first's tokens (a leak would draft [6, 6]), with or
    without reset; keep_cache keeps the index only for a context that continues it."""
    first, second = [4, 2, 6, 6, 1, 2, 3], [9, 8, 4, 2]
    drafter = SuffixDrafter()
    assert drafter.propose(first, 2, PARAMS, GENERATOR).tokens == []
    assert drafter.propose(second, 2, PARAMS, GENERATOR).tokens == []  # no reset between
    drafter.reset()
    assert drafter.propose([*first, 9, 4, 2], 2, PARAMS, GENERATOR).tokens == [6, 6]
    drafter.reset(keep_cache=True)
    assert drafter.propose(second, 2, PARAMS, GENERATOR).tokens == []
    drafter.reset(keep_cache=True)
    assert drafter.propose([*second, 5, 9, 8], 2, PARAMS, GENERATOR).tokens == [4, 2]


def test_a_tree_puts_the_likeliest_chain_first() -> None:
    """Continuations [5, 6] x3, [7, 8] x2, [5, 9] x1: with width 2 the chain is 5, 6 and the
    other candidates follow, each after its parent."""
    rows = np.array([[5, 6], [5, 6], [5, 6], [7, 8], [7, 8], [5, 9]], dtype=np.int32)
    nodes = grow_tree(rows, depth=2, budget=5, width=2, min_prob=0.1)
    proposal = chain_first(nodes)
    assert proposal.tokens[:2] == [5, 6] and proposal.chain_length == 2
    assert sorted(proposal.tokens) == [5, 6, 7, 8, 9]
    feed = [None, *proposal.tokens]
    paths = set()
    for i, parent in enumerate(proposal.parents):
        assert parent <= i  # every parent before its child
        paths.add((feed[parent], proposal.tokens[i]))
    assert paths == {(None, 5), (5, 6), (None, 7), (7, 8), (5, 9)}
    assert chain_first(grow_tree(rows, 2, 2, 1, 0.1)).parents is None  # width 1: a chain
    assert grow_tree(rows, 2, 5, 2, 0.7) == []  # no first token is that likely


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("prompt", ["random-a", "repetitive"])
def test_greedy_output_is_plain_greedy_alone_and_in_auto(
        prompt: str, target_runner: ModelRunner, close_draft_model: PreTrainedModel) -> None:
    expected = plain_tokens(target_runner.model, PROMPTS[prompt])
    history = AnswerHistory(cap_tokens=1000)
    history.add(expected[5:25])  # part of this very answer, as if asked before
    for drafters in ((SuffixDrafter(),), (SuffixDrafter(history),),
                     (NgramDrafter(3, 1), SuffixDrafter(history),
                      draft_drafter(close_draft_model))):
        for adaptive in (False, True):
            engine = SpeculativeEngine(target_runner, drafters, decode, set())
            tokens, events = collect(engine, request(PROMPTS[prompt], k=4, adaptive=adaptive))
            assert tokens == expected, ([d.traits.name for d in drafters], adaptive)
            assert {e.drafter for e in events if e.drafted} <= {"ngram", "suffix",
                                                                 "draft_model"}


def test_a_history_of_the_answer_makes_it_draft_the_answer(target_runner: ModelRunner) -> None:
    """The same question again (a regenerated answer): with the first answer in its history the
    drafter proposes the rest of it, so the answer takes a fraction of the target passes;
    without it, next to none are saved on a random prompt."""
    prompt = PROMPTS["random-b"]
    expected = plain_tokens(target_runner.model, prompt)
    history = AnswerHistory(cap_tokens=1000)
    cold = collect(SpeculativeEngine(target_runner, (SuffixDrafter(history),), decode, set()),
                   request(prompt, k=8))[1]
    history.add(expected)
    tokens, warm = collect(SpeculativeEngine(target_runner, (SuffixDrafter(history),), decode,
                                             set()), request(prompt, k=8))
    assert tokens == expected
    assert len(warm) * 3 <= len(expected) and len(warm) < len(cold)
    assert not warm[0].drafted  # nothing says which answer comes: it starts after one token
    # learnt after the end of its prompt (as the app learns it): drafted from the first token
    history.replace([expected], [prompt])
    tokens, led = collect(SpeculativeEngine(target_runner, (SuffixDrafter(history),), decode,
                                            set()), request(prompt, k=8))
    assert tokens == expected and led[0].accepted == 8 and len(led) < len(warm)


class RecordingSuffix(SuffixDrafter):
    """Keeps every proposal."""

    def __init__(self, history: AnswerHistory) -> None:
        super().__init__(history)
        self.proposals: list[Proposal] = []

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        self.proposals.append(super().propose(context, k, params, generator, width))
        return self.proposals[-1]


def test_greedy_trees_from_the_history_equal_plain_greedy(tmp_path_factory: pytest.TempPathFactory
                                                           ) -> None:
    """On a target that feeds trees, a history whose continuations branch gives trees (width
    3), and the output is plain greedy decoding's."""
    from kernel_helpers import kernel_lib
    from test_tree import native_model, native_runner, tokens

    model = native_model(seed=11)
    target = native_runner(model, kernel_lib(tmp_path_factory))
    prompt = tokens(9, seed=20)
    expected = collect(SpeculativeEngine(target, (), decode, set()),
                       request(prompt, max_new_tokens=32))[0]
    history = AnswerHistory(cap_tokens=10_000)
    rng = random.Random(5)
    for start in range(0, 28, 2):  # the answer, and copies with a wrong token here and there
        history.add(expected[start : start + 8])
        wrong = list(expected[start : start + 8])
        wrong[rng.randrange(1, len(wrong))] = (wrong[0] + 1) % 100
        history.add(wrong)
    drafter = RecordingSuffix(history)
    out = collect(SpeculativeEngine(target, (drafter,), decode, set()),
                  request(prompt, k=6, max_new_tokens=32, tree_width=3))[0]
    assert out == expected
    assert any(p.parents is not None for p in drafter.proposals)


# ----------------------------------------------------------------------------- sampling


def stat_history(p1: torch.Tensor) -> AnswerHistory:
    """A history that has the prompt's tail [3, 4] go on with the target's likeliest first
    token, then another: drafted (one-hot) at the first step, often rejected."""
    top = int(p1.argmax())
    history = AnswerHistory(cap_tokens=1000)
    history.extend([[STAT_PROMPT[-2], STAT_PROMPT[-1], top, (top + 1) % 13],
                    [STAT_PROMPT[-1], top, (top + 5) % 13, 2]])
    return history


def test_sampled_first_two_tokens_follow_the_target(stat_models: tuple) -> None:
    """Suffix drafts (one-hot q) in sampled decoding leave the first two tokens distributed as
    under plain sampling (exact reference); it did draft, and had drafts rejected."""
    target, _, p1, p2 = stat_models
    c1, c2, stats = first_two_counts(target, SuffixDrafter(stat_history(p1)), range(1500))
    assert stats.drafted > 1500 and 0.05 < stats.acceptance_rate < 0.95
    for counts, p in ((c1, p1), (c2, p2)):
        stat, df = chi_square(counts, p)
        assert stat < chi_square_critical(df), (stat, df)


def test_the_sampling_check_has_power(stat_models: tuple, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    """Negative control: resampling from p after a rejection fails the same check."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, token: p)
    target, _, p1, p2 = stat_models
    c1, c2, _ = first_two_counts(target, SuffixDrafter(stat_history(p1)), range(1500))
    assert any(chi_square(c, p)[0] > chi_square_critical(chi_square(c, p)[1])
               for c, p in ((c1, p1), (c2, p2)))


def test_sampled_requests_get_chains(target_runner: ModelRunner) -> None:
    """Trees are for greedy requests: a sampled one with width 3 gets one chain."""
    history = AnswerHistory(cap_tokens=100)
    history.extend([[1, 2, 3], [1, 2, 4], [1, 2, 5]])
    proposal = SuffixDrafter(history).propose([1, 2], 4, HOT, GENERATOR, width=3)
    assert proposal.parents is None and len(proposal.tokens) == 1
    tree = SuffixDrafter(history).propose([1, 2], 4, GREEDY, GENERATOR, width=3)
    assert tree.parents is not None and sorted(tree.tokens) == [3, 4, 5]
