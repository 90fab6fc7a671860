"""Compatible drafters for a target, found in the model library, and a preset made of one.

A draft model is offered only when its tokenizer is the target's, checked token by token: the
same token at every id and the same special and added tokens (a draft's guesses are token ids
the target verifies; ids that mean other text would be rejected every time). Names are never
trusted: two models of one family may differ in a single added token. A GGUF's tokenizer is its
``tokenizer.ggml.tokens`` with the CONTROL, USER_DEFINED and UNKNOWN ones as its added
tokens; a folder's is what ``AutoTokenizer`` loads (``get_vocab()`` and
``added_tokens_decoder``), so the two formats compare with each other. The rows llama.cpp pads
a vocabulary with (``[PAD<id>]``) count as tokens, as they do for the loader's own check
(``loading.check_same_tokenizer``, which transformers' reading of such a GGUF keeps them for):
a padded GGUF and an unpadded folder of the same family are refused here as they would be at
load. A draft must also be smaller than its target (it runs k times a step).

Besides draft models: the draft heads trained for this target (the built-in heads of
``config.BUILTIN_HEADS``, and heads in the library whose config names it), each of the method
its files mark (``registry.head_method``: any registered head method), and n-gram lookup,
which every target can use. Each choice carries the memory the whole preset would need here
(``hardware.estimate_preset``) and whether it fits. ``make_preset`` writes one as a preset of
the user's (``presets.save_user_preset``), which ``--preset NAME`` and the app's dropdown find.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from localspec.config import BUILTIN_HEADS, NATIVE_ARCHITECTURES, parse_preset
from localspec.errors import LocalSpecError, ModelLoadError
from localspec.models.builtin import BUILTIN_MODELS
from localspec.models.cache import builtin_gguf_path, builtin_header
from localspec.models.hardware import (
    Hardware,
    HardwareError,
    MemoryEstimate,
    architecture,
    count_parameters,
    detect_hardware,
    estimate_preset,
    fits,
)
from localspec.models.library import LibraryEntry, find_entry, list_library
from localspec.presets import builtin_head_folder, save_user_preset
from localspec.registry import head_method
from localspec.runtime.gguf_header import read_gguf_header

_ADDED = (2, 3, 4)  # gguf.TokenType: UNKNOWN, CONTROL, USER_DEFINED


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as the ids it gives: every token's id, and the special and added ones."""

    tokens: dict[str, int]
    added: dict[str, int]


def vocabulary(entry: LibraryEntry) -> Vocabulary:
    """The tokenizer of a library entry (ModelLoadError when it cannot be read); a built-in
    one from its packages' GGUF header."""
    arrays = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"})
    builtin = BUILTIN_MODELS.get(entry.name) if entry.source == "built-in" else None
    path = builtin_gguf_path(builtin) if builtin else entry.path or Path(entry.model)
    if builtin or path.is_file():
        header = builtin_header(builtin, arrays) if builtin else read_gguf_header(path, arrays)
        tokens = header.fields.get("tokenizer.ggml.tokens")
        types = header.fields.get("tokenizer.ggml.token_type") or []
        if not isinstance(tokens, list) or not isinstance(types, list):
            raise ModelLoadError(f"{path}: the GGUF holds no tokenizer (tokenizer.ggml.tokens)")
        kinds = list(enumerate(zip(tokens, types + [1] * (len(tokens) - len(types)),
                                   strict=True)))
        return Vocabulary({t: i for i, (t, _) in kinds},
                          {t: i for i, (t, k) in kinds if k in _ADDED})
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: its tokenizer cannot be loaded: {exc}") from exc
    return Vocabulary(dict(tokenizer.get_vocab()),
                      {str(t.content): i for i, t in tokenizer.added_tokens_decoder.items()
                       if t.content != f"[PAD{i}]"})


def vocabulary_difference(target: Vocabulary, draft: Vocabulary) -> str | None:
    """How ``draft``'s tokenizer differs from ``target``'s (None: it does not), naming the
    first id that differs."""
    for what, a, b in (("token", target.tokens, draft.tokens),
                       ("special/added token", target.added, draft.added)):
        if a == b:
            continue
        by_id_a, by_id_b = ({i: t for t, i in m.items()} for m in (a, b))
        ids = sorted(set(by_id_a) | set(by_id_b))
        first = next(i for i in ids if by_id_a.get(i) != by_id_b.get(i))
        count = sum(1 for i in ids if by_id_a.get(i) != by_id_b.get(i))
        return (f"a different tokenizer: {count} {what} id(s) differ, first id {first}: "
                f"{by_id_a.get(first)!r} in the target, {by_id_b.get(first)!r} in the draft")
    return None


# ----------------------------------------------------------------------------- choices


@dataclass(frozen=True)
class DrafterChoice:
    """One way to draft for the target, with the memory the whole preset needs here."""

    key: str  # what ``--drafter`` takes: the draft's library name, the head's, or "ngram"
    method: str
    model: str | None  # [speculative_config] model
    quantization: str  # of a draft model ("none" otherwise)
    estimate: MemoryEstimate | None
    fits: bool
    reason: str  # how it fits (or why it does not, or why there is no estimate)

    def to_json(self) -> dict[str, object]:
        memory = round(self.estimate.total / 2**30, 2) if self.estimate else None
        return {"key": self.key, "method": self.method, "model": self.model,
                "quantization": self.quantization, "memory_gib": memory, "fits": self.fits,
                "reason": self.reason}


@dataclass(frozen=True)
class DrafterReport:
    """The target, how it would be served, what can draft for it and what was left out."""

    target: LibraryEntry
    quantization: str  # the target's in a preset made here
    choices: tuple[DrafterChoice, ...]
    refused: tuple[tuple[str, str], ...]  # (library name, why it is not offered)

    def choice(self, key: str | None) -> DrafterChoice:
        """The choice ``key`` (default: the first that fits); PresetError-like message else."""
        if key is None:
            fitting = [c for c in self.choices if c.fits] or list(self.choices)
            return fitting[0]
        for c in self.choices:
            if key in (c.key, c.model):
                return c
        offered = ", ".join(c.key for c in self.choices)
        raise ModelLoadError(f"'{key}' is not a drafter offered for {self.target.name}; the "
                             f"offered ones are {offered}")


def serving_quantization(entry: LibraryEntry, draft: bool) -> str:
    """The CPU quantization a preset made here gives a model: a GGUF of a native
    architecture keeps its matrices (w4a8; a draft not all-native is requantized to Q4_K,
    which changes its guesses, never the output), another folder of one is int8 (w8a8),
    anything else runs unquantized."""
    facts = entry.facts
    if facts is None and entry.source == "built-in":  # not assembled yet: a GGUF
        return "requant-q4k" if draft else "w4a8"
    if facts is None or facts.architecture not in NATIVE_ARCHITECTURES:
        return "none"
    if facts.kind == "gguf":
        return "w4a8" if facts.native or not draft else "requant-q4k"
    return "requant-q4k" if draft else "w8a8"


def preset_text(name: str, target: LibraryEntry, quantization: str,
                choice: DrafterChoice) -> str:
    """A preset's TOML (the shipped presets' schema) for the target and this drafter."""
    def q(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)  # a TOML basic string

    speculative = [f"method = {q(choice.method)}"]
    if choice.model is not None:
        speculative.append(f"model = {q(choice.model)}")
    tokens = 8 if choice.method == "ngram" else 12
    speculative.append(f"num_speculative_tokens = {tokens}")
    if choice.method == "draft_model":
        speculative.append(f"quantization = {q(choice.quantization)}")
    lookup = "false" if choice.method == "ngram" else "true"
    return "\n".join([
        f"# Made by `localspec models drafters {target.name} --make-preset {name}`.",
        f"name = {q(name)}",
        f"description = {q(f'{target.name}, drafted by {choice.key} ({choice.method}), CPU')}",
        'hardware = "cpu"', "", "[target]", f"model = {q(target.model)}", 'dtype = "bfloat16"',
        'device = "cpu"', f"quantization = {q(quantization)}", "", "[speculative_config]",
        *speculative, "", "[sampling]", "temperature = 0.0", "max_new_tokens = 512", "",
        "[localspec]", "adaptive_k = true", f"lookup_first = {lookup}", ""])


def _estimate(target: LibraryEntry, quantization: str, choice: DrafterChoice,
              hardware: Hardware) -> DrafterChoice:
    """``choice`` with the memory its preset needs and whether that fits ``hardware``."""
    import tomllib

    preset = parse_preset(tomllib.loads(preset_text("estimate", target, quantization, choice)))
    try:
        estimate = estimate_preset(preset)
    except HardwareError as exc:
        return DrafterChoice(**{**choice.__dict__, "reason": f"no estimate: {exc}"})
    ok, reason = fits(estimate, hardware)
    return DrafterChoice(**{**choice.__dict__, "estimate": estimate, "fits": ok,
                            "reason": reason})


def _parameters(entry: LibraryEntry) -> int | None:
    try:
        return count_parameters(architecture(entry.model)).total
    except (HardwareError, LocalSpecError, OSError):
        return None


def _head_method(folder: Path) -> str | None:
    """The registered head method of a head folder, from its training.json or config.json
    (``registry.head_method``)."""
    for name in ("training.json", "config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        method = head_method(data) if isinstance(data, dict) else None
        if method is not None:
            return method
    return None


def _heads(target: LibraryEntry, entries: list[LibraryEntry]) -> list[DrafterChoice]:
    """The heads trained for the target: built-in ones and the library's."""
    found = []
    for head, trained_for in BUILTIN_HEADS.items():
        method = _head_method(builtin_head_folder(head))
        if trained_for in (target.name, target.model) and method is not None:
            found.append(DrafterChoice(head, method, head, "none", None, False, ""))
    for entry in entries:
        facts = entry.facts
        if facts is not None and facts.kind == "head" and entry.path is not None and \
                facts.head_for in (target.name, target.model):
            method = _head_method(entry.path)
            if method is not None:
                found.append(DrafterChoice(entry.name, method, str(entry.path), "none", None,
                                           False, ""))
    return found


def find_drafters(target_name: str, hardware: Hardware | None = None,
                  entries: list[LibraryEntry] | None = None) -> DrafterReport:
    """What can draft for the library's model ``target_name``, each with its memory here."""
    entries = list_library() if entries is None else entries
    hardware = hardware or detect_hardware()
    target = find_entry(target_name, entries)
    if target.error is not None:
        raise ModelLoadError(f"{target.name} cannot be used: {target.error}")
    if target.facts is not None and target.facts.kind == "head":
        raise ModelLoadError(f"{target.name} is a draft head, not a model: name its target")
    wanted = vocabulary(target)
    size = _parameters(target)
    choices, refused = [], []
    for entry in entries:
        if entry is target or entry.error is not None or (
                entry.facts is not None and entry.facts.kind == "head"):
            continue
        try:
            reason = vocabulary_difference(wanted, vocabulary(entry))
        except LocalSpecError as exc:
            reason = f"its tokenizer cannot be read: {exc}"
        params = _parameters(entry)
        if reason is None and (size is None or params is None or params >= size):
            reason = "not smaller than the target" if params and size else \
                "its size is unknown (no architecture to count)"
        if reason is not None:
            refused.append((entry.name, reason))
            continue
        choices.append(DrafterChoice(entry.name, "draft_model", entry.model,
                                     serving_quantization(entry, draft=True), None, False, ""))
    choices += _heads(target, entries)
    choices.append(DrafterChoice("ngram", "ngram", None, "none", None, False, ""))
    quantization = serving_quantization(target, draft=False)
    estimated = tuple(_estimate(target, quantization, c, hardware) for c in choices)
    return DrafterReport(target, quantization, estimated, tuple(refused))


def make_preset(name: str, report: DrafterReport, drafter: str | None = None) -> Path:
    """Save the preset of ``report``'s target with ``drafter`` (a choice's key; default the
    first that fits) as the user's preset ``name``; its path."""
    choice = report.choice(drafter)
    return save_user_preset(name, preset_text(name, report.target, report.quantization, choice))
