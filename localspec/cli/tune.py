"""``localspec tune``: flags and prompts checked, then ``training.tuning`` measures this machine
and saves the preset's fastest settings as a preset of the user's; this prints its tables."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from localspec.cli.loading import load_pipeline
from localspec.pipeline import request_settings_for
from localspec.presets import load_preset
from localspec.training.prompts import encode_prompts, load_prompts
from localspec.training.tuning import check_name, format_report, run_tune, tuned_name


def run_tune_command(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """Flags, prompts and the preset's name checked before the models load."""
    preset = load_preset(args.preset)
    request_settings_for(preset, max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompts = load_prompts(args.prompts)
    check_name(args.name or tuned_name(args.preset))
    pipe = load_pipeline(preset, need_draft=preset.draft_spec() is not None)
    encoded = encode_prompts(pipe, prompts, args.max_new_tokens)
    report = run_tune(pipe, args.preset, encoded, args.max_new_tokens, args.repeats, args.name,
                      log)
    print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report))
    return 0
