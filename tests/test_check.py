"""``localspec verify``'s checker: its chi-square test (SciPy, pooled small bins) must pass a
correct sampler and fail a deliberately wrong one, and its q must come from a draft cache that
holds the current prompt only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from tolerance import normalised_rtol

import localspec.cli.check as check_module
import localspec.engine.verify as verify_module
from localspec.cli.check import (
    P_VALUE_THRESHOLD,
    check_sampling,
    chi_square_p_value,
    emitted_token_counts,
    run_checks,
)
from localspec.cli.main import main
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams, logits_to_probs
from localspec.training.prompts import encode

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005], dtype=torch.float64)
Q = P.flip(0)
PROMPTS = [{"prompt": "def add(a, b):\n    return a + b\n"}, {"prompt": "hello world"}]


def multinomial_counts(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(probs.float(), n, replacement=True, generator=g)
    return torch.bincount(draws, minlength=len(probs))


def wrong_residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """A classic bug: resample from p itself after a rejection."""
    return p


# ----------------------------------------------------------------------------- chi-square


def test_chi_square_accepts_right_and_rejects_wrong_distribution() -> None:
    for seed in range(5):
        assert chi_square_p_value(multinomial_counts(P, 4000, seed), P) > P_VALUE_THRESHOLD
    tilted = (P + 0.02) / (P + 0.02).sum()
    assert chi_square_p_value(multinomial_counts(tilted, 4000, 0), P) < 1e-6


def test_chi_square_pools_small_bins_like_scipy_on_pooled_arrays() -> None:
    """Bins expecting < 5 counts are pooled; a pool still < 5 joins the smallest large bin."""
    counts = torch.tensor([50, 30, 12, 3, 2, 3])
    probs = torch.tensor([0.5, 0.3, 0.12, 0.04, 0.03, 0.01])
    # expected 50, 30, 12 | 4, 3, 1 -> pool of 8 (>= 5) is its own bin
    assert chi_square_p_value(counts, probs) == pytest.approx(
        chisquare([50, 30, 12, 8], [50, 30, 12, 8]).pvalue)
    counts = torch.tensor([60, 25, 10, 3, 2])
    probs = torch.tensor([0.6, 0.25, 0.11, 0.02, 0.02])
    # expected 60, 25, 11 | 2, 2 -> pool of 4 (< 5) joins the 11 bin
    assert chi_square_p_value(counts, probs) == pytest.approx(
        chisquare([60, 25, 15], [60, 25, 15]).pvalue)


def test_chi_square_impossible_token_fails() -> None:
    """A token with probability 0 emitted even once is a bug, whatever the pooling says."""
    probs = torch.tensor([0.5, 0.5, 0.0])
    assert chi_square_p_value(torch.tensor([500, 499, 1]), probs) == 0.0
    assert chi_square_p_value(torch.tensor([500, 500, 0]), probs) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- the verifier


@pytest.mark.parametrize("q", [Q, None], ids=["draft q", "one-hot q"])
def test_emitted_tokens_pass_with_the_right_sampler(q: torch.Tensor | None) -> None:
    counts = emitted_token_counts(P, q, 4000, seed=1)
    assert chi_square_p_value(counts, P) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("q", [Q, None], ids=["draft q", "one-hot q"])
def test_negative_control_wrong_residual_fails_the_check(monkeypatch: pytest.MonkeyPatch,
                                                        q: torch.Tensor | None) -> None:
    monkeypatch.setattr(verify_module, "residual_distribution", wrong_residual)
    counts = emitted_token_counts(P, q, 4000, seed=1)
    assert chi_square_p_value(counts, P) < P_VALUE_THRESHOLD


# ----------------------------------------------------------------------------- on tiny models


@pytest.fixture(scope="module")
def pipe(presets: dict[str, str]) -> Pipeline:
    return Pipeline.load(load_preset(presets["draft"]))


def test_draft_q_of_each_prompt_is_computed_from_an_empty_cache(
        pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt 2's q must be what a fresh draft runner gives for prompt 2 alone (not with
    prompt 1's tokens still in the draft's cache)."""
    seen: list[torch.Tensor] = []

    def capture(p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int
                ) -> torch.Tensor:
        if q is not None:
            seen.append(q)
        return torch.zeros_like(p, dtype=torch.long)

    monkeypatch.setattr(check_module, "emitted_token_counts", capture)
    vocab = pipe.target.model.config.vocab_size
    check_sampling(pipe, PROMPTS, positions=2, support=vocab, trials=1)
    assert len(seen) == 4  # 2 prompts x 2 positions
    params = SamplingParams(1.0, 0, 1.0)  # the preset's: greedy -> temperature 1
    ids = encode(pipe, PROMPTS[1])
    fresh = logits_to_probs(ModelRunner(pipe.draft.model).forward(ids, logits_to_keep=2), params)
    for j in range(2):  # support = whole vocabulary, so q is the row over its own sum
        torch.testing.assert_close(seen[2 + j], fresh[j], rtol=normalised_rtol(vocab),
                                   atol=torch.finfo(torch.float32).tiny)


def test_run_checks_passes_and_its_negative_control_fails(
        pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    report = run_checks(pipe, PROMPTS, max_new_tokens=6)
    assert report["passed"], report
    assert {r["method"] for r in report["greedy"]} == {"ngram", "suffix", "draft_model", "auto"}
    assert {r["drafter"] for r in report["sampling"]} == {"ngram (one-hot q)", "draft_model"}
    monkeypatch.setattr(verify_module, "residual_distribution", wrong_residual)
    bad = check_sampling(pipe, PROMPTS)
    assert not all(r["passed"] for r in bad)


def test_verify_command_fails_with_a_wrong_sampler(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        presets: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "hello world"}\n',
                    encoding="utf-8")
    monkeypatch.setattr(verify_module, "residual_distribution", wrong_residual)
    assert main(["verify", "--preset", presets["draft"], "--prompts", str(path),
                 "--max-new-tokens", "6"]) == 1  # exit 0 when it passes: see test_cli
    assert capsys.readouterr().out.strip().endswith("FAILED")


def test_chi_square_concentrated_p_still_detects_a_wrong_sampler() -> None:
    """p concentrated on one token leaves one large bin: pooling must not merge the rest into it
    (which left a single bin and p-value 1 whatever the counts)."""
    probs = torch.tensor([0.999, 0.0005, 0.0005], dtype=torch.float64)
    assert chi_square_p_value(torch.tensor([0, 2000, 2000]), probs) < 1e-6
    assert chi_square_p_value(torch.tensor([3996, 2, 2]), probs) > 0.01
