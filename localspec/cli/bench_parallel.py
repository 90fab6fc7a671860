"""``bench --parallel N``: N clients at once against the same N requests one at a time.

The loaded pipeline is served by the API in this process (``ModelHost(parallel=N)``: N slots
whose requests share target passes, ``localspec.slots``) on a free loopback port. For each
method, the first N prompts of the set are sent twice over real HTTP (streamed completions of
the prompts' token ids, greedy, ``max_tokens`` each, ``localspec.method``): one at a time by
one client, then all at once by N clients, each on its own connection. The figure is the
total tok/s of each phase (all new tokens over the phase's wall time, first request sent to
last ``[DONE]``) and their ratio; each answer given together must be the one given alone
(text and token count).

Before each method's phases, N short requests at once (untimed) make every slot's engine (its
caches, a draft model's runner) and pay the first passes' set-up. As ``bench --api`` does,
the model is loaded on a thread that ends with it (``bench_api.run_alone``), so every pass
runs on the host's one engine thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from localspec.api.local_server import serve_in_thread
from localspec.cli.bench import check_methods, needs_draft
from localspec.cli.bench_api import READ_TIMEOUT_S, check_api_methods, run_alone, run_via_api
from localspec.config import Preset
from localspec.host import ModelHost
from localspec.pipeline import Pipeline, request_settings_for
from localspec.training.prompts import encode_prompts, load_prompts

WARM_UP_TOKENS = 8


def _together(clients: list[httpx.Client], method: str, prompts: list[list[int]],
              max_new: int) -> tuple[list[dict[str, Any]], float]:
    """Every prompt at once, each by its own client: the runs and the wall time of all."""
    runs: list[dict[str, Any] | BaseException | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            runs[i] = run_via_api(clients[i], method, prompts[i], max_new)
        except BaseException as exc:  # raised below, on the caller's thread
            runs[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    for run in runs:
        if isinstance(run, BaseException):
            raise run
    return runs, wall  # type: ignore[return-value]


def run_parallel_bench(pipe: Pipeline, preset_key: str, prompts: list[list[int]],
                       methods: list[str], max_new: int, parallel: int,
                       log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The comparison for every method (see the module docstring) on the first ``parallel``
    prompts: tok/s alone and together, the ratio, and whether every answer was identical."""
    chosen = [prompts[i % len(prompts)] for i in range(parallel)]
    host = ModelHost(loader=lambda _preset, _previous, _progress: pipe, warm_up=False,
                     audit=False, parallel=parallel)
    if not host.load(preset_key):
        raise RuntimeError(f"serving the loaded pipeline failed: {host.status().error}")
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    report: dict[str, Any] = {"parallel": parallel, "max_new_tokens": max_new, "methods": {}}
    with serve_in_thread(host, max_queued=max(16, parallel)) as url:
        clients = [httpx.Client(base_url=url, timeout=timeout, trust_env=False)
                   for _ in range(parallel)]
        try:
            for method in methods:
                log(f"{method}: warming up {parallel} slots")
                _together(clients, method, chosen, WARM_UP_TOKENS)
                log(f"{method}: {parallel} requests one at a time")
                start = time.perf_counter()
                alone = [run_via_api(clients[0], method, ids, max_new) for ids in chosen]
                alone_wall = time.perf_counter() - start
                log(f"{method}: {parallel} requests at once")
                together, together_wall = _together(clients, method, chosen, max_new)
                alone_speed = sum(r["new_tokens"] for r in alone) / alone_wall
                speed = sum(r["new_tokens"] for r in together) / together_wall
                report["methods"][method] = {
                    "alone_tokens_per_second": alone_speed,
                    "together_tokens_per_second": speed,
                    "speedup": speed / alone_speed,
                    "identical": all(a["text"] == t["text"] and a["new_tokens"] == t["new_tokens"]
                                     for a, t in zip(alone, together, strict=True)),
                    "alone": alone, "together": together,
                    "alone_wall_s": alone_wall, "together_wall_s": together_wall,
                }
        finally:
            for client in clients:
                client.close()
    report["peak_batch"] = host.scheduler.peak if host.scheduler is not None else 1
    return report


def format_parallel(report: dict[str, Any]) -> str:
    """The comparison as a table, one method a row."""
    n = report["parallel"]
    lines = [f"{n} clients at once vs the same {n} requests one at a time (through the API, "
             f"streamed, greedy, {report['max_new_tokens']} new tokens each; total tok/s)",
             f"{'method':14s} {'alone':>8s} {'together':>9s} {'speedup':>8s}  identical"]
    for method, r in report["methods"].items():
        lines.append(f"{method:14s} {r['alone_tokens_per_second']:8.2f} "
                     f"{r['together_tokens_per_second']:9.2f} {r['speedup']:7.2f}x  "
                     f"{'yes' if r['identical'] else 'NO'}")
    lines.append(f"most requests in one target pass: {report['peak_batch']}")
    return "\n".join(lines)


def run_parallel_command(args: argparse.Namespace, preset: Preset,
                         load_pipeline: Callable[..., Pipeline],
                         log: Callable[[str], None]) -> int:
    """``bench --parallel N``: the methods named (default: plain decoding and the preset's
    method), checked before the model loads; prints the table (or JSON with ``--json``)."""
    named = [m.strip() for m in (args.methods or "").split(",") if m.strip()]
    methods = check_methods(preset, named or [preset.speculative_config.method])
    check_api_methods(methods)
    request_settings_for(preset, max_new_tokens=args.max_new_tokens, temperature=0.0)
    rows = load_prompts(args.prompts)
    pipe = run_alone(functools.partial(
        load_pipeline, preset, need_draft=any(needs_draft(m, preset) for m in methods)))
    prompts = encode_prompts(pipe, rows, args.max_new_tokens)
    report = run_parallel_bench(pipe, args.preset, prompts, methods, args.max_new_tokens,
                                args.parallel, log)
    print(json.dumps(report, ensure_ascii=False) if args.json else format_parallel(report))
    return 0
