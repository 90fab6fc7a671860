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
itself as the ``drafters.base.BuildContext``. Plain decoding (``"none"``) is an entry with no
``build``: it is a choice wherever a method is (presets, ``--method``, the method switch), so
one tuple holds every choice.

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


@dataclass(frozen=True)
class DrafterSpec:
    """One speculative method, as everything outside its own module sees it."""

    name: str  # [speculative_config] method, --method, the method switch's value
    label: str  # in the app's method switch
    build: str | None  # "module:function" taking a BuildContext; None: plain decoding
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
    trainable: bool = False  # train-drafter can train one (localspec.training.heads)
    # not a drafter but a set of them, one chosen each step by the engine's policy (``auto``:
    # its members are resolved by ``localspec.drafter_set``)
    chooses: bool = False

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

    @property
    def speculative(self) -> bool:
        """Whether it drafts at all (False for plain decoding)."""
        return self.build is not None or self.chooses


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
    DrafterSpec("eagle3", "EAGLE-3 head", "localspec.drafters.eagle:build_eagle3",
                needs="head", vllm_method="eagle3", weight_bytes=eagle3_bytes, trainable=True),
    DrafterSpec("eagle", "EAGLE head", "localspec.drafters.eagle:build_eagle", needs="head",
                vllm_method="eagle", weight_bytes=eagle_bytes, trainable=True),
    DrafterSpec("medusa", "Medusa heads", "localspec.drafters.medusa:build", needs="head",
                vllm_method="medusa", weight_bytes=medusa_bytes, trainable=True,
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


def methods_needing(needs: Needs) -> tuple[str, ...]:
    """The methods that need ``needs`` besides the target."""
    return tuple(spec.name for spec in DRAFTERS if spec.needs == needs)


def trainable_methods() -> tuple[str, ...]:
    """The methods whose heads ``train-drafter`` trains."""
    return tuple(spec.name for spec in DRAFTERS if spec.trainable)
