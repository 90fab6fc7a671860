"""A method resolved into the drafters its engine runs: once, before any model is loaded.

A method name ("draft_model", "auto", ...) says what to run; which drafters that is depends on
the preset. "auto" runs ``[localspec] drafters`` (by default n-gram lookup, the suffix drafter
and the preset's model or head), a method that drafts with a model or head runs behind lookup with
``[localspec] lookup_first``, plain decoding runs none. ``Preset.drafter_set`` resolves a
method here once, checking that the preset meets each member's needs, and everything after it
takes the ``DrafterSet``: the pipeline builds each member through the registry and hands the
engine the tuple; the engine's policy (``engine.choice``) picks among them each step.

Torch-free, on the floor under ``config``: it reads only the registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from localspec.errors import PresetError
from localspec.registry import AUTO, drafter_spec


@dataclass(frozen=True)
class DrafterSet:
    """A method and the registered drafters its engine runs (none: plain decoding)."""

    method: str
    members: tuple[str, ...]


def resolve(method: str, members: tuple[str, ...], own: tuple[str, ...], has_draft: bool,
            preset: str, preset_method: str) -> DrafterSet:
    """``method``'s set of ``members`` in preset ``preset`` (whose own method
    ``preset_method`` runs ``own``); PresetError unless ``method`` is registered and the
    preset meets each member's needs: a draft model loaded (``has_draft``), a head only where
    the preset's own method runs it (it names the head in ``[speculative_config] model``)."""
    drafter_spec(method)  # a registered method
    for name in members:
        needs = drafter_spec(name).needs
        if needs == "draft_model" and not has_draft:
            raise PresetError(f"method '{name}' needs a draft model, and preset '{preset}' "
                              "names none in [speculative_config] model")
        if needs == "head" and name not in own:
            raise PresetError(f"method '{name}' needs a head made for this target in "
                              f"[speculative_config] model, and preset '{preset}' is set up "
                              f"for method '{preset_method}': use a preset with method = "
                              f"\"{name}\"")
    return DrafterSet(method, members)


def check_members(method: str, listed: tuple[str, ...], members: tuple[str, ...],
                  has_model: bool, has_head: bool = False) -> None:
    """ValueError unless ``members``, of a preset of ``method`` that lists ``listed`` in
    [localspec] drafters, can be the drafters of one engine: a list only for "auto";
    registered drafters (not plain decoding, not "auto"), each once; at most one draft model
    and one head, each named: a lone one by ``[speculative_config] model``, a head beside a
    draft model by ``[localspec] head`` (``has_head``), read by a head member only."""
    if listed and method != AUTO:
        raise ValueError(f"[localspec] drafters lists the members of method '{AUTO}', and "
                         f"[speculative_config] method is '{method}'")
    for name in members:
        if name == AUTO or not drafter_spec(name).speculative:
            raise ValueError(f"[localspec] drafters: '{name}' is not a drafter; list drafters "
                             f"such as 'ngram', 'draft_model', 'eagle3'")
    if len(set(members)) < len(members):
        raise ValueError(f"[localspec] drafters lists a drafter twice: {list(members)}")
    needing = {drafter_spec(name).needs: name for name in members
               if drafter_spec(name).needs != "nothing"}
    heads = [name for name in members if drafter_spec(name).needs == "head"]
    if len(heads) > 1:
        raise ValueError(f"[localspec] drafters: {' and '.join(heads)} are both heads, and a "
                         "preset names one head: keep one of them")
    if needing and not has_model:
        raise ValueError(f"[localspec] drafters: '{next(iter(needing.values()))}' needs "
                         "[speculative_config] model (the draft model or head to load)")
    if len(needing) == 2 and not has_head:
        raise ValueError(f"[localspec] drafters: '{needing['head']}' beside a draft model "
                         "needs [localspec] head (the head to load; [speculative_config] model "
                         "is the draft model)")
    if has_head and (method != AUTO or "head" not in needing):
        raise ValueError("[localspec] head names the head of an 'auto' preset's head member "
                         "(such as 'eagle3' in [localspec] drafters); a lone head is "
                         "[speculative_config] model")


def members_of(method: str, preset_method: str, has_model: bool, listed: tuple[str, ...],
               lookup_first: bool) -> tuple[str, ...]:
    """The drafters an engine for ``method`` runs in a preset of ``preset_method`` (one chosen
    each step when several): "auto"'s members are ``listed`` ([localspec] drafters), else n-gram
    lookup, the suffix drafter and, when [speculative_config] model names one
    (``has_model``), the preset's model or head method or else a draft model; a method that
    needs a model or head runs behind lookup with ``lookup_first``; plain decoding has none."""
    if method == AUTO:
        needs = drafter_spec(preset_method).needs
        own = preset_method if needs != "nothing" else "draft_model"
        return listed or (("ngram", "suffix", own) if has_model else ("ngram", "suffix"))
    spec = drafter_spec(method)
    if not spec.speculative:
        return ()
    return ("ngram", method) if lookup_first and spec.needs != "nothing" else (method,)
