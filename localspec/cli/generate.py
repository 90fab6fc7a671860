"""``localspec generate``: flags checked against the preset, then one or more samples printed.

Everything a flag can get wrong (NaN temperature, top-p out of (0, 1], a seed beyond 64 bits,
seeds S..S+N-1 that overflow, a method the preset cannot run, an empty prompt, a prompt whose
bytes are not UTF-8: Python hands those over as lone surrogates) is refused from
the preset alone, before the models load: a typo must not cost a model load. The engine's own
checks (a prompt longer than the context) still run after loading, and raise the same family
of errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from localspec.cli.loading import load_pipeline
from localspec.config import MAX_SEED, Preset
from localspec.engine.engine import StepEvent
from localspec.engine.stats import GenerationStats
from localspec.errors import RequestError
from localspec.files import check_unicode
from localspec.pipeline import request_settings_for
from localspec.presets import load_preset
from localspec.registry import drafter_spec


@dataclass(frozen=True)
class GeneratePlan:
    """What ``generate`` will do, validated: the preset, the method and the settings."""

    preset: Preset
    method: str
    settings: dict[str, Any]  # request overrides shared by every sample (None = preset's)
    seeds: tuple[int, ...]  # one per sample


def plan_generate(args: argparse.Namespace) -> GeneratePlan:
    """Check every flag against the preset (no model loaded); ConfigError/PresetError/
    RequestError name what is wrong."""
    preset = load_preset(args.preset)
    method = preset.drafter_set(args.method).method
    check_unicode(args.prompt, "--prompt", RequestError)
    if args.raw and args.prompt == "":
        raise RequestError("--prompt is empty: nothing to continue")
    if not args.raw and not args.prompt.strip():
        raise RequestError("--prompt is empty (or only whitespace): nothing to answer")
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k,
                "num_speculative_tokens": args.num_speculative_tokens}
    first = request_settings_for(preset, seed=args.seed, **settings).seed
    last = first + args.num_samples - 1
    if last > MAX_SEED:
        raise RequestError(f"seed = {first} with --num-samples {args.num_samples} needs seeds up "
                           f"to {last}, beyond the 64-bit limit {MAX_SEED}: choose a smaller "
                           "--seed")
    return GeneratePlan(preset, method, settings, tuple(range(first, last + 1)))


def _print_delta(event: StepEvent) -> None:
    sys.stdout.write(event.text_delta)
    sys.stdout.flush()


def run_generate(args: argparse.Namespace) -> int:
    """Validate, load, generate ``--num-samples`` samples; print text (streamed for one
    sample) or one JSON object; a summary line on stderr."""
    plan = plan_generate(args)
    members = plan.preset.drafter_set(plan.method).members
    needs = [drafter_spec(name).needs for name in members]
    pipe = load_pipeline(plan.preset, need_draft="draft_model" in needs)
    prompt_ids = pipe.encode_prompt(args.prompt, raw=args.raw)
    streaming = not args.json and len(plan.seeds) == 1
    samples = []
    stats = GenerationStats()
    for seed in plan.seeds:
        request = pipe.request(prompt_ids, seed=seed, **plan.settings)
        result = pipe.run(request, plan.method, on_event=_print_delta if streaming else None)
        samples.append({"text": result.text, "token_ids": result.token_ids})
        stats = stats.merge(result.stats)
    if args.json:
        print(json.dumps({"preset": plan.preset.name, "method": plan.method,
                          "samples": samples, "stats": stats.as_dict()}, ensure_ascii=False))
        return 0
    if not streaming:
        for i, sample in enumerate(samples):
            print(f"--- sample {i} ---\n{sample['text']}")
    d = stats.as_dict()
    print(f"\n[{plan.method}] {d['new_tokens']} tokens, {d['tokens_per_second']:.2f} tok/s, "
          f"acceptance {d['acceptance_rate']:.0%}, {d['mean_accepted_length']:.2f} tokens "
          f"per target pass{_by_drafter(stats)}", file=sys.stderr)
    return 0


def _by_drafter(stats: GenerationStats) -> str:
    """", by drafter: ngram 40/52, draft_model 10/30" (accepted/drafted) when several drafted."""
    counts = stats.drafters()
    if len(counts) < 2:
        return ""
    return ", by drafter: " + ", ".join(f"{name} {c['accepted']}/{c['drafted']}"
                                        for name, c in counts.items())
