"""Command line: ``localspec generate | bench | verify | quality | presets | export-vllm |
gpucheck | serve | chats | models | tune``.

Thin: parse flags, validate them against the preset (no model needed), load a preset into a
Pipeline, call the engine, benchmark or checker, print. Every flag, method and prompt is checked
before any model loads, so a typo costs milliseconds, not a model load.

Every expected failure (a ``LocalSpecError``: bad preset, missing model, mismatched tokenizer,
over-long prompt, bad setting, unreadable prompts file) ends with one line
``localspec: error: ...`` and exit status 2. Anything else is a bug: its traceback goes to a
log file under the cache folder, the user sees one line naming it and that file, exit status 1.
Neither can fail on what the text holds: the log is written with lone surrogates escaped, and
stdout, like Python's stderr, escapes them too (a file name that is not UTF-8 in a table or in
JSON, where the escape is valid JSON) instead of raising mid-print.

``localspec train-drafter`` trains an EAGLE, EAGLE-3 or Medusa head (``cli/train_drafter``);
``localspec chats`` lists, shows, exports and imports the app's saved conversations
(``cli/chats``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from transformers.utils import logging as transformers_logging

from localspec.cli.loading import load_pipeline
from localspec.cli.options import (
    MAX_BENCH_REPEATS,
    MAX_NUM_SAMPLES,
    add_chats,
    add_gpucheck,
    add_models,
    add_serve,
    add_train_drafter,
    add_tune,
    count,
)
from localspec.config import DEFAULT_PRESET, MAX_PARALLEL, cache_root
from localspec.errors import ConfigError, LocalSpecError
from localspec.pipeline import request_settings_for
from localspec.presets import load_preset
from localspec.registry import method_names

HARDWARE_LABELS = {"cpu": "CPU", "gpu-8gb": "GPU 8 GB", "gpu-12gb": "GPU 12 GB",
                   "gpu-16gb": "GPU 16 GB", "gpu-24gb": "GPU 24 GB", "h100-80gb": "H100 80 GB"}
EXIT_ERROR = 2  # a LocalSpecError: the user can fix it
EXIT_BUG = 1  # anything else
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help="a shipped preset (see `localspec presets`) or a .toml path")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _log_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cmd_generate(args: argparse.Namespace) -> int:
    from localspec.cli.generate import run_generate

    return run_generate(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from localspec.cli.bench import (
        HF_METHODS,
        SIMULATED,
        check_methods,
        default_methods,
        format_table,
        hf_pipeline,
        load_prompts,
        needs_draft,
        run_bench,
    )
    from localspec.cli.bench_api import api_runner, check_api_methods, run_alone
    from localspec.cli.bench_history import BenchHistory

    if args.bandwidth:
        from localspec.cli.bench_bandwidth import run_bandwidth

        print(run_bandwidth(log=_log_line))
        return 0
    preset = load_preset(args.preset)
    if args.parallel:
        from localspec.cli.bench_parallel import run_parallel_command

        return run_parallel_command(args, preset, load_pipeline, _log_line)
    simulated = [f"{SIMULATED}{a.strip()}" for a in (args.simulate_acceptance or "").split(",")
                 if a.strip()]
    if args.methods is None and not simulated:
        methods = default_methods(preset)
        if args.api:  # transformers' methods cannot run through the API
            methods = [m for m in methods if m not in HF_METHODS]
    else:
        named = [m.strip() for m in (args.methods or "").split(",") if m.strip()]
        if args.methods is not None and not named:
            raise ConfigError(f"--methods {args.methods!r} names no method: give one or more of "
                              f"{', '.join(method_names() + HF_METHODS)}, separated by commas")
        methods = check_methods(preset, (named or ["none"]) + simulated)
    if args.api:
        check_api_methods(methods)
    request_settings_for(preset, max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompts = load_prompts(args.prompts)
    load = functools.partial(load_pipeline, preset,
                             need_draft=any(needs_draft(m, preset) for m in methods))
    pipe = run_alone(load) if args.api else load()  # bench_api says why
    with contextlib.ExitStack() as stack:
        via_api = stack.enter_context(api_runner(pipe, args.preset)) if args.api else None
        history = (BenchHistory(pipe, args.history, args.history_session)
                   if args.history is not None or args.history_session else None)
        report = run_bench(pipe, prompts, methods, args.max_new_tokens, args.repeats,
                           log=_log_line, hf_pipe=hf_pipeline(pipe, methods, load_pipeline),
                           via_api=via_api, history=history)
    print(json.dumps(report, ensure_ascii=False) if args.json else format_table(report))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from localspec.cli.check import format_report, run_checks
    from localspec.training.prompts import load_prompts

    preset = load_preset(args.preset)
    request_settings_for(preset, max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompts = load_prompts(args.prompts)
    pipe = load_pipeline(preset)
    report = run_checks(pipe, prompts, args.max_new_tokens, log=_log_line)
    print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def _cmd_quality(args: argparse.Namespace) -> int:
    from localspec.cli.quality import run_quality

    return run_quality(args, log=_log_line)


def _cmd_gpucheck(args: argparse.Namespace) -> int:
    from localspec.cli.gpucheck import run_gpucheck_command

    return run_gpucheck_command(args, log=_log_line)


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


def _cmd_serve(args: argparse.Namespace) -> int:
    from localspec.cli.serve import run_serve

    return run_serve(args)


def _cmd_chats(args: argparse.Namespace) -> int:
    from localspec.cli.chats import run_chats

    return run_chats(args)


def _cmd_models(args: argparse.Namespace) -> int:
    from localspec.cli.models import run_models

    return run_models(args, log=_log_line)


def _cmd_tune(args: argparse.Namespace) -> int:
    from localspec.cli.tune import run_tune_command

    return run_tune_command(args, log=_log_line)


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from localspec.cli.train_drafter import run_train_drafter

    return run_train_drafter(args, log=_log_line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localspec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    _add_common(gen)
    gen.add_argument("--method", choices=method_names(), default=None,
                     help="override the preset's speculative method")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="skip the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None,
                     help="first seed; sample i uses seed + i (all must fit in 64 bits)")
    gen.add_argument("--num-speculative-tokens", type=int, default=None)
    gen.add_argument("--num-samples", type=count(MAX_NUM_SAMPLES), default=1)
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="compare methods side by side on a prompt set")
    _add_common(bench)
    bench.add_argument("--prompts", default=None, help="JSONL file (default: built-in set)")
    bench.add_argument("--methods", default=None,
                       help="comma-separated (default: every method the preset can run, then "
                            "hf-assisted and hf-lookup, less one needing a draft model the "
                            "preset lacks)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=count(MAX_BENCH_REPEATS), default=1)
    bench.add_argument("--simulate-acceptance", default=None, metavar="A[,A...]",
                       help="also run draft_model@A: the draft model's real cost, but drafts "
                            "that are the target's own greedy tokens, each kept with "
                            "probability A (engine overhead at a realistic acceptance, e.g. "
                            "on random weights); output stays exact")
    bench.add_argument("--history", default=None, metavar="PATH",
                       help="the suffix drafter's history of earlier answers: those of a "
                            "conversations .db or of a JSONL prompt file's assistant messages "
                            "(default: empty; the bench never learns its own answers)")
    bench.add_argument("--history-session", action="store_true",
                       help="the prompts are one session: each runs with the plain answers of "
                            "the prompts before it in the history (see localspec/data/"
                            "multiturn.jsonl)")
    bench.add_argument("--bandwidth", action="store_true",
                       help="instead: this machine's read bandwidth and each native kernel's "
                            "share of it (one row through the 1.5B's layers, per GGUF type)")
    bench.add_argument("--api", action="store_true",
                       help="also run each method through the OpenAI-compatible API (served "
                            "here, streamed over loopback HTTP, one client) right after its "
                            "direct run: tok/s, ratio to the direct run, identical output; our "
                            "methods only (default: those the preset can run)")
    bench.add_argument("--parallel", type=count(MAX_PARALLEL), default=None, metavar="N",
                       help="instead: N clients at once against the same N requests one at a "
                            "time, through the API (default methods: none and the preset's)")
    bench.set_defaults(func=_cmd_bench)

    verify = sub.add_parser("verify", help="check that speculation changes nothing, here")
    _add_common(verify)
    verify.add_argument("--prompts", default=None, help="JSONL file (default: built-in set)")
    verify.add_argument("--max-new-tokens", type=int, default=64)
    verify.set_defaults(func=_cmd_verify)

    quality = sub.add_parser(
        "quality", help="how closely the served (maybe quantized) target follows a reference "
                        "target: top-1 agreement and perplexity, teacher-forced over text")
    _add_common(quality)
    quality.add_argument("--against", default=None, metavar="PRESET",
                         help="compare with this preset's target (default: the same target "
                              "with no quantization, in bfloat16)")
    quality.add_argument("--text", action="extend", nargs="+", default=None, metavar="FILE",
                         help="UTF-8 text files to score (default: built-in Python source and "
                              "English prose)")
    quality.add_argument("--max-tokens", type=int, default=2048,
                         help="read at most the first N tokens of each text (N - 1 scored "
                              "predictions; default 2048)")
    quality.set_defaults(func=_cmd_quality)

    presets = sub.add_parser("presets", help="list presets and what fits this machine")
    presets.add_argument("--json", action="store_true", help="print one JSON object")
    presets.set_defaults(func=_cmd_presets)

    export = sub.add_parser("export-vllm", help="print the equivalent `vllm serve` command")
    export.add_argument("preset_name", metavar="PRESET",
                        help="a shipped preset (see `localspec presets`) or a .toml path")
    export.set_defaults(func=_cmd_export_vllm)
    add_gpucheck(sub, _cmd_gpucheck)
    add_train_drafter(sub, _cmd_train_drafter)
    add_serve(sub, _cmd_serve)
    add_chats(sub, _cmd_chats)
    add_models(sub, _cmd_models)
    add_tune(sub, _cmd_tune)
    return parser


def write_crash_log(exc: BaseException, argv: Sequence[str]) -> Path:
    """The command and the full traceback of a bug, in a new file under ``cache_root()/logs``
    (created on demand); its path. Raises OSError if the file cannot be written."""
    folder = cache_root() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    text = "".join(traceback.format_exception(exc))
    path.write_text(f"localspec {shlex.join(argv)}\n\n{text}", encoding="utf-8",
                    errors="backslashreplace")  # lone surrogates in a message or argument
    return path


def _summary(exc: BaseException) -> str:
    """``Type: first line of the message``, escaped to ASCII-safe text; the type alone when
    the message is empty or cannot be made."""
    try:
        message = str(exc)
    except Exception:  # any __str__ may raise anything; the report of a bug must not
        message = ""
    first_line = next(iter(message.strip().splitlines()), "")
    first_line = first_line.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__


def _report_bug(exc: Exception, argv: Sequence[str]) -> int:
    """One line for the user, the traceback in a log file (on stderr if that cannot be
    written: a bug must never be hidden)."""
    summary = _summary(exc)
    try:
        path = write_crash_log(exc, argv)
    except OSError as log_error:
        print(f"localspec: internal error: {summary} (no log file: {log_error}); traceback:",
              file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
        return EXIT_BUG
    print(f"localspec: internal error: {summary} (details: {path})", file=sys.stderr)
    return EXIT_BUG


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (captured output): nothing to do
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (argparse exits 2 itself on a bad flag)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # a real text stream (not every test's stand-in)
        reconfigure(errors="backslashreplace")
    transformers_logging.disable_progress_bar()  # our own bar shows loading; one is enough
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LocalSpecError as exc:
        print(f"localspec: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `localspec generate ... | head`: the reader left, not a bug
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # a bug: logged in full, summarised in one line
        return _report_bug(exc, argv)


def console() -> None:
    """The ``localspec`` console command."""
    sys.exit(main())
