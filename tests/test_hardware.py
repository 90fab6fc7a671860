"""Memory estimates computed from model configs, hardware detection, the presets listing and the
vLLM export. The parameter count is checked against real instantiated models (tiny ones built
from configs, and the built-in checkpoints when they are cached), the byte rules against
bitsandbytes and LocalSpec's own int8 layers."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, Qwen2Config

from localspec.cli.main import main
from localspec.cli.export import export_vllm
from localspec.models.hardware import (
    GIB,
    HARDWARE_MEMORY,
    Architecture,
    Gpu,
    Hardware,
    HardwareError,
    MemoryEstimate,
    _meminfo,
    architecture,
    count_parameters,
    detect_hardware,
    estimate_preset,
    fits,
    kv_cache_bytes,
    survey_presets,
    weight_bytes,
)
from localspec.config import cache_root
from localspec.presets import list_preset_names, load_preset
from localspec.runtime.quant import quantize_int8_weight_only

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("config", [
    Qwen2Config(**SMALL, tie_word_embeddings=False),
    Qwen2Config(**SMALL, tie_word_embeddings=True),
    LlamaConfig(**SMALL, tie_word_embeddings=True),
    LlamaConfig(**SMALL, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    LlamaConfig(**{**SMALL, "num_key_value_heads": 4}, head_dim=16),  # head_dim != hidden/heads
], ids=["qwen2", "qwen2-tied", "llama-tied", "llama-bias", "llama-head-dim"])
def test_parameter_count_matches_an_instantiated_model(config: object) -> None:
    model = AutoModelForCausalLM.from_config(config)
    counted = count_parameters(Architecture.from_config(config.to_dict())).total
    assert counted == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                  "smollm2-135m-instruct"])
def test_builtin_models_count_exactly(name: str) -> None:
    """The shipped table and the converted checkpoint's real config agree with its weights."""
    folder = cache_root() / "models" / name
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"{name} is not converted yet (the real-model tests do that)")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    from localspec.models.hardware import _known_configs

    assert count_parameters(architecture(name)).total == stored
    assert count_parameters(Architecture.from_config(_known_configs()[name])).total == stored


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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


@pytest.mark.parametrize("name", [n for n in list_preset_names() if not n.startswith("cpu")])
def test_gpu_presets_fit_their_class(name: str) -> None:
    """Each GPU preset's computed need fits the card it is named for, with its draft aboard."""
    preset = load_preset(name)
    estimate = estimate_preset(preset)
    assert preset.target.device == "cuda" and estimate.on_gpu
    assert estimate.draft_weights > 0 and estimate.kv_cache > 0
    assert estimate.total <= 0.95 * HARDWARE_MEMORY[preset.hardware]
    assert fits(estimate, Hardware(16, 64 * GIB, 60 * GIB, (Gpu("card", HARDWARE_MEMORY[
        preset.hardware]),)))[0]


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


def test_meminfo_and_detection(tmp_path: Path) -> None:
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:   8192000 kB\n")
    assert _meminfo(fake) == (16384000 * 1024, 8192000 * 1024)
    hw = detect_hardware()
    assert hw.cpu_count >= 1 and hw.ram_total > 0
    assert len(hw.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert "RAM" in hw.describe()


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
    assert "int8-weight-only' has no vLLM equivalent" in captured.err
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
