"""Benchmark: every method on every prompt, interleaved, in one process, on models loaded once.

Methods: our engine's, as the drafter registry lists them (``none``, plain decoding, is the
baseline; by default every method the preset can run); transformers' own ``hf-assisted``
(``generate(assistant_model=...)``), ``hf-lookup`` (``generate(prompt_lookup_num_tokens=...)``)
and ``hf-plain`` (plain ``generate``), run as anchors on the same weights — or, when the served
target is in one of the CPU quantizations (whose weights live in the CPU forward, not in a
transformers model), on the same target unquantized in bfloat16, loaded beside it: the bf16
path, side by side in the same run. Greedy only: that is where "identical to none" is defined
(an hf-* row on the bf16 target is another model's output). Each method runs once on each prompt
before any runs twice, so drift in machine speed (heat, other processes) spreads over all
methods instead of favouring one. Every method, setting and prompt is checked before the first
run (``check_methods``, ``encode_prompts``): a benchmark never fails halfway. With ``--api``
(``bench_api``) each of our methods' runs is repeated at once through the OpenAI-compatible
API on the same loaded models: the API's overhead, measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from localspec.cli.bench_api import (
    ApiRunner,
    check_api_methods,
    format_api,
    summarise_api,
)
from localspec.cli.bench_history import BenchHistory
from localspec.config import CPU_QUANTIZATIONS, Preset, unquantized_target
from localspec.drafters.simulated import SimulatedDrafter
from localspec.errors import ConfigError, PresetError
from localspec.pipeline import Pipeline
from localspec.registry import AUTO, drafter_spec, method_names, methods_needing
from localspec.training.prompts import encode_prompts, load_prompts

__all__ = ["DEFAULT_HF_METHODS", "HF_METHODS", "SIMULATED", "check_methods", "default_methods",
           "first_difference", "format_table", "hf_pipeline", "load_prompts", "needs_draft",
           "run_bench", "simulated_acceptance", "summarise"]

HF_METHODS = ("hf-assisted", "hf-lookup", "hf-plain")
DEFAULT_HF_METHODS = ("hf-assisted", "hf-lookup")  # hf-plain only when asked for
SIMULATED = "draft_model@"  # draft_model@0.8: the draft's cost, acceptance 0.8 (simulated)
WARM_UP_TOKENS = 8  # each method's untimed first run


def check_methods(preset: Preset, methods: list[str]) -> list[str]:
    """The methods to run (``none`` first, the baseline; no repeats), each checked runnable
    with ``preset``: ConfigError for an unknown name, PresetError for one needing a draft
    model the preset does not name. Needs no model."""
    ours = method_names()
    if not methods:
        raise ConfigError(f"no methods to benchmark: choose from "
                          f"{', '.join(ours + HF_METHODS)}")
    unknown = [m for m in methods
               if m not in ours + HF_METHODS and simulated_acceptance(m) is None]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(ours + HF_METHODS)} or {SIMULATED}A "
                          "(A in [0, 1])")
    for method in methods:
        if method in ours:
            preset.drafter_set(method)
        elif needs_draft(method) and preset.draft_spec() is None:
            raise PresetError(f"method '{method}' needs a draft model, and preset "
                              f"'{preset.name}' names none in [speculative_config] model")
    return list(dict.fromkeys(["none", *methods]))


def simulated_acceptance(method: str) -> float | None:
    """A for a method ``draft_model@A`` with A in [0, 1]; None for any other name."""
    if not method.startswith(SIMULATED):
        return None
    try:
        acceptance = float(method.removeprefix(SIMULATED))
    except ValueError:
        return None
    return acceptance if 0.0 <= acceptance <= 1.0 else None


def needs_draft(method: str, preset: Preset | None = None) -> bool:
    """Whether ``method`` (ours, hf-* or simulated) runs the preset's draft model (an "auto"
    set: when ``preset`` gives it one)."""
    member = (preset is not None and method in method_names()
              and any(drafter_spec(name).needs == "draft_model"
                      for name in preset.drafter_set(method).members))
    return (method in methods_needing("draft_model") or method == "hf-assisted" or member
            or simulated_acceptance(method) is not None)


def default_methods(preset: Preset) -> list[str]:
    """Every registered method ``preset`` can run ("auto" when it has several members: one is
    its only member run again), then DEFAULT_HF_METHODS less one needing a draft model the
    preset does not name."""
    ours = []
    for method in method_names():
        try:
            if method == AUTO and len(preset.drafter_set(AUTO).members) < 2:
                continue
            preset.drafter_set(method)
        except PresetError:
            continue
        ours.append(method)
    has_draft = preset.draft_spec() is not None
    return ours + [m for m in DEFAULT_HF_METHODS if has_draft or not needs_draft(m)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end); None if identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class _CallCounter:
    """Counts forward calls of a module (transformers' generate hides its step count)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


def hf_pipeline(pipe: Pipeline, methods: list[str], load: Callable[..., Pipeline]
                ) -> Pipeline | None:
    """The pipeline transformers' methods run on: ``pipe`` itself, or for a CPU-quantized target
    the same preset with its target in bfloat16 (loaded with ``load``); None if no hf-* method."""
    hf = [m for m in methods if m in HF_METHODS]
    if not hf:
        return None
    if pipe.target.decoder is None:
        return pipe
    preset = unquantized_target(pipe.preset)
    if preset.speculative_config.quantization in CPU_QUANTIZATIONS:  # hf-assisted: a hf draft
        sc = preset.speculative_config.model_copy(update={"quantization": "none"})
        preset = preset.model_copy(update={"speculative_config": sc})
    return load(preset, need_draft=any(needs_draft(m) for m in hf))


def _run_hf(pipe: Pipeline, method: str, prompt_ids: list[int], max_new: int) -> dict[str, Any]:
    model = pipe.target.model
    sc = pipe.preset.speculative_config
    kwargs: dict[str, Any] = {}
    if method == "hf-assisted":
        if pipe.draft is None:
            raise PresetError("method 'hf-assisted' needs a pipeline loaded with its draft model")
        kwargs["assistant_model"] = pipe.draft.model
    elif method == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = sc.num_speculative_tokens
        kwargs["max_matching_ngram_size"] = sc.prompt_lookup_max
    ids = torch.tensor([prompt_ids], device=model.device)
    counter = _CallCounter(model)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                temperature=None, top_p=None, top_k=None,
                pad_token_id=pipe.tokenizer.pad_token_id or pipe.tokenizer.eos_token_id,
                eos_token_id=sorted(pipe.eos_token_ids()), **kwargs)
    finally:
        counter.remove()
    wall = time.perf_counter() - start
    tokens = out[0, len(prompt_ids):].tolist()
    passes = max(1, counter.calls - 1)  # the first call is the prefill
    return {"token_ids": tokens, "tokens_per_second": len(tokens) / wall, "wall_time_s": wall,
            "acceptance_rate": None, "mean_accepted_length": len(tokens) / passes,
            "target_forward_passes": passes}


def _run_ours(pipe: Pipeline, method: str, prompt_ids: list[int], max_new: int,
              reference: list[int] | None = None) -> dict[str, Any]:
    """One of our methods; ``draft_model@A`` drafts with the real draft model's cost but the
    target's greedy tokens from ``reference`` (plain decoding's), each kept with A."""
    request = pipe.request(prompt_ids, max_new_tokens=max_new, temperature=0.0)
    acceptance = simulated_acceptance(method)
    if acceptance is None:
        result = pipe.run(request, method)
    else:
        # the draft_model engine's own draft model (built once, its cut head packed once),
        # without the lookup in front of it
        draft = pipe.engine("draft_model").drafters[-1]
        drafter = SimulatedDrafter(draft, reference or [], len(prompt_ids), acceptance)
        result = pipe.run(request, engine=pipe.engine_with((drafter,)))
    s = result.stats
    return {"token_ids": result.token_ids, "text": result.text,
            "tokens_per_second": s.tokens_per_second, "wall_time_s": s.wall_time,
            "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
            "target_forward_passes": s.target_forward_passes, "drafters": s.drafters()}


def _run_one(pipe: Pipeline, hf_pipe: Pipeline | None, method: str, prompt_ids: list[int],
             max_new: int, reference: list[int] | None) -> dict[str, Any]:
    if method in HF_METHODS and hf_pipe is not None:
        return _run_hf(hf_pipe, method, prompt_ids, max_new)
    return _run_ours(pipe, method, prompt_ids, max_new, reference)


def _now(work: Callable[[], Any]) -> Any:
    return work()


def run_bench(
    pipe: Pipeline,
    prompts: list[dict[str, Any]],
    methods: list[str],
    max_new_tokens: int,
    repeats: int = 1,
    log: Callable[[str], None] = lambda _line: None,
    hf_pipe: Pipeline | None = None,
    via_api: ApiRunner | None = None,
    history: BenchHistory | None = None,
) -> dict[str, Any]:
    """Run all methods on all prompts ``repeats`` (>= 1) times; summarise per method.
    Methods and prompts are checked before the first run; hf-* methods run on ``hf_pipe``
    (default: ``pipe``). With ``via_api`` (``bench_api.api_runner``; our methods only), each
    run is followed by the same one through the API, summarised under ``"api"``; then every
    direct run is on the API's engine thread, as the API's generations are. ``history``: the
    earlier answers each prompt runs with (``bench_history``; None: the history stays empty)."""
    methods = check_methods(pipe.preset, methods)
    if via_api is not None:
        check_api_methods(methods)
    on_engine: Callable[[Callable[[], Any]], Any] = via_api.on_engine if via_api is not None \
        else _now
    hf_pipe = hf_pipe or pipe
    encoded = on_engine(partial(encode_prompts, pipe, prompts, max_new_tokens))
    if history is not None:
        history.before(0)
    # Warm-up of every method: first calls pay for allocations, lazy initialisation (and on a
    # GPU, kernel selection), which would otherwise count against whichever method runs first.
    reference = on_engine(partial(_run_ours, pipe, "none", encoded[0], WARM_UP_TOKENS))["token_ids"]
    for method in methods[1:]:  # methods[0] is "none", just run
        on_engine(partial(_run_one, pipe, hf_pipe, method, encoded[0], WARM_UP_TOKENS, reference))
    if via_api is not None:  # and the API's path: its connection, its first requests
        for method in methods:
            via_api(method, encoded[0], WARM_UP_TOKENS)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    api_runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for rep in range(repeats):
        for i, prompt_ids in enumerate(encoded):
            if history is not None:
                history.before(i)
            for method in methods:  # "none" first: its tokens are the simulated drafts' truth
                reference = runs[(i, "none")][-1]["token_ids"] if method != "none" else None
                run = on_engine(partial(_run_one, pipe, hf_pipe, method, prompt_ids,
                                    max_new_tokens, reference))
                runs.setdefault((i, method), []).append(run)
                if history is not None and method == "none":
                    history.answered(i, prompt_ids, run["token_ids"])
                log(f"[{rep + 1}/{repeats}] prompt {i + 1}/{len(encoded)} {method:12s} "
                    f"{run['tokens_per_second']:6.2f} tok/s  {len(run['token_ids'])} tokens")
                if via_api is not None:  # the same run through the API, right after
                    api_run = via_api(method, prompt_ids, max_new_tokens)
                    api_runs.setdefault((i, method), []).append(api_run)
                    log(f"[{rep + 1}/{repeats}] prompt {i + 1}/{len(encoded)} {method:12s} "
                        f"{api_run['tokens_per_second']:6.2f} tok/s  {api_run['new_tokens']} "
                        "tokens via API")
    report = summarise(prompts, methods, runs)
    if history is not None:
        report["history"] = history.describe()
    if via_api is not None:
        report["api"] = summarise_api(prompts, methods, runs, api_runs)
    if hf_pipe is not pipe:
        spec = hf_pipe.preset.target
        report["hf_target"] = f"{spec.model} ({spec.dtype}, quantization {spec.quantization})"
    return report


def summarise(prompts: list[dict[str, Any]], methods: list[str],
              runs: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[str, Any]:
    per_prompt = []
    for i, row in enumerate(prompts):
        reference = runs[(i, "none")][0]["token_ids"]
        detail: dict[str, Any] = {"category": row.get("category", ""), "methods": {}}
        for method in methods:
            rs = runs[(i, method)]
            first_diff = first_difference(reference, rs[0]["token_ids"])
            detail["methods"][method] = {
                "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
                "acceptance_rate": rs[0]["acceptance_rate"],
                "mean_accepted_length": rs[0]["mean_accepted_length"],
                "new_tokens": len(rs[0]["token_ids"]),
                "identical_to_none": first_diff is None,
                "first_difference_at": first_diff,
                "drafters": rs[0].get("drafters", {}),
            }
        per_prompt.append(detail)
    summary: dict[str, Any] = {}
    base = [p["methods"]["none"]["tokens_per_second"] for p in per_prompt]
    for method in methods:
        rows = [p["methods"][method] for p in per_prompt]
        speedups = [r["tokens_per_second"] / b for r, b in zip(rows, base, strict=True)
                    if b > 0]
        acc = [r["acceptance_rate"] for r in rows if r["acceptance_rate"] is not None]
        summary[method] = {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
            "speedup": statistics.median(speedups) if speedups else None,
            "acceptance_rate": statistics.mean(acc) if acc else None,
            "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in rows),
            "identical_to_none": all(r["identical_to_none"] for r in rows),
            "drafters": _drafter_totals(r["drafters"] for r in rows),
        }
    return {"methods": summary, "prompts": per_prompt}


def _drafter_totals(runs: Iterable[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Steps, drafted and accepted tokens per drafter over ``runs``, with the acceptance."""
    totals: dict[str, dict[str, Any]] = {}
    for run in runs:
        for name, counts in run.items():
            total = totals.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
            for key in total:
                total[key] += counts[key]
    for total in totals.values():
        total["acceptance_rate"] = total["accepted"] / total["drafted"] if total["drafted"] else 0.0
    return totals


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    """Per-method table, then per-category speedups."""
    lines = [f"{'method':13s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'tok/pass':>9s}  "
             "identical"]
    for method, r in report["methods"].items():
        lines.append(f"{method:13s} {_fmt(r['tokens_per_second'], '7.2f')} "
                     f"{_fmt(r['speedup'], '7.2f')}x {_fmt(r['acceptance_rate'], '7.0%')} "
                     f"{_fmt(r['mean_accepted_length'], '9.2f')}  "
                     f"{'yes' if r['identical_to_none'] else 'NO'}")
    if "history" in report:
        lines.append(report["history"])
    if "hf_target" in report:
        lines.append(f"hf-* methods ran on {report['hf_target']}, not the served target: "
                     "their tokens are that model's")
    if "api" in report:
        lines += ["", *format_api(report["api"])]
    lines.append("")
    lines.append("per prompt: tok/s (speedup vs none)")
    methods = list(report["methods"])
    lines.append(f"{'#':>2s} {'category':16s} " + " ".join(f"{m:>17s}" for m in methods))
    for i, p in enumerate(report["prompts"], start=1):
        base = p["methods"]["none"]["tokens_per_second"]
        cells = []
        for m in methods:
            r = p["methods"][m]
            mark = "" if r["identical_to_none"] else f"≠@{r['first_difference_at']}"
            speedup = r["tokens_per_second"] / base
            cells.append(f"{r['tokens_per_second']:6.2f} ({speedup:4.2f}x){mark:>4s}")
        lines.append(f"{i:2d} {p['category'][:16]:16s} " + " ".join(f"{c:>17s}" for c in cells))
    return "\n".join(lines)
