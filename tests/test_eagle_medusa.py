"""EAGLE, EAGLE-3 and Medusa drafting on tiny targets: the runner's recorded features are the
target's hidden states; every drafter's greedy output equals plain decoding (on the Hugging
Face and the CPU forward); heads built to be right are accepted exactly as predicted, which a
drafter reading the wrong feature rows fails; the drafters' incremental proposals equal a
from-scratch reference under any pattern of acceptances; seeded sampling completes and
repeats. Loading the published layouts is ``test_head_layouts``."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable

import pytest
import torch
from conftest import collect, decode
from engine_helpers import Gate
from head_models import VOCAB, clock_target, llama_target, unit_embeddings
from tolerance import assert_within, forward_atol, matmul_bound, sum_to_one_atol
from torch.nn import functional as F
from transformers import PreTrainedModel

from localspec.drafters.eagle import EagleDrafter, eagle3_layers
from localspec.drafters.eagle_head import EagleHead, EagleSpec, HeadCache
from localspec.drafters.medusa import MedusaDrafter, MedusaHeads
from localspec.engine.drafter import Drafter, Proposal
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

METHODS = ("eagle", "eagle3", "medusa")
PROMPTS = ([5, 17, 33, 2, 80, 41, 9], [60, 3, 91, 44, 12, 12, 70, 8, 25, 38, 77])
GREEDY = SamplingParams()


def request(prompt: list[int], k: int = 3, max_new_tokens: int = 30,
            sampling: SamplingParams = GREEDY, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                             sampling=sampling, num_speculative_tokens=k, adaptive=False,
                             seed=seed)


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Random weights from an explicit generator; norm weights near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)


def random_head(method: str, model: PreTrainedModel, seed: int = 1) -> EagleHead | MedusaHeads:
    """A random head of ``method`` for ``model``; EAGLE-3's draft vocabulary is 60 random ids."""
    if method == "medusa":
        heads = MedusaHeads(model.config.hidden_size, VOCAB, num_heads=4)
        randomize(heads, seed)
        return heads.eval()
    head = EagleHead(EagleSpec.for_target(model.config, method,
                                          draft_vocab_size=60 if method == "eagle3" else 0))
    randomize(head, seed)
    if head.lm_head is not None:
        with torch.no_grad():
            head.lm_head.weight.mul_(10.0)  # peaked logits: no near-ties between the paths
            ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:60]
            head.d2t.copy_(ids.sort().values - torch.arange(60))
    return head.eval()


def drafter_for(method: str, head: EagleHead | MedusaHeads, runner: ModelRunner) -> Drafter:
    if method == "medusa":
        return MedusaDrafter(head, runner)
    return EagleDrafter(head, runner)


def cpu(model: PreTrainedModel, kind: str = "w8a8") -> ModelRunner:
    taken = copy.deepcopy(model)
    return ModelRunner(taken, decoder=CpuDecoder(taken, kind))


RUNNERS: dict[str, Callable[[PreTrainedModel], ModelRunner]] = {"hf": ModelRunner, "cpu": cpu}


# ----------------------------------------------------------------------------- features


@pytest.mark.parametrize("path", ["hf", "cpu"])
def test_recorded_features_are_the_targets_hidden_states(path: str) -> None:
    """Every fed token's rows are kept (a prefill with logits_to_keep=1 included) and equal
    Hugging Face's hidden_states at the asked layers, through a crop and a re-feed."""
    model = llama_target()
    runner = RUNNERS[path](model) if path == "hf" else cpu(model, "dense")
    layers = (0, 2, 4, 8)  # 8 = the final normed state
    tokens = [5, 17, 33, 2, 80, 41, 9, 60, 3, 91]
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
    runner.record_features(layers)
    runner.forward(tokens[:6], logits_to_keep=1)
    runner.forward([70, 71])  # a rejected draft
    runner.crop(6)
    runner.forward(tokens[6:])
    features = runner.features(0, len(tokens))
    assert features.shape == (len(tokens), 4 * 32)
    reduction = max(model.config.intermediate_size, len(tokens), model.config.hidden_size)
    torch.testing.assert_close(features.float(), expected, rtol=0,
                               atol=forward_atol(expected, reduction))
    with torch.no_grad():  # the LM head on given rows, as an EAGLE head's output is read
        final = features[:, -32:].float()
        assert_within(runner.head_logits(final), model.lm_head(final),
                      matmul_bound(final, model.lm_head.weight))
    with pytest.raises(ValueError, match="no recorded features"):
        runner.features(0, len(tokens) + 2)
    runner.record_features((8,))  # another layer set: earlier rows were not recorded for it
    with pytest.raises(ValueError, match="no recorded features"):
        runner.features(0, 1)
    with pytest.raises(ValueError, match="feature layers must be"):
        runner.record_features((9,))


# ----------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("path", ["hf", "cpu"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_equals_plain_decoding(method: str, path: str) -> None:
    """Random heads on a random target: the output is the plain greedy output. The engines
    share the runner, and plain decoding records no features although the head asked."""
    model = llama_target()
    runner = RUNNERS[path](model)
    plain = SpeculativeEngine(runner, (), decode, set())
    drafted = SpeculativeEngine(runner, (drafter_for(method, random_head(method, model), runner),),
                                decode, set())
    for prompt in PROMPTS:
        reference = collect(plain, request(prompt))[0]
        assert runner.feature_layers is None
        tokens, events = collect(drafted, request(prompt))
        assert tokens == reference
        assert all(len(e.drafted) == e.k > 0 for e in events)  # it drafted at every step


def built_to_be_right(method: str, model: PreTrainedModel) -> EagleHead | MedusaHeads:
    """Heads for ``clock_target`` (x -> x + 1) whose drafts are right, reading features:

    EAGLE: fc passes the embedding of the next token through, the layer adds nothing, and the
    target's LM head reads it: every draft is right. EAGLE-3: fc takes the high layer's feature
    of token i (its embedding), and its own LM head maps embedding x to x + 2: the first draft is
    right only if it read token n-2's features; the next ones repeat it, so are wrong. Medusa:
    head i maps embedding x to x + 2 + i: all right, if it reads token n-2's feature.
    """
    unit = unit_embeddings(model)
    h = model.config.hidden_size
    if method == "medusa":
        heads = MedusaHeads(h, VOCAB, num_heads=4)  # residual blocks start as the identity
        with torch.no_grad():
            for i, lm_head in enumerate(heads.lm_heads):
                lm_head.weight.copy_(20.0 * unit.roll(2 + i, dims=0))
        return heads.eval()
    head = EagleHead(EagleSpec.for_target(model.config, method))
    randomize(head, seed=3)
    with torch.no_grad():
        head.fc.weight.zero_()
        columns = slice(0, h) if method == "eagle" else slice(2 * h, 3 * h)
        head.fc.weight[:, columns] = torch.eye(h)
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
        if head.lm_head is not None:
            head.lm_head.weight.copy_(20.0 * unit.roll(2, dims=0))
            head.norm.weight.fill_(1.0)
    return head.eval()


@pytest.mark.parametrize("path", ["hf", "cpu"])
@pytest.mark.parametrize(("method", "accepted"), [("eagle", 3), ("eagle3", 1), ("medusa", 3)])
def test_heads_built_to_be_right_are_accepted(method: str, accepted: int, path: str) -> None:
    """On the clock target, each step accepts exactly what the construction predicts, and the
    output is still the target's own: x, x + 1, x + 2, ..."""
    model = clock_target()
    runner = RUNNERS[path](model)
    drafter = drafter_for(method, built_to_be_right(method, model), runner)
    prompt = [5, 17, 33, 2, 80, 95, 96]  # ends as the clock runs: 95, 96, 0, 1, ...
    tokens, events = collect(SpeculativeEngine(runner, (drafter,), decode, set()),
                             request(prompt, k=3, max_new_tokens=40))
    assert tokens == [i % VOCAB for i in range(97, 137)]
    assert [e.accepted for e in events] == [accepted] * len(events)


# ----------------------------------------------------------------------------- reference


def reference_proposal(method: str, head: EagleHead | MedusaHeads, model: PreTrainedModel,
                       context: list[int], k: int) -> list[int]:
    """Slow and obvious: a fresh full target pass over context[:-1], the head over every
    position from scratch (its own new cache), then k greedy steps."""
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True)
        final = out.last_hidden_state[0]  # [n - 1, hidden]
        if method == "medusa":
            return [int(head.lm_heads[i](head.blocks[i](final[-1:])).argmax())
                    for i in range(min(k, head.num_heads))]
        layers = eagle3_layers(model.config.num_hidden_layers)
        features = final if method == "eagle" else torch.cat(
            [out.hidden_states[i][0] for i in layers], dim=-1)
        table = model.get_input_embeddings().weight
        cache = HeadCache(head.spec, torch.float32, "cpu")
        for_logits, hidden = head(features, F.embedding(torch.tensor(context[1:]), table), 0,
                                  cache, from_target=True)
        tokens = []
        for j in range(k):
            row = for_logits[-1:]
            logits = model.lm_head(row) if method == "eagle" else head.draft_logits(row, VOCAB)
            tokens.append(int(logits.argmax()))
            for_logits, hidden = head(hidden[-1:], F.embedding(torch.tensor(tokens[-1:]), table),
                                      len(context) - 1 + j, cache, from_target=False)
        return tokens


@pytest.mark.parametrize("method", METHODS)
def test_proposals_equal_a_from_scratch_reference(method: str) -> None:
    """Driven as the engine drives it, but accepting a random number of drafts (none, some,
    all) and skipping the drafter on some steps, every proposal equals the reference's: the
    features of accepted tokens come from the verify pass, stale head positions are dropped."""
    model = llama_target()
    runner = ModelRunner(model)
    head = random_head(method, model)
    drafter = drafter_for(method, head, runner)
    rng = random.Random(7)
    for prompt in PROMPTS:
        runner.reset()
        drafter.reset()
        context = list(prompt)
        runner.forward(context[:-1], logits_to_keep=1)
        seen = {"checked": 0, "skipped": 0, "all kept": 0}
        for _ in range(16):
            k = rng.choice([0, 1, 3, 4])
            drafts = drafter.propose(context, k, GREEDY, torch.Generator()).tokens if k else []
            if k:
                assert drafts == reference_proposal(method, head, model, context, k), context
            runner.forward([context[-1], *drafts])
            kept = rng.randint(0, len(drafts))
            runner.crop(len(context) + kept)
            context += [*drafts[:kept], rng.randrange(VOCAB)]
            seen["checked" if k else "skipped"] += 1
            seen["all kept"] += bool(drafts) and kept == len(drafts)
        assert seen["checked"] >= 8 and seen["skipped"] and seen["all kept"], seen


# ----------------------------------------------------------------------------- sampling


class Recording(Drafter):
    """A drafter wrapper that keeps every proposal."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.traits = inner, inner.traits
        self.proposals: list[Proposal] = []

    def reset(self, keep_cache: bool = False) -> None:
        self.inner.reset()

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator, width: int = 1) -> Proposal:
        proposal = self.inner.propose(context, k, params, generator)
        self.proposals.append(proposal)
        return proposal


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_completes_and_repeats(method: str) -> None:
    """Temperature 1: a run completes, the same seed repeats it token for token, another seed
    differs, and every draft comes with its q row (a distribution, q(token) its confidence;
    EAGLE-3's mass only on its draft vocabulary)."""
    model = llama_target()
    runner = ModelRunner(model)
    head = random_head(method, model)
    recording = Recording(drafter_for(method, head, runner))
    engine = SpeculativeEngine(runner, (recording,), decode, set())
    hot = SamplingParams(temperature=1.0, top_p=0.95)
    first = collect(engine, request(PROMPTS[1], max_new_tokens=40, sampling=hot, seed=11))[0]
    again = collect(engine, request(PROMPTS[1], max_new_tokens=40, sampling=hot, seed=11))[0]
    other = collect(engine, request(PROMPTS[1], max_new_tokens=40, sampling=hot, seed=12))[0]
    assert len(first) == 40 and first == again and first != other
    allowed = (torch.arange(60) + head.d2t).tolist() if method == "eagle3" else range(VOCAB)
    for proposal in recording.proposals:
        assert proposal.q_draft is not None and proposal.q_draft.shape == (len(proposal.tokens),
                                                                           VOCAB)
        torch.testing.assert_close(proposal.q_draft.sum(-1), torch.ones(len(proposal.tokens)),
                                   rtol=0, atol=sum_to_one_atol(VOCAB))
        for row, token, confidence in zip(proposal.q_draft, proposal.tokens,
                                          proposal.confidences, strict=True):
            assert token in allowed and float(row[token]) == pytest.approx(confidence)
        if method == "eagle3":
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[list(allowed)] = False
            assert float(proposal.q_draft[:, outside].sum()) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_a_head_skipped_by_another_drafter_catches_up(method: str) -> None:
    """In a set of drafters behind one that drafts blocks of 6 tokens, the head is skipped
    for several steps at a time: each time it is asked again its proposal equals the
    from-scratch reference (features of tokens it did not draft come from the verify passes),
    and the output is plain decoding's."""
    model = llama_target()
    prompt = PROMPTS[1]
    plain = collect(SpeculativeEngine(ModelRunner(model), (), decode, set()),
                    request(prompt, max_new_tokens=40))[0]
    runner = ModelRunner(model)
    head = random_head(method, model)
    asked: list[int] = []

    class Checked(Recording):
        def propose(self, context: list[int], k: int, params: SamplingParams,
                    generator: torch.Generator, width: int = 1) -> Proposal:
            proposal = super().propose(context, k, params, generator, width)
            assert proposal.tokens == reference_proposal(method, head, model, context, k)
            asked.append(len(context))
            return proposal

    drafters = (Gate(plain, len(prompt)), Checked(drafter_for(method, head, runner)))
    tokens, events = collect(SpeculativeEngine(runner, drafters, decode, set()),
                             request(prompt, max_new_tokens=40))
    assert tokens == plain
    assert {e.drafter for e in events if e.drafted} == {"gate", method}
    assert max(b - a for a, b in itertools.pairwise(asked)) > 4
