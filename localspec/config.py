"""LocalSpec's configuration: the names, limits and defaults that more than one part reads, in
one torch-free module (reading a preset costs milliseconds). A constant only one subsystem
reads lives beside it instead (the API's in ``api/``, the saved conversations' in ``chats/``,
the sliders' span in ``ui/layout``, the command line's in ``cli/options``).

What a preset or a request may say: dtypes, devices, quantizations, hardware classes, the
bounds of every setting and their defaults; methods are checked against the drafter registry
(``localspec.registry``), so a method registered there is valid here with no list to update.
The schema is frozen pydantic models (``extra="forbid"``, ``Literal`` choices, numeric bounds,
finite floats only), as vLLM's ``SpeculativeConfig``; the engine, the loader, the command line
and the app read their choices and limits from here, and all below the edge trusts a validated
object. ``[speculative_config]`` keeps vLLM's keys and meanings, so the same table can go to
``vllm serve --speculative-config``; LocalSpec's own knobs live in ``[localspec]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from platformdirs import user_data_dir
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from localspec.drafter_set import DrafterSet, check_members, members_of, resolve
from localspec.errors import PresetError, RequestError
from localspec.registry import AUTO, drafter_spec, method_names

# ----------------------------------------------------------------------------- names


def _registered_method(value: str) -> str:
    """``value`` if the registry has a method of that name; else the error a ``Literal`` of
    the registered names gives (described as such by ``describe_errors``)."""
    names = method_names()
    if value not in names:
        quoted = [repr(name) for name in names]
        expected = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
        raise PydanticCustomError("literal_error", "Input should be {expected}",
                                  {"expected": expected})
    return value


# A registered method's name: checked when a preset is validated, not frozen at import.
Method = Annotated[str, AfterValidator(_registered_method)]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
QuantizationName = Literal["none", "w4a8", "requant-q4k", "requant-q3m", "w8a8",
                           "int8-weight-only", "bnb-4bit", "bnb-8bit"]
HardwareClass = Literal["cpu", "gpu-8gb", "gpu-12gb", "gpu-16gb", "gpu-24gb", "h100-80gb"]

DTYPES: tuple[str, ...] = get_args(Dtype)
DEVICES: tuple[str, ...] = get_args(Device)
QUANTIZATIONS: tuple[str, ...] = get_args(QuantizationName)
RENAMED_QUANTIZATIONS = {"w4a8-requant": "requant-q4k"}  # names a preset may still use
Quantization = Annotated[QuantizationName, BeforeValidator(
    lambda value: RENAMED_QUANTIZATIONS.get(value, value) if isinstance(value, str) else value)]
# Served by the CPU forward (runtime.decoder): "w8a8" int8 weights, per-token int8 activations;
# "w4a8" a GGUF's matrices of NATIVE_GGUF_TYPES as stored (others w8a8); "requant-q4k" / "-q3m"
# every layer matrix in Q4_K / Q3_M (3 bits): lossy against the file, for drafts, which guess.
CPU_QUANTIZATIONS: tuple[str, ...] = ("w8a8", "w4a8", "requant-q4k", "requant-q3m")
HARDWARE: tuple[str, ...] = get_args(HardwareClass)
DEFAULT_PRESET = "cpu-qwen-coder-draft"
# Heads shipped in the package (localspec/data/heads/<name>/) by name, with their targets.
BUILTIN_HEADS: dict[str, str] = {"qwen2.5-coder-1.5b-eagle3": "qwen2.5-coder-1.5b-instruct",
                                  "qwen2.5-coder-1.5b-medusa": "qwen2.5-coder-1.5b-instruct"}


def cache_root() -> Path:
    """Where assembled GGUF files and converted weights live (``LOCALSPEC_CACHE`` overrides)."""
    env = os.environ.get("LOCALSPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "localspec"


# The user's own data (saved conversations, added models, presets): not the cache, which a
# user may delete to free space. ``LOCALSPEC_DATA`` moves it; else the platform's data folder.
DATA_ENV = "LOCALSPEC_DATA"
CHATS_FILE = "chats.db"  # SQLite, WAL mode (localspec/chats/: chats_path)


def data_root() -> Path:
    """Where the user's data lives: ``$LOCALSPEC_DATA``, else the platform's user data folder
    (``~/.local/share/localspec`` on Linux)."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else Path(user_data_dir("localspec", appauthor=False))


# The model library (models/library.py): the user's models folder, where Hub downloads land
# (``LOCALSPEC_MODELS`` moves it); paths added by hand and user presets: the data folder.
MODELS_ENV = "LOCALSPEC_MODELS"
GGUF_META_FOLDER = "meta"  # under cache_root(): a GGUF's config and tokenizer (gguf_meta)
# What the fast native CPU path serves: the architectures its forward runs (runtime.decoder)
# and the GGUF matrix types w4a8 keeps as stored (runtime.gguf_kquants).
NATIVE_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
NATIVE_GGUF_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0")


def models_root() -> Path:
    """The user's models folder: ``$LOCALSPEC_MODELS``, else ``models/`` in the data folder."""
    env = os.environ.get(MODELS_ENV)
    return Path(env).expanduser() if env else data_root() / "models"


# ----------------------------------------------------------------------------- limits

MAX_SPECULATIVE_TOKENS = 32  # the most drafts one target pass verifies
MAX_TREE_WIDTH = 8  # the most candidates for a first draft token (a static draft tree)
DEFAULT_CONTEXT = 4096  # KV tokens a GPU preset reserves: its memory estimate, cuda_graphs' cache
MAX_LOOKUP_NGRAM = 64  # also the longest match the suffix drafter measures
# Earlier answers' tokens the suffix drafter keeps (~16 bytes a token), the oldest evicted first
HISTORY_DRAFT_TOKENS = 2_000_000
MAX_NEW_TOKENS = 32768
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1_000_000
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
# A file the user names (prompts, presets, texts, documents): bounds what /dev/zero makes us read
MAX_USER_FILE_BYTES = 64 * 2**20
# A training corpus (all its files): ~60M tokens, days of features on a CPU; bounds `--corpus /`
MAX_CORPUS_BYTES = 4 * MAX_USER_FILE_BYTES
# Requests the API holds at once, waiting or generating: one more gets a 429, never a hang
API_MAX_QUEUED = 16
# Slots whose requests share target passes (`serve --parallel`); each holds its own KV caches
MAX_PARALLEL = 16
API_KEY_ENV = "LOCALSPEC_API_KEY"  # read when --api-key is not given
# Structured output (engine/grammar.py): an answer's format (its ``OutputFormat.key()`` text)
# longer than this, or a compile slower than this, is refused with a FormatError (HTTP 400)
MAX_FORMAT_CHARS = 200_000
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
GRAMMAR_CACHE_SIZE = 32  # compiled formats a pipeline keeps (by OutputFormat.key())
# The whitespace a JSON value may hold between its tokens: enough for pretty-printed nesting,
# bounded so that a model cannot spend its answer on blanks
JSON_WHITESPACE = r"[ \t\n]{0,16}"
# Tokens the grammar forces that a step may append after the drafter's last one (free drafts)
MAX_FORCED_DRAFTS = 16

SpecTokens = Annotated[int, Field(ge=1, le=MAX_SPECULATIVE_TOKENS)]
TreeWidth = Annotated[int, Field(ge=1, le=MAX_TREE_WIDTH)]
LookupN = Annotated[int, Field(ge=1, le=MAX_LOOKUP_NGRAM)]
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K)]
NewTokens = Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Probability01 = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]
SpecFactor = Annotated[float, Field(gt=0.0, le=MAX_SPECULATIVE_TOKENS, allow_inf_nan=False)]
NonEmpty = Annotated[str, Field(min_length=1)]

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


# ----------------------------------------------------------------------------- the schema


def _gguf_on_cpu(spec: TargetConfig | SpeculativeConfig, device: str) -> bool:
    """A .gguf model, no quantization named, off CUDA: served natively (w4a8), not as bf16."""
    return ("quantization" not in spec.model_fields_set and device != "cuda"
            and str(spec.model or "").lower().endswith(".gguf"))


class TargetConfig(BaseModel):
    """The model that answers."""

    model_config = _STRICT

    model: NonEmpty  # built-in name | Hugging Face repo id | folder | .gguf path
    dtype: Dtype = "auto"
    device: Device = "auto"
    quantization: Quantization = "none"  # "w4a8" for a .gguf off CUDA (_gguf_on_cpu)

    @model_validator(mode="after")
    def _fastest_for_gguf(self) -> TargetConfig:
        if _gguf_on_cpu(self, self.device):  # frozen: set while validating
            object.__setattr__(self, "quantization", "w4a8")
        return self


class SpeculativeConfig(BaseModel):
    """vLLM's ``speculative_config`` keys (a subset), same names and meanings."""

    model_config = _STRICT

    method: Method = "none"
    # the draft model or head the method needs (registry: its ``needs``): a built-in name,
    # folder or Hugging Face repo id
    model: NonEmpty | None = None
    num_speculative_tokens: SpecTokens = 5
    prompt_lookup_max: LookupN = 4
    prompt_lookup_min: LookupN = 1
    quantization: Quantization = "none"  # of the draft model
    # method "suffix": vLLM's keys and defaults (drafters/suffix.py says what they do)
    suffix_decoding_max_tree_depth: LookupN = 24
    suffix_decoding_max_spec_factor: SpecFactor = 1.0
    suffix_decoding_min_token_prob: Probability01 = 0.1

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        needs = drafter_spec(self.method).needs
        if needs != "nothing" and not self.model:
            what = ("model to load" if needs == "draft_model"
                    else "head to load: a folder or a Hugging Face repo id")
            raise ValueError(f"method '{self.method}' needs 'model' (the draft {what})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("need prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} > {self.prompt_lookup_max}")
        if (needs == "draft_model" or self.method == AUTO) and _gguf_on_cpu(self, "auto"):
            object.__setattr__(self, "quantization", "w4a8")
        return self


class SamplingConfig(BaseModel):
    """How the target's distribution is shaped; temperature 0 is greedy."""

    model_config = _STRICT

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # 0 = off
    max_new_tokens: NewTokens = 512
    seed: Seed = 0


class LocalSpecConfig(BaseModel):
    """Settings vLLM does not have."""

    model_config = _STRICT

    adaptive_k: bool = True  # choose k each step from measured acceptance and costs
    draft_dtype: Dtype = "auto"
    draft_confidence_threshold: Probability01 = 0.3  # end a chain below this chance kept whole
    logits_fp32: bool = True  # target's final norm and top logits in float32
    draft_vocab_size: Annotated[int, Field(ge=0)] = 0  # draft LM head cut to N ids (0 = all)
    lookup_first: bool = False  # n-gram lookup first, the draft model or head on a miss
    tree_width: TreeWidth = 1  # greedy: first-token candidates verified as a tree (1: a chain)
    # method "auto"'s members (none listed: drafter_set.members_of's; checked by check_members)
    drafters: Annotated[tuple[Method, ...], Field(strict=False)] = ()
    head: NonEmpty | None = None  # auto's head beside the draft model [speculative_config] names
    # CUDA only, experimental: static KV caches of DEFAULT_CONTEXT tokens and every forward of
    # up to 32 tokens (target and draft) replayed as a CUDA graph, compiled once per width
    cuda_graphs: bool = False
    history_drafts: bool = True  # the suffix drafter reads earlier answers too (saved chats)


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how (validated values only)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "none"
    revision: str | None = None
    allow_pickle: bool = False


class Preset(BaseModel):
    """A target, a drafter and settings: one ``presets/*.toml`` file."""

    model_config = _STRICT

    name: NonEmpty
    description: NonEmpty
    hardware: HardwareClass
    target: TargetConfig
    speculative_config: SpeculativeConfig = SpeculativeConfig()
    sampling: SamplingConfig = SamplingConfig()
    localspec: LocalSpecConfig = LocalSpecConfig()
    path: Any = Field(default=None, exclude=True)  # the file it came from (set by the loader)

    def target_spec(self) -> ModelSpec:
        t = self.target
        return ModelSpec(t.model, dtype=t.dtype, device=t.device, quantization=t.quantization)

    @model_validator(mode="after")
    def _check_members(self) -> Preset:
        sc, ls = self.speculative_config, self.localspec
        check_members(sc.method, ls.drafters, self._member_names(), sc.model is not None,
                      ls.head is not None)
        return self

    def head_source(self) -> str:
        """The head a head drafter reads: ``[localspec] head``, else ``[speculative_config]
        model``."""
        return self.localspec.head or self.speculative_config.model or ""

    def drafter_set(self, method: str | None = None) -> DrafterSet:
        """Method ``method`` (default: the preset's) resolved into the drafters its engine
        runs; PresetError unless it is registered and this preset meets each member's needs
        (``drafter_set.resolve``). Needs no model: callers resolve every method they will run
        before loading anything."""
        method = method or self.speculative_config.method
        return resolve(method, self._member_names(method), self._member_names(),
                       self.draft_spec() is not None, self.name, self.speculative_config.method)

    def _member_names(self, method: str | None = None) -> tuple[str, ...]:
        """The drafters an engine for ``method`` (default: the preset's) runs (members_of)."""
        sc, ls = self.speculative_config, self.localspec
        return members_of(method or sc.method, sc.method, sc.model is not None, ls.drafters,
                          ls.lookup_first)

    def draft_spec(self) -> ModelSpec | None:
        """The draft model to load (None when ``model`` is absent or names a head)."""
        sc, needs = self.speculative_config, {drafter_spec(m).needs for m in self._member_names()}
        if sc.model is None or ("head" in needs and self.localspec.head is None):
            return None
        return ModelSpec(sc.model, dtype=self.localspec.draft_dtype, device=self.target.device,
                         quantization=sc.quantization)


class RequestSettings(SamplingConfig):
    """One generation's settings: the preset's, with any of them overridden."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    num_speculative_tokens: SpecTokens = 5
    adaptive: bool = True
    tree_width: TreeWidth = 1


# ----------------------------------------------------------------------------- messages

_TABLES = ("target", "speculative_config", "sampling", "localspec")


def _where(loc: tuple[Any, ...]) -> str:
    if loc and loc[0] in _TABLES:
        return f"[{loc[0]}]" + "".join(f" {part}" for part in loc[1:])
    return " ".join(str(part) for part in loc)


def _allowed(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Keys allowed where an unknown key ``loc`` was found."""
    if len(loc) > 1 and loc[0] in _TABLES:
        model = Preset.model_fields[loc[0]].annotation  # type: ignore[assignment]
    return [name for name, info in model.model_fields.items() if not info.exclude]


def describe_errors(exc: ValidationError, model: type[BaseModel]) -> str:
    """pydantic's errors as lines that name the key, the value and what is allowed."""
    lines = []
    for error in exc.errors(include_url=False):
        loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
        where, key = _where(loc), str(loc[-1]) if loc else ""
        parent = _where(loc[:-1])
        if kind == "extra_forbidden":
            allowed = ", ".join(_allowed(model, loc))
            lines.append(f"{parent + ': ' if parent else ''}unknown key '{key}'; allowed: "
                         f"{allowed}")
        elif kind == "missing":
            lines.append(f"{parent + ': ' if parent else ''}missing required key '{key}'")
        elif kind in ("model_type", "model_attributes_type"):
            lines.append(f"{where} must be a table, got {type(value).__name__}")
        elif kind == "literal_error":
            choices = error.get("ctx", {}).get("expected", "")
            lines.append(f"{where} = {value!r} is not one of: {choices}")
        elif kind == "value_error":
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{where + ': ' if where else ''}{message}")
        else:
            lines.append(f"{where} = {value!r}: {error['msg']}")
    return "; ".join(lines)


def parse_preset(data: dict[str, Any], where: str = "preset") -> Preset:
    """Validate a parsed TOML document (a dict) and build a Preset; PresetError names
    ``where``, the key and what is allowed."""
    if not isinstance(data, dict):
        raise PresetError(f"{where}: a preset is a TOML table of keys")
    if "path" in data:
        raise PresetError(f"{where}: unknown key 'path'")
    try:
        return Preset.model_validate(data)
    except ValidationError as exc:
        raise PresetError(f"{where}: {describe_errors(exc, Preset)}") from None


def request_settings(base: dict[str, Any], overrides: dict[str, Any]) -> RequestSettings:
    """The preset's settings ``base`` with ``overrides`` (None = keep); RequestError if any is
    out of range (NaN, negative, a seed beyond 64 bits, ...)."""
    values = {**base, **{key: value for key, value in overrides.items() if value is not None}}
    try:
        return RequestSettings.model_validate(values)
    except ValidationError as exc:
        raise RequestError(describe_errors(exc, RequestSettings)) from None


def unquantized_target(preset: Preset) -> Preset:
    """``preset`` with its target unquantized in bfloat16: what a quantized target is measured
    against (``quality``) and compared with (``bench``'s hf-* methods)."""
    target = preset.target.model_copy(update={"quantization": "none", "dtype": "bfloat16"})
    return preset.model_copy(update={"target": target})
