"""``bench --bandwidth`` on shapes small enough for a test: every native type is timed and
reported against the measured read bandwidth (the numbers themselves are for a quiet machine)."""

from __future__ import annotations

import re

import pytest

from localspec.cli import bench_bandwidth
from localspec.runtime.kernels import KernelUnavailable, serving_kernels


@pytest.fixture()
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        serving_kernels(bench_bandwidth.kernel_dir())
    except KernelUnavailable as exc:
        pytest.skip(f"no native kernels here: {exc}")
    monkeypatch.setattr(bench_bandwidth, "LAYER_SHAPES", ((64, 256), (32, 512)))
    monkeypatch.setattr(bench_bandwidth, "LAYERS", 2)
    monkeypatch.setattr(bench_bandwidth, "SUM_BYTES", 1 << 20)


def test_every_type_is_timed_and_its_bytes_counted(small: None) -> None:
    lines: list[str] = []
    table = bench_bandwidth.run_bandwidth(repeats=1, log=lines.append)
    assert lines[0].startswith("read bandwidth: ")
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()
            if line.startswith("| Q")}
    assert sorted(rows) == sorted(bench_bandwidth.TYPES)
    # bits a weight, packed: Q4_K 4.5 (+ the per-group scales kept as bytes and floats), Q8_0 8.5
    q4 = bench_bandwidth.measure_type("Q4_K", repeats=1)
    q8 = bench_bandwidth.measure_type("Q8_0", repeats=1)
    q3 = bench_bandwidth.measure_type("Q3_M", repeats=1)
    weights = 2 * (64 * 256 + 32 * 512)
    assert 4.5 <= 8 * q4.nbytes / weights < 6.5 and 8.5 <= 8 * q8.nbytes / weights < 10
    assert 8 * q3.nbytes / weights == 8 * q4.nbytes / weights - 1  # a bit a weight fewer
    assert all(s > 0 for s in q4.seconds.values())
    assert re.search(r"\| Q6_K \| \d+ \| [\d.]+ ms \| [\d.]+ \| \d+% \|", table)


def test_the_cli_takes_it_without_a_preset(small: None, capsys: pytest.CaptureFixture) -> None:
    from localspec.cli.main import main

    assert main(["bench", "--bandwidth"]) == 0
    assert "% of bandwidth" in capsys.readouterr().out
