"""The w4a8 CPU forward on tiny random models: Q4_K matrices through the native kernel keep a
verify pass bit-identical to one-token steps (what keeps speculation lossless), "w4a8" takes a
GGUF's Q4_K numbers only where they are exactly the model's weights, "requant-q4k" quantizes
every matrix (and "requant-q3m" to 3 bits), and ``load_model`` stores, reloads and falls back
to w8a8 with a reason."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, collect, decode, make_tiny_model, perturbed_copy, tiny_config
from kernel_helpers import assert_matches_reference
from kernel_helpers import reference as kernel_product
from transformers import AutoModelForCausalLM, PreTrainedModel

from localspec.config import ModelSpec
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.models import packed_store
from localspec.models.loading import load_model
from localspec.runtime import weight_formats
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.gguf_kquants import hf_module_name, read_kquant_matrices
from localspec.runtime.kernels import (
    KernelUnavailable,
    KQuantWeights,
    Q4KWeights,
    quantize_q4_0,
    quantize_q4k,
    quantize_q6k,
)
from localspec.runtime.quant import Q3MLinear, Q4KLinear, Q6KLinear, W8A8Linear
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import ConcatLinear, cut_linear, export_weights
from localspec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("own_cache")


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model: PreTrainedModel, kind: str, kernels: object,
            q4k: dict[str, KQuantWeights] | None = None,
            dtype: torch.dtype = torch.float32) -> ModelRunner:
    taken = copy.deepcopy(model).to(dtype)
    return ModelRunner(taken, decoder=CpuDecoder(taken, kind, export_weights(taken, kind, q4k),
                                                  kernels))


def _as_q4k(model: PreTrainedModel, names: tuple[str, ...]) -> dict[str, Q4KWeights]:
    """Make the named modules' weights exactly Q4_K (as a GGUF's are) and return them by name."""
    found = {}
    with torch.no_grad():
        for name in names:
            module = model.get_submodule(name)
            found[name] = quantize_q4k(module.weight)
            module.weight.copy_(found[name].dequantize())
    return found


REQUANT = {"requant-q4k": Q4KLinear, "requant-q3m": Q3MLinear}


@pytest.mark.parametrize("kind", REQUANT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_w4a8_batch_equals_one_token_steps(kernels: object, dtype: torch.dtype, kind: str) -> None:
    """After any prefix, a pass over n tokens gives bit for bit the logits of n one-token
    steps, also after cropping back: the w4a8 model is a fixed function of each position."""
    runner = _runner(make_tiny_model(seed=0), kind, kernels, dtype=dtype)
    assert all(type(layer.gate_up) is REQUANT[kind] for layer in runner.decoder.layers)
    tokens = _tokens(50, seed=3)
    steps = torch.cat([runner.forward([t]) for t in tokens])
    assert torch.isfinite(steps).all()
    for prefix in (1, 17):
        runner.reset()
        assert torch.equal(runner.forward(tokens[:prefix]), steps[:prefix])
        for n in (2, 5, 9, 13):
            runner.crop(prefix)
            assert torch.equal(runner.forward(tokens[prefix:prefix + n]),
                               steps[prefix:prefix + n]), (prefix, n)


def test_w4a8_native_stack_keeps_passes_equal_to_steps(kernels: object) -> None:
    """With a bf16 cache and head_dim 32 (the tiny model above has 8) every layer runs in one
    native call: a pass still equals one-token steps bit for bit, EAGLE features included,
    and the logits are those of the tensor-call loop (with the attention kernel, or SDPA)
    within float error. A prompt longer than ROW_ATTENTION_MAX runs in pieces of the native
    stack, so it too equals the steps bit for bit; the loop runs it as one masked SDPA call."""
    config = tiny_config()
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 128, 128, 4
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    runner = _runner(model, "requant-q4k", kernels, dtype=torch.bfloat16)
    decoder = runner.decoder
    assert decoder.native is not None and decoder.row_attention is not None
    tokens = _tokens(150, seed=4)
    runner.record_features((0, 1, 2))
    steps = torch.cat([runner.forward([t]) for t in tokens[:40]])
    features = runner.features(0, 40).clone()
    for prefix in (1, 17):
        for n in (2, 9, 16):
            runner.crop(prefix)
            assert torch.equal(runner.forward(tokens[prefix:prefix + n]),
                               steps[prefix:prefix + n]), (prefix, n)
            assert torch.equal(runner.features(prefix, prefix + n),
                               features[prefix:prefix + n]), (prefix, n)
    runner.reset()
    long_prompt = runner.forward(tokens)  # 150 rows: native pieces of 128 and 22
    assert torch.equal(long_prompt[:40], steps)
    assert torch.equal(runner.features(0, 40), features)
    assert runner.features(0, 150).shape[0] == 150
    tolerance = 0.03 * steps.abs().max().item()
    decoder.native = None
    runner.reset()
    masked = runner.forward(tokens)  # the loop: one masked SDPA call a layer
    assert torch.allclose(masked[:40], steps, atol=tolerance)
    for attention in (decoder.row_attention, None):
        decoder.row_attention = attention
        runner.reset()
        loop = torch.cat([runner.forward([t]) for t in tokens[:40]])
        assert torch.allclose(loop, steps, atol=tolerance)
        assert torch.allclose(runner.features(0, 40), features, atol=0.03 * features.abs().max())
        assert (loop.argmax(-1) == steps.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("kind", REQUANT)
def test_w4a8_requant_follows_the_float_model(kernels: object, kind: str) -> None:
    """4- or 3-bit weights are coarser than int8 but must still be the same model (a packing
    or scale error would be far off): relative logit error and argmax agreement."""
    model = make_tiny_model(seed=1)
    tokens = _tokens(60, seed=1)
    reference = ModelRunner(model).forward(tokens)
    logits = _runner(model, kind, kernels).forward(tokens)
    relative = float((logits - reference).norm() / reference.norm())
    assert relative < 0.15, relative
    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    assert agreement >= 0.75, agreement


def test_w4a8_takes_q4k_only_where_it_is_the_models_weight(kernels: object) -> None:
    """Exact Q4_K matrices run in the kernel; a mapped matrix that differs from the loaded
    weight (another layout, another model) is served as w8a8 from the model's own weights, and
    a fused layer mixes the two in order."""
    model = make_tiny_model(seed=2)
    exact = _as_q4k(model, ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                            "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                            "model.layers.0.mlp.down_proj"))
    wrong = quantize_q4k(torch.randn(64, 32))  # gate_proj's shape, other numbers
    mapping = {**exact, "model.layers.1.mlp.gate_proj": wrong}
    reference = ModelRunner(model).forward(_tokens(30, seed=5))
    runner = _runner(model, "w4a8", kernels, mapping)
    first, second = runner.decoder.layers
    assert isinstance(first.qkv, ConcatLinear)
    assert [type(p) for p in first.qkv.parts] == [Q4KLinear, W8A8Linear]  # q+k, then v
    assert isinstance(first.gate_up, Q4KLinear) and isinstance(first.down, Q4KLinear)
    assert not first.down_rotated and second.down_rotated  # only an int8 down is rotated
    assert isinstance(second.gate_up, W8A8Linear)  # the wrong numbers were not taken
    logits = runner.forward(_tokens(30, seed=5))
    assert float((logits - reference).norm() / reference.norm()) < 0.05


def test_w4a8_serves_q6k_matrices_in_their_own_kernel(kernels: object,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF's Q6_K matrices (here v, down and the LM head, 256 inputs wide) run exactly in
    the Q6_K kernel beside Q4_K ones, unrotated; the model stays a fixed function of each
    position (a pass over n tokens is bit for bit n one-token steps) and close to float. The
    head's rows (a trained head's start) come from its numbers, and a cut of them (a draft's)
    is their Q4_0 in the native kernel (``cut_linear``), padded to whole 16-row blocks."""
    vocab = 112
    config = tiny_config(vocab)
    config.hidden_size = config.intermediate_size = 256
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kinds = {"self_attn.q_proj": quantize_q4k, "self_attn.k_proj": quantize_q4k,
             "self_attn.v_proj": quantize_q6k, "mlp.down_proj": quantize_q6k}
    mapping: dict[str, KQuantWeights] = {}
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        names = {f"model.layers.{i}.{name}": quantize for i in range(2)
                 for name, quantize in kinds.items()}
        for name, quantize in {**names, "lm_head": quantize_q6k}.items():
            module = model.get_submodule(name)
            mapping[name] = quantize(module.weight)
            module.weight.copy_(mapping[name].dequantize())
    tokens = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    reference = ModelRunner(model).forward(tokens)
    runner = _runner(model, "w4a8", kernels, mapping)
    for layer in runner.decoder.layers:
        assert type(layer.down) is Q6KLinear and not layer.down_rotated
        assert [type(p) for p in layer.qkv.parts] == [Q4KLinear, Q6KLinear]
    head = runner.decoder.head
    assert head.linear == "q6k" and type(head.part(None)) is Q6KLinear
    steps = torch.cat([runner.forward([t]) for t in tokens])
    runner.reset()
    assert torch.equal(runner.forward(tokens[:10]), steps[:10])
    assert torch.equal(runner.forward(tokens[10:]), steps[10:])
    assert float((steps - reference).norm() / reference.norm()) < 0.05
    rows = torch.tensor([0, 7, 50, vocab - 1])
    assert torch.equal(head.rows(rows), mapping["lm_head"].dequantize()[rows])
    hidden = torch.randn(3, 256)
    cut = head.logits(hidden, rows)
    as_q4_0 = quantize_q4_0(head.rows(rows))
    assert_matches_reference(cut[:, rows], kernel_product(hidden, as_q4_0, None))
    assert int(torch.isinf(cut).sum()) == 3 * (vocab - len(rows))
    assert type(cut_linear(lambda ids: torch.randn(len(ids), 48), torch.arange(5), kernels)
                ) is W8A8Linear  # no whole 32-groups
    many = torch.arange(0, vocab, 4)  # quantized CUT_CHUNK rows at a time: the same product
    whole = cut_linear(head.rows, many, kernels)(hidden)
    monkeypatch.setattr(weight_formats, "CUT_CHUNK", 16)
    assert torch.equal(cut_linear(head.rows, many, kernels)(hidden), whole)


def test_w4a8_greedy_speculation_equals_plain(kernels: object) -> None:
    """Greedy speculation with a w4a8 target and a 4-bit draft emits exactly plain w4a8
    greedy decoding's tokens, with drafts both accepted and rejected."""
    target_model = make_tiny_model(seed=0)
    target = _runner(target_model, "requant-q4k", kernels)
    draft = _runner(perturbed_copy(target_model, seed=9, noise=0.05), "requant-q4k", kernels)
    accepted = rejected = 0
    for prompt in ([5, 9, 2, 44], [60, 3, 17, 17, 8]):
        def make(prompt: list[int] = prompt) -> GenerationRequest:
            return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=30,
                                     sampling=SamplingParams(), num_speculative_tokens=5,
                                     adaptive=False)

        plain, _ = collect(SpeculativeEngine(target, (), decode, set()), make())
        drafter = DraftModelDrafter(draft, target_vocab_size=VOCAB, tokenizer_vocab_size=VOCAB)
        tokens, events = collect(SpeculativeEngine(target, (drafter,), decode, set()), make())
        assert tokens == plain
        accepted += sum(e.accepted for e in events)
        rejected += sum(len(e.drafted) - e.accepted for e in events)
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_load_w4a8_requant_stores_and_reloads(saved_model_dir: Path,
                                               session_kernels: Path) -> None:
    """load_model(..., "requant-q4k") serves Q4_K layers, stores them, and a second load
    reads the store (same logits, bit for bit)."""
    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="requant-q4k")
    first = load_model(spec)
    assert isinstance(first.decoder.layers[0].gate_up, Q4KLinear)
    ids = list(range(3, 30))
    logits = first.runner().forward(ids)
    assert torch.isfinite(logits).all()
    again = load_model(spec)
    assert torch.equal(again.runner().forward(ids), logits)


def _served_as(folder: Path, quantization: str) -> tuple[type, list[str]]:
    """The class of the first gate/up layer load_model gives, and the progress messages."""
    messages: list[str] = []
    loaded = load_model(ModelSpec(str(folder), dtype="bfloat16", quantization=quantization),
                        progress=lambda message, _: messages.append(message))
    return type(loaded.decoder.layers[0].gate_up), messages


def test_w4a8_falls_back_to_w8a8_with_a_reason(saved_model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """"w4a8" of a model that is not a GGUF, or on a machine without the kernel, is served as
    w8a8, and says why (the model still loads and answers)."""
    kind, messages = _served_as(saved_model_dir, "w4a8")
    assert kind is W8A8Linear and any("not a GGUF model" in m for m in messages)

    def unavailable(_: Path) -> object:
        raise KernelUnavailable("this CPU lacks avx512_vnni")

    monkeypatch.setattr(packed_store, "serving_kernels", unavailable)
    kind, messages = _served_as(saved_model_dir, "requant-q4k")
    assert kind is W8A8Linear and any("lacks avx512_vnni" in m for m in messages)


def test_gguf_names_and_unreadable_files(tmp_path: Path) -> None:
    """GGUF tensor names map to the modules they are; a damaged file gives no Q4_K matrices
    (the model is then served as w8a8), never a traceback."""
    assert hf_module_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj"
    assert hf_module_name("blk.0.attn_v.weight") == "model.layers.0.self_attn.v_proj"
    assert hf_module_name("output.weight") == "lm_head"
    assert hf_module_name("blk.0.attn_norm.weight") is None
    assert hf_module_name("token_embd.weight") is None
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert len(read_kquant_matrices(garbage)) == 0
