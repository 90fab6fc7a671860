"""Method "auto": several drafters in one engine, one chosen each step. Greedy output is plain
greedy output, the engine switches drafters within one answer and names them in its events and
stats, drafters skipped for several steps catch up, sampling with a one-hot and a distribution
drafter in one answer follows the target's distribution, drafting stops when no drafter pays,
and a preset's list of drafters is checked."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
import test_engine_sampling
import torch
from conftest import collect, decode, draft_drafter
from engine_helpers import GREEDY, MAX_NEW, PROMPTS, Gate, plain_tokens, request
from test_engine_sampling import (
    STAT_VOCAB,
    chi_square,
    chi_square_critical,
    first_two_counts,
)
from transformers import PreTrainedModel

import localspec.engine.verify as verify_module
from localspec.config import parse_preset
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.choice import LONG_COPY_PRIOR, Attempt, DrafterChoice, Shadows
from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.engine.engine import SpeculativeEngine
from localspec.engine.stats import GenerationStats
from localspec.errors import PresetError
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

# a long block the answer is likely to copy, then fresh text
BLOCK = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
COPY_PROMPT = [7, *BLOCK, 8, 9, *BLOCK, 8, 9, 40, 41]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("prompt", ["random-a", "repetitive"])
def test_auto_greedy_equals_plain(prompt: str, adaptive: bool, target_runner: ModelRunner,
                                  close_draft_model: PreTrainedModel) -> None:
    drafters = (NgramDrafter(3, 1), draft_drafter(close_draft_model))
    engine = SpeculativeEngine(target_runner, drafters, decode, set())
    tokens, events = collect(engine, request(PROMPTS[prompt], k=4, adaptive=adaptive))
    assert tokens == plain_tokens(target_runner.model, PROMPTS[prompt])
    assert {e.drafter for e in events if e.drafted} <= {"ngram", "draft_model"}
    assert all(e.drafter is None for e in events if not e.drafted)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_engine_switches_drafters_within_one_answer(
        adaptive: bool, target_runner: ModelRunner, target_model: PreTrainedModel) -> None:
    """Lookup drafts first (the prompt ends inside a repeated block: a sure guess), the draft
    model (here the target itself: always right) where lookup has nothing or misses; events
    and stats name each."""
    drafters = (NgramDrafter(4, 2), draft_drafter(target_model))
    engine = SpeculativeEngine(target_runner, drafters, decode, set())
    tokens, events = collect(engine, request(COPY_PROMPT, k=4, adaptive=adaptive))
    assert tokens == plain_tokens(target_model, COPY_PROMPT)
    names = [e.drafter for e in events if e.drafted]
    assert names[0] == "ngram"  # the prompt ends inside the block: lookup has the rest
    assert "draft_model" in names
    switches = sum(a != b for a, b in itertools.pairwise(names))
    assert switches >= 1
    stats = GenerationStats()
    for event in events:
        stats.add(event)
    counts = stats.drafters()
    assert set(counts) == {"ngram", "draft_model"}
    assert sum(c["drafted"] for c in counts.values()) == stats.drafted
    assert counts["draft_model"]["accepted"] == counts["draft_model"]["drafted"]  # q == p
    assert stats.as_dict()["drafters"] == counts


class Checked(Drafter):
    """A drafter whose every proposal is compared with a fresh copy's on the same context: a
    drafter that fell out of step with the context while skipped proposes otherwise."""

    def __init__(self, inner: Drafter, fresh: Callable[[], Drafter]) -> None:
        # not free even where ``inner`` is: only the engine's own asks are counted
        self.inner, self.fresh = inner, fresh
        self.traits = DrafterTraits(inner.traits.name)
        self.asked: list[int] = []  # the context lengths it was asked at

    def reset(self, keep_cache: bool = False) -> None:
        self.inner.reset()

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        proposal = self.inner.propose(context, k, params, generator)
        reference = self.fresh().propose(context, k, params, generator)
        assert proposal.tokens == reference.tokens, len(context)
        self.asked.append(len(context))
        return proposal


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_a_skipped_drafter_catches_up(kind: str, target_runner: ModelRunner,
                                      close_draft_model: PreTrainedModel) -> None:
    """Another member drafts blocks of 6 tokens in between: each time this drafter is asked
    again it proposes what a fresh one does on the same context, and a draft model's cache
    holds exactly what it has seen."""
    def make() -> Drafter:
        return NgramDrafter(3, 1) if kind == "ngram" else draft_drafter(close_draft_model)

    prompt = PROMPTS["random-b"]
    reference = plain_tokens(target_runner.model, prompt, max_new_tokens=60)
    member = Checked(make(), make)
    engine = SpeculativeEngine(target_runner, (Gate(reference, len(prompt)),
                                                            member,), decode, set())
    tokens, events = collect(engine, request(prompt, k=3, max_new_tokens=60))
    assert tokens == reference
    names = [e.drafter for e in events if e.drafted]
    assert "gate" in names and (kind != "draft_model" or kind in names)
    gaps = [b - a for a, b in zip(member.asked, member.asked[1:], strict=False)]
    assert max(gaps) > 4  # skipped for several steps, more tokens than one catch-up pass
    if isinstance(member.inner, DraftModelDrafter):
        assert member.inner.runner.length == len(member.inner._seen)


class Miss(Drafter):
    """Always wrong (the plain answer's next token + 1), and slow: drafting never pays."""

    def __init__(self, name: str, reference: list[int], prompt_length: int) -> None:
        self.traits = DrafterTraits(name)
        self.reference, self.prompt_length = reference, prompt_length
        self.calls = 0

    def reset(self, keep_cache: bool = False) -> None:
        self.calls = 0

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        self.calls += 1
        time.sleep(0.01 * k)  # many times a tiny target's pass
        truth = self.reference[len(context) - self.prompt_length]
        return Proposal([(truth + 1) % 64] * k)


def test_plain_steps_except_probes_when_no_drafter_pays(target_runner: ModelRunner) -> None:
    prompt, n = PROMPTS["random-a"], 120
    reference = plain_tokens(target_runner.model, prompt, max_new_tokens=n)
    members = [Miss("miss-a", reference, len(prompt)), Miss("miss-b", reference, len(prompt))]
    engine = SpeculativeEngine(target_runner, members, decode, set())
    tokens, events = collect(engine, request(prompt, k=4, adaptive=True, max_new_tokens=n))
    assert tokens == reference
    drafted = [e for e in events if e.drafted]
    assert all(e.accepted == 0 for e in drafted)
    # each: one unmeasured first draft, then probes after 8, 16, 32, 64 plain steps
    assert all(1 <= m.calls <= 5 for m in members), [m.calls for m in members]
    assert len(events) - len(drafted) >= n - 10


def test_choice_prefers_the_drafter_with_the_higher_rate() -> None:
    """Two measured drafters at the same cost: the one accepted more often is asked first; a
    drafter that never pays is left out but for its probes."""
    choice = DrafterChoice(3, k_max=4)
    rates = {0: 2, 1: 4, 2: 0}  # accepted of 4 drafted
    for _ in range(30):
        for index, accepted in rates.items():
            choice.order([False] * 3)
            choice.asked(Attempt(index, 4))
            choice.record(index, 4, accepted, {index: 0.001}, 0.01)
    order = [a.index for a in choice.order([False, False, False]) if not a.probe]
    assert order == [1, 0]


def test_sure_guesses_are_estimated_apart() -> None:
    """Lookup-like: its guesses miss unless it is sure, and then they are kept whole. Beside a
    draft model that keeps half of its drafts, it is asked first with long drafts when sure,
    after the draft model when not: one estimate of both kinds ranks it second either way."""
    choice = DrafterChoice(2, k_max=8)
    for step in range(40):
        sure = step % 4 == 0
        attempts = choice.order([sure, False])
        drafter = attempts[0].index if attempts else 1
        choice.asked(Attempt(drafter, 8, sure=sure and drafter == 0))
        kept = (8 if sure else 0) if drafter == 0 else 2
        choice.record(drafter, 8 if drafter == 0 else 4, kept,
                      {drafter: 0.0001 if drafter == 0 else 0.004}, 0.02)
        if drafter == 1:  # lookup, free, is shadowed on the steps it did not draft
            choice.shadow(0, 8, 8 if sure else 0, 0.0001, sure)
    sure_first = choice.order([True, False])[0]
    assert sure_first.index == 0 and sure_first.k >= 6 and not sure_first.probe
    assert choice.order([False, False])[0].index == 1


def test_a_long_copy_is_estimated_apart_from_its_own_prior() -> None:
    """Lookup's second grade (a long copy under way) has its own estimator, which starts from
    LONG_COPY_PRIOR: after the same verdicts (4 drafted, all kept) it drafts longer than the
    first grade, which starts from the weak prior."""
    choice = DrafterChoice(1, k_max=12)
    for _ in range(3):  # plain passes of 1 and of 5 rows: the verify line
        choice.order([0])
        choice.record(None, 0, 0, {}, 0.030)
        choice.order([0])
        choice.record(None, 4, 4, {}, 0.045)
    for grade in (1, 2):
        choice.shadow(0, 4, 4, 0.0001, grade)
    plans = {grade: choice.sure_estimator(0, grade).plan()[0] for grade in (1, 2)}
    assert choice.sure_estimator(0, 2).alpha_prior == LONG_COPY_PRIOR
    assert plans[2] > plans[1] > 0, plans
    assert choice.order([2])[0].k == plans[2] and choice.order([1])[0].k == plans[1]


# ----------------------------------------------------------------------------- sampling

stat_models = test_engine_sampling.stat_models  # the 13-token target and draft, p1 and p2


class OneHotSometimes(Drafter):
    """A deterministic drafter (q one-hot, ``q_draft`` None) that guesses token 3 on contexts
    of even length and has nothing on the others, so the draft model drafts those."""

    traits = DrafterTraits("onehot")

    def reset(self, keep_cache: bool = False) -> None:
        """Stateless."""

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        return Proposal([3] * min(k, 2)) if len(context) % 2 == 0 else Proposal([])


def mixed_counts(target: PreTrainedModel, draft: PreTrainedModel, seeds: range
                 ) -> tuple[torch.Tensor, torch.Tensor, set[Any]]:
    drafters = (OneHotSometimes(), DraftModelDrafter(ModelRunner(draft), STAT_VOCAB, STAT_VOCAB))
    first, second, stats = first_two_counts(target, drafters, seeds)
    return first, second, set(stats.drafters())


def test_mixed_drafters_sample_the_targets_distribution(stat_models: tuple) -> None:
    """One-hot drafts on one step, the draft model's q on the next, in one answer: the first
    two tokens follow the target's exact distributions (each proposal verified with its own
    q)."""
    target, draft, p1, p2 = stat_models
    c1, c2, names = mixed_counts(target, draft, range(1500))
    assert names == {"onehot", "draft_model"}
    for counts, p in ((c1, p1), (c2, p2)):
        stat, df = chi_square(counts, p)
        assert stat < chi_square_critical(df), (stat, df)


def test_mixed_check_has_power(stat_models: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a wrong residual (resampling from p) fails the same check."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, token: p)
    target, draft, p1, p2 = stat_models
    c1, c2, _ = mixed_counts(target, draft, range(600))
    assert any(chi_square(c, p)[0] > chi_square_critical(chi_square(c, p)[1])
               for c, p in ((c1, p1), (c2, p2)))


# ----------------------------------------------------------------------------- presets


def preset(method: str = "auto", model: str | None = "some/draft",
           **localspec: object) -> dict[str, Any]:
    sc: dict[str, Any] = {"method": method} | ({"model": model} if model else {})
    return {"name": "p", "description": "d", "hardware": "cpu",
            "target": {"model": "some/target"}, "speculative_config": sc,
            "localspec": localspec}


def test_auto_members_default_and_listed() -> None:
    assert parse_preset(preset()).drafter_set().members == ("ngram", "suffix", "draft_model")
    assert parse_preset(preset(model=None)).drafter_set().members == ("ngram", "suffix")
    head = parse_preset(preset(drafters=["eagle3", "ngram"]))
    assert head.drafter_set().members == ("eagle3", "ngram") and head.draft_spec() is None
    assert parse_preset(preset()).draft_spec() is not None
    eagle = parse_preset(preset("eagle3"))
    assert eagle.drafter_set("auto").members == ("ngram", "suffix", "eagle3")
    lookup = parse_preset(preset("draft_model", lookup_first=True))
    assert lookup.drafter_set().members == ("ngram", "draft_model")
    assert parse_preset(preset("none", model=None)).drafter_set().members == ()
    three = parse_preset(preset(drafters=["ngram", "eagle3", "draft_model"], head="some/head"))
    assert three.draft_spec() is not None and three.draft_spec().model == "some/draft"
    assert three.head_source() == "some/head" and head.head_source() == "some/draft"
    pair = parse_preset(preset(drafters=["ngram", "eagle3"], head="some/head"))
    assert pair.head_source() == "some/head" and pair.draft_spec() is not None


@pytest.mark.parametrize(("data", "needle"), [
    (preset(drafters=["ngram", "lookahead"]), "is not one of"),
    (preset(drafters=["none"]), "'none' is not a drafter"),
    (preset(drafters=["auto", "ngram"]), "'auto' is not a drafter"),
    (preset(drafters=["ngram", "ngram"]), "lists a drafter twice"),
    (preset(drafters=["draft_model", "eagle3"]), "'eagle3' beside a draft model needs "
                                                 "[localspec] head"),
    (preset(drafters=["medusa", "eagle3"], head="h"), "medusa and eagle3 are both heads"),
    (preset(drafters=["ngram", "draft_model"], head="h"), "[localspec] head names the head"),
    (preset("draft_model", head="h"), "[localspec] head names the head of"),
    (preset("eagle3", head="h"), "a lone head is [speculative_config] model"),
    (preset(model=None, drafters=["ngram", "medusa"]), "'medusa' needs [speculative_config] model"),
    (preset("ngram", drafters=["ngram"]), "lists the members of method 'auto'"),
])
def test_bad_drafter_lists_are_preset_errors(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(PresetError) as info:
        parse_preset(data, "p.toml")
    assert needle in str(info.value) and str(info.value).startswith("p.toml: ")


# ----------------------------------------------------------------------------- shadows


class Recorder:
    """Stands for DrafterChoice: what ``shadow`` was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def shadow(self, drafter: int, drafted: int, accepted: int, draft_time: float,
               sure: bool = False) -> None:
        self.calls.append((drafter, drafted, accepted, sure))


def test_a_shadow_guess_is_settled_by_the_output() -> None:
    shadows, seen = Shadows(), Recorder()
    output = [1, 2, 3]
    shadows.add(0, 3, [5, 6, 7], 0.0, sure=True)  # continues after output[:3]
    shadows.add(1, 3, [5, 9], 0.0)
    shadows.add(1, 3, [], 0.0)  # nothing guessed: nothing to learn
    shadows.resolve([*output, 5], seen)  # both still match what is known
    assert seen.calls == []
    shadows.resolve([*output, 5, 6], seen)  # the second guess missed at its second token
    assert seen.calls == [(1, 2, 1, False)]
    shadows.resolve([*output, 5, 6, 7, 8], seen)  # the first was kept whole
    assert seen.calls == [(1, 2, 1, False), (0, 3, 3, True)]


class TwoRight(Drafter):
    """Free, like lookup: the plain answer's next two tokens, then a wrong one."""

    traits = DrafterTraits("two-right", free=True)

    def __init__(self, reference: list[int], prompt_length: int) -> None:
        self.reference, self.prompt_length = reference, prompt_length

    def reset(self, keep_cache: bool = False) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        at = len(context) - self.prompt_length
        right = self.reference[at:at + 2]
        return Proposal([*right, (self.reference[at + 2] + 1) % 64] if len(right) == 2 else [])


@pytest.mark.parametrize("greedy", [True, False])
def test_a_free_drafter_learns_from_steps_another_drafted(
        greedy: bool, target_runner: ModelRunner, target_model: PreTrainedModel,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft model (the target itself: always right, so ranked first) drafts; a free
    drafter that did not draft is asked what it would have drafted and learns what the output
    kept (two of three here), in greedy decoding only, where the output does not depend on the
    drafts."""
    told: list[tuple[int, int, int]] = []
    real = DrafterChoice.shadow

    def shadow(self: DrafterChoice, drafter: int, drafted: int, accepted: int,
               draft_time: float, sure: bool = False) -> None:
        told.append((drafter, drafted, accepted))
        real(self, drafter, drafted, accepted, draft_time, sure)

    monkeypatch.setattr(DrafterChoice, "shadow", shadow)
    prompt = PROMPTS["random-a"]
    reference = plain_tokens(target_model, prompt, max_new_tokens=MAX_NEW + 3)
    drafters = (draft_drafter(target_model), TwoRight(reference, len(prompt)))
    engine = SpeculativeEngine(target_runner, drafters, decode, set())
    sampling = GREEDY if greedy else SamplingParams(temperature=1.0)
    tokens, events = collect(engine, request(prompt, k=4, adaptive=False, sampling=sampling))
    if not greedy:
        assert told == []
        return
    assert tokens == reference[:len(tokens)]
    assert {e.drafter for e in events if e.drafted} == {"draft_model"}
    assert len(told) >= len(events) - 2 and set(told) == {(1, 3, 2)}, told
