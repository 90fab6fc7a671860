"""A preset as the equivalent ``vllm serve`` command, for users who outgrow one machine.

``[speculative_config]`` already uses vLLM's keys, so the export mostly copies it: the method
becomes vLLM's name for it and the keys vLLM reads for it (both from the drafter registry),
built-in model names become their Hugging Face repo ids, bitsandbytes 4-bit becomes vLLM's
``bitsandbytes`` quantization, and whatever vLLM has no equivalent for (LocalSpec's
``[localspec]`` knobs, int8 weight-only or bnb 8-bit on the fly, a method vLLM lacks) is left
out with a note that says so. It does not check that vLLM supports the model or the GPU.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from localspec.config import BUILTIN_HEADS, Preset, SpeculativeConfig
from localspec.models.hardware import hf_repo_for
from localspec.presets import builtin_head_folder
from localspec.registry import drafter_spec

# LocalSpec quantization -> vLLM's (None: vLLM cannot quantize this way on the fly)
VLLM_QUANTIZATION = {"none": "", "bnb-4bit": "bitsandbytes", "bnb-8bit": None,
                     "int8-weight-only": None, "w8a8": None, "w4a8": None,
                     "requant-q4k": None, "requant-q3m": None}


@dataclass(frozen=True)
class VllmExport:
    command: str
    speculative_config: dict | None
    notes: tuple[str, ...]  # what was translated or dropped, for stderr


def speculative_config_for_vllm(sc: SpeculativeConfig, notes: list[str]) -> dict | None:
    """The speculative_config table with vLLM's keys only (None for plain decoding, or a
    method vLLM does not have)."""
    spec = drafter_spec(sc.method)
    if not spec.speculative:
        notes.append(f"method '{sc.method}': no speculative decoding, so no "
                     "--speculative-config")
        return None
    if spec.vllm_method is None:
        notes.append(f"method '{sc.method}' has no vLLM equivalent: exported without "
                     "--speculative-config (plain decoding)")
        return None
    config: dict[str, object] = {"method": spec.vllm_method,
                                 "num_speculative_tokens": sc.num_speculative_tokens}
    if spec.needs == "draft_model" and sc.model:
        config["model"] = hf_repo_for(sc.model)
        if config["model"] != sc.model:
            notes.append(f"built-in draft '{sc.model}' is {config['model']} on the Hub")
        quant = VLLM_QUANTIZATION.get(sc.quantization)
        if quant:
            config["quantization"] = quant
        elif quant is None:
            notes.append(f"draft quantization '{sc.quantization}' has no vLLM equivalent: "
                         "dropped (the draft runs unquantized)")
    if spec.needs == "head" and sc.model:  # a Hub id or folder, as vLLM takes it
        config["model"] = sc.model
        if sc.model in BUILTIN_HEADS:
            config["model"] = str(builtin_head_folder(sc.model))
            notes.append(f"built-in head '{sc.model}' is the folder {config['model']}")
            if spec.builtin_head_note:
                notes.append(spec.builtin_head_note)
    for key in spec.vllm_keys:
        config[key] = getattr(sc, key)
    return config


def export_vllm(preset: Preset) -> VllmExport:
    notes: list[str] = []
    target = hf_repo_for(preset.target.model)
    if target != preset.target.model:
        notes.append(f"built-in target '{preset.target.model}' is {target} on the Hub")
    parts = ["vllm", "serve", shlex.quote(target)]
    if preset.target.dtype != "auto":
        parts += ["--dtype", preset.target.dtype]
    quant = VLLM_QUANTIZATION.get(preset.target.quantization)
    if quant:
        parts += ["--quantization", quant]
    elif quant is None:
        notes.append(f"target quantization '{preset.target.quantization}' has no on-the-fly "
                     "vLLM equivalent: dropped (use a pre-quantized checkpoint instead)")
    spec = speculative_config_for_vllm(preset.speculative_config, notes)
    if spec is not None:
        parts += ["--speculative-config", shlex.quote(json.dumps(spec))]
    notes.append("[localspec] settings (adaptive_k, draft_confidence_threshold, logits_fp32, ...)"
                 " are LocalSpec's own and have no vLLM flag: not exported")
    return VllmExport(" ".join(parts), spec, tuple(notes))
