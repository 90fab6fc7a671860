"""Command line: ``python -m localspec generate | bench | verify | presets | export-vllm``.

Thin: parse flags, load a preset into a Pipeline, call the engine, benchmark or checker, print.
Every expected failure (bad preset, missing model, mismatched tokenizer, over-long prompt, bad
setting) ends with a one-line message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from tqdm import tqdm
from transformers.utils import logging as transformers_logging

from localspec.engine.engine import StepEvent
from localspec.errors import LocalSpecError
from localspec.pipeline import Pipeline
from localspec.config import DEFAULT_PRESET, HARDWARE_LABELS, METHODS
from localspec.presets import load_preset

class ProgressBar:
    """Progress callback for model assembly/loading: one tqdm bar per stage, on stderr."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None
        self._message = ""

    def __call__(self, message: str, fraction: float) -> None:
        if message != self._message:
            self.close()
            self._message = message
            if fraction >= 1.0:  # a stage that is already done needs no bar
                return
            self._bar = tqdm(total=100, desc=message, unit="%", file=sys.stderr, leave=False)
        if self._bar is not None:
            self._bar.update(int(100 * fraction) - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def load_pipeline(preset_name: str, need_draft: bool = True) -> Pipeline:
    preset = load_preset(preset_name)
    progress = ProgressBar()
    try:
        return Pipeline.load(preset, progress=progress, load_draft=need_draft)
    finally:
        progress.close()


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help="a name from presets/ or a path to a .toml file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _print_delta(event: StepEvent) -> None:
    sys.stdout.write(event.text_delta)
    sys.stdout.flush()


def _cmd_generate(args: argparse.Namespace) -> int:
    method = args.method
    pipe = load_pipeline(args.preset, need_draft=method in (None, "draft_model"))
    prompt_ids = pipe.encode_prompt(args.prompt, raw=args.raw)
    samples = []
    stats = None
    for i in range(args.num_samples):
        request = pipe.request(
            prompt_ids,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, num_speculative_tokens=args.num_speculative_tokens,
            seed=(args.seed if args.seed is not None else pipe.preset.sampling.seed) + i,
        )
        streaming = not args.json and args.num_samples == 1
        result = pipe.run(request, method, on_event=_print_delta if streaming else None)
        samples.append({"text": result.text, "token_ids": result.token_ids})
        stats = result.stats if stats is None else stats.merge(result.stats)
    method_used = method or pipe.preset.speculative_config.method
    if args.json:
        print(json.dumps({"preset": pipe.preset.name, "method": method_used,
                          "samples": samples, "stats": stats.as_dict()}, ensure_ascii=False))
    else:
        if not streaming:
            for i, sample in enumerate(samples):
                print(f"--- sample {i} ---\n{sample['text']}")
        d = stats.as_dict()
        print(f"\n[{method_used}] {d['new_tokens']} tokens, {d['tokens_per_second']:.2f} tok/s, "
              f"acceptance {d['acceptance_rate']:.0%}, {d['mean_accepted_length']:.2f} tokens "
              f"per target pass", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from localspec.cli.bench import format_table, load_prompts, run_bench

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompts = load_prompts(args.prompts)
    pipe = load_pipeline(args.preset, need_draft=any(m in ("draft_model", "hf-assisted")
                                                     for m in methods))
    report = run_bench(pipe, prompts, methods, args.max_new_tokens, args.repeats,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report, ensure_ascii=False) if args.json else format_table(report))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from localspec.cli.bench import load_prompts
    from localspec.cli.check import format_report, run_checks

    pipe = load_pipeline(args.preset)
    report = run_checks(pipe, load_prompts(args.prompts), args.max_new_tokens,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def _cmd_presets(args: argparse.Namespace) -> int:
    from localspec.models.hardware import detect_hardware, survey_presets

    hardware = detect_hardware()
    rows = survey_presets(hardware)
    if args.json:
        print(json.dumps({
            "hardware": hardware.describe(),
            "presets": [{"preset": r.key, "name": r.title, "hardware": r.hardware,
                         "method": r.preset.speculative_config.method if r.preset else None,
                         "memory_gib": round(r.estimate.total / 2**30, 2) if r.estimate else None,
                         "fits": r.fits, "reason": r.reason, "error": r.error} for r in rows],
        }, ensure_ascii=False))
        return 0
    print(f"This machine: {hardware.describe()}\n")
    group = None
    for r in rows:
        if r.hardware != group:
            group = r.hardware
            print(f"{HARDWARE_LABELS.get(group, group)}:")
        mark = "ok " if r.fits else "-- "
        if r.error is not None:
            print(f"  !! {r.key}: {r.error}")
            continue
        method = r.preset.speculative_config.method
        print(f"  {mark}{r.key:<30} {method:<11} {r.reason}")
    print("\nok = fits this machine (estimate computed from each model's config and quantization)")
    return 0


def _cmd_export_vllm(args: argparse.Namespace) -> int:
    from localspec.cli.export import export_vllm

    result = export_vllm(load_preset(args.preset_name))
    for note in result.notes:
        print(f"# {note}", file=sys.stderr)
    print(result.command)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localspec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    _add_common(gen)
    gen.add_argument("--method", choices=METHODS, default=None,
                     help="override the preset's speculative method")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="skip the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--num-speculative-tokens", type=int, default=None)
    gen.add_argument("--num-samples", type=int, default=1)
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="compare methods side by side on a prompt set")
    _add_common(bench)
    bench.add_argument("--prompts", default=None, help="JSONL file (default: built-in set)")
    bench.add_argument("--methods", default="none,draft_model,ngram,hf-assisted,hf-lookup")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1)
    bench.set_defaults(func=_cmd_bench)

    verify = sub.add_parser("verify", help="check that speculation changes nothing, here")
    _add_common(verify)
    verify.add_argument("--prompts", default=None, help="JSONL file (default: built-in set)")
    verify.add_argument("--max-new-tokens", type=int, default=64)
    verify.set_defaults(func=_cmd_verify)

    presets = sub.add_parser("presets", help="list presets and what fits this machine")
    presets.add_argument("--json", action="store_true", help="print one JSON object")
    presets.set_defaults(func=_cmd_presets)

    export = sub.add_parser("export-vllm", help="print the equivalent `vllm serve` command")
    export.add_argument("preset_name", metavar="PRESET",
                        help="a name from presets/ or a path to a .toml file")
    export.set_defaults(func=_cmd_export_vllm)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    transformers_logging.disable_progress_bar()  # our own bar shows loading; one is enough
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LocalSpecError as exc:
        print(f"localspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    """The ``localspec`` console command."""
    sys.exit(main())
