"""Int8 weight-only linear layers and the draft's frequent-token head."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from localspec.drafters.draft_model import frequent_token_rows
from localspec.runtime.quant import Int8WeightOnlyLinear, quantize_int8_weight_only
from localspec.runtime.runner import ModelRunner


def test_int8_linear_matches_float_within_quantization_error() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    ref = linear(x).float()
    out = Int8WeightOnlyLinear(linear)(x).float()
    assert out.shape == ref.shape
    # one int8 step is 1/127 of the row's largest weight: the error stays about that size
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_quantize_replaces_linears_but_skipped_names(target_model) -> None:
    model = type(target_model)(target_model.config).to(torch.bfloat16).eval()
    model.load_state_dict(target_model.state_dict())
    count = quantize_int8_weight_only(model, skip=("lm_head",))
    assert count == sum(1 for n, m in target_model.named_modules()
                        if isinstance(m, nn.Linear) and n != "lm_head")
    assert isinstance(model.lm_head, nn.Linear)
    runner = ModelRunner(model)
    logits = runner.forward([1, 2, 3])
    assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_frequent_token_rows_keep_first_ids_and_specials() -> None:
    class Tok:
        added_tokens_decoder: ClassVar[dict[int, str]] = {95: "<eos>", 96: "<pad>", 500: "<x>"}

    rows = frequent_token_rows(Tok(), 10, 97)
    assert rows.tolist() == [*range(10), 95, 96]
    assert frequent_token_rows(Tok(), 0, 97) is None
    assert frequent_token_rows(Tok(), 97, 97) is None


def test_runner_with_vocab_rows_masks_other_tokens(target_model) -> None:
    rows = torch.tensor([0, 3, 5, 7])
    full = ModelRunner(target_model).forward([1, 2, 3])
    cut = ModelRunner(target_model, vocab_rows=rows).forward([1, 2, 3])
    assert torch.allclose(cut[:, rows], full[:, rows], atol=1e-5)
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[rows] = False
    assert torch.isinf(cut[:, others]).all()
