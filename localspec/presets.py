"""Presets as data: ``presets/*.toml`` read with the standard library and validated strictly.

A preset bundles a target, a drafter and settings. Its ``[speculative_config]`` uses vLLM's keys
with vLLM's meanings (``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_max``,
``prompt_lookup_min``, ``quantization``), so the same table can be handed to ``vllm serve
--speculative-config``. LocalSpec's own knobs that vLLM does not have live in ``[localspec]``.
Every error names the file, the key and what would be accepted.
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from localspec.engine import MAX_SPECULATIVE_TOKENS
from localspec.models import DEVICES, DTYPES, QUANTIZATIONS, ModelSpec

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
DEFAULT_PRESET = "cpu-qwen-coder-draft"
HARDWARE = ("cpu", "gpu-8gb", "gpu-12gb", "gpu-16gb", "gpu-24gb", "h100-80gb")
METHODS = ("none", "draft_model", "ngram")


class PresetError(ValueError):
    """A preset is missing, unreadable or invalid; the message says where and why."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys (a subset), same names and meanings."""

    method: str = "none"
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    quantization: str = "none"  # of the draft model


@dataclass(frozen=True)
class TargetConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "none"


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    seed: int = 0


@dataclass(frozen=True)
class LocalSpecConfig:
    """Settings vLLM does not have."""

    adaptive_k: bool = True  # choose k each step from measured acceptance and costs
    draft_dtype: str = "auto"
    draft_confidence_threshold: float = 0.3  # stop drafting when the draft's best guess is below
    logits_fp32: bool = True  # target's final norm and LM head in float32 (fewer bf16 near-ties)
    draft_vocab_size: int = 0  # cut the draft's LM head to the first N ids + specials (0 = all)
    lookup_first: bool = False  # draft_model: try n-gram lookup first, the draft model on a miss


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    hardware: str
    target: TargetConfig
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    localspec: LocalSpecConfig = field(default_factory=LocalSpecConfig)
    path: Path | None = None

    def target_spec(self) -> ModelSpec:
        t = self.target
        return ModelSpec(t.model, dtype=t.dtype, device=t.device, quantization=t.quantization)

    def draft_spec(self) -> ModelSpec | None:
        sc = self.speculative_config
        if sc.model is None:
            return None
        return ModelSpec(sc.model, dtype=self.localspec.draft_dtype, device=self.target.device,
                         quantization=sc.quantization)


def _build(cls: type, table: Any, where: str) -> Any:
    """Instantiate a flat dataclass from a TOML table, checking keys and types."""
    if not isinstance(table, dict):
        raise PresetError(f"{where} must be a table")
    known = {f.name: f for f in fields(cls) if f.name != "path"}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise PresetError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(known)}")
    for key, value in table.items():
        expected = known[key].type
        ok = {
            "str": isinstance(value, str),
            "str | None": isinstance(value, str),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
        }.get(expected, True)
        if not ok:
            raise PresetError(f"{where}.{key} must be of type {expected.replace(' | None', '')}, "
                              f"got {type(value).__name__} {value!r}")
    missing = [f.name for f in known.values() if f.default is MISSING
               and f.default_factory is MISSING and f.name not in table]
    if missing:
        raise PresetError(f"{where}: missing required key(s) {', '.join(missing)}")
    return cls(**table)


def _choice(value: str, allowed: tuple[str, ...], where: str) -> None:
    if value not in allowed:
        raise PresetError(f"{where} = '{value}' is not one of: {', '.join(allowed)}")


def parse_preset(data: dict[str, Any], where: str = "preset") -> Preset:
    """Validate a parsed TOML document and build a Preset."""
    data = dict(data)
    if "target" not in data:
        raise PresetError(f"{where}: missing [target] table")
    tables = {
        "target": TargetConfig,
        "speculative_config": SpeculativeConfig,
        "sampling": SamplingConfig,
        "localspec": LocalSpecConfig,
    }
    built = {key: _build(cls, data.pop(key, {}), f"{where} [{key}]") for key, cls in tables.items()}
    top = {"name": str, "description": str, "hardware": str}
    unknown = sorted(set(data) - set(top))
    if unknown:
        raise PresetError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed at top level: "
                          f"{', '.join(top)} and tables [{'], ['.join(tables)}]")
    for key in top:
        if not isinstance(data.get(key), str) or not data[key]:
            raise PresetError(f"{where}: '{key}' must be a non-empty string")
    preset = Preset(name=data["name"], description=data["description"], hardware=data["hardware"],
                    **built)
    _validate(preset, where)
    return preset


def _validate(preset: Preset, where: str) -> None:
    _choice(preset.hardware, HARDWARE, f"{where} hardware")
    t, sc, s, ls = preset.target, preset.speculative_config, preset.sampling, preset.localspec
    _choice(t.dtype, ("auto", *DTYPES), f"{where} [target] dtype")
    _choice(ls.draft_dtype, ("auto", *DTYPES), f"{where} [localspec] draft_dtype")
    _choice(t.device, DEVICES, f"{where} [target] device")
    _choice(t.quantization, QUANTIZATIONS, f"{where} [target] quantization")
    _choice(sc.quantization, QUANTIZATIONS, f"{where} [speculative_config] quantization")
    _choice(sc.method, METHODS, f"{where} [speculative_config] method")
    if sc.method == "draft_model" and not sc.model:
        raise PresetError(f"{where} [speculative_config]: method 'draft_model' needs 'model'")
    if not 1 <= sc.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise PresetError(f"{where} [speculative_config] num_speculative_tokens must be 1.."
                          f"{MAX_SPECULATIVE_TOKENS}, got {sc.num_speculative_tokens}")
    if not 1 <= sc.prompt_lookup_min <= sc.prompt_lookup_max:
        raise PresetError(f"{where} [speculative_config]: need 1 <= prompt_lookup_min <= "
                          "prompt_lookup_max")
    if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0 or s.max_new_tokens < 1:
        raise PresetError(f"{where} [sampling]: need temperature >= 0, 0 < top_p <= 1, "
                          "top_k >= 0, max_new_tokens >= 1")
    if ls.draft_vocab_size < 0:
        raise PresetError(f"{where} [localspec] draft_vocab_size must be >= 0 (0 = full)")
    if not 0 <= ls.draft_confidence_threshold < 1:
        raise PresetError(f"{where} [localspec] draft_confidence_threshold must be in [0, 1)")


def preset_path(name_or_path: str) -> Path:
    """A name from presets/ (with or without .toml) or a path to a file."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" and path.is_file():
        return path
    candidate = PRESETS_DIR / f"{name_or_path.removesuffix('.toml')}.toml"
    if candidate.is_file():
        return candidate
    raise PresetError(f"unknown preset '{name_or_path}': not a file, and presets/ has "
                      f"{', '.join(list_preset_names()) or 'no presets'}")


def load_preset(name_or_path: str) -> Preset:
    path = preset_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PresetError(f"{path}: not valid TOML: {exc}") from exc
    return replace(parse_preset(data, where=str(path)), path=path)


def list_preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))
