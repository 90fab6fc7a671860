"""``localspec gpucheck`` without a GPU: its parts run on tiny models (``--shapes tiny``) and
write the report, so the command is known to work before a CUDA machine's short lease is
spent on it; on the presets' shapes it refuses without CUDA, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error, run_cli


def test_tiny_run_writes_the_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "gpucheck", "--shapes", "tiny", "--parts", "machine",
                             "correctness", "cost", "--out", str(tmp_path))
    assert code == 0, out + err
    [report_path] = tmp_path.glob("gpucheck-*.json")
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["machine"]["versions"]["torch"] and report["machine"]["device"] == "cpu"
    correctness = report["correctness"]
    assert correctness["passed"], correctness
    assert {"float32", "float32-graphs", "bfloat16", "bfloat16-graphs"} <= set(correctness)
    assert set(report["cost"]["target-graphs"]["ms"]) == {"1", "2", "4", "8", "16", "32"}
    markdown = report_path.with_suffix(".md").read_text(encoding="utf-8")
    assert "| tokens fed | target eager ms | target graphs ms |" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_refused_without_a_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_user_error(run_cli(capsys, "gpucheck", "--out", str(tmp_path)),
                      "PyTorch sees none here")
    assert_user_error(run_cli(capsys, "gpucheck", "--shapes", "tiny", "--parts", "gpu"),
                      "--parts gpu: choose from machine, correctness")
