"""Memory estimates computed from model configs, hardware detection, the presets listing and the
vLLM export. The parameter count is checked against models transformers builds on the meta
device (every architecture of the shipped table, tiny ones) and the table's built-in entries
against the real GGUF checkpoints in their packages; the byte rules against bitsandbytes and
LocalSpec's own int8 layers."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import psutil
import pytest
import torch
from accelerate.utils import compute_module_sizes
from conftest import tiny_config
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

from localspec.cli.export import export_vllm
from localspec.cli.main import main
from localspec.config import parse_preset
from localspec.drafters.eagle_head import EagleHead, EagleSpec
from localspec.errors import ModelLoadError
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import _source_files
from localspec.models.hardware import (
    GIB,
    HARDWARE_MEMORY,
    KNOWN_CONFIGS,
    Architecture,
    Gpu,
    Hardware,
    HardwareError,
    MemoryEstimate,
    architecture,
    count_parameters,
    detect_hardware,
    estimate_preset,
    fits,
    head_weight_bytes,
    kv_cache_bytes,
    survey_presets,
    weight_bytes,
)
from localspec.presets import list_preset_names, load_preset, shipped_preset_names
from localspec.registry import EAGLE3_DRAFT_VOCAB
from localspec.runtime.quant import quantize_int8_weight_only

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
SHIPPED = json.loads(KNOWN_CONFIGS.read_text(encoding="utf-8"))["models"]


def _from_table(name: str) -> PretrainedConfig:
    """The transformers config of a model_configs.json entry, as transformers itself builds it."""
    fields = {k: v for k, v in SHIPPED[name].items() if k != "hf_repo"}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


CONFIGS = {
    **{name: lambda name=name: _from_table(name) for name in SHIPPED},
    "conftest-tiny": tiny_config,
    "qwen2-tied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "llama-bias": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False, attention_bias=True,
                                      mlp_bias=True),
    "llama-head-dim": lambda: LlamaConfig(**{**SMALL, "num_key_value_heads": 4}, head_dim=16),
}


@pytest.mark.parametrize("key", list(CONFIGS))
def test_parameter_count_matches_a_meta_model(key: str) -> None:
    """count_parameters (plain arithmetic) equals the model transformers builds from the same
    config, exactly: in total, in the decoder layers' linear weights (what quantization shrinks)
    and their output rows; the dtype bytes agree with accelerate's compute_module_sizes.

    Built under ``torch.device("meta")``, not accelerate's ``init_empty_weights``: the latter
    re-creates every assigned parameter, which unties a tied LM head (accelerate issue #3668)
    and would count the embedding twice."""
    config = CONFIGS[key]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = Architecture.from_config(config.to_dict())
    counts = count_parameters(arch)
    assert counts.total == sum(p.numel() for p in model.parameters())
    linears = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    assert counts.linear == sum(m.weight.numel() for m in linears)
    assert counts.linear_rows == sum(m.out_features for m in linears)
    sizes = compute_module_sizes(model, dtype=torch.bfloat16)
    buffers = compute_module_sizes(model, dtype=torch.bfloat16, buffers_only=True)
    assert weight_bytes(arch, "none", "bfloat16") == sizes[""] - buffers.get("", 0)


def _gguf_reader(name: str, tmp_path: Path) -> gguf.GGUFReader:
    """The header of a built-in checkpoint straight from its installed package (no cache).

    A split checkpoint's header lies in its first part; the first part is copied into a sparse
    file of the assembled size, so the reader's tensor views fit without copying the weights."""
    model = BUILTIN_MODELS[name]
    try:
        sources = _source_files(model)
    except ModelLoadError as exc:
        pytest.skip(f"{name}: its package is not installed ({exc})")
    if len(sources) == 1:
        return gguf.GGUFReader(str(sources[0]))
    sparse = tmp_path / model.gguf_name
    shutil.copyfile(sources[0], sparse)
    os.truncate(sparse, model.size)
    return gguf.GGUFReader(str(sparse))


LINEAR_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_builtin_table_matches_the_shipped_gguf(name: str, tmp_path: Path) -> None:
    """The shipped table's entry for a built-in equals its real checkpoint: the GGUF header's
    hyperparameters and its tensors' element counts (total and linear). Reads the installed
    packages directly, so it needs no converted model in the cache and no test before it."""
    reader = _gguf_reader(name, tmp_path)
    table = SHIPPED[name]
    kind = reader.get_field("general.architecture").contents()
    assert kind == table["model_type"]
    facts = {key: reader.get_field(f"{kind}.{field}").contents() for key, field in [
        ("num_hidden_layers", "block_count"), ("hidden_size", "embedding_length"),
        ("intermediate_size", "feed_forward_length"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("max_position_embeddings", "context_length")]}
    assert facts == {key: table[key] for key in facts}
    tensors = {t.name: int(t.n_elements) for t in reader.tensors}
    assert tensors["token_embd.weight"] == table["vocab_size"] * table["hidden_size"]
    assert ("output.weight" not in tensors) == table["tie_word_embeddings"]
    counts = count_parameters(Architecture.from_config(table))
    assert counts.total == sum(tensors.values())
    assert counts.linear == sum(n for t, n in tensors.items() if t.endswith(LINEAR_TENSORS))


@pytest.mark.parametrize("folder", ["models/smollm2-135m-instruct",
                                    "meta/smollm2-135m-instruct.bfloat16"])
def test_converted_config_on_disk_wins_over_the_table(folder: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in's architecture comes from the shipped table until a config.json of it is in
    the cache (a conversion's, or the one the CPU forward reads from the GGUF), then from that
    file (here one with another vocabulary, written by transformers): the estimate follows the
    checkpoint actually run."""
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path))
    name = "smollm2-135m-instruct"
    assert architecture(name) == Architecture.from_config(SHIPPED[name])
    config = _from_table(name)
    config.vocab_size = 1000
    config.save_pretrained(tmp_path / folder)
    on_disk = architecture(name)
    assert on_disk == replace(Architecture.from_config(SHIPPED[name]), vocab_size=1000)


@pytest.mark.parametrize(("repo", "billions"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", 0.494), ("Qwen/Qwen2.5-7B-Instruct", 7.62),
    ("Qwen/Qwen2.5-14B-Instruct", 14.77), ("Qwen/Qwen2.5-32B-Instruct", 32.76),
    ("meta-llama/Llama-3.2-1B-Instruct", 1.24), ("meta-llama/Llama-3.1-8B-Instruct", 8.03),
    ("meta-llama/Llama-3.1-70B-Instruct", 70.55),
])
def test_known_architectures_give_the_published_sizes(repo: str, billions: float) -> None:
    """Parameter counts from the shipped config facts match the model cards' totals."""
    assert count_parameters(architecture(repo)).total / 1e9 == pytest.approx(billions, rel=0.005)


def _saved_tiny(tmp_path: Path) -> tuple[Path, Architecture]:
    config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    return tmp_path, Architecture.from_config(config.to_dict())


def _footprint(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, plus bitsandbytes' 4-bit absmax (a quant_state)."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
    rotary = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    return total - rotary


def test_weight_bytes_match_loaded_models(tmp_path: Path) -> None:
    folder, arch = _saved_tiny(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert weight_bytes(arch, "none", "bfloat16") == _footprint(plain)
    quantize_int8_weight_only(plain, skip=("lm_head",))
    assert weight_bytes(arch, "int8-weight-only", "bfloat16") == _footprint(plain)
    assert weight_bytes(arch, "none", "float32") == 2 * weight_bytes(arch, "none", "bfloat16")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="no bitsandbytes")
def test_bnb_4bit_rule_matches_bitsandbytes(tmp_path: Path) -> None:
    folder, arch = _saved_tiny(tmp_path)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cpu",
                                                 quantization_config=config)
    assert weight_bytes(arch, "bnb-4bit", "bfloat16") == _footprint(model)


def test_kv_cache_and_unknown_models() -> None:
    arch = architecture("meta-llama/Llama-3.1-8B-Instruct")
    # 32 layers x 8 kv heads x 128 dims x (k and v) x 2 bytes = 128 KiB per token
    assert kv_cache_bytes(arch, 1) == 128 * 1024
    assert kv_cache_bytes(arch, 8192, "float32") == 2 * kv_cache_bytes(arch, 8192)
    with pytest.raises(HardwareError, match=r"no config\.json for 'someone/unknown-model'"):
        architecture("someone/unknown-model")
    with pytest.raises(HardwareError, match="quantization 'fp3'"):
        weight_bytes(arch, "fp3")


def test_local_folder_config_is_read(tmp_path: Path) -> None:
    config = LlamaConfig(**SMALL)
    config.save_pretrained(tmp_path)
    assert architecture(str(tmp_path)).hidden_size == 128


@pytest.mark.parametrize("name", [n for n in shipped_preset_names()
                                  if not n.startswith("cpu")])
def test_gpu_presets_fit_their_class(name: str) -> None:
    """Each GPU preset's computed need fits the card it is named for, with its draft aboard."""
    preset = load_preset(name)
    estimate = estimate_preset(preset)
    assert preset.target.device == "cuda" and estimate.on_gpu
    assert estimate.draft_weights > 0 and estimate.kv_cache > 0
    assert estimate.total <= 0.95 * HARDWARE_MEMORY[preset.hardware]
    assert fits(estimate, Hardware(16, 64 * GIB, 60 * GIB, (Gpu("card", HARDWARE_MEMORY[
        preset.hardware]),)))[0]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_weight_bytes_match_a_built_head(method: str) -> None:
    """The estimate of a published head is the size of the head module LocalSpec loads it
    into, shaped for the target as the EAGLE authors shape theirs (no embedding of its own)."""
    config = LlamaConfig(**SMALL)
    spec = EagleSpec.for_target(config, method, draft_vocab_size=EAGLE3_DRAFT_VOCAB)
    head = EagleHead(spec, dtype=torch.bfloat16, device="meta")
    built = sum(t.numel() * 2 for n, t in head.state_dict().items() if n != "d2t")
    norms = sum(t.numel() * 2 for n, t in head.state_dict().items() if "norm" in n)
    assert head_weight_bytes(Architecture.from_config(config.to_dict()), method) == built - norms


@pytest.mark.parametrize(("name", "least", "most"), [("cpu-qwen-coder-eagle", 39e6, 40e6),
                                                    ("cpu-qwen-coder-medusa", 14e6, 15e6)])
def test_builtin_heads_are_estimated_at_their_real_size(name: str, least: float,
                                                        most: float) -> None:
    """A built-in head counts as the files it ships (the Medusa heads read the target's LM
    head: a published Medusa head's shape would add ~2 GB)."""
    assert least <= estimate_preset(load_preset(name)).draft_weights <= most


def test_auto_counts_each_members_weights() -> None:
    """"auto" holds every member's weights: the draft model's (and its KV cache) as the draft
    preset does, and a head's beside it."""
    draft = estimate_preset(load_preset("cpu-qwen-coder-draft"))
    auto = load_preset("cpu-qwen-coder-auto")
    assert estimate_preset(auto).draft_weights == draft.draft_weights
    assert estimate_preset(auto).kv_cache == draft.kv_cache
    data = auto.model_dump()
    data["localspec"] |= {"drafters": ["ngram", "eagle3", "draft_model"],
                          "head": "qwen2.5-coder-1.5b-eagle3"}
    both = estimate_preset(parse_preset(data))
    assert 39e6 <= both.draft_weights - draft.draft_weights <= 40e6


def test_fits_reasons() -> None:
    need = MemoryEstimate(6 * GIB, GIB, GIB // 2, GIB // 2, 4096, on_gpu=True)
    cpu_only = Hardware(2, 16 * GIB, 8 * GIB)
    ok, reason = fits(need, cpu_only)
    assert not ok and "needs a CUDA GPU with ~8.0 GiB" in reason
    ok, reason = fits(need, Hardware(2, 16 * GIB, 8 * GIB, (Gpu("small", 6 * GIB),)))
    assert not ok and "largest GPU has 6.0 GiB" in reason
    assert fits(need, Hardware(2, 16 * GIB, 8 * GIB, (Gpu("big", 24 * GIB),)))[0]
    cpu_need = MemoryEstimate(6 * GIB, 0, GIB, GIB, 4096, on_gpu=False)
    assert not fits(cpu_need, Hardware(2, 4 * GIB, 2 * GIB))[0]
    assert fits(cpu_need, cpu_only)[0]


def test_detect_hardware_reports_this_machine() -> None:
    """Cores and RAM are this machine's, in bytes: RAM total equals psutil's and, where POSIX
    says, physical pages x page size (an independent source); free RAM lies within it."""
    hw = detect_hardware()
    assert hw.cpu_count == os.cpu_count()
    assert hw.ram_total == psutil.virtual_memory().total
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        assert hw.ram_total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < hw.ram_available <= hw.ram_total
    assert len(hw.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert f"{hw.cpu_count} CPU cores, {hw.ram_total / GIB:.1f} GiB RAM" in hw.describe()


def test_estimates_import_no_torch() -> None:
    """The preset listing's estimates run without torch (it costs seconds to import)."""
    code = ("import sys; from localspec.models import hardware as h; "
            "rows = h.survey_presets(h.Hardware(2, 32 * h.GIB, 30 * h.GIB)); "
            "assert all(r.estimate for r in rows), rows; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr


def test_survey_marks_what_fits_and_invalid_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("name = 1\n", encoding="utf-8")
    cpu_only = Hardware(2, 32 * GIB, 30 * GIB)
    rows = survey_presets(cpu_only, [*list_preset_names(), str(broken)])
    by_key = {r.key: r for r in rows}
    assert by_key["cpu-smollm2-ngram"].fits and not by_key["gpu-8gb-qwen2.5-7b-draft"].fits
    assert by_key[str(broken)].error and not by_key[str(broken)].fits
    order = [r.hardware for r in rows]
    assert order.index("cpu") < order.index("gpu-8gb") < order.index("h100-80gb")
    assert order[-1] == "invalid"


def test_cli_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "This machine:" in out and "GPU 24 GB:" in out
    for name in list_preset_names():
        assert name in out
    assert main(["presets", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["preset"] for p in data["presets"]} == set(list_preset_names())
    assert all(p["memory_gib"] > 0 for p in data["presets"])


def _spec_json(command: str) -> dict:
    words = shlex.split(command)
    return json.loads(words[words.index("--speculative-config") + 1])


def test_export_vllm(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["export-vllm", "gpu-8gb-qwen2.5-7b-draft"]) == 0
    command = capsys.readouterr().out.strip()
    assert command.startswith("vllm serve Qwen/Qwen2.5-7B-Instruct ")
    assert "--quantization bitsandbytes" in command
    assert _spec_json(command) == {"method": "draft_model", "num_speculative_tokens": 5,
                                   "model": "Qwen/Qwen2.5-0.5B-Instruct"}

    assert main(["export-vllm", "cpu-qwen-coder-draft"]) == 0
    captured = capsys.readouterr()
    spec = _spec_json(captured.out)
    assert spec["model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct" and "quantization" not in spec
    assert "requant-q3m' has no vLLM equivalent" in captured.err
    assert "vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct" in captured.out

    ngram = _spec_json(export_vllm(load_preset("cpu-smollm2-ngram")).command)
    assert ngram == {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2}

    plain = tmp_path / "plain.toml"
    plain.write_text('name = "p"\ndescription = "d"\nhardware = "cpu"\n[target]\n'
                     'model = "org/model"\n', encoding="utf-8")
    result = export_vllm(load_preset(str(plain)))
    assert result.command == "vllm serve org/model" and result.speculative_config is None
    assert main(["export-vllm", "no-such-preset"]) == 2
