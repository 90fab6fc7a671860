"""On a CUDA GPU: the engine runs every draw on the model's device (a CPU generator cannot
drive CUDA multinomials) and stays lossless. Skipped where PyTorch sees no GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import collect, decode, make_tiny_model, perturbed_copy

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]
PROMPT = [5, 17, 33, 2, 80, 41, 9]


def engines(dtype: torch.dtype) -> tuple[SpeculativeEngine, SpeculativeEngine]:
    target = make_tiny_model(seed=0).to("cuda", dtype)
    draft = perturbed_copy(make_tiny_model(seed=0), seed=2, noise=0.5).to("cuda", dtype)
    vocab = target.config.vocab_size
    drafter = DraftModelDrafter(ModelRunner(draft), target_vocab_size=vocab,
                                tokenizer_vocab_size=vocab)
    # bf16: float32-exact top logits, as the presets run it, so near-ties cannot flip argmaxes
    return (SpeculativeEngine(ModelRunner(target, logits_fp32=True), (), decode, set()),
            SpeculativeEngine(ModelRunner(target, logits_fp32=True), (drafter,), decode, set()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equal_on_cuda(dtype: torch.dtype) -> None:
    plain, spec = engines(dtype)
    request = GenerationRequest(PROMPT, max_new_tokens=40, num_speculative_tokens=4,
                                adaptive=False)
    assert collect(spec, request)[0] == collect(plain, request)[0]


def test_sampling_on_cuda_is_seeded() -> None:
    _, spec = engines(torch.float32)
    request = GenerationRequest(PROMPT, max_new_tokens=30, num_speculative_tokens=4,
                                sampling=SamplingParams(temperature=1.0), seed=7)
    first, events = collect(spec, request)
    assert len(first) == 30 and any(e.drafted for e in events)
    assert collect(spec, request)[0] == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_are_lossless(dtype: torch.dtype) -> None:
    """Target and draft on static caches with their forwards replayed as CUDA graphs: the
    speculative output equals plain decoding's on the usual cache, and sampling is seeded."""
    target = make_tiny_model(seed=0).to("cuda", dtype)
    draft = perturbed_copy(make_tiny_model(seed=0), seed=2, noise=0.5).to("cuda", dtype)
    vocab = target.config.vocab_size

    def graphed(model: torch.nn.Module, **options: object) -> ModelRunner:
        return ModelRunner(model, static_cache=256, cuda_graphs=True, **options)

    drafter = DraftModelDrafter(graphed(draft), target_vocab_size=vocab,
                                tokenizer_vocab_size=vocab)
    spec = SpeculativeEngine(graphed(target, logits_fp32=True), (drafter,), decode, set())
    plain = SpeculativeEngine(ModelRunner(target, logits_fp32=True), (), decode, set())
    for adaptive in (False, True):
        request = GenerationRequest(PROMPT, max_new_tokens=60, num_speculative_tokens=5,
                                    adaptive=adaptive)
        assert collect(spec, request)[0] == collect(plain, request)[0]
    sampled = GenerationRequest(PROMPT, max_new_tokens=30, num_speculative_tokens=4,
                                sampling=SamplingParams(temperature=1.0), seed=7)
    assert collect(spec, sampled)[0] == collect(spec, sampled)[0]
