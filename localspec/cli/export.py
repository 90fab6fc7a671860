"""A preset as the equivalent ``vllm serve`` command, for users who outgrow one machine.

``[speculative_config]`` already uses vLLM's keys, so the export mostly copies it: built-in
model names become their Hugging Face repo ids, bitsandbytes 4-bit becomes vLLM's
``bitsandbytes`` quantization, and whatever vLLM has no equivalent for (LocalSpec's
``[localspec]`` knobs, int8 weight-only or bnb 8-bit on the fly) is left out with a note that
says so. It does not check that vLLM supports the model or the GPU.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from localspec.config import BUILTIN_HEADS, HEAD_METHODS, Preset, SpeculativeConfig
from localspec.models.hardware import hf_repo_for
from localspec.presets import builtin_head_folder

# LocalSpec method name -> vLLM's speculative_config "method"
VLLM_METHODS = {"draft_model": "draft_model", "ngram": "ngram", "eagle": "eagle",
                "eagle3": "eagle3", "medusa": "medusa"}
# LocalSpec quantization -> vLLM's (None: vLLM cannot quantize this way on the fly)
VLLM_QUANTIZATION = {"none": "", "bnb-4bit": "bitsandbytes", "bnb-8bit": None,
                     "int8-weight-only": None, "w8a8": None, "w4a8": None,
                     "requant-q4k": None}


@dataclass(frozen=True)
class VllmExport:
    command: str
    speculative_config: dict | None
    notes: tuple[str, ...]  # what was translated or dropped, for stderr


def speculative_config_for_vllm(sc: SpeculativeConfig, notes: list[str]) -> dict | None:
    """The speculative_config table with vLLM's keys only (None for method "none")."""
    if sc.method == "none":
        notes.append("method 'none': no speculative decoding, so no --speculative-config")
        return None
    config: dict[str, object] = {"method": VLLM_METHODS[sc.method],
                                 "num_speculative_tokens": sc.num_speculative_tokens}
    if sc.method == "draft_model" and sc.model:
        config["model"] = hf_repo_for(sc.model)
        if config["model"] != sc.model:
            notes.append(f"built-in draft '{sc.model}' is {config['model']} on the Hub")
        quant = VLLM_QUANTIZATION.get(sc.quantization)
        if quant:
            config["quantization"] = quant
        elif quant is None:
            notes.append(f"draft quantization '{sc.quantization}' has no vLLM equivalent: "
                         "dropped (the draft runs unquantized)")
    if sc.method in HEAD_METHODS and sc.model:  # a Hub id or folder, as vLLM takes it
        config["model"] = sc.model
        if sc.model in BUILTIN_HEADS:
            config["model"] = str(builtin_head_folder(sc.model))
            notes.append(f"built-in head '{sc.model}' is the folder {config['model']}")
            if sc.method == "medusa":  # see drafters/medusa.py: token_map over the target's
                notes.append("its Medusa heads read the target's own LM head (the rows in "
                             "token_map); vLLM's Medusa needs LM heads inside the checkpoint, "
                             "so vLLM cannot load these heads as they are")
    if sc.method == "ngram":
        config["prompt_lookup_max"] = sc.prompt_lookup_max
        config["prompt_lookup_min"] = sc.prompt_lookup_min
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
