"""Tuning: the settings of a preset that measure fastest on this machine, saved as a preset
(``localspec tune`` and the app's "Tune for this machine" run it).

Every figure LocalSpec ships was tuned on one 2-core machine; the right draft length, confidence
threshold and drafter differ with the cores, the memory bandwidth and the user's prompts. So
``tune`` measures, in one process on the preset's models loaded once (greedy; the built-in
prompts or the user's JSONL, ``max_new_tokens`` each):

1. the target's pass cost per verify width (1 to k + 1 rows, best of three): what a draft costs
   to check here, printed as a table;
2. the preset's own settings, then one setting at a time around the best so far (a coordinate
   search): the method (each one the preset can run, plain decoding and ``auto`` included),
   the form a draft model is served in on the CPU (``draft_forms``: Q3_M, Q4_K, int8, a GGUF's
   own types; which one is fastest depends on the machine's bandwidth against its compute, and
   int8 runs on oneDNN, which uses AMX where a Xeon has it), ``auto``'s members (every set of two
   or more of the preset's own), n-gram lookup first, the most drafts a step, the draft's
   confidence threshold and, where the target feeds draft trees (the native CPU decoder), the
   tree width (1, 2, 3). A
   candidate replaces the best only when it is faster by more than ``MARGIN`` over all prompts
   (tokens over seconds): one run of each is noisy, and a setting that merely ties is no reason
   to change;
3. the preset's settings against the chosen ones, interleaved ``repeats`` times: the chosen ones
   are kept only if they are faster there too, so a tuned preset is never slower than the one it
   came from on the prompts it measured.

The result is the preset's TOML with those values changed (``tomlkit``: the preset's comments
stay), saved among the user's presets as ``<preset>-tuned`` (a preset ``tune`` made before under
that name is replaced; any other is refused before anything is measured). Every candidate's
output is compared with plain decoding's: one that differs (a near-tie on a float path, as
``verify`` allows, or a bug) is reported and never chosen.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomlkit
import torch

from localspec.config import CPU_QUANTIZATIONS, MAX_SPECULATIVE_TOKENS, Preset, parse_preset
from localspec.errors import LocalSpecError, ModelLoadError, PresetError
from localspec.models.loading import pick_device
from localspec.models.packed_store import gguf_source
from localspec.pipeline import Pipeline
from localspec.presets import preset_path, save_user_preset, user_preset_file
from localspec.registry import AUTO, drafter_spec, method_names

MARGIN = 0.03  # a candidate must be this much faster than the best so far to replace it
K_CHOICES = (4, 8, 12, 16)
THRESHOLDS = (0.3, 0.5, 0.7, 0.8, 0.9)  # where a chain ends: the chance it is kept whole
LABEL = 72  # the settings' column in the progress lines (the report's fits its longest)
MARK = "# Made by `localspec tune"  # the first line of a preset tune wrote (it may replace it)


class TuneStopped(LocalSpecError):
    """The user stopped tuning: nothing was saved."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings tune varies."""

    method: str
    k: int
    threshold: float
    lookup_first: bool
    tree_width: int = 1
    members: tuple[str, ...] = ()  # "auto"'s, as [localspec] drafters lists them
    draft_quantization: str = "none"  # [speculative_config] quantization: the draft model's

    def drafters(self) -> tuple[str, ...]:
        """The drafters these settings run: auto's members, else the method alone."""
        return self.members if self.method == AUTO else (self.method,)

    def runs_draft_model(self) -> bool:
        """Whether these settings run the draft model (alone or as a member of auto)."""
        return any(drafter_spec(m).needs == "draft_model" for m in self.drafters())

    def label(self) -> str:
        if self.method == "none":
            return "none"
        members = f"[{'+'.join(self.members)}]" if self.method == AUTO and self.members else ""
        parts = [self.method + members, f"k<={self.k}"]
        if drafter_spec(self.method).needs != "nothing":
            parts += [f"threshold {self.threshold:g}",
                      f"lookup_first {str(self.lookup_first).lower()}"]
        elif self.method == AUTO:
            parts.append(f"threshold {self.threshold:g}")
        if self.tree_width > 1:
            parts.append(f"tree {self.tree_width}")
        if self.runs_draft_model():
            parts.append(f"draft {self.draft_quantization}")
        return ", ".join(parts)


def settings_of(preset: Preset) -> Settings:
    return Settings(preset.speculative_config.method,
                    preset.speculative_config.num_speculative_tokens,
                    preset.localspec.draft_confidence_threshold, preset.localspec.lookup_first,
                    preset.localspec.tree_width, preset.drafter_set(AUTO).members,
                    preset.speculative_config.quantization)


def changes(preset: Preset, s: Settings) -> list[tuple[str, str, Any]]:
    """(table, key, value) that give ``preset`` the settings ``s``; a value None removes the key.
    "auto"'s members are for it only, and ``[localspec] head`` for its head beside the draft
    model: otherwise a head member reads its head from ``[speculative_config] model`` (so the
    saved preset does not load a draft model it never runs)."""
    auto = s.method == AUTO
    out: list[tuple[str, str, Any]] = [
        ("speculative_config", "method", s.method),
        ("speculative_config", "num_speculative_tokens", s.k),
        ("localspec", "draft_confidence_threshold", s.threshold),
        ("localspec", "lookup_first", s.lookup_first),
        ("localspec", "tree_width", s.tree_width),
        ("localspec", "drafters", list(s.members) if auto and s.members else None)]
    if s.draft_quantization != preset.speculative_config.quantization:
        out.append(("speculative_config", "quantization", s.draft_quantization))
    runs = s.drafters()
    if preset.localspec.head is not None and not (auto and "draft_model" in runs):
        out.append(("localspec", "head", None))
        if any(drafter_spec(m).needs == "head" for m in runs):
            out.append(("speculative_config", "model", preset.head_source()))
    return out


def with_settings(preset: Preset, s: Settings) -> Preset:
    """``preset`` with ``s`` (validated as a preset file is)."""
    data = preset.model_dump(exclude_none=True)
    for table, key, value in changes(preset, s):
        if value is None:
            data[table].pop(key, None)
        else:
            data[table][key] = value
    return parse_preset(data, where=f"preset '{preset.name}' with {s.label()}")


def runnable_methods(preset: Preset) -> list[str]:
    """Every method the preset's models can run (plain decoding first)."""
    ok = []
    for method in method_names():
        try:
            preset.drafter_set(method)
        except PresetError:
            continue
        ok.append(method)
    return ok


def pass_costs(pipe: Pipeline, prompt_ids: list[int], widths: range) -> dict[int, float]:
    """Seconds of one target pass of each width after ``prompt_ids``: the best of three rounds
    over all widths (a round at a time, so that a slow moment of the machine spreads over the
    widths instead of inflating one)."""
    runner = pipe.target_runner()
    runner.reset()
    runner.forward(prompt_ids[:-1], logits_to_keep=1)
    start = runner.length
    costs = dict.fromkeys(widths, float("inf"))
    for _ in range(3):
        for width in widths:
            t0 = time.perf_counter()
            runner.forward([prompt_ids[-1]] * width)
            costs[width] = min(costs[width], time.perf_counter() - t0)
            runner.crop(start)
    runner.reset()
    return costs


@dataclasses.dataclass
class Measured:
    """One setting's runs over the prompts."""

    settings: Settings
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def measure(pipe: Pipeline, s: Settings, encoded: list[list[int]], max_new: int,
            into: Measured | None = None) -> Measured:
    """Greedy runs of every prompt with ``s`` on ``pipe``'s models (its runner shared)."""
    variant = Pipeline(with_settings(pipe.preset, s), pipe.target, pipe.draft,
                       _runner=pipe.target_runner())
    out = into or Measured(s)
    for ids in encoded:
        request = variant.request(ids, max_new_tokens=max_new, temperature=0.0,
                                  num_speculative_tokens=s.k)
        result = variant.run(request)
        out.tokens += len(result.token_ids)
        out.seconds += result.stats.wall_time
        out.outputs.append(result.token_ids)
    return out


def draft_forms(preset: Preset) -> list[str]:
    """The forms a CPU preset's draft model may be served in (its own first); none where the
    draft runs elsewhere. "w4a8" only for a GGUF (a folder would get w8a8 under that name)."""
    spec = preset.draft_spec()
    if spec is None or spec.device == "cuda" or pick_device(spec.device) != "cpu":
        return []
    forms = [q for q in CPU_QUANTIZATIONS if q != "w4a8" or gguf_source(spec) is not None]
    return [spec.quantization, *(q for q in forms if q != spec.quantization)]


STAGES = ("method", "draft quantization", "auto's drafters", "lookup first", "drafts a step",
          "confidence threshold", "tree width")
TREE_WIDTHS = (1, 2, 3)


def options(stage: str, best: Settings, methods: list[str], trees: bool = False,
            forms: list[str] | None = None) -> list[Settings]:
    """The candidates of one stage of the coordinate search, around ``best``; tree widths only
    where the target runner ``trees`` (feeds draft trees), the draft's ``forms``
    (``draft_forms``) where its draft model runs."""
    if stage == "method":
        return [dataclasses.replace(best, method=m) for m in methods]
    if best.method == "none":
        return []
    if stage == "draft quantization" and best.runs_draft_model():
        return [dataclasses.replace(best, draft_quantization=q) for q in forms or ()]
    if stage == "auto's drafters" and best.method == AUTO:
        pool = best.members  # the preset's own: a set of them needs nothing more loaded
        return [dataclasses.replace(best, members=members) for size in range(2, len(pool) + 1)
                for members in itertools.combinations(pool, size)]
    model = drafter_spec(best.method).needs != "nothing"  # a draft model or a head
    if stage == "drafts a step":
        return [dataclasses.replace(best, k=k) for k in K_CHOICES if k <= MAX_SPECULATIVE_TOKENS]
    if stage == "lookup first" and model:
        return [dataclasses.replace(best, lookup_first=v) for v in (False, True)]
    if stage == "confidence threshold" and (model or best.method == AUTO):
        return [dataclasses.replace(best, threshold=t) for t in THRESHOLDS]
    if stage == "tree width" and trees and (model or best.method == AUTO):
        return [dataclasses.replace(best, tree_width=w) for w in TREE_WIDTHS]
    return []


def tuned_name(preset_name: str) -> str:
    stem = Path(str(preset_name)).name.removesuffix(".toml")
    return f"{stem}-tuned"


def check_name(name: str) -> bool:
    """Whether saving ``name`` replaces a preset tune made; PresetError (before anything is
    measured) for a name that is no valid preset name or that another preset holds."""
    path = user_preset_file(name)
    if not path.exists():
        return False
    try:
        first = path.read_text(encoding="utf-8").split("\n", 1)[0]
    except (OSError, UnicodeDecodeError):
        first = ""
    if not first.startswith(MARK):
        raise PresetError(f"a preset '{name}' already exists ({path}) and `localspec tune` did "
                          "not make it: give another --name, or delete that file first")
    return True


def tuned_text(source: str, preset: Preset, s: Settings, header: str) -> str:
    """``source`` (the preset's TOML) with ``s``, a new name and ``header`` on top."""
    doc = tomlkit.parse(source)
    for table, key, value in changes(preset, s):
        if table not in doc:
            doc.add(table, tomlkit.table())
        if value is not None:
            doc[table][key] = value  # type: ignore[index]
        elif key in doc[table]:  # type: ignore[operator]
            del doc[table][key]  # type: ignore[union-attr]
    doc["name"] = f"{preset.name} (tuned)"
    return header + tomlkit.dumps(doc)


def run_tune(pipe: Pipeline, preset_name: str, encoded: list[list[int]], max_new: int,
             repeats: int, name: str | None = None,
             log: Callable[[str], None] = lambda _line: None,
             cancelled: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Measure, choose, save; the report (``format_report`` prints it). TuneStopped, with
    nothing saved, once ``cancelled`` says so (checked before each setting's run)."""

    name = name or tuned_name(preset_name)
    replace = check_name(name)
    preset = pipe.preset
    start = settings_of(preset)
    pipes = {start.draft_quantization: pipe}  # by the draft's form, all on pipe's target runner

    def run(s: Settings, into: Measured | None = None) -> Measured:
        """ModelLoadError where the draft's form cannot be loaded."""
        if cancelled():
            raise TuneStopped("tuning stopped: nothing was saved")
        form = s.draft_quantization
        if form not in pipes:
            log(f"loading the draft model as {form} (once; a new form is quantized and stored "
                "first)")
            with_form = with_settings(preset, dataclasses.replace(start, draft_quantization=form))
            loaded = Pipeline.load(with_form, previous=pipe)
            pipes[form] = Pipeline(with_form, pipe.target, loaded.draft,
                                   _runner=pipe.target_runner())
        return measure(pipes[form], s, encoded, max_new, into)

    widths = range(1, min(max(start.k, *K_CHOICES), MAX_SPECULATIVE_TOKENS) + 2)
    costs = pass_costs(pipe, encoded[0], widths)
    log("pass cost by width (ms): " + ", ".join(f"{w}: {c * 1e3:.1f}" for w, c in costs.items()))
    methods, forms = runnable_methods(preset), draft_forms(preset)
    seen: dict[Settings, Measured] = {}
    plain = run(dataclasses.replace(start, method="none"))
    seen[plain.settings] = plain
    best = seen[start] = plain if start.method == "none" else run(start)
    trials = []
    for stage in STAGES:
        for s in options(stage, best.settings, methods, pipe.target_runner().supports_trees,
                         forms):
            if s not in seen:
                try:
                    seen[s] = run(s)
                except ModelLoadError as exc:
                    log(f"{stage:21s} {s.label():{LABEL}s} not loaded: {exc}")
                    continue
            m = seen[s]
            # greedy output with speculation is plain decoding's; a float path may differ at
            # a near-tie (what `verify` allows): such a setting is reported, never chosen
            exact = m.outputs == plain.outputs
            trials.append({"stage": stage, "settings": s.label(), "tok_s": m.rate,
                           "vs_start": m.rate / seen[start].rate if seen[start].rate else 0.0,
                           "identical": exact})
            log(f"{stage:21s} {s.label():{LABEL}s} {m.rate:7.2f} tok/s"
                f"{'' if exact else '  output differs from plain: not chosen'}")
            if exact and m.rate > best.rate * (1 + MARGIN):
                best = m
            for form in set(pipes) - {start.draft_quantization, best.settings.draft_quantization}:
                del pipes[form]  # a draft no later run uses: its memory back before the next
    before, after = Measured(start), Measured(best.settings)
    for _ in range(repeats):
        run(start, into=before)
        if best.settings != start:
            run(best.settings, into=after)
    chosen = after if best.settings != start and after.rate > before.rate else before
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs "
               f"({torch.backends.cpu.get_cpu_capability()})")
    header = (f"{MARK} --preset {preset_name}` on {machine}, {time.strftime('%Y-%m-%d')}: "
              f"{before.rate:.2f} tok/s with its settings, {chosen.rate:.2f} with these.\n")
    source = preset_path(preset_name).read_text(encoding="utf-8")
    text = tuned_text(source, preset, chosen.settings, header)
    path = save_user_preset(name, text, replace=replace)
    return {"preset": preset_name, "saved": str(path), "name": name, "pass_ms": {
        w: round(c * 1e3, 2) for w, c in costs.items()}, "trials": trials,
        "searched": best.settings.label(),
        "before": {"settings": start.label(), "tok_s": before.rate},
        "after": {"settings": chosen.settings.label(), "tok_s": chosen.rate},
        "plain_tok_s": plain.rate}


def format_report(report: dict[str, Any]) -> str:
    """The tables ``tune`` prints: pass costs, every trial, before and after."""
    costs = report["pass_ms"]
    width = max(len(t["settings"]) for t in [*report["trials"], report["before"],
                                             report["after"]])
    lines = ["target pass by verify width (ms, best of 3):",
             "  " + "  ".join(f"{w}: {c:.1f}" for w, c in costs.items()), "",
             f"{'stage':21s} {'settings':{width}s} {'tok/s':>7s} {'vs start':>9s}"]
    lines += [f"{t['stage']:21s} {t['settings']:{width}s} {t['tok_s']:7.2f} "
              f"{t['vs_start']:8.2f}x"
              f"{'' if t['identical'] else '  (output differs from plain)'}"
              for t in report["trials"]]
    plain = report["plain_tok_s"]
    lines += ["", f"{'':21s} {'settings':{width}s} {'tok/s':>7s} {'vs plain':>9s}"]
    for row in ("before", "after"):
        r = report[row]
        speedup = r["tok_s"] / plain if plain else 0.0
        lines.append(f"{row:21s} {r['settings']:{width}s} {r['tok_s']:7.2f} {speedup:8.2f}x")
    lines += ["", f"saved as preset '{report['name']}': {report['saved']} "
              f"(--preset {report['name']})"]
    return "\n".join(lines)
