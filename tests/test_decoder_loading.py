"""Which models the CPU forward takes (Llama-family with SiLU and full attention; anything else
refused with the reason), and what ``load_model`` does with "w8a8": a clear error for an
unsupported architecture, a ``CpuDecoder`` for a supported one, its int8 weights stored once,
reused, rebuilt when damaged, older formats replaced; a draft shares the target's tokenizer
only when its files are the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    MAX_POSITIONS,
    TOKENIZER_TEXTS,
    TOKENIZER_VOCAB,
    VOCAB,
    make_tiny_model,
    train_tokenizer,
)
from decoder_helpers import _tiny_llama
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedModel, Qwen2Config

from localspec.config import ModelSpec
from localspec.errors import ModelLoadError
from localspec.models.loading import load_model
from localspec.runtime.decoder import CpuDecoder, unsupported_reason
from localspec.runtime.runner import ModelRunner

# load_model stores w8a8 weights under the cache root: keep them out of the user's
pytestmark = pytest.mark.usefixtures("own_cache")


def _tiny_gpt2() -> PreTrainedModel:
    config = GPT2Config(vocab_size=TOKENIZER_VOCAB, n_positions=64, n_embd=32, n_layer=1,
                        n_head=2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_unsupported_reason() -> None:
    """Only Llama-family models with SiLU and full attention are taken; anything else is
    refused with a reason naming what is unsupported, and CpuDecoder raises it."""
    gpt2 = _tiny_gpt2()
    reason = unsupported_reason(gpt2)
    assert reason is not None and "gpt2" in reason and "llama" in reason and "qwen2" in reason
    with pytest.raises(ValueError, match="gpt2"):
        CpuDecoder(gpt2, "w8a8")
    assert gpt2.transformer.h[0].attn.c_attn.weight.numel() > 0  # refused before emptying

    def qwen2(**overrides: object) -> PreTrainedModel:
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=MAX_POSITIONS, **overrides)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    assert unsupported_reason(qwen2()) is None
    assert unsupported_reason(_tiny_llama(seed=0)) is None
    assert "gelu" in (unsupported_reason(qwen2(hidden_act="gelu")) or "")
    assert "sliding" in (unsupported_reason(qwen2(use_sliding_window=True)) or "")


def test_load_w8a8_refuses_unsupported_architecture(tmp_path: Path) -> None:
    """load_model with quantization "w8a8" on a saved GPT-2 folder fails with a
    ModelLoadError naming the architecture and the way out, instead of a traceback."""
    train_tokenizer(TOKENIZER_TEXTS).save_pretrained(tmp_path)
    _tiny_gpt2().save_pretrained(tmp_path)
    spec = ModelSpec(str(tmp_path), dtype="float32", device="cpu", quantization="w8a8")
    with pytest.raises(ModelLoadError, match="gpt2") as error:
        load_model(spec)
    assert "w8a8" in str(error.value) and "int8-weight-only" in str(error.value)
    # the same folder loads without the CPU forward
    assert load_model(ModelSpec(str(tmp_path), dtype="float32", device="cpu")).decoder is None


def test_load_w8a8_builds_cpu_decoder(saved_model_dir: Path) -> None:
    """load_model(..., quantization="w8a8") of a saved Qwen2 gives a LoadedModel with a
    CpuDecoder; its runners run that decoder, with the saved model's vocabulary and logits
    close to the float model's (the right weights were taken)."""
    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", device="cpu", quantization="w8a8")
    loaded = load_model(spec)
    assert isinstance(loaded.decoder, CpuDecoder)
    assert loaded.decoder.dtype == torch.bfloat16
    runner = loaded.runner()
    assert runner.decoder is loaded.decoder and runner.vocab_size == TOKENIZER_VOCAB
    tokens = loaded.tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    assert len(tokens) > 3
    logits = runner.forward(tokens)
    assert logits.shape == (len(tokens), TOKENIZER_VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and runner.length == len(tokens)
    reference = ModelRunner(make_tiny_model(seed=0, vocab_size=TOKENIZER_VOCAB)).forward(tokens)
    relative = float((logits - reference).norm() / reference.norm())
    assert relative < 0.05, relative
    # a second runner has its own cache
    other = loaded.runner()
    assert other.length == 0 and torch.equal(other.forward(tokens), logits)
    # loading again (the w8a8 weights may now come from a stored copy) gives the same model
    reloaded = load_model(spec)
    assert isinstance(reloaded.decoder, CpuDecoder)
    assert torch.equal(reloaded.runner().forward(tokens), logits)


def test_w8a8_store_is_reused_and_rebuilt_when_damaged(saved_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first w8a8 load stores its int8 weights; the next reads them (no quantization,
    and the float weights are never loaded: an empty model tree with the real config and
    generation settings) and gives the same logits; a damaged store is quantized again, never
    read as garbage."""
    from localspec.models import loading, packed_store

    spec = ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8")
    ids = list(range(3, 40))
    original = load_model(spec)
    first = original.runner().forward(ids)
    store = packed_store.store_dir(saved_model_dir) / packed_store.WEIGHTS_NAME
    assert store.is_file()

    calls: list[str] = []
    real_export = packed_store.export_weights
    monkeypatch.setattr(packed_store, "export_weights",
                        lambda *a, **k: calls.append("quantize") or real_export(*a, **k))
    real_load = loading.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append("float weights") or real_load(*a, **k))
    again = load_model(spec)
    assert torch.equal(again.runner().forward(ids), first)
    assert calls == []  # read from the store, nothing else
    for settings in ("generation_config", "config"):
        assert getattr(again.model, settings).to_dict() == getattr(original.model,
                                                                   settings).to_dict()

    data = bytearray(store.read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(bytes(data))
    assert torch.equal(load_model(spec).runner().forward(ids), first)
    assert calls == ["float weights", "quantize"]  # the damage was seen: quantized again


def test_store_of_an_older_format_is_replaced(saved_model_dir: Path) -> None:
    """A new store removes what an earlier format left for the same model folder."""
    from localspec.models import packed_store

    current = packed_store.store_dir(saved_model_dir)
    stale = current.with_name(current.name.rsplit("-", 1)[0] + "-0123456789ab")
    stale.mkdir(parents=True)
    (stale / packed_store.WEIGHTS_NAME).write_bytes(b"old")
    load_model(ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8"))
    assert (current / packed_store.WEIGHTS_NAME).is_file() and not stale.exists()


def test_draft_shares_the_targets_tokenizer_only_when_its_files_are_the_same(
        saved_model_dir: Path, tmp_path: Path) -> None:
    """A draft folder with byte-identical tokenizer files reuses the target's tokenizer (one
    tokenizer load fewer per start); a changed file gets its own."""
    import shutil

    target = load_model(ModelSpec(str(saved_model_dir), dtype="bfloat16", quantization="w8a8"))
    twin = tmp_path / "twin"
    shutil.copytree(saved_model_dir, twin)
    spec = ModelSpec(str(twin), dtype="bfloat16", quantization="w8a8")
    assert load_model(spec, share_tokenizer=target).tokenizer is target.tokenizer
    config = twin / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 77}', 1))
    other = load_model(spec, share_tokenizer=target).tokenizer
    assert other is not target.tokenizer and other.model_max_length == 77
