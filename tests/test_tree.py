"""Static draft trees on a tiny native model: a tree forward gives every node the logits its
root path gives fed as a chain (bit for bit), ``keep_path`` leaves the cache a chain leaves,
and greedy speculation with trees is plain greedy decoding token for token."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, collect, decode, tiny_config
from engine_helpers import GREEDY, request
from kernel_helpers import kernel_lib
from transformers import AutoModelForCausalLM, PreTrainedModel

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.engine.drafter import Proposal
from localspec.engine.engine import GenerationError, SpeculativeEngine
from localspec.engine.verify import verify_tree
from localspec.presets import load_preset
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import export_weights
from localspec.sampling import SamplingParams
from localspec.training import tuning

# a tree of 8 tokens: a chain 0-1-2-3, siblings 4 and 6 of 1, 5 under 4, 7 under 6
PARENTS = [-1, 0, 1, 2, 0, 4, 1, 6]
NOISE = 0.3  # the draft's relative weight noise


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return kernel_lib(tmp_path_factory)


def native_model(seed: int) -> PreTrainedModel:
    """A tiny Qwen2 whose shapes the native stack takes (head_dim 32), in float32."""
    config = tiny_config()
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 128, 128, 4
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # peaked logits, as a trained model's
        model.lm_head.weight.mul_(20.0)
    return model


def native_runner(model: PreTrainedModel, lib: ctypes.CDLL) -> ModelRunner:
    """A runner over the requant-q4k CPU decoder with a bf16 cache (the native stack)."""
    taken = copy.deepcopy(model).to(torch.bfloat16)
    decoder = CpuDecoder(taken, "requant-q4k", export_weights(taken, "requant-q4k", None), lib)
    assert decoder.native is not None and decoder.supports_trees
    return ModelRunner(taken, decoder=decoder)


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def root_path(parents: list[int], j: int) -> list[int]:
    path = [j]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("stack", ["native", "loop"])
@pytest.mark.parametrize("start", [20, 32])
def test_tree_forward_equals_each_root_path_as_a_chain(lib: ctypes.CDLL, stack: str,
                                                        start: int) -> None:
    """Every node's logits (and EAGLE features) from one tree forward are bit for bit those of
    the last token of its root path fed as a chain, in the native stack and in the Python loop
    over layers with the attention kernel."""
    runner = native_runner(native_model(seed=1), lib)
    if stack == "loop":
        runner.decoder.native = None
    runner.record_features((0, 1))
    prompt, tree = tokens(start, seed=2), tokens(len(PARENTS), seed=3)
    runner.forward(prompt)
    logits = runner.forward(tree, parents=PARENTS)
    features = runner.features(start, start + len(PARENTS)).clone()
    for j in range(len(PARENTS)):
        path = root_path(PARENTS, j)
        runner.crop(start)
        chain = runner.forward([tree[r] for r in path])
        assert torch.equal(logits[j], chain[-1]), j
        assert torch.equal(features[j], runner.features(start, start + len(path))[-1]), j
    assert not torch.equal(logits[4], logits[1])  # siblings of one parent: other tokens


def test_keep_path_leaves_the_cache_a_chain_leaves(lib: ctypes.CDLL) -> None:
    """After a tree forward and ``keep_path`` of an off-chain path, the next forward (and the
    kept features) equal those after feeding that path as a chain; on-chain paths too."""
    model = native_model(seed=4)
    runner, chain = native_runner(model, lib), native_runner(model, lib)
    prompt, tree, after = tokens(21, seed=5), tokens(len(PARENTS), seed=6), tokens(3, seed=7)
    for path in ([0, 4, 5], [0, 1, 6, 7], [0, 1, 2], [0]):
        for r in (runner, chain):
            r.reset()
            r.record_features((2,))
            r.forward(prompt)
        runner.forward(tree, parents=PARENTS)
        runner.keep_path(path)
        chain.forward([tree[r] for r in path])
        assert runner.length == chain.length == len(prompt) + len(path)
        assert torch.equal(runner.forward(after), chain.forward(after)), path
        assert torch.equal(runner.features(0, runner.length), chain.features(0, chain.length))


def test_trees_are_refused_where_they_cannot_be_fed(lib: ctypes.CDLL) -> None:
    """Parents that are no tree and a path that is no root path are ValueErrors; a Hugging
    Face runner says it feeds chains only."""
    runner = native_runner(native_model(seed=8), lib)
    runner.forward(tokens(5, seed=9))
    for parents in ([0, 0, 1], [-1, 2, 0], [-1, 0]):
        with pytest.raises(ValueError, match="parents"):
            runner.forward([1, 2, 3], parents=parents)
    runner.forward([1, 2, 3], parents=[-1, 0, 0])
    with pytest.raises(ValueError, match="root path"):
        runner.keep_path([0, 1, 2])
    hf = ModelRunner(native_model(seed=8))
    assert not hf.supports_trees
    with pytest.raises(ValueError, match="chains only"):
        hf.forward([1, 2], parents=[-1, 0])


class RecordingDrafter(DraftModelDrafter):
    """A draft model's drafter that keeps every proposal it made, trees included."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(ModelRunner(model), target_vocab_size=VOCAB, tokenizer_vocab_size=VOCAB)
        self.proposals: list[Proposal] = []

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        proposal = super().propose(context, k, params, generator, width)
        self.proposals.append(proposal)
        return proposal


def noisy_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """``model`` with relative Gaussian noise on every weight: a draft that is often right,
    and when wrong, often has the target's token among its next guesses."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            param.mul_(1 + noise * torch.randn(param.shape, generator=generator))
    return noisy


@pytest.mark.parametrize("width", [2, 3])
def test_greedy_trees_equal_plain_greedy(lib: ctypes.CDLL, width: int) -> None:
    """Greedy speculation with a tree of ``width`` first guesses is plain greedy decoding token
    for token, and the tree is doing something: some step accepts a first token that was not
    the chain's (a sibling) and goes on; events list the kept path's drafts first."""
    model = native_model(seed=11)
    target = native_runner(model, lib)
    drafter = RecordingDrafter(noisy_copy(model, NOISE, seed=12))
    plain = SpeculativeEngine(target, (), decode, set())
    engine = SpeculativeEngine(target, (drafter,), decode, set())
    siblings = 0
    for seed in range(3):
        prompt = tokens(9, seed=20 + seed)
        expected = collect(plain, request(prompt, max_new_tokens=48))[0]
        drafter.proposals.clear()
        out, events = collect(engine, request(prompt, k=4, max_new_tokens=48,
                                              tree_width=width))
        assert out == expected, seed
        drafted = [e for e in events if e.drafted]
        assert len(drafted) == len(drafter.proposals)
        assert any(p.parents is not None for p in drafter.proposals)
        for event, proposal in zip(drafted, drafter.proposals, strict=True):
            assert sorted(event.drafted) == sorted(proposal.tokens)
            assert event.tokens[:event.accepted] == event.drafted[:event.accepted]
            if event.accepted and event.tokens[0] != proposal.tokens[0]:
                assert event.tokens[0] in proposal.tokens[proposal.chain_length:]
                siblings += 1
    assert siblings > 0


def test_trees_only_where_the_request_is_greedy_and_the_target_feeds_them(
        lib: ctypes.CDLL) -> None:
    """A sampled request, and any request on a runner without tree support, drafts chains."""
    model = native_model(seed=11)
    drafter = RecordingDrafter(noisy_copy(model, NOISE, seed=12))
    prompt = tokens(9, seed=20)
    for target, sampling in ((native_runner(model, lib), SamplingParams(temperature=1.0)),
                             (ModelRunner(copy.deepcopy(model)), GREEDY)):
        engine = SpeculativeEngine(target, (drafter,), decode, set())
        collect(engine, request(prompt, k=4, max_new_tokens=20, sampling=sampling,
                                tree_width=3))
        assert drafter.proposals and all(p.parents is None for p in drafter.proposals)
        drafter.proposals.clear()
    with pytest.raises(GenerationError, match="tree_width"):
        engine.generate(request(prompt, tree_width=0))


def test_verify_tree_walks_the_targets_argmaxes() -> None:
    """From the root, down the child carrying the target's argmax; the argmax where no child
    carries it is the recovered token, the one after a leaf the bonus token."""
    drafts, parents = [10, 11, 12, 20, 21], (0, 1, 2, 0, 4)  # chain 10-11-12; 20-21 beside

    def logits(argmaxes: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(argmaxes), 30).float()

    verdict, path = verify_tree(logits([20, 0, 0, 0, 21, 7]), drafts, parents)
    assert (path, verdict.num_accepted, verdict.token, verdict.is_bonus) == ([0, 4, 5], 2, 7,
                                                                              True)
    verdict, path = verify_tree(logits([10, 11, 5, 0, 0, 0]), drafts, parents)
    assert (path, verdict.num_accepted, verdict.token, verdict.is_bonus) == ([0, 1, 2], 2, 5,
                                                                              False)
    verdict, path = verify_tree(logits([3, 0, 0, 0, 0, 0]), drafts, parents)
    assert (path, verdict.num_accepted, verdict.token) == ([0], 0, 3)


def test_tune_tries_tree_widths_where_the_target_feeds_trees(presets: dict[str, str]) -> None:
    """tune's "tree width" stage: widths 1-3 for a model-based drafter on a target that feeds
    trees, none otherwise (or for n-gram lookup); the width goes into the tuned preset."""
    preset = load_preset(presets["draft"])
    start = tuning.settings_of(preset)
    assert start.method == "draft_model" and start.tree_width == 1
    assert tuning.options("tree width", start, [], trees=False) == []
    assert [s.tree_width for s in tuning.options("tree width", start, [], trees=True)] == [1, 2, 3]
    ngram = dataclasses.replace(start, method="ngram")
    assert tuning.options("tree width", ngram, [], trees=True) == []
    wide = dataclasses.replace(start, tree_width=3)
    assert "tree 3" in wide.label()
    assert tuning.settings_of(tuning.with_settings(preset, wide)) == wide
    source = Path(presets["draft"]).read_text(encoding="utf-8")
    text = tuning.tuned_text(source, preset, wide, "# tuned\n")
    assert tomllib.loads(text)["localspec"]["tree_width"] == 3
