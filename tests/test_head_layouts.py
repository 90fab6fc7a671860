"""Draft heads in their published layouts: EAGLE, EAGLE-3 and Medusa checkpoints written in
exactly those layouts (safetensors and weights-only pickles) load with every tensor where it
belongs and draft losslessly, from a folder and from the Hub cache; heads made for another
target (hidden size, vocabulary, layers), of the other kind, incomplete, or with a damaged
token map are refused with a message that says which and why, never a traceback.

Unreadable head files, built-in heads and heads named by a preset are ``test_head_files``."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import collect, decode
from head_models import (
    DRAFT_VOCAB,
    HIDDEN,
    VOCAB,
    eagle1_tensors,
    eagle3_tensors,
    llama_config,
    llama_target,
    medusa_config,
    medusa_tensors,
    write_head,
)

from localspec.drafters.eagle import EagleDrafter
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_eagle_head, load_medusa_heads
from localspec.drafters.medusa import MedusaDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.errors import ModelLoadError
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.runner import ModelRunner

FORMATS = {"eagle": ("pytorch_model.bin", "model.safetensors"),
           "medusa": ("medusa_lm_head.pt", "medusa_lm_head.safetensors")}


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return ModelRunner(llama_target())


def greedy_equals_plain(runner: ModelRunner, drafter: object) -> None:
    request = GenerationRequest(prompt_ids=[5, 17, 33, 2, 80, 41, 9], max_new_tokens=20,
                                num_speculative_tokens=3, adaptive=False)
    plain = collect(SpeculativeEngine(runner, (), decode, set()), request)[0]
    tokens, events = collect(SpeculativeEngine(runner, (drafter,), decode, set()), request)
    assert tokens == plain and all(e.drafted for e in events)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("filename", FORMATS["eagle"])
def test_eagle1_layout(tmp_path: Path, target: ModelRunner, filename: str) -> None:
    tensors = eagle1_tensors(HIDDEN, VOCAB)
    write_head(tmp_path / "head", llama_config(HIDDEN, VOCAB), tensors, filename)
    head, layers = load_eagle_head(read_head(str(tmp_path / "head")), "eagle", target)
    assert layers is None and head.spec.kind == "eagle" and head.spec.fc_bias
    state = head.state_dict()
    for key in ("fc.weight", "fc.bias", "layers.0.self_attn.k_proj.weight",
                "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"):
        assert torch.equal(state[key], tensors[key]), key
    assert not hasattr(head.layers[0], "input_layernorm")  # EAGLE's first layer has none
    assert head.embed_tokens is None and head.lm_head is None  # the target's are used
    greedy_equals_plain(target, EagleDrafter(head, target, layers))


@pytest.mark.parametrize("filename", FORMATS["eagle"])
def test_eagle3_layout(tmp_path: Path, target: ModelRunner, filename: str) -> None:
    tensors = eagle3_tensors(HIDDEN, VOCAB, DRAFT_VOCAB)
    config = llama_config(HIDDEN, VOCAB, draft_vocab_size=DRAFT_VOCAB,
                          architectures=["LlamaForCausalLMEagle3"])
    write_head(tmp_path / "head", config, tensors, filename)
    head, layers = load_eagle_head(read_head(str(tmp_path / "head")), "eagle3", target)
    assert layers == (2, 4, 5)  # low, middle, high of an 8-layer target
    state = head.state_dict()
    for key in ("fc.weight", "norm.weight", "lm_head.weight", "d2t"):
        assert torch.equal(state[key], tensors[key]), key
    for name in ("hidden_norm.weight", "input_layernorm.weight", "self_attn.q_proj.weight"):
        assert torch.equal(state[f"layers.0.{name}"], tensors[f"midlayer.{name}"]), name
    assert head.layers[0].self_attn.q_proj.in_features == 2 * HIDDEN
    logits = head.draft_logits(torch.ones(1, HIDDEN), VOCAB)[0]  # [vocab]: draft ids mapped
    assert torch.equal(torch.isfinite(logits), tensors["t2d"])
    greedy_equals_plain(target, EagleDrafter(head, target, layers))


def test_eagle3_layers_from_config(tmp_path: Path, target: ModelRunner) -> None:
    config = llama_config(HIDDEN, VOCAB, draft_vocab_size=DRAFT_VOCAB,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    write_head(tmp_path, config, eagle3_tensors(HIDDEN, VOCAB, DRAFT_VOCAB), "model.safetensors")
    assert load_eagle_head(read_head(str(tmp_path)), "eagle3", target)[1] == (1, 3, 6)


@pytest.mark.parametrize("filename", FORMATS["medusa"])
@pytest.mark.parametrize("variant", ["original", "vllm", "no-lm-heads"])
def test_medusa_layouts(tmp_path: Path, target: ModelRunner, filename: str,
                        variant: str) -> None:
    """medusa_lm_head.pt keys, vLLM's keys and config names, and the earliest heads that
    read with the target's LM head."""
    tensors = medusa_tensors(HIDDEN, VOCAB, num_heads=3, lm_heads=variant != "no-lm-heads")
    config: dict[str, object] = medusa_config(num_heads=3)
    if variant == "vllm":
        tensors = {k.replace(".0.linear.", ".layers.0.").replace(".1.weight", ".weight"): v
                   for k, v in tensors.items()}
        tensors = {(f"blocks.{k}" if ".layers." in k else f"lm_heads.{k}"): v
                   for k, v in tensors.items()}
        config = {"num_heads": 3, "num_hidden_layers": 1, "hidden_size": HIDDEN,
                  "vocab_size": VOCAB, "model_type": "medusa"}
    write_head(tmp_path, config, tensors, filename)
    heads = load_medusa_heads(read_head(str(tmp_path)), target)
    assert heads.num_heads == 3 and (heads.lm_heads is None) == (variant == "no-lm-heads")
    state = heads.state_dict()
    original = medusa_tensors(HIDDEN, VOCAB, num_heads=3)
    assert torch.equal(state["blocks.2.layers.0.weight"], original["2.0.linear.weight"])
    assert torch.equal(state["blocks.2.layers.0.bias"], original["2.0.linear.bias"])
    if heads.lm_heads is not None:
        assert torch.equal(state["lm_heads.1.weight"], original["1.1.weight"])
    greedy_equals_plain(target, MedusaDrafter(heads, target))


def _truncated_medusa(own_lm_heads: bool) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """vLLM's Medusa layout with a truncated vocabulary: ``token_map`` lists the target ids the
    heads guess from (here every third id, unsorted), their own LM heads have that many rows."""
    token_map = torch.arange(0, VOCAB, 3).flip(0)
    tensors = {f"blocks.{k.replace('.0.linear.', '.layers.0.')}": v
               for k, v in medusa_tensors(HIDDEN, VOCAB, lm_heads=False).items()}
    if own_lm_heads:
        tensors.update({f"lm_heads.{i}.weight": 3.0 * torch.randn(
            len(token_map), HIDDEN, generator=torch.Generator().manual_seed(i))
            for i in range(3)})
    config = {"num_heads": 3, "num_hidden_layers": 1, "hidden_size": HIDDEN, "vocab_size": VOCAB,
              "truncated_vocab_size": len(token_map), "model_type": "medusa"}
    return config, {**tensors, "token_map": token_map}


@pytest.mark.parametrize("own_lm_heads", [True, False], ids=["own-lm-heads", "targets-lm-head"])
def test_medusa_truncated_vocabulary(tmp_path: Path, target: ModelRunner,
                                     own_lm_heads: bool) -> None:
    """A head with a ``token_map`` guesses only those ids (through its own LM heads' rows or
    the target's) and is still exact."""
    config, tensors = _truncated_medusa(own_lm_heads)
    write_head(tmp_path, config, tensors, "model.safetensors")
    heads = load_medusa_heads(read_head(str(tmp_path)), target)
    assert torch.equal(heads.token_map, tensors["token_map"])
    drafter = MedusaDrafter(heads, target)
    collect(SpeculativeEngine(target, (drafter,), decode, set()),
            GenerationRequest(prompt_ids=[5, 17, 33], max_new_tokens=2))
    logits = drafter._logits(0, target.features(1, 2))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[tensors["token_map"]] = False
    assert torch.isinf(logits[outside]).all() and torch.isfinite(logits[~outside]).all()
    greedy_equals_plain(target, drafter)


@pytest.mark.parametrize("damage", ["outside the vocabulary", "repeated", "size differs"])
def test_a_damaged_token_map_is_refused(tmp_path: Path, target: ModelRunner, damage: str) -> None:
    config, tensors = _truncated_medusa(own_lm_heads=False)
    token_map = tensors["token_map"]
    if damage == "outside the vocabulary":
        tensors["token_map"] = token_map + VOCAB
    elif damage == "repeated":
        tensors["token_map"] = torch.zeros_like(token_map)
    else:
        config["truncated_vocab_size"] = len(token_map) + 1
    write_head(tmp_path, config, tensors, "model.safetensors")
    with pytest.raises(ModelLoadError, match="token_map must list distinct ids of the target"):
        load_medusa_heads(read_head(str(tmp_path)), target)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_heads_take_the_targets_dtype_on_the_cpu_path(tmp_path: Path, method: str) -> None:
    """On the CPU production path (a bfloat16 target under the int8 CPU forward, float32
    features) a loaded head runs in bfloat16 and the output is still plain decoding's."""
    model = llama_target().to(torch.bfloat16)
    runner = ModelRunner(model, decoder=CpuDecoder(model, "w8a8"))
    if method == "medusa":
        write_head(tmp_path, medusa_config(), medusa_tensors(HIDDEN, VOCAB), "medusa_lm_head.pt")
        heads = load_medusa_heads(read_head(str(tmp_path)), runner)
        assert heads.dtype == torch.bfloat16
        greedy_equals_plain(runner, MedusaDrafter(heads, runner))
        return
    config = llama_config(HIDDEN, VOCAB, draft_vocab_size=DRAFT_VOCAB)
    tensors = (eagle1_tensors(HIDDEN, VOCAB) if method == "eagle"
               else eagle3_tensors(HIDDEN, VOCAB, DRAFT_VOCAB))
    write_head(tmp_path, config, tensors, "pytorch_model.bin")
    head, layers = load_eagle_head(read_head(str(tmp_path)), method, runner)
    assert head.fc.weight.dtype == torch.bfloat16
    greedy_equals_plain(runner, EagleDrafter(head, runner, layers))


def test_head_from_the_hub_cache(tmp_path: Path, target: ModelRunner,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """org/name resolves offline to its cached snapshot; a repo not cached is a clear error."""
    hub = tmp_path / "hub"
    repo = hub / "models--yuhuili--EAGLE-tiny"
    write_head(repo / "snapshots" / ("a" * 40), llama_config(HIDDEN, VOCAB),
               eagle1_tensors(HIDDEN, VOCAB), "pytorch_model.bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    files = read_head("yuhuili/EAGLE-tiny")
    assert files.folder.resolve() == (repo / "snapshots" / ("a" * 40)).resolve()
    assert load_eagle_head(files, "eagle", target)[0].spec.hidden_size == HIDDEN
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        read_head("yuhuili/EAGLE-absent")


# ----------------------------------------------------------------------------- refusals


def _refusal(tmp_path: Path, method: str) -> dict[str, tuple]:
    """Per case: (config, tensors, filename, needles). Hidden 48 and vocab 120 are another
    target's."""
    wide = llama_config(48, VOCAB, heads=4, kv_heads=2)
    big_vocab = llama_config(HIDDEN, 120, draft_vocab_size=DRAFT_VOCAB)
    three = llama_config(HIDDEN, VOCAB, draft_vocab_size=DRAFT_VOCAB)
    cases = {
        "eagle": {
            "hidden size": (wide, eagle1_tensors(48, VOCAB), ["hidden size 48", "is 32"]),
            "vocabulary": (llama_config(HIDDEN, 120), eagle1_tensors(HIDDEN, 120),
                           ["vocabulary size 120", "is 97"]),
            "other kind": (three, eagle3_tensors(HIDDEN, VOCAB, DRAFT_VOCAB),
                           ["an EAGLE-3 head", 'method = "eagle3"']),
            "incomplete": (llama_config(HIDDEN, VOCAB), {
                k: v for k, v in eagle1_tensors(HIDDEN, VOCAB).items() if "down_proj" not in k},
                ["missing layers.0.mlp.down_proj.weight"]),
            "no config": (None, eagle1_tensors(HIDDEN, VOCAB), ["no config.json"]),
            "bad config": ({**llama_config(HIDDEN, VOCAB), "hidden_size": "32"},
                           eagle1_tensors(HIDDEN, VOCAB), ["'hidden_size' must be a positive"]),
        },
        "eagle3": {
            "hidden size": (llama_config(48, VOCAB, draft_vocab_size=DRAFT_VOCAB),
                            eagle3_tensors(48, VOCAB, DRAFT_VOCAB), ["hidden size 48"]),
            "vocabulary": (big_vocab, eagle3_tensors(HIDDEN, 120, DRAFT_VOCAB),
                           ["vocabulary size 120", "is 97"]),
            "layers": ({**three, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 9, 30]}},
                       eagle3_tensors(HIDDEN, VOCAB, DRAFT_VOCAB),
                       ["layers [2, 9, 30]", "has 8 layers"]),
            "other kind": (llama_config(HIDDEN, VOCAB), eagle1_tensors(HIDDEN, VOCAB),
                           ["an EAGLE head", 'method = "eagle"']),
        },
        "medusa": {
            "hidden size": (medusa_config(), medusa_tensors(48, VOCAB), ["hidden size 48"]),
            "vocabulary": (medusa_config(), medusa_tensors(HIDDEN, 120),
                           ["vocabulary size 120", "is 97"]),
            "not medusa": (medusa_config(), eagle1_tensors(HIDDEN, VOCAB),
                           ["no Medusa head tensors"]),
        },
    }
    return cases[method]


REFUSALS = [(method, case) for method, cases in (
    ("eagle", ("hidden size", "vocabulary", "other kind", "incomplete", "no config",
               "bad config")),
    ("eagle3", ("hidden size", "vocabulary", "layers", "other kind")),
    ("medusa", ("hidden size", "vocabulary", "not medusa"))) for case in cases]


@pytest.mark.parametrize(("method", "case"), REFUSALS)
def test_a_head_for_another_target_is_refused(tmp_path: Path, target: ModelRunner, method: str,
                                              case: str) -> None:
    config, tensors, needles = _refusal(tmp_path, method)[case]
    write_head(tmp_path, config, tensors, "model.safetensors")
    files = read_head(str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        if method == "medusa":
            load_medusa_heads(files, target)
        else:
            load_eagle_head(files, method, target)
    message = str(info.value)
    assert str(tmp_path) in message and f"'{tmp_path}'" in message
    for needle in needles:
        assert needle in message, (needle, message)
