"""How much memory a preset needs, and what this machine has.

The estimate is computed, never typed by hand: the parameter count comes from a model's
architecture (hidden size, intermediate size, layers, attention and key/value heads, head size,
vocabulary, tied embeddings), the bytes per weight from the dtype and quantization, and the KV
cache from layers x kv heads x head size x context. Architectures are read from a real
``config.json`` whenever one is on disk (a local folder, a converted built-in model, the Hugging
Face cache); otherwise from ``localspec/data/model_configs.json``, the public config values of the
models the shipped presets name, so ``python -m localspec presets`` works offline.

It deliberately does NOT model activations of long prompts, allocator fragmentation or the CUDA
context exactly: a fixed overhead plus a margin stands in for those, so treat a preset within a
few hundred MB of a card's size as "may not fit".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import psutil

from localspec.config import (
    BUILTIN_HEADS,
    DEFAULT_CONTEXT,
    DTYPES,
    GGUF_META_FOLDER,
    HARDWARE,
    Preset,
    cache_root,
)
from localspec.errors import ModelLoadError
from localspec.models.builtin import BUILTIN_MODELS
from localspec.presets import builtin_head_folder
from localspec.registry import drafter_spec

GIB = 1024**3
KNOWN_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "model_configs.json"
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
# Memory of each hardware class, as the preset's ``hardware`` names it.
HARDWARE_MEMORY = {"gpu-8gb": 8 * GIB, "gpu-12gb": 12 * GIB, "gpu-16gb": 16 * GIB,
                   "gpu-24gb": 24 * GIB, "h100-80gb": 80 * GIB}
RUNTIME_OVERHEAD = GIB // 2  # CUDA context / PyTorch runtime, allocator slack
WEIGHT_MARGIN = 0.05  # temporary buffers while loading and running, as a share of the weights


class HardwareError(ValueError):
    """An architecture is unknown, so no estimate can be made; the message says what to do."""


@dataclass(frozen=True)
class Architecture:
    """The config.json facts that decide a decoder-only transformer's size."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool  # biases on q, k, v (Qwen2 always; Llama with attention_bias)
    o_bias: bool = False  # bias on o (Llama with attention_bias)
    mlp_bias: bool = False
    max_position_embeddings: int = 0

    @classmethod
    def from_config(cls, config: dict) -> Architecture:
        """From a parsed config.json (Llama, Qwen2 and Mistral-style models)."""
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias")),
                o_bias=bool(config.get("attention_bias")) and config.get("model_type") != "qwen2",
                mlp_bias=bool(config.get("mlp_bias")),
                max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise HardwareError(f"config lacks a usable architecture field: {exc}") from exc


@dataclass(frozen=True)
class ParameterCount:
    """A decoder's parameters split by how quantization treats them."""

    linear: int  # weights of the decoder layers' linear projections (what quantization shrinks)
    linear_rows: int  # their output rows (one scale each for int8 schemes)
    other: int  # embeddings, LM head, norms, biases: kept in the compute dtype

    @property
    def total(self) -> int:
        return self.linear + self.other


def count_parameters(arch: Architecture) -> ParameterCount:
    """Exact parameter count of a Llama/Qwen2-style decoder from its architecture.

    Plain arithmetic rather than a model built on the meta device, so the preset listing needs
    no torch; the tests check it against such models for every shipped architecture."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
    mlp = 3 * h * arch.intermediate_size  # gate, up, down
    per_layer_rows = q + 2 * kv + h + 2 * arch.intermediate_size + h
    biases = ((q + 2 * kv) if arch.qkv_bias else 0) + (h if arch.o_bias else 0)
    biases += (2 * arch.intermediate_size + h) if arch.mlp_bias else 0
    norms = 2 * h
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    layers = arch.num_hidden_layers
    return ParameterCount(
        linear=layers * (attention + mlp),
        linear_rows=layers * per_layer_rows,
        other=embeddings + layers * (biases + norms) + h,  # + the final norm
    )


def weight_bytes(arch: Architecture, quantization: str = "none", dtype: str = "auto") -> int:
    """Bytes of weights once loaded: bnb-4bit is NF4 (half a byte) plus one float32 absmax per
    block of 64, bnb-8bit one byte plus a float32 scale per row, int8-weight-only one byte plus a
    compute-dtype scale per row; embeddings, LM head, norms and biases stay in the dtype. w8a8
    (the CPU forward) is one byte plus a float32 scale per row for every linear layer, and
    its LM head is held twice in int8 (packed for oneDNN, and plain for cutting a draft's rows):
    as many bytes as a bfloat16 head, on top of the embeddings even when they were tied. w4a8
    keeps a GGUF's Q4_K and Q6_K matrices as they are (4.5 bits a weight counted for every
    linear layer; a Q4_K_M file's Q6_K ones read 6.6) and is otherwise w8a8; requant-q3m
    counts Q3_M as packed, 3.75 bits a weight."""
    counts = count_parameters(arch)
    unit = DTYPE_BYTES.get(dtype, 2)
    other = counts.other * unit
    if quantization == "none":
        return counts.linear * unit + other
    if quantization == "bnb-4bit":
        return counts.linear // 2 + counts.linear // 64 * 4 + other
    if quantization == "bnb-8bit":
        return counts.linear + counts.linear_rows * 4 + other
    if quantization == "int8-weight-only":
        return counts.linear + counts.linear_rows * unit + other
    tied_head = arch.vocab_size * arch.hidden_size * 2 if arch.tie_word_embeddings else 0
    if quantization == "w8a8":
        return counts.linear + counts.linear_rows * 4 + other + tied_head
    if quantization in ("w4a8", "requant-q4k"):
        return counts.linear * 9 // 16 + other + tied_head
    if quantization == "requant-q3m":  # 3.75 bits a weight, as packed
        return counts.linear * 15 // 32 + other + tied_head
    raise HardwareError(f"no size rule for quantization '{quantization}'")


def kv_cache_bytes(arch: Architecture, context: int, dtype: str = "auto") -> int:
    """Keys and values of every layer for ``context`` tokens."""
    per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    return per_token * context * DTYPE_BYTES.get(dtype, 2)


# ----------------------------------------------------------------------------- architectures


@lru_cache(maxsize=1)
def _known_configs() -> dict[str, dict]:
    return json.loads(KNOWN_CONFIGS.read_text(encoding="utf-8"))["models"]


def hf_repo_for(model: str) -> str:
    """The Hugging Face repo id for a built-in name (what vLLM would load); else ``model``."""
    return _known_configs().get(model, {}).get("hf_repo", model)


def _config_on_disk(model: str) -> Path | None:
    """A real config.json for ``model`` on disk: local folder, converted built-in, HF cache."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if model in BUILTIN_MODELS:  # converted or read from the GGUF, in any dtype
        folders = [model, *(f"{model}.{dtype}" for dtype in DTYPES)]
        found = [cache_root() / base / f / "config.json" for base in ("models", GGUF_META_FOLDER)
                 for f in folders]
        return next((c for c in found if c.is_file()), None)
    if model.count("/") == 1 and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except (ImportError, ValueError):
            return None
        return Path(cached) if isinstance(cached, str) else None
    return None


def architecture(model: str) -> Architecture:
    """The architecture of a model named as presets name models."""
    if model.lower().endswith(".gguf") and Path(model).expanduser().is_file():
        from localspec.runtime.gguf_header import gguf_config, read_gguf_header

        try:
            return Architecture.from_config(gguf_config(read_gguf_header(Path(model).expanduser())))
        except ModelLoadError as exc:
            raise HardwareError(str(exc)) from exc
    config_path = _config_on_disk(model)
    if config_path is not None:
        return Architecture.from_config(json.loads(config_path.read_text(encoding="utf-8")))
    known = _known_configs().get(model)
    if known is None:
        raise HardwareError(
            f"no config.json for '{model}' on disk and it is not in {KNOWN_CONFIGS.name}: "
            "download it once (or point the preset at a local folder) to get a memory estimate"
        )
    return Architecture.from_config(known)


def head_weight_bytes(arch: Architecture, method: str) -> int:
    """Bytes of a published draft head of ``method`` for a target of ``arch``, in 16 bits as
    they ship: the registry's estimate for the method (0 when it has none). Their KV cache (one
    layer) is left out: a 130th of an 8B target's."""
    estimate = drafter_spec(method).weight_bytes
    return estimate(arch) if estimate is not None else 0


def shipped_head_bytes(name: str | None) -> int:
    """The size of built-in head ``name``'s weights as they ship (0 if it is not one): where
    ``head_weight_bytes`` can only assume a published head's shape (Medusa with LM heads of
    its own: ~2 GB for the 1.5B, against the built-in heads' 14 MB)."""
    if name not in BUILTIN_HEADS:
        return 0
    return sum(f.stat().st_size for f in builtin_head_folder(name).glob("*.safetensors"))


# ----------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class MemoryEstimate:
    target_weights: int
    draft_weights: int
    kv_cache: int
    overhead: int
    context: int
    on_gpu: bool

    @property
    def total(self) -> int:
        return self.target_weights + self.draft_weights + self.kv_cache + self.overhead

    def describe(self) -> str:
        where = "GPU" if self.on_gpu else "RAM"
        return (f"~{self.total / GIB:.1f} GiB {where} (target {self.target_weights / GIB:.1f}, "
                f"draft {self.draft_weights / GIB:.1f}, KV cache {self.kv_cache / GIB:.1f} for "
                f"{self.context} tokens, overhead {self.overhead / GIB:.1f})")


def runs_on_gpu(preset: Preset) -> bool:
    return preset.target.device == "cuda" or preset.hardware != "cpu"


def estimate_preset(preset: Preset, context: int = DEFAULT_CONTEXT) -> MemoryEstimate:
    """Memory the preset needs: target and draft weights (a draft model's from its
    architecture, a built-in head's from its files, any other drafter's from the registry's
    estimate for its method), KV caches of target and draft model, overhead."""
    target = architecture(preset.target.model)
    ctx = min(context, target.max_position_embeddings or context)
    target_bytes = weight_bytes(target, preset.target.quantization, preset.target.dtype)
    kv = kv_cache_bytes(target, ctx, preset.target.dtype)
    draft_bytes = 0
    draft_spec = preset.draft_spec()
    for method in preset.drafter_set().members:  # "auto": each member's
        needs = drafter_spec(method).needs
        if draft_spec is not None and needs == "draft_model":
            draft = architecture(draft_spec.model)
            draft_bytes += weight_bytes(draft, draft_spec.quantization, draft_spec.dtype)
            kv += kv_cache_bytes(draft, ctx, draft_spec.dtype)
        elif needs == "head":
            head = preset.head_source()
            draft_bytes += shipped_head_bytes(head) or head_weight_bytes(target, method)
        else:  # a drafter with weights of its own (none of the built-in ones)
            draft_bytes += head_weight_bytes(target, method)
    overhead = RUNTIME_OVERHEAD + int(WEIGHT_MARGIN * (target_bytes + draft_bytes))
    return MemoryEstimate(target_bytes, draft_bytes, kv, overhead, ctx, runs_on_gpu(preset))


# ----------------------------------------------------------------------------- this machine


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int


@dataclass(frozen=True)
class Hardware:
    cpu_count: int
    ram_total: int
    ram_available: int
    gpus: tuple[Gpu, ...] = ()

    def describe(self) -> str:
        gpus = ", ".join(f"{g.name} {g.memory / GIB:.0f} GiB" for g in self.gpus) or "no CUDA GPU"
        return (f"{self.cpu_count} CPU cores, {self.ram_total / GIB:.1f} GiB RAM "
                f"({self.ram_available / GIB:.1f} GiB free), {gpus}")


def detect_hardware() -> Hardware:
    """CPU cores, RAM and CUDA GPUs of this machine. RAM comes from psutil (``/proc/meminfo`` on
    Linux, the native APIs elsewhere), so there is no parser of our own to keep right. torch is
    imported here, for the GPUs, and nowhere else in this module: estimates stay torch-free."""
    memory = psutil.virtual_memory()
    gpus: list[Gpu] = []
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(Gpu(props.name, int(props.total_memory)))
    except (ImportError, RuntimeError):
        pass
    return Hardware(os.cpu_count() or 1, int(memory.total), int(memory.available),
                    tuple(gpus))


def fits(estimate: MemoryEstimate, hardware: Hardware) -> tuple[bool, str]:
    """Whether the estimate fits this machine, and a short reason either way."""
    need = estimate.total / GIB
    if estimate.on_gpu:
        if not hardware.gpus:
            return False, f"needs a CUDA GPU with ~{need:.1f} GiB; this machine has none"
        best = max(g.memory for g in hardware.gpus)
        if best < estimate.total:
            return False, f"needs ~{need:.1f} GiB of GPU memory; the largest GPU has " \
                          f"{best / GIB:.1f} GiB"
        return True, f"~{need:.1f} GiB of {best / GIB:.1f} GiB GPU memory"
    if hardware.ram_total and hardware.ram_total < estimate.total:
        return False, f"needs ~{need:.1f} GiB RAM; this machine has {hardware.ram_total / GIB:.1f}"
    return True, f"~{need:.1f} GiB of {hardware.ram_total / GIB:.1f} GiB RAM"


def hardware_order(hardware_class: str) -> int:
    return HARDWARE.index(hardware_class) if hardware_class in HARDWARE else len(HARDWARE)


# ----------------------------------------------------------------------------- survey


@dataclass(frozen=True)
class PresetSummary:
    """One preset file as the preset list shows it: valid or not, its estimate, whether it fits."""

    key: str  # the name `--preset` takes (file stem)
    preset: Preset | None
    error: str | None  # why the file does not load, if it does not
    estimate: MemoryEstimate | None
    fits: bool
    reason: str

    @property
    def hardware(self) -> str:
        return self.preset.hardware if self.preset is not None else "invalid"

    @property
    def title(self) -> str:
        return self.preset.name if self.preset is not None else f"{self.key} (invalid)"


def summarize_preset(key: str, hardware: Hardware) -> PresetSummary:
    from localspec.presets import PresetError, load_preset

    try:
        preset = load_preset(key)
    except PresetError as exc:
        return PresetSummary(key, None, str(exc), None, False, "invalid preset file")
    try:
        estimate = estimate_preset(preset)
    except HardwareError as exc:
        return PresetSummary(key, preset, None, None, True, f"no estimate: {exc}")
    ok, reason = fits(estimate, hardware)
    return PresetSummary(key, preset, None, estimate, ok, reason)


def survey_presets(hardware: Hardware, keys: list[str] | None = None) -> list[PresetSummary]:
    """Every preset (or ``keys``): the shipped ones, then the user's, each ordered by hardware
    class then name."""
    from localspec.presets import list_preset_names, user_preset_names

    rows = [summarize_preset(k, hardware) for k in (keys or list_preset_names())]
    own = set(user_preset_names())  # the user's presets come after the shipped ones
    return sorted(rows, key=lambda r: (r.key in own, hardware_order(r.hardware), r.key))
