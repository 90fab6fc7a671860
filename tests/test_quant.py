"""Int8 weight-only linear layers and the draft's frequent-token head."""

from __future__ import annotations

import copy
import math
from typing import ClassVar

import pytest
import torch
from conftest import VOCAB, make_tiny_model
from tolerance import assert_within, matmul_bound
from torch import nn
from torch.nn import functional as F

from localspec.drafters.draft_model import frequent_token_rows
from localspec.runtime.quant import Int8WeightOnlyLinear, quantize_int8_weight_only
from localspec.runtime.runner import ModelRunner


def _random_linear(dtype: torch.dtype, generator: torch.Generator) -> nn.Linear:
    """A 256 -> 96 layer whose rows have very different ranges (so per-row scales matter)."""
    linear = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=generator)
                            * torch.rand(96, 1, generator=generator))
        linear.bias.copy_(torch.randn(96, generator=generator))
    return linear.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_f_linear_within_the_quantization_step(dtype: torch.dtype) -> None:
    """Against F.linear with the float weights, with bounds derived from the int8 step.

    Row i's step is s_i = max|W_i| / 127; rounding moves each weight by at most s_i / 2, plus
    max|W_i| * u when the scale itself is stored in a dtype of unit roundoff u. So output i
    moves by at most ||x||_1 times that, plus a few roundings of the output in the dtype. In
    float32 the error also has the size rounding predicts: s_i / sqrt(12) * ||x||_2 (RMS)."""
    generator = torch.Generator().manual_seed(0)
    linear = _random_linear(dtype, generator)
    layer = Int8WeightOnlyLinear(linear)
    weight, bias = linear.weight.detach().float(), linear.bias.detach().float()
    step = weight.abs().amax(dim=1) / 127  # [out]
    unit = torch.finfo(dtype).eps / 2
    assert (layer.weight_int8.abs().amax(dim=1) == 127).all()  # each row uses the full range
    torch.testing.assert_close(layer.scale.float(), step, rtol=2 * unit, atol=0.0)
    weight_bound = step / 2 + weight.abs().amax(dim=1) * unit  # [out]
    dequantized = layer.weight_int8.float() * layer.scale.float()[:, None]
    assert ((dequantized - weight).abs() <= weight_bound[:, None] * (1 + 1e-6)).all()

    x = torch.randn(4, 7, 256, generator=generator).to(dtype)  # [batch, seq, in]
    xf = x.float()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (4, 7, 96)
    error = (out.float() - F.linear(xf, weight, bias)).abs()  # [batch, seq, out]
    bound = (xf.abs().sum(-1, keepdim=True) * weight_bound
             + 3 * unit * (xf.abs() @ weight.abs().T + bias.abs()))
    assert (error <= bound).all(), float((error / bound).max())
    if dtype == torch.float32:
        predicted = step / math.sqrt(12) * xf.norm(dim=-1, keepdim=True)
        rms_ratio = float((error / predicted).pow(2).mean().sqrt())
        assert 0.8 < rms_ratio < 1.2, rms_ratio


def test_int8_model_logits_follow_the_float_model() -> None:
    """The int8 weight-only copy of a tiny model with peaked logits (LM head in float, as
    LocalSpec quantizes drafts) gives nearly the float model's logits and the same argmax.
    The q/k/v biases are made non-zero first (Qwen2 initialises them to zero), so a layer
    that dropped its bias would show."""
    model = make_tiny_model(seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator))
    quantized = copy.deepcopy(model)
    count = quantize_int8_weight_only(quantized, skip=("lm_head",))
    assert count == sum(1 for n, m in model.named_modules()
                        if isinstance(m, nn.Linear) and n != "lm_head")
    assert isinstance(quantized.lm_head, nn.Linear)
    assert isinstance(quantized.model.layers[0].mlp.down_proj, Int8WeightOnlyLinear)
    tokens = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = ModelRunner(model).forward(tokens)  # [64, vocab]
    logits = ModelRunner(quantized).forward(tokens)
    assert logits.shape == reference.shape
    relative = float((logits - reference).norm() / reference.norm())
    assert relative < 0.02, relative  # measured 0.004
    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    assert agreement >= 0.95, agreement  # measured 1.0


def test_quantize_replaces_linears_but_skipped_names(target_model) -> None:
    """bf16 model: every linear but the skipped LM head is replaced, and the runner still
    gives the bf16 model's logits up to the int8 error."""
    model = type(target_model)(target_model.config).to(torch.bfloat16).eval()
    model.load_state_dict(target_model.state_dict())
    reference = ModelRunner(model).forward([1, 2, 3])
    count = quantize_int8_weight_only(model, skip=("lm_head",))
    assert count == sum(1 for n, m in target_model.named_modules()
                        if isinstance(m, nn.Linear) and n != "lm_head")
    assert isinstance(model.lm_head, nn.Linear)
    logits = ModelRunner(model).forward([1, 2, 3])
    assert logits.shape == (3, model.config.vocab_size)
    assert float((logits - reference).norm() / reference.norm()) < 0.05


def test_frequent_token_rows_keep_first_ids_and_specials() -> None:
    class Tok:
        added_tokens_decoder: ClassVar[dict[int, str]] = {95: "<eos>", 96: "<pad>", 500: "<x>"}

    rows = frequent_token_rows(Tok(), 10, 97)
    assert rows.tolist() == [*range(10), 95, 96]
    assert frequent_token_rows(Tok(), 0, 97) is None
    assert frequent_token_rows(Tok(), 97, 97) is None


def test_runner_with_vocab_rows_masks_other_tokens(target_model) -> None:
    """The cut head's logits are the full head's at its rows (up to the rounding of a dot
    product of the hidden size: a matrix of other rows is summed in other blocks), -inf
    elsewhere."""
    rows = torch.tensor([0, 3, 5, 7])
    full = ModelRunner(target_model).forward([1, 2, 3])
    runner = ModelRunner(target_model, vocab_rows=rows)
    cut = runner.forward([1, 2, 3])
    assert_within(cut[:, rows], full[:, rows],
                  matmul_bound(runner.last_hidden, target_model.lm_head.weight[rows]))
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[rows] = False
    assert torch.isinf(cut[:, others]).all()


def test_quantize_per_channel_in_row_chunks_is_bit_for_bit_the_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows go QUANTIZE_ROWS at a time (a head's float32 copies are never whole): each row's
    int8 values and scale are those of the whole matrix quantized at once."""
    from localspec.runtime import quant

    weight = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    whole = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    monkeypatch.setattr(quant, "QUANTIZE_ROWS", 5)
    q, s = quant.quantize_per_channel(weight)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, whole) and torch.equal(s, scale)
