"""The command line on tiny saved models: every bad flag or method choice ends in one
``localspec: error: ...`` line and exit 2 (before any model loads where the preset alone can
tell), a bug ends in one ``internal error`` line, a log file and exit 1, and the happy paths
of generate, bench and verify work end to end. Bad files and text: ``test_cli_input``.

Most tests call ``main([...])`` in-process; two run ``python -m localspec`` to see the real
stderr."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli

from localspec.cli.bench import check_methods, default_methods
from localspec.config import MAX_NEW_TOKENS, MAX_SEED
from localspec.presets import load_preset

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("own_cache")  # crash logs go there too


# ----------------------------------------------------------------------------- generate flags


@pytest.mark.parametrize(("flags", "setting"), [
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "-0.5"], "top_p"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "nan"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", str(MAX_NEW_TOKENS + 1)], "max_new_tokens"),
    (["--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--num-speculative-tokens", "33"], "num_speculative_tokens"),
    (["--seed", "-1"], "seed"),
    (["--seed", str(2**64)], "seed"),
    (["--seed", str(MAX_SEED), "--num-samples", "2"], "--num-samples 2"),
    (["--seed", str(MAX_SEED - 2), "--num-samples", "4"], "beyond the 64-bit limit"),
])
@pytest.mark.usefixtures("no_loading")
def test_generate_bad_setting_is_exit_2_before_loading(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], flags: list[str],
        setting: str) -> None:
    assert_user_error(run_cli(capsys, "generate", "--preset", presets["draft"], "--prompt", "hi",
                              *flags), setting)


def test_largest_seeds_that_fit_are_accepted(presets: dict[str, str]) -> None:
    from localspec.cli.generate import plan_generate
    from localspec.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--preset", presets["ngram"], "--prompt", "x",
                                      "--seed", str(MAX_SEED - 2), "--num-samples", "3"])
    assert plan_generate(args).seeds == (MAX_SEED - 2, MAX_SEED - 1, MAX_SEED)


@pytest.mark.parametrize(("command", "flag", "value"), [
    ("generate", "--num-samples", "0"), ("generate", "--num-samples", "-3"),
    ("generate", "--num-samples", "1001"), ("generate", "--num-samples", "two"),
    ("bench", "--repeats", "0"), ("bench", "--repeats", "-1"), ("bench", "--repeats", "101"),
])
def test_counts_out_of_range_are_argparse_errors(capsys: pytest.CaptureFixture[str],
                                                 presets: dict[str, str], command: str,
                                                 flag: str, value: str) -> None:
    prompt = ["--prompt", "hi"] if command == "generate" else []
    code, _, err = run_cli(capsys, command, "--preset", presets["ngram"], *prompt, flag, value)
    assert code == 2 and f"argument {flag}" in err and "Traceback" not in err


@pytest.mark.parametrize(("flags", "needle"), [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "  \n\t "], "only whitespace"),
    (["--prompt", "", "--raw"], "--prompt is empty"),
    (["--prompt", "hi", "--method", "draft_model"], "needs a draft model"),
])
@pytest.mark.usefixtures("no_loading")
def test_generate_bad_prompt_or_method_before_loading(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], flags: list[str],
        needle: str) -> None:
    assert_user_error(run_cli(capsys, "generate", "--preset", presets["ngram"], *flags), needle)


def test_generate_without_chat_template_says_use_raw(capsys: pytest.CaptureFixture[str],
                                                     presets: dict[str, str]) -> None:
    assert_user_error(run_cli(capsys, "generate", "--preset", presets["no-template"],
                              "--prompt", "hi"), "no chat template", "--raw")
    code, _, err = run_cli(capsys, "generate", "--preset", presets["no-template"],
                           "--prompt", "  ", "--raw", "--max-new-tokens", "3")
    assert code == 0, err  # whitespace is a fine raw continuation


def test_generate_prompt_longer_than_context(capsys: pytest.CaptureFixture[str],
                                             presets: dict[str, str]) -> None:
    """The engine's GenerationError (a LocalSpecError) is exit 2, not a traceback."""
    assert_user_error(run_cli(capsys, "generate", "--preset", presets["ngram"], "--raw",
                              "--prompt", "hello world " * 200), "context holds 256")


def test_generate_json_and_streaming(capsys: pytest.CaptureFixture[str],
                                     presets: dict[str, str]) -> None:
    code, out, err = run_cli(capsys, "generate", "--preset", presets["draft"], "--prompt", "hi",
                             "--json", "--num-samples", "2", "--temperature", "0.7",
                             "--seed", "3")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "draft_model" and len(data["samples"]) == 2
    lengths = [len(s["token_ids"]) for s in data["samples"]]  # a draw may end one at EOS
    assert all(1 <= n <= 8 for n in lengths) and data["stats"]["new_tokens"] == sum(lengths)
    code, out, err = run_cli(capsys, "generate", "--preset", presets["draft"], "--prompt", "hi",
                             "--method", "ngram")
    assert code == 0, err
    assert "[ngram] 8 tokens" in err


@pytest.mark.parametrize("temperature", ["1e-40", "5e-324"])
def test_generate_tiny_temperature_is_greedy_not_nan(capsys: pytest.CaptureFixture[str],
                                                     presets: dict[str, str],
                                                     temperature: str) -> None:
    """A valid but tiny temperature must not overflow the logits into NaN probabilities."""
    outputs = []
    for value in ("0", temperature):
        code, out, err = run_cli(capsys, "generate", "--preset", presets["draft"], "--prompt",
                                 "hi", "--json", "--temperature", value)
        assert code == 0, err
        outputs.append(json.loads(out)["samples"][0]["token_ids"])
    assert outputs[0] == outputs[1]


# ----------------------------------------------------------------------------- bench and verify


@pytest.mark.parametrize(("methods", "needle"), [
    ("none,draft_model", "method 'draft_model' needs a draft model"),
    ("hf-assisted", "method 'hf-assisted' needs a draft model"),
    ("ngram,beam", "unknown method(s) beam"),
    (" , ", "--methods ' , ' names no method"),
    ("", "--methods '' names no method"),
])
@pytest.mark.usefixtures("no_loading")
def test_bench_methods_checked_before_anything_runs(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], methods: str,
        needle: str) -> None:
    assert_user_error(run_cli(capsys, "bench", "--preset", presets["ngram"], "--methods",
                              methods), needle)


@pytest.mark.parametrize("command", ["bench", "verify"])
@pytest.mark.usefixtures("no_loading")
def test_bench_and_verify_max_new_tokens_checked_first(
        capsys: pytest.CaptureFixture[str], presets: dict[str, str], command: str) -> None:
    assert_user_error(run_cli(capsys, command, "--preset", presets["ngram"],
                              "--max-new-tokens", "0"), "max_new_tokens")


def test_default_methods_follow_the_preset(presets: dict[str, str]) -> None:
    assert default_methods(load_preset(presets["ngram"])) == ["none", "ngram", "suffix", "auto",
                                                              "hf-lookup"]
    with_draft = load_preset(presets["draft"])
    assert "draft_model" in default_methods(with_draft)
    assert check_methods(with_draft, ["ngram", "none", "ngram", "hf-assisted"]) == [
        "none", "ngram", "hf-assisted"]


def test_bench_and_verify_run(capsys: pytest.CaptureFixture[str], presets: dict[str, str],
                              tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"category": "a", "prompt": "def add(a, b):"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n",
                    encoding="utf-8")
    code, out, err = run_cli(capsys, "bench", "--preset", presets["draft"], "--prompts",
                             str(path), "--methods", "ngram,draft_model", "--max-new-tokens",
                             "6", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert list(report["methods"]) == ["none", "ngram", "draft_model"]
    assert all(r["identical_to_none"] for r in report["methods"].values())
    assert [p["category"] for p in report["prompts"]] == ["a", ""]
    code, out, err = run_cli(capsys, "verify", "--preset", presets["ngram"], "--prompts",
                             str(path), "--max-new-tokens", "6", "--json")
    assert code == 0, err
    assert json.loads(out)["passed"] is True


def test_bench_warms_up_every_method_before_timing(presets: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each method runs once, short, before any timed run, so none pays the first-call costs
    for the others."""
    import localspec.cli.bench as bench

    calls: list[tuple[str, int]] = []

    def fake_run(_pipe: object, method: str, prompt_ids: list[int], max_new: int,
                 reference: list[int] | None = None) -> dict:
        calls.append((method, max_new))
        return {"token_ids": [1] * max_new, "tokens_per_second": 1.0, "wall_time_s": 1.0,
                "acceptance_rate": None, "mean_accepted_length": 1.0,
                "target_forward_passes": max_new}

    monkeypatch.setattr(bench, "_run_ours", fake_run)
    monkeypatch.setattr(bench, "encode_prompts", lambda _pipe, rows, _max: [[1, 2]] * len(rows))
    pipe = type("Pipe", (), {"preset": load_preset(presets["draft"])})()
    bench.run_bench(pipe, [{"prompt": "a"}, {"prompt": "b"}], ["ngram", "draft_model"], 20)
    warm = [(m, bench.WARM_UP_TOKENS) for m in ("none", "ngram", "draft_model")]
    assert calls[:3] == warm and all(n == 20 for _, n in calls[3:]) and len(calls) == 9


def test_bench_simulated_acceptance(capsys: pytest.CaptureFixture[str],
                                    presets: dict[str, str], tmp_path: Path) -> None:
    """--simulate-acceptance adds draft_model@A runs, exact like every method; it needs a draft
    model and an A in [0, 1], both checked before loading."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "bench", "--preset", presets["draft"], "--methods", "none",
                             "--simulate-acceptance", "1,0", "--max-new-tokens", "6",
                             "--prompts", str(prompts), "--json")
    assert code == 0, err
    report = json.loads(out)["methods"]
    assert list(report) == ["none", "draft_model@1", "draft_model@0"]
    assert all(r["identical_to_none"] for r in report.values())
    assert report["draft_model@1"]["acceptance_rate"] == 1.0
    assert report["draft_model@0"]["acceptance_rate"] == 0.0
    for flags, message in (((presets["ngram"], "0.5"), "needs a draft model"),
                           ((presets["draft"], "1.5"), "unknown method(s) draft_model@1.5")):
        code, _, err = run_cli(capsys, "bench", "--preset", flags[0], "--simulate-acceptance",
                               flags[1])
        assert code == 2 and message in err, err


# ----------------------------------------------------------------------------- bugs, interrupts


def _boom(_args: object) -> int:
    raise RuntimeError("boom\nsecond line")


def test_internal_error_is_logged_not_shown(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch,
                                            own_cache: Path) -> None:
    monkeypatch.setattr("localspec.cli.main._cmd_presets", _boom)
    code, _, err = run_cli(capsys, "presets")
    assert code == 1 and "Traceback" not in err
    line = err.strip()
    assert line.startswith("localspec: internal error: RuntimeError: boom (details: ")
    log = Path(line.removesuffix(")").rsplit("(details: ", 1)[1])
    assert log.parent == own_cache / "logs"
    text = log.read_text(encoding="utf-8")
    assert "Traceback" in text and "second line" in text and "_boom" in text


def test_internal_error_without_a_writable_log_shows_traceback(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("LOCALSPEC_CACHE", str(blocker))
    monkeypatch.setattr("localspec.cli.main._cmd_presets", _boom)
    code, _, err = run_cli(capsys, "presets")
    assert code == 1 and "localspec: internal error: RuntimeError: boom (no log file" in err
    assert "Traceback" in err  # never hidden


@pytest.mark.parametrize(("exc", "status", "message"), [
    (KeyboardInterrupt, 130, "localspec: interrupted\n"),
    (BrokenPipeError, 141, ""),  # `localspec generate ... | head`: quiet
])
def test_interrupt_and_broken_pipe(capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch, exc: type[BaseException],
                                   status: int, message: str) -> None:
    def stopped(_args: object) -> int:
        raise exc

    monkeypatch.setattr("localspec.cli.main._cmd_presets", stopped)
    assert run_cli(capsys, "presets") == (status, "", message)


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALSPEC_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def test_python_m_localspec_runs_the_cli(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m localspec`` is the CLI, exit status included (in-process: the fast lane's
    check; the real process is the next test's)."""
    monkeypatch.setattr(sys, "argv", ["localspec", "presets", "--json"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("localspec", run_name="__main__")
    assert exit_.value.code == 0
    assert json.loads(capsys.readouterr().out)


def test_subprocess_stderr_has_no_traceback(presets: dict[str, str], tmp_path: Path) -> None:
    """The real ``python -m localspec`` process: one line on stderr, the right exit status."""
    out = subprocess.run([sys.executable, "-m", "localspec", "generate", "--preset",
                          presets["ngram"], "--prompt", "hi", "--temperature", "nan"],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "LOCALSPEC_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("localspec: error: temperature")
    bug = _python("import sys\nimport localspec.cli.main as m\n"
                  "def boom(_args):\n    raise ValueError('a bug')\n"
                  "m._cmd_presets = boom\nsys.exit(m.main(['presets']))", tmp_path)
    assert bug.returncode == 1 and "Traceback" not in bug.stderr, bug.stderr
    assert "internal error: ValueError: a bug (details: " in bug.stderr
    assert list((tmp_path / "cache" / "logs").glob("crash-*.log"))
