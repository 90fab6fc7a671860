"""Each architecture the CPU forward serves (Llama, Qwen2, Qwen3) against transformers' own
forward of the same weights, on tiny random models built from a config: the dense kind up to
float32 rounding, the int8 kind ("w8a8") and the native Q4_K stack ("w4a8", every layer in one
``decoder_forward`` call) up to what quantizing the activations can move, and greedy
generation token for token. An architecture it does not serve (Phi-3, Gemma) is refused by
name and served through transformers.

Qwen3 is the case that needs care: an RMSNorm of every query and key head (``q_norm``,
``k_norm``) after the projections and before RoPE, no q/k/v biases, and a head_dim that is
not hidden / heads (here 32 x 4 heads = 128 query values over a hidden size of 64). Every
norm weight is random, so a norm dropped, swapped or applied over the wrong axis shows.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_TEXTS, TOKENIZER_VOCAB, train_tokenizer
from tolerance import forward_atol
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from localspec.config import ModelSpec
from localspec.errors import ModelLoadError
from localspec.models.loading import load_model
from localspec.runtime.decoder import CpuDecoder, unsupported_reason
from localspec.runtime.kernels import Q4KWeights, quantize_q4k
from localspec.runtime.runner import ModelRunner
from localspec.runtime.weight_formats import export_weights

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
CONFIGS: dict[str, PretrainedConfig] = {
    # head_dim 32 = hidden / heads; one key-value head for two query heads
    "llama": LlamaConfig(**SHAPE, num_attention_heads=2, num_key_value_heads=1),
    "qwen2": Qwen2Config(**SHAPE, num_attention_heads=2, num_key_value_heads=1),
    # head_dim 32 != hidden / heads (16): q is 128 wide over a hidden size of 64
    "qwen3": Qwen3Config(**SHAPE, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
PROMPT_LENGTH, GREEDY_TOKENS, PROMPTS = 24, 20, 4


def tiny_model(architecture: str, seed: int = 0) -> PreTrainedModel:
    """A random float32 model of ``architecture``: every norm weight random in [0.5, 1.5]
    (transformers starts them at one, where a missing or swapped norm cannot show), Qwen2's
    q/k/v biases random, the LM head scaled up so that the logits are peaked (stable greedy
    argmaxes)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[architecture]),
                                             dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
        model.lm_head.weight.mul_(4.0)
    return model


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model: PreTrainedModel, prompt: list[int], count: int) -> list[int]:
    """Greedy continuation by transformers' own forward over the whole sequence each step."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def served(model: PreTrainedModel, kind: str, kernels: object | None = None,
           q4k: dict[str, Q4KWeights] | None = None,
           dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A runner over a CpuDecoder of a copy of ``model`` (the decoder empties what it takes)."""
    taken = copy.deepcopy(model).to(dtype)
    decoder = CpuDecoder(taken, kind, export_weights(taken, kind, q4k), kernels)
    return ModelRunner(taken, decoder=decoder)


def served_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of ``ids`` fed as one pass of PROMPT_LENGTH rows, then one token at a time (the
    two ways a verify pass and a decode step call the forward)."""
    runner.reset()
    return torch.cat([runner.forward(ids[:PROMPT_LENGTH])] +
                     [runner.forward([t]) for t in ids[PROMPT_LENGTH:]])


def served_greedy(runner: ModelRunner, prompt: list[int], count: int) -> list[int]:
    """Greedy continuation of ``prompt`` by the runner, one-token steps."""
    runner.reset()
    last = runner.forward(prompt)[-1]
    out: list[int] = []
    for _ in range(count):
        out.append(int(last.argmax()))
        last = runner.forward([out[-1]])[-1]
    return out


def greedy_agreement(runner: ModelRunner, model: PreTrainedModel) -> float:
    """The share of transformers' greedy tokens (GREEDY_TOKENS after each of PROMPTS prompts)
    that the runner's forward picks too, given the same text before each."""
    matched = 0
    for seed in range(PROMPTS):
        prompt = tokens(8, seed=100 + seed)
        expected = hf_greedy(model, prompt, GREEDY_TOKENS)
        runner.reset()
        picked = runner.forward(prompt + expected)[len(prompt) - 1:-1].argmax(-1)
        matched += int((picked == torch.tensor(expected)).sum())
    return matched / (PROMPTS * GREEDY_TOKENS)


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).norm() / reference.norm())


pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_dense_forward_is_transformers_forward(architecture: str) -> None:
    """The dense CPU forward computes transformers' function: logits within float32 rounding
    (``forward_atol``; the longest sum is the MLP width), and greedy decoding gives the same
    tokens (all of them: no winner is that close)."""
    model = tiny_model(architecture)
    assert unsupported_reason(model) is None
    ids = tokens(40, seed=1)
    reference = hf_logits(model, ids)
    runner = served(model, "dense")
    logits = served_logits(runner, ids)
    atol = forward_atol(reference, max(model.config.intermediate_size, len(ids)))
    torch.testing.assert_close(logits, reference, rtol=0, atol=atol)
    for seed in range(PROMPTS):
        prompt = tokens(8, seed=100 + seed)
        expected = hf_greedy(model, prompt, GREEDY_TOKENS)
        assert served_greedy(runner, prompt, GREEDY_TOKENS) == expected, seed
        assert len(set(expected)) > 3  # not one token repeated: the comparison says something


# The quantized kinds are another function than transformers' float forward, so no float
# tolerance applies: int8 activations move every input of a product by up to half a step
# (1/254 of its row's, or its 32-group's, largest value), w8a8's int8 weights and its int8
# LM head (w4a8's too: a head is kept natively only in Q6_K) every weight likewise, and the
# bf16 KV cache every key and value by up to 2^-9 relatively. Through two layers of these
# tiny random models' peaked attention that is 1.4-3.2% of the logits' norm (measured), so
# LIMIT is 5%; the negative control checks that an error in what the architectures differ in
# (q/k norms, biases, the attention norm) moves the logits by well over it. Such noise also
# flips greedy tokens at near-ties (a random model's top two logits are often within 2% of
# each other), and a flipped token changes the rest of the text: transformers' greedy tokens
# are checked one by one on its own text instead (measured 95-100% picked, asserted 90%).
LIMIT = 0.05


def _negative_control(model: PreTrainedModel, ids: list[int], reference: torch.Tensor) -> None:
    """Qwen3's q/k norms (Qwen2's biases, Llama's attention norm) re-drawn: far over LIMIT."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if any(part in name for part in ("q_norm", "k_norm", "bias", "input_layernorm")):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    assert relative_error(hf_logits(other, ids), reference) > 3 * LIMIT


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_w8a8_follows_transformers(architecture: str) -> None:
    """The int8 forward (torch's int8 products, SDPA) of each architecture follows
    transformers' float forward: relative logit error under LIMIT, transformers' greedy
    tokens picked (see LIMIT)."""
    model = tiny_model(architecture)
    ids = tokens(40, seed=3)
    reference = hf_logits(model, ids)
    runner = served(model, "w8a8")
    logits = served_logits(runner, ids)
    assert relative_error(logits, reference) < LIMIT
    _negative_control(model, ids, reference)
    assert greedy_agreement(runner, model) >= 0.9


def _q4k_exact(model: PreTrainedModel) -> dict[str, Q4KWeights]:
    """Make every layer matrix exactly Q4_K (as a GGUF's are) and every other weight exactly
    bf16 (what the native stack keeps in bf16: the embedding; norms are read from it too):
    the served model and the float32 reference then hold the same numbers."""
    found = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
                found[name] = quantize_q4k(module.weight)
                module.weight.copy_(found[name].dequantize())
        for name, param in model.named_parameters():
            if name.removesuffix(".weight") not in found:
                param.copy_(param.to(torch.bfloat16).float())
    return found


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_w4a8_native_stack_follows_transformers(architecture: str, kernels: object) -> None:
    """The native stack (Q4_K products, the C norms, RoPE and attention over a bf16 cache)
    runs every layer of each architecture and follows transformers' float32 forward of the
    same Q4_K weights: relative logit error under LIMIT, transformers' greedy tokens picked
    (see LIMIT). A pass of many rows gives the bits of one-token steps (what keeps
    speculation lossless)."""
    model = tiny_model(architecture)
    q4k = _q4k_exact(model)
    runner = served(model, "w4a8", kernels, q4k, dtype=torch.bfloat16)
    assert runner.decoder.native is not None  # every layer Q4_K, all in one native call
    ids = tokens(40, seed=5)
    reference = hf_logits(model, ids)
    logits = served_logits(runner, ids)
    runner.reset()
    assert torch.equal(torch.cat([runner.forward([t]) for t in ids]), logits)
    assert relative_error(logits, reference) < LIMIT
    _negative_control(model, ids, reference)
    assert greedy_agreement(runner, model) >= 0.9


def _phi3() -> PreTrainedModel:
    config = Phi3Config(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_other_architectures_are_refused_by_name() -> None:
    """Phi-3 and Gemma are not the CPU forward's: the reason names the architecture and the
    served ones, and CpuDecoder refuses before it empties the model."""
    gemma = AutoModelForCausalLM.from_config(GemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32), dtype=torch.float32)
    for model, name in ((_phi3(), "phi3"), (gemma, "gemma")):
        reason = unsupported_reason(model) or ""
        assert f"'{name}'" in reason and "qwen3" in reason, reason
        with pytest.raises(ValueError, match=name):
            CpuDecoder(model, "w4a8")
        assert model.model.layers[0].mlp.down_proj.weight.numel() > 0


def test_other_architectures_are_served_by_transformers(tmp_path: Path) -> None:
    """A saved Phi-3 asked for "w4a8" fails with a ModelLoadError naming it (no traceback);
    without a CPU quantization it loads and its runner computes transformers' logits."""
    train_tokenizer(TOKENIZER_TEXTS).save_pretrained(tmp_path)
    model = _phi3()
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="phi3"):
        load_model(ModelSpec(str(tmp_path), dtype="float32", device="cpu", quantization="w4a8"))
    loaded = load_model(ModelSpec(str(tmp_path), dtype="float32", device="cpu"))
    assert loaded.decoder is None
    ids = tokens(20, seed=7)
    ids = [i % TOKENIZER_VOCAB for i in ids]
    reference = hf_logits(model, ids)
    torch.testing.assert_close(loaded.runner().forward(ids), reference, rtol=0,
                               atol=forward_atol(reference, 128))
