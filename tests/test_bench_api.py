"""``bench --api`` on tiny saved models: each of our methods also runs through the
OpenAI-compatible API (served in the process, streamed over loopback HTTP) right after its
direct run, and the report says, per method and per prompt, its tok/s, its ratio to the direct
run and whether its output is the direct run's. Methods the API cannot run (transformers'
``hf-*``, the simulated ``draft_model@A``) are refused with ``--api`` before any model loads.
No timing is asserted: the machine running the tests is not quiet."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli

import localspec.cli.bench as bench
import localspec.cli.bench_api as bench_api
import localspec.cli.main as cli_main
from localspec.cli.bench import WARM_UP_TOKENS


@pytest.fixture
def prompts_file(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"category": "code", "prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n",
                    encoding="utf-8")
    return str(path)


def test_bench_api_runs_every_method_through_the_api(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], prompts_file: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each direct run is followed by the same run through the API (same prompt ids, method,
    max tokens); the rows exist for every method, identical, with a ratio."""
    calls: list[tuple[str, int, int]] = []
    real = bench_api.run_via_api

    def recording(client: object, method: str, prompt_ids: list[int], max_new: int) -> dict:
        calls.append((method, len(prompt_ids), max_new))
        return real(client, method, prompt_ids, max_new)

    monkeypatch.setattr(bench_api, "run_via_api", recording)
    code, out, err = run_cli(capsys, "bench", "--preset", presets["draft"], "--prompts",
                             prompts_file, "--methods", "ngram,draft_model", "--max-new-tokens",
                             "6", "--repeats", "2", "--api", "--json")
    assert code == 0, err
    report = json.loads(out)
    methods = ["none", "ngram", "draft_model"]
    assert list(report["methods"]) == methods and list(report["api"]["methods"]) == methods
    for row in report["api"]["methods"].values():
        assert row["identical_to_direct"] is True
        assert row["tokens_per_second"] > 0 and row["ratio"] > 0 and row["min_ratio"] > 0
    assert [list(p) for p in report["api"]["prompts"]] == [methods, methods]
    assert all(r["new_tokens"] == 6 for p in report["api"]["prompts"] for r in p.values())
    # warm-up first (every method, short), then 2 repeats x 2 prompts x 3 methods
    assert [(m, n) for m, _, n in calls[:3]] == [(m, WARM_UP_TOKENS) for m in methods]
    assert [m for m, _, _ in calls[3:]] == methods * 4 and all(n == 6 for *_, n in calls[3:])
    assert err.count("via API") == 12  # a log line per run through the API


def test_bench_api_table_has_a_row_per_method(capsys: pytest.CaptureFixture[str],
                                              presets: dict[str, str],
                                              prompts_file: str) -> None:
    """Without --methods, --api runs the preset's own methods (no hf-*), and the table ends
    with ``METHOD via API`` rows: tok/s, ratio, lowest ratio, identical."""
    code, out, err = run_cli(capsys, "bench", "--preset", presets["ngram"], "--prompts",
                             prompts_file, "--max-new-tokens", "5", "--api")
    assert code == 0, err
    assert "hf-lookup" not in out
    rows = {line.split(" via API")[0]: line.split(" via API")[1].split()
            for line in out.splitlines() if " via API " in line}
    assert list(rows) == ["none", "ngram", "suffix", "auto"]
    for tok_s, ratio, lowest, identical in rows.values():
        assert float(tok_s) > 0 and ratio.endswith("x") and float(ratio[:-1]) > 0
        assert float(lowest[:-1]) > 0 and identical == "yes"


def test_bench_api_flags_a_different_answer(capsys: pytest.CaptureFixture[str],
                                            presets: dict[str, str], prompts_file: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity check can fail: an answer through the API that differs from the direct
    run's (here: the API's text altered on the client) reads NO."""
    real = bench_api.run_via_api

    def altered(client: object, method: str, prompt_ids: list[int], max_new: int) -> dict:
        run = real(client, method, prompt_ids, max_new)
        return {**run, "text": run["text"] + "!"} if method == "ngram" else run

    monkeypatch.setattr(bench_api, "run_via_api", altered)
    code, out, err = run_cli(capsys, "bench", "--preset", presets["ngram"], "--prompts",
                             prompts_file, "--max-new-tokens", "5", "--api", "--json")
    assert code == 0, err
    api = json.loads(out)["api"]["methods"]
    assert api["none"]["identical_to_direct"] is True
    assert api["ngram"]["identical_to_direct"] is False


@pytest.mark.parametrize("api", [True, False])
def test_bench_api_generates_on_the_engine_thread(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], prompts_file: str,
        monkeypatch: pytest.MonkeyPatch, api: bool) -> None:
    """With --api the model load is on a thread of its own that ends with it, and every direct
    run on the host's one engine thread, where the API's generations run: no other thread keeps
    an OpenMP pool while one generates (see ``ModelHost.on_engine``). Without --api, bench runs
    on the main thread as it always has."""
    threads: list[threading.Thread] = []
    real_run, real_load = bench._run_ours, cli_main.load_pipeline

    def run(*args: object, **kwargs: object) -> dict:
        threads.append(threading.current_thread())
        return real_run(*args, **kwargs)

    def load(*args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(bench, "_run_ours", run)
    monkeypatch.setattr(cli_main, "load_pipeline", load)
    code, _, err = run_cli(capsys, "bench", "--preset", presets["ngram"], "--prompts",
                           prompts_file, "--max-new-tokens", "4", *(["--api"] if api else []))
    assert code == 0, err
    assert len(threads) == 1 + 4 + 2 * 4  # the load, the warm-ups, 2 prompts x 4 methods
    if api:
        loader, runs = threads[0], threads[1:]
        assert loader is not threading.main_thread() and not loader.is_alive()
        assert len(set(runs)) == 1 and runs[0].name.startswith("localspec-engine")
    else:
        assert set(threads) == {threading.main_thread()}


@pytest.mark.parametrize(("flags", "needle"), [
    (["--methods", "ngram,hf-lookup"], "hf-lookup cannot go through it"),
    (["--methods", "hf-plain,hf-lookup"], "hf-plain, hf-lookup cannot go through it"),
    (["--methods", "none", "--simulate-acceptance", "0.5"],
     "draft_model@0.5 cannot go through it"),
    (["--simulate-acceptance", "0.5"], "draft_model@0.5 cannot go through it"),
])
@pytest.mark.usefixtures("no_loading")
def test_bench_api_refuses_methods_the_api_cannot_run(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], flags: list[str],
        needle: str) -> None:
    assert_user_error(run_cli(capsys, "bench", "--preset", presets["draft"], "--api", *flags),
                      needle, "drop --api")


def test_bench_api_user_errors_from_a_run_thread_are_exit_2(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], tmp_path: Path) -> None:
    """What a run raises on its own thread is raised in the command: a prompt too long for the
    context is the usual one-line error, exit 2."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "hello world " * 200}) + "\n", encoding="utf-8")
    assert_user_error(run_cli(capsys, "bench", "--preset", presets["ngram"], "--prompts",
                              str(path), "--api"), "long.jsonl line 1", "context holds 256")


def test_bench_parallel_compares_clients_at_once_with_one_at_a_time(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], prompts_file: str) -> None:
    """``bench --parallel 3``: per method (default: none and the preset's), the first 3 prompts
    (the set repeated) one at a time and at once through the API, every answer identical, a
    pass that served all three; the table names both phases. A bad count is exit 2."""
    code, out, err = run_cli(capsys, "bench", "--preset", presets["draft"], "--prompts",
                             prompts_file, "--max-new-tokens", "6", "--parallel", "3", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert list(report["methods"]) == ["none", "draft_model"] and report["parallel"] == 3
    for row in report["methods"].values():
        assert row["identical"] is True and len(row["alone"]) == len(row["together"]) == 3
        assert row["alone_tokens_per_second"] > 0 and row["speedup"] > 0
        assert all(r["new_tokens"] == 6 for r in row["together"])
    assert report["peak_batch"] == 3
    code, out, err = run_cli(capsys, "bench", "--preset", presets["draft"], "--prompts",
                             prompts_file, "--max-new-tokens", "6", "--parallel", "2",
                             "--methods", "ngram")
    assert code == 0, err
    assert "2 clients at once" in out and "ngram" in out and "identical" in out
    code, _, err = run_cli(capsys, "bench", "--parallel", "17")
    assert code == 2 and "--parallel: must be between 1 and 16" in err
