"""Draft heads in their published layouts: EAGLE, EAGLE-3 and Medusa checkpoints written in
exactly those layouts (safetensors and weights-only pickles) load with every tensor where it
belongs and draft losslessly; from a folder, the Hub cache, and a preset end to end. Heads
made for another target (hidden size, vocabulary, layers), of the other kind, incomplete,
damaged, or pickles that need more than tensors are refused with a message that says which
and why, never a traceback."""

from __future__ import annotations

import itertools
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import assert_user_error, collect, decode, run_cli, write_preset
from head_models import (
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

from localspec.cli.export import export_vllm
from localspec.config import BUILTIN_HEADS
from localspec.drafters import head_files
from localspec.drafters.eagle import EagleDrafter
from localspec.drafters.head_files import read_head
from localspec.drafters.head_layouts import load_eagle_head, load_medusa_heads
from localspec.drafters.medusa import MedusaDrafter
from localspec.engine.engine import GenerationRequest, SpeculativeEngine
from localspec.errors import ModelLoadError, PresetError
from localspec.pipeline import check_method
from localspec.presets import builtin_head_folder, load_preset
from localspec.runtime.decoder import CpuDecoder
from localspec.runtime.runner import ModelRunner

FORMATS = {"eagle": ("pytorch_model.bin", "model.safetensors"),
           "medusa": ("medusa_lm_head.pt", "medusa_lm_head.safetensors")}
DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return ModelRunner(llama_target())


def greedy_equals_plain(runner: ModelRunner, drafter: object) -> None:
    request = GenerationRequest(prompt_ids=[5, 17, 33, 2, 80, 41, 9], max_new_tokens=20,
                                num_speculative_tokens=3, adaptive=False)
    plain = collect(SpeculativeEngine(runner, None, decode, set()), request)[0]
    tokens, events = collect(SpeculativeEngine(runner, drafter, decode, set()), request)
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
    collect(SpeculativeEngine(target, drafter, decode, set()),
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


class _TouchesAFile:
    """Unpickling this calls Path.touch: code a checkpoint must never get to run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def test_a_pickle_that_needs_more_than_weights_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    tensors = {**eagle1_tensors(HIDDEN, VOCAB), "extra": _TouchesAFile(marker)}
    write_head(tmp_path / "head", llama_config(HIDDEN, VOCAB), tensors, "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as info:
        read_head(str(tmp_path / "head"))
    assert "needs more than tensors" in str(info.value) and "weights_only" in str(info.value)
    assert "Unsupported global" in str(info.value) and not marker.exists()
    # The control: a full unpickling does run it (so the marker above could have appeared).
    torch.load(tmp_path / "head" / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(("setup", "needle"), [
    ("absent", "not found"), ("a file", "is a file"), ("empty", "holds no weights"),
    ("truncated", "damaged or incomplete"), ("not a dict", "not a state dict"),
    ("bad json", "not JSON")])
def test_unreadable_heads_are_refused(tmp_path: Path, setup: str, needle: str) -> None:
    folder = tmp_path / "head"
    if setup == "a file":
        folder = write_head(folder, None, {"x": torch.zeros(1)}, "model.safetensors")
        folder = folder / "model.safetensors"
    elif setup != "absent":
        folder.mkdir()
    if setup == "truncated":
        write_head(folder, None, eagle1_tensors(HIDDEN, VOCAB), "model.safetensors")
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:500])
    if setup == "not a dict":
        torch.save([torch.zeros(2)], folder / "medusa_lm_head.pt")
    if setup == "bad json":
        write_head(folder, None, medusa_tensors(HIDDEN, VOCAB), "medusa_lm_head.pt")
        (folder / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=needle):
        read_head(str(folder))


def test_a_builtin_head_is_read_from_the_package(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in head's name reads the package's folder; an install that lacks it says so
    (and what to do) instead of trying the Hub; export-vllm gives vLLM the folder."""
    name = next(iter(BUILTIN_HEADS))
    folder = write_head(tmp_path / name, medusa_config(), medusa_tensors(HIDDEN, VOCAB),
                        "medusa_lm_head.safetensors")
    monkeypatch.setattr(head_files, "builtin_head_folder", lambda _: folder)
    files = read_head(name)
    assert files.folder == folder and "0.0.linear.weight" in files.tensors
    monkeypatch.setattr(head_files, "builtin_head_folder", lambda _: tmp_path / "gone")
    with pytest.raises(ModelLoadError, match=r"missing from this install.*reinstall"):
        read_head(name)
    for shipped in BUILTIN_HEADS:  # the real ones ship, each with a preset
        assert (builtin_head_folder(shipped) / "config.json").is_file()
    for preset_name, head in (("cpu-qwen-coder-eagle", name),
                              ("cpu-qwen-coder-medusa", "qwen2.5-coder-1.5b-medusa")):
        preset = load_preset(preset_name)
        assert preset.speculative_config.model == head
        export = export_vllm(preset)
        assert export.speculative_config["model"] == str(builtin_head_folder(head))
        assert any("vLLM cannot load" in note for note in export.notes) == ("medusa" in head)


# ----------------------------------------------------------------------------- end to end


def test_presets_with_heads_end_to_end(tmp_path: Path, tiny_folders: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset naming a head folder: `generate` with each method, alone or behind n-gram
    lookup, prints the plain greedy text; a head for another target is one line of error,
    exit status 2."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "cache"))
    vocab = 300  # tiny_folders' target: a 2-layer Qwen2 with a 300-token tokenizer
    heads = {
        "eagle": write_head(tmp_path / "eagle", llama_config(HIDDEN, vocab),
                            eagle1_tensors(HIDDEN, vocab), "pytorch_model.bin"),
        "eagle3": write_head(tmp_path / "eagle3", llama_config(
            HIDDEN, vocab, draft_vocab_size=DRAFT_VOCAB,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}),
            eagle3_tensors(HIDDEN, vocab, DRAFT_VOCAB), "model.safetensors"),
        "medusa": write_head(tmp_path / "medusa", medusa_config(), medusa_tensors(HIDDEN, vocab),
                             "medusa_lm_head.pt"),
    }
    plain = run_cli(capsys, "generate", "--preset", write_preset(
        tmp_path, tiny_folders["target"], method="none", max_new_tokens=12), "--prompt", "hi")
    assert plain[0] == 0, plain[2]
    for (method, folder), lookup_first in itertools.product(heads.items(), (False, True)):
        preset = write_preset(tmp_path, tiny_folders["target"], folder, method=method,
                              max_new_tokens=12, adaptive=False, lookup_first=lookup_first)
        code, out, err = run_cli(capsys, "generate", "--preset", preset, "--prompt", "hi")
        assert code == 0 and out == plain[1], (method, lookup_first, err)
        assert f"[{method}] 12 tokens" in err
    prompts = tmp_path / "prompts.jsonl"  # the built-in ones overflow the tiny model's context
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "add two numbers"}\n', encoding="utf-8")
    code, out, err = run_cli(capsys, "verify", "--preset", preset, "--prompts", str(prompts))
    assert code == 0 and "PASSED" in out and f" {method} " in out, err  # the head is checked
    wrong = write_head(tmp_path / "wrong", medusa_config(), medusa_tensors(48, vocab),
                       "medusa_lm_head.pt")
    preset = write_preset(tmp_path, tiny_folders["target"], wrong, method="medusa")
    assert_user_error(run_cli(capsys, "generate", "--preset", preset, "--prompt", "hi"),
                      "hidden size 48", str(wrong))


def test_a_head_method_in_a_preset(tmp_path: Path, tiny_folders: dict[str, Path]) -> None:
    """``model`` names the head, not a draft model to load; the method is available only in a
    preset set up for it; export-vllm passes it on as vLLM's speculative_config."""
    head = tmp_path / "some-head"
    preset = load_preset(write_preset(tmp_path, tiny_folders["target"], head, method="eagle3"))
    assert preset.draft_spec() is None
    check_method(preset, "eagle3")
    with pytest.raises(PresetError, match="set up for method 'eagle3'"):
        check_method(preset, "medusa")
    drafting = load_preset(write_preset(tmp_path, tiny_folders["target"], tiny_folders["draft"]))
    with pytest.raises(PresetError, match="method 'eagle' needs a head"):
        check_method(drafting, "eagle")
    assert export_vllm(preset).speculative_config == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": str(head)}
