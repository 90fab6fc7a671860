"""The drafter registry: every speculative method LocalSpec knows, each described once.

One ``DrafterSpec`` per method says what the rest of the program needs to know about it
without loading it: its name (what a preset's ``[speculative_config] method`` says), its label
in the app's method switch, vLLM's name for it (``export-vllm``), what it needs besides the
target (nothing, a draft model, or a head named in ``[speculative_config] model``), how much
memory its own weights take, whether ``train-drafter`` can train one, and how it is built.
The preset schema, the pipeline, the app, export, verify, bench, train-drafter and the memory
estimates read these entries instead of keeping lists of their own: a new drafter is its own
module plus one entry in ``DRAFTERS``.

``build`` is a lazy reference, ``"module:function"`` (like an entry point): this module sits
on the torch-free floor under ``config`` and never imports torch or a drafter; the pipeline
imports the function when an engine for the method is first asked for, and calls it with
itself as the ``drafters.base.BuildContext``. Two entries have no ``build``, as they are
choices wherever a method is (presets, ``--method``, the method switch), so one tuple holds
every choice: plain decoding (``"none"``), and ``"auto"``, which ``chooses``: it is no drafter
but several, resolved by ``localspec.drafter_set`` and picked from each step by the engine's
policy (``engine.choice``).

Everything reads ``DRAFTERS`` through the functions below, at call time; nothing keeps a copy
made at import. So a test that registers a toy drafter (monkeypatching ``DRAFTERS``) sees it
taken up everywhere, exactly as an entry added to this file would be.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from localspec.errors import PresetError

# What a drafter needs besides the target: "draft_model" a draft model named in
# [speculative_config] model (loaded with the preset); "head" a head made for this target,
# named there (read when the engine is first asked for).
Needs = Literal["nothing", "draft_model", "head"]
NEEDS: tuple[str, ...] = get_args(Needs)


class TargetShape(Protocol):
    """The target's architecture numbers a head's size follows (``models.hardware``'s
    ``Architecture`` has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def _is_reference(reference: str) -> bool:
    """Whether ``reference`` has the form ``"module:attribute"``."""
    module, _, attribute = reference.partition(":")
    return bool(module and attribute)


@dataclass(frozen=True)
class HeadSpec:
    """What a head method's files and training need, named lazily like ``build``.

    ``load`` and ``trainer`` are ``"module:attribute"`` references that the code using them
    imports (``drafters.head_layouts.load_head``, ``training.heads.head_trainer``): ``load`` a
    function ``(files, target, dtype) -> (module, target layers it reads)`` that reads the
    head's published layout; ``trainer`` an object with ``training.heads.HeadTrainer``'s
    methods (None: ``train-drafter`` cannot train one). ``architectures`` and ``config_keys``
    tell a folder of this method by its config.json (``head_method``)."""

    label: str  # the method's name in messages about its files ("EAGLE-3")
    load: str  # "module:function" reading a head of this method for a target
    trainer: str | None = None  # "module:attribute": the method's HeadTrainer
    # a config.json "architectures" entry containing one of these marks a head of the method
    architectures: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()  # so does one of these config.json keys

    def __post_init__(self) -> None:
        """A malformed head is a programming error, caught when the registry is imported."""
        if not _is_reference(self.load) or not (self.trainer is None
                                                or _is_reference(self.trainer)):
            raise ValueError(f"head '{self.label}': load and trainer must be 'module:attribute'")


@dataclass(frozen=True)
class DrafterSpec:
    """One speculative method, as everything outside its own module sees it."""

    name: str  # [speculative_config] method, --method, the method switch's value
    label: str  # in the app's method switch
    build: str | None  # "module:function" taking a BuildContext; None: plain decoding, a set
    needs: Needs = "nothing"
    vllm_method: str | None = None  # vLLM's speculative_config method (None: no equivalent)
    # [speculative_config] keys vLLM reads for this method besides method, model and
    # num_speculative_tokens (export copies them)
    vllm_keys: tuple[str, ...] = ()
    # said by export-vllm when the preset names a head shipped with LocalSpec
    builtin_head_note: str | None = None
    # bytes of the drafter's own weights for a target of this shape, in 16 bits, as published
    # heads of the method are shaped (a built-in head counts as its files instead); None: none
    weight_bytes: Callable[[TargetShape], int] | None = None
    # not a drafter but a set of them, one chosen each step by the engine's policy (``auto``:
    # its members are resolved by ``localspec.drafter_set``)
    chooses: bool = False
    # how a head method's files are told, read and trained (None: not found by the finder,
    # not read by head_layouts.load_head, not trained)
    head: HeadSpec | None = None

    def __post_init__(self) -> None:
        """A malformed entry is a programming error, caught when the registry is imported."""
        module, _, function = (self.build or "").partition(":")
        if not self.name or "@" in self.name or self.name.startswith("hf-"):
            raise ValueError(f"drafter name {self.name!r}: bench reserves '@' and 'hf-'")
        if self.build is not None and not (module and function):
            raise ValueError(f"drafter '{self.name}': build must be 'module:function'")
        if self.needs not in NEEDS:
            raise ValueError(f"drafter '{self.name}': needs must be one of {NEEDS}")
        if self.build is None and (self.needs != "nothing" or self.vllm_method):
            raise ValueError(f"drafter '{self.name}': without a build it is plain decoding "
                             "or a set")
        if self.chooses and self.build is not None:
            raise ValueError(f"'{self.name}' chooses among drafters: it has no build")
        if self.head is not None and self.needs != "head":
            raise ValueError(f"drafter '{self.name}': a head (HeadSpec) is for needs='head'")

    @property
    def speculative(self) -> bool:
        """Whether it drafts at all (False for plain decoding)."""
        return self.build is not None or self.chooses

    @property
    def trainable(self) -> bool:
        """Whether ``train-drafter`` can train one: its head names a trainer."""
        return self.head is not None and self.head.trainer is not None


# ----------------------------------------------------------------------------- head sizes

EAGLE3_DRAFT_VOCAB = 32000  # the draft vocabulary of the published EAGLE-3 Llama heads
MEDUSA_HEADS = 5  # the published Medusa heads' count


def _eagle_layer(t: TargetShape, width: int) -> int:
    """Parameters of one decoder layer shaped like the target's whose attention reads
    ``width`` (norms left out)."""
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    return width * (q + 2 * kv) + q * t.hidden_size + 3 * t.hidden_size * t.intermediate_size


def eagle_bytes(t: TargetShape) -> int:
    """EAGLE: ``fc`` [h, 2h] and one decoder layer; it reads through the target's LM head."""
    h = t.hidden_size
    return 2 * (2 * h * h + _eagle_layer(t, h))


def eagle3_bytes(t: TargetShape) -> int:
    """EAGLE-3: ``fc`` [h, 3h], one layer whose attention reads 2h, and an LM head over
    EAGLE3_DRAFT_VOCAB draft tokens."""
    h = t.hidden_size
    return 2 * (3 * h * h + _eagle_layer(t, 2 * h) + EAGLE3_DRAFT_VOCAB * h)


def medusa_bytes(t: TargetShape) -> int:
    """Medusa: MEDUSA_HEADS residual blocks, each with an LM head of its own."""
    h = t.hidden_size
    return 2 * MEDUSA_HEADS * (h * h + h + t.vocab_size * h)


# ----------------------------------------------------------------------------- the registry

AUTO = "auto"  # several drafters, the best chosen each step (drafter_set.py, engine/choice.py)

DRAFTERS: tuple[DrafterSpec, ...] = (
    DrafterSpec("none", "none (plain decoding)", build=None),
    DrafterSpec("draft_model", "draft model", "localspec.drafters.draft_model:build",
                needs="draft_model", vllm_method="draft_model"),
    DrafterSpec("ngram", "n-gram lookup", "localspec.drafters.ngram:build", vllm_method="ngram",
                vllm_keys=("prompt_lookup_max", "prompt_lookup_min")),
    DrafterSpec("suffix", "suffix tree (this chat and your history)",
                "localspec.drafters.suffix:build", vllm_method="suffix",
                vllm_keys=("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor",
                           "suffix_decoding_min_token_prob")),
    DrafterSpec("eagle3", "EAGLE-3 head", "localspec.drafters.eagle:build_eagle3",
                needs="head", vllm_method="eagle3", weight_bytes=eagle3_bytes,
                head=HeadSpec("EAGLE-3", "localspec.drafters.head_layouts:load_eagle3",
                              "localspec.training.eagle_trainer:EAGLE3",
                              architectures=("Eagle3",))),
    DrafterSpec("eagle", "EAGLE head", "localspec.drafters.eagle:build_eagle", needs="head",
                vllm_method="eagle", weight_bytes=eagle_bytes,
                head=HeadSpec("EAGLE", "localspec.drafters.head_layouts:load_eagle",
                              "localspec.training.eagle_trainer:EAGLE",
                              architectures=("Eagle",))),
    DrafterSpec("medusa", "Medusa heads", "localspec.drafters.medusa:build", needs="head",
                vllm_method="medusa", weight_bytes=medusa_bytes,
                head=HeadSpec("Medusa", "localspec.drafters.head_layouts:load_medusa",
                              "localspec.training.medusa_trainer:MEDUSA",
                              architectures=("Medusa",), config_keys=("medusa_num_heads",)),
                # drafters/medusa.py: the built-in heads read the target's LM head (token_map)
                builtin_head_note="its Medusa heads read the target's own LM head (the rows in "
                                  "token_map); vLLM's Medusa needs LM heads inside the "
                                  "checkpoint, so vLLM cannot load these heads as they are"),
    DrafterSpec(AUTO, "Auto: best drafter each step", build=None, chooses=True),
)


def drafters() -> tuple[DrafterSpec, ...]:
    """Every registered method, plain decoding first, in the order the app lists them."""
    return DRAFTERS


def method_names() -> tuple[str, ...]:
    """The names a preset, ``--method`` or the method switch may give."""
    return tuple(spec.name for spec in DRAFTERS)


def drafter_spec(name: str) -> DrafterSpec:
    """The entry of method ``name``; PresetError naming the choices if there is none."""
    for spec in DRAFTERS:
        if spec.name == name:
            return spec
    raise PresetError(f"unknown method '{name}': choose one of {', '.join(method_names())}")


def head_spec(name: str) -> HeadSpec:
    """The head of method ``name``; PresetError if it is unknown or needs no head."""
    head = drafter_spec(name).head
    if head is None:
        raise PresetError(f"method '{name}' drafts without a head: choose one of "
                          f"{', '.join(methods_needing('head'))}")
    return head


def head_method(config: dict[str, object]) -> str | None:
    """The head method a head folder's config.json (or training.json) describes, or None
    for a folder that is no registered head: its ``method`` when that is a head method, else
    the method whose ``architectures`` mark matches ``config["architectures"]`` (the longest
    mark wins: "Eagle3" over "Eagle") or one of whose ``config_keys`` it has."""
    heads = {spec.name: spec.head for spec in DRAFTERS if spec.head is not None}
    method = config.get("method")
    if isinstance(method, str) and method in heads:
        return method
    listed = config.get("architectures")
    names = " ".join(str(a) for a in listed) if isinstance(listed, list) else ""
    marked = [(len(mark), name) for name, head in heads.items() for mark in head.architectures
              if mark in names]
    if marked:
        return max(marked)[1]
    return next((name for name, head in heads.items()
                 if any(key in config for key in head.config_keys)), None)


def methods_needing(needs: Needs) -> tuple[str, ...]:
    """The methods that need ``needs`` besides the target."""
    return tuple(spec.name for spec in DRAFTERS if spec.needs == needs)


def trainable_methods() -> tuple[str, ...]:
    """The methods whose heads ``train-drafter`` trains."""
    return tuple(spec.name for spec in DRAFTERS if spec.trainable)
