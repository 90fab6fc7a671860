"""Requests stepped together (``engine.batch``): one target pass for every member's rows, and
each answer token for token what the request gets alone: plain decoding, n-gram lookup and a
draft model; greedy (trees too) and sampled with seeds; a member that is cancelled or fails
ends alone. The batched k (``adaptive.Load``) is the lone k when the load is zero."""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import decode
from engine_helpers import HOT, request
from kernel_helpers import kernel_lib
from test_tree import native_model, native_runner, noisy_copy, tokens

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.engine.adaptive import AdaptiveK, Load
from localspec.engine.batch import Batch, run_together
from localspec.engine.drafter import Drafter, DrafterTraits, Proposal
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.cpu_forward import CpuFeed, CpuForward
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return kernel_lib(tmp_path_factory)


class Slots:
    """Engines over one target and one draft model (weights shared), each slot with its own
    runners (caches) and drafters, as ``Pipeline``'s slots."""

    def __init__(self, lib: ctypes.CDLL, method: str) -> None:
        model = native_model(seed=11)
        self.target = native_runner(model, lib)
        self.draft = native_runner(noisy_copy(model, 0.3, seed=12), lib)
        self.method = method

    def engine(self) -> SpeculativeEngine:
        target = ModelRunner(self.target.model, decoder=self.target.decoder)
        drafters: tuple[Drafter, ...] = ()
        if self.method == "ngram":
            drafters = (NgramDrafter(),)
        elif self.method == "draft_model":
            runner = ModelRunner(self.draft.model, decoder=self.draft.decoder)
            drafters = (DraftModelDrafter(runner, 97, 97),)
        return SpeculativeEngine(target, drafters, decode, {96})


def prompts() -> list[list[int]]:
    repetitive = [10, 11, 12, 13, 14] * 4
    return [tokens(7, 1), tokens(15, 2), repetitive, tokens(3, 4)]


def alone(slots: Slots, requests: list[GenerationRequest]) -> list[list[int]]:
    return [[t for e in slots.engine().generate(r) for t in e.tokens] for r in requests]


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
@pytest.mark.parametrize("sampled", [False, True])
def test_batched_answers_are_the_answers_alone(lib: ctypes.CDLL, method: str,
                                               sampled: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests of different prompt lengths and lengths stepped together give each the
    tokens it gets alone; sampled ones (k fixed: adaptive off) too, each with its own seed;
    greedy draft-model requests also as trees. Rows from several requests did share passes."""
    slots = Slots(lib, method)
    extra = {"sampling": HOT, "adaptive": False} if sampled else {"adaptive": True}
    requests = [request(p, k=3, max_new_tokens=n, seed=s, **extra)  # type: ignore[arg-type]
                for p, n, s in zip(prompts(), (30, 12, 40, 25), (1, 2, 3, 4), strict=True)]
    if method == "draft_model" and not sampled:
        requests[1] = request(prompts()[1], k=3, max_new_tokens=12, tree_width=2)
    expected = alone(slots, requests)
    widths: list[int] = []
    batch_forward = CpuForward.forward_batch

    def spy(feeds: list[CpuFeed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        widths.append(len(feeds))
        return batch_forward(feeds)

    monkeypatch.setattr(CpuForward, "forward_batch", staticmethod(spy))
    batched = run_together([(slots.engine(), r) for r in requests])
    assert widths and max(widths) == 4
    assert [[t for e in events for t in e.tokens] for events in batched] == expected
    assert [len(e) for e in expected] == [30, 12, 40, 25]  # no EOS cut them short
    # the negative control: another seed's sample differs
    if sampled:
        other = alone(slots, [request(prompts()[0], k=3, max_new_tokens=30, seed=9, **extra)])
        assert other[0] != expected[0]  # type: ignore[arg-type]


class Failing(Drafter):
    """Raises on its third proposal: one member's failure."""

    traits = DrafterTraits("failing")

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, keep_cache: bool = False) -> None:
        self.calls = 0

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafter broke")
        return Proposal([])


def test_a_cancelled_or_failing_member_leaves_the_others_alone(lib: ctypes.CDLL) -> None:
    """One member cancelled after its fourth step ends with "cancelled", one whose drafter
    raises ends with that error; the others run to their ends with the tokens they get alone."""
    slots = Slots(lib, "draft_model")
    reqs = [request(p, k=3, max_new_tokens=30) for p in prompts()[:3]]
    expected = alone(slots, [reqs[0], reqs[2]])
    steps = {"n": 0}
    cancelled_gen = slots.engine().start(reqs[1], cancelled=lambda: steps["n"] >= 4)
    broken = SpeculativeEngine(ModelRunner(slots.target.model, decoder=slots.target.decoder),
                               (Failing(),), decode, set())
    batch = Batch()
    members = [slots.engine().start(reqs[0]), cancelled_gen, broken.start(reqs[2]),
               slots.engine().start(reqs[2])]
    for member in members:
        batch.add(member)
    outcomes: dict[int, list[object]] = {id(m): [] for m in members}
    while batch.members:
        steps["n"] += 1
        for member, outcome in batch.step():
            outcomes[id(member)].append(outcome)
    tokens_of = [[t for e in outcomes[id(m)] if not isinstance(e, Exception) for t in e.tokens]
                 for m in members]
    assert tokens_of[0] == expected[0] and tokens_of[3] == expected[1]
    assert outcomes[id(members[1])][-1].finish_reason == "cancelled"  # type: ignore[union-attr]
    assert isinstance(outcomes[id(members[2])][-1], RuntimeError)
    with pytest.raises(ValueError, match="target runner of its own"):
        batch.add(members[0])
        batch.add(members[0])


def test_the_batched_cost_model_is_the_lone_one_at_zero_load() -> None:
    """With no load the batched plan is bit for bit the lone plan; a heavy load (a pass whose
    other rows already keep many tokens a second) makes the same drafter draft less."""
    estimator = AdaptiveK(k_max=8)
    for step in range(12):
        estimator.update(drafted=6, accepted=3 + step % 3, draft_time=6 * 0.004,
                         verify_time=0.030 + 0.004 * 7)
        estimator.verify.update(1, 0.030)
    lone = estimator.plan()
    assert estimator.plan(Load()) == lone and lone[0] > 0
    busy = estimator.plan(Load(tokens=12.0, seconds=0.0, rows=12))
    assert busy[0] < lone[0]
