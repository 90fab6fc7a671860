"""``bench --api``: every method also run through the OpenAI-compatible API, to show its cost.

The pipeline the direct runs use is served as it is (no second load, no warm-up, no audit) by
the API in a thread of this process, on a free loopback port; one client (httpx, over real
HTTP, one kept-alive connection) streams ``POST /v1/completions`` with the direct run's own
prompt token ids, greedy, the same ``max_tokens`` and ``localspec.method``. ``run_bench``
interleaves the two: each direct run is followed at once by the same run through the API, so
drift in machine speed reaches both alike.

Every generation, direct or through the API, runs on the host's one engine thread
(``ModelHost.on_engine`` says why: OpenMP pools kept by several threads halve a CPU decode's
speed), and the model load on a thread of its own that ends with it (``run_alone``), so no
other thread of the process keeps an OpenMP pool, as in ``localspec serve`` and the app.

The clock matches the direct run's (``Pipeline.run``: from the call to the generator's end):
from sending the request to the stream's last data, ``[DONE]``. Tokens are counted exactly
(``stream_options.include_usage``: the server's ``completion_tokens``); the streamed text and
that count are compared with the direct run's, which is what "identical" means here. Asking
for each token's id (``localspec.tokens``) would add per-token decoding to the measured path.

Only our methods can go through the API: transformers' (``hf-*``) and the simulated ones
(``draft_model@A``) are refused together with ``--api``, before any model loads.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from localspec.api.local_server import serve_in_thread
from localspec.errors import ConfigError
from localspec.host import ModelHost
from localspec.pipeline import Pipeline
from localspec.registry import method_names

T = TypeVar("T")


# The longest wait for the next piece of a stream: a prefill on a slow CPU, never a hang.
READ_TIMEOUT_S = 600.0
SUFFIX = " via API"


def check_api_methods(methods: list[str]) -> None:
    """ConfigError unless every method is one of ours (the registry's): those are what the
    API serves."""
    foreign = [m for m in methods if m not in method_names()]
    if foreign:
        raise ConfigError(f"--api runs our methods through the API ({', '.join(method_names())})"
                          f"; {', '.join(foreign)} cannot go through it: leave "
                          f"{'it' if len(foreign) == 1 else 'them'} out (--methods, "
                          "--simulate-acceptance) or drop --api")


def run_alone(work: Callable[[], T]) -> T:
    """``work()`` on a thread of its own, which ends with it (and its OpenMP pool with it); its
    result, or what it raised, raised here. The thread is a daemon: Ctrl-C does not wait for
    a generation to end."""
    outcome: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # anything at all: handed to the caller, who raises it
            outcome.append((False, exc))

    thread = threading.Thread(target=target, daemon=True, name="bench-run")
    thread.start()
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


@dataclass
class ApiRunner:
    """Runs through the API served over ``host``, and the direct runs beside them on the same
    engine thread."""

    client: httpx.Client
    host: ModelHost

    def __call__(self, method: str, prompt_ids: list[int], max_new: int) -> dict[str, Any]:
        """One run of ``method`` on ``prompt_ids`` through the API."""
        return run_via_api(self.client, method, prompt_ids, max_new)

    def on_engine(self, work: Callable[[], T]) -> T:
        """``work()`` (a direct run) on the engine thread the API's generations run on."""
        return self.host.run_on_engine(work)


@contextmanager
def api_runner(pipe: Pipeline, preset_key: str) -> Iterator[ApiRunner]:
    """``pipe`` served by the API (as preset ``preset_key``) while the block runs; yields the
    runner of one method on one prompt through it."""
    host = ModelHost(loader=lambda _preset, _previous, _progress: pipe, warm_up=False,
                     audit=False)
    if not host.load(preset_key):
        raise RuntimeError(f"serving the loaded pipeline failed: {host.status().error}")
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    # trust_env=False: a proxy from the environment must not stand between us and loopback
    with serve_in_thread(host) as url, httpx.Client(base_url=url, timeout=timeout,
                                                   trust_env=False) as client:
        yield ApiRunner(client, host)


def _api_failure(what: str, body: str) -> RuntimeError:
    """The API failing a request every check already passed is a bug: its message, as a
    RuntimeError (the command line logs it as one)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:500]
    return RuntimeError(f"{what}: {message}")


def run_via_api(client: httpx.Client, method: str, prompt_ids: list[int],
                max_new: int) -> dict[str, Any]:
    """One greedy streamed completion of ``prompt_ids`` with ``method``: its text, token count,
    tok/s and wall time (request sent to ``[DONE]`` received)."""
    body = {"prompt": prompt_ids, "max_tokens": max_new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "localspec": {"method": method}}
    pieces: list[str] = []
    usage: dict[str, int] | None = None
    wall = None
    start = time.perf_counter()
    with client.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            raise _api_failure(f"the API answered {response.status_code}",
                               response.read().decode(errors="replace"))
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                wall = time.perf_counter() - start
                break
            event = json.loads(data)
            if "error" in event:
                raise _api_failure("the API's stream stopped with an error", data)
            pieces.extend(choice.get("text") or "" for choice in event.get("choices", ()))
            usage = event.get("usage") or usage
    if wall is None or usage is None:
        raise RuntimeError(f"the API's stream for method {method} ended without "
                           f"{'[DONE]' if wall is None else 'its usage'}")
    new_tokens = int(usage["completion_tokens"])
    return {"text": "".join(pieces), "new_tokens": new_tokens,
            "tokens_per_second": new_tokens / wall if wall > 0 else 0.0, "wall_time_s": wall}


def summarise_api(prompts: list[dict[str, Any]], methods: list[str],
                  runs: dict[tuple[int, str], list[dict[str, Any]]],
                  api_runs: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """Per method and per prompt: tok/s through the API, its ratio to the direct runs' (the
    medians over repeats, per prompt; the median of those ratios per method), and whether
    every run through the API gave the direct run's text and token count."""
    per_prompt: list[dict[str, Any]] = []
    for i in range(len(prompts)):
        detail = {}
        for method in methods:
            direct, api = runs[(i, method)], api_runs[(i, method)]
            direct_speed = statistics.median(r["tokens_per_second"] for r in direct)
            speed = statistics.median(r["tokens_per_second"] for r in api)
            detail[method] = {
                "tokens_per_second": speed,
                "ratio": speed / direct_speed if direct_speed > 0 else None,
                "new_tokens": api[0]["new_tokens"],
                "identical_to_direct": all(
                    a["text"] == d["text"] and a["new_tokens"] == len(d["token_ids"])
                    for a, d in zip(api, direct, strict=True)),
            }
        per_prompt.append(detail)
    summary = {}
    for method in methods:
        rows = [p[method] for p in per_prompt]
        ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
        summary[method] = {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
            "ratio": statistics.median(ratios) if ratios else None,
            "min_ratio": min(ratios) if ratios else None,
            "identical_to_direct": all(r["identical_to_direct"] for r in rows),
        }
    return {"methods": summary, "prompts": per_prompt}


def format_api(api: dict[str, Any]) -> list[str]:
    """The table's rows for the runs through the API, one per method."""
    lines = ["through the API (streaming over HTTP, one client, the same loaded models): "
             "tok/s, ratio to the direct run (median, lowest prompt), identical to it",
             f"{'method':22s} {'tok/s':>7s} {'ratio':>7s} {'lowest':>7s}  identical"]
    for method, r in api["methods"].items():
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:6.3f}x"
        lowest = "-" if r["min_ratio"] is None else f"{r['min_ratio']:6.3f}x"
        lines.append(f"{method + SUFFIX:22s} {r['tokens_per_second']:7.2f} {ratio:>7s} "
                     f"{lowest:>7s}  {'yes' if r['identical_to_direct'] else 'NO'}")
    return lines
