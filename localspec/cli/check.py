"""``localspec verify``: prove on the user's own preset and hardware that speculation is lossless.

Two checks:
1. **Greedy equality**: every prompt is generated with plain decoding and with each speculative
   method; token ids must be identical. Where they differ, the target's own logits at the first
   differing position are examined: if its two best tokens are a near-tie (logit gap below
   ``NEAR_TIE_LOGITS``), the difference is numerical noise of the batched verify pass and is
   reported with its margin; otherwise the check fails.
2. **Sampling distribution**: on real target/draft distributions (p, q) taken from the models at
   positions of the prompts, the verifier is run thousands of times with k = 1 and the emitted
   token's frequencies are compared with p by a chi-square test. For speed the rows are
   restricted to the union of the top tokens of p and q (renormalised): the test checks the
   verifier's arithmetic on real shapes, not the tail mass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from localspec.cli.bench import encode, first_difference
from localspec.pipeline import Pipeline
from localspec.runtime.runner import ModelRunner
from localspec.engine.verify import SamplingParams, logits_to_probs, sample, verify_sampling

NEAR_TIE_LOGITS = 0.5
P_VALUE_THRESHOLD = 1e-3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
                       ) -> float:
    """Goodness of fit of observed ``counts`` to ``probs`` (bins with small expectation pooled).

    Uses the Wilson-Hilferty normal approximation of the chi-square tail (no SciPy needed).
    """
    total = float(counts.sum())
    expected = probs.double() * total
    big = expected >= min_expected
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = len(obs) - 1
    if df < 1:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def emitted_token_counts(p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int
                         ) -> torch.Tensor:
    """Run speculative sampling with k = 1 ``trials`` times; count the first emitted token.

    p, q: [vocab]. The draft token is drawn from q (or is q's argmax for a one-hot draft).
    """
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p, dtype=torch.long)
    p_rows = torch.stack([p, p])  # position 1 only matters for the bonus token
    for _ in range(trials):
        # A one-hot draft proposes p's second-best token: accepted often, rejected often.
        draft = sample(q, generator) if q is not None else int(torch.topk(p, 2).indices[1])
        verdict = verify_sampling(p_rows, None if q is None else q[None], [draft], generator)
        counts[draft if verdict.num_accepted else verdict.token] += 1
    return counts


@torch.inference_mode()
def _target_top2(pipe: Pipeline, ids: list[int]) -> dict[str, Any]:
    """The target's two best next tokens after ``ids``, from one fresh pass."""
    runner = pipe.engine("none").target
    runner.reset()
    logits = runner.forward(ids, logits_to_keep=1)[-1]
    runner.reset()
    values, tokens = torch.topk(logits, 2)
    probs = torch.softmax(logits, dim=-1)
    return {"tokens": tokens.tolist(), "logit_gap": float(values[0] - values[1]),
            "probs": [float(probs[t]) for t in tokens]}


def check_greedy(pipe: Pipeline, prompts: list[dict[str, Any]], methods: list[str],
                 max_new_tokens: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    results = []
    for i, row in enumerate(prompts):
        ids = encode(pipe, row)
        plain = pipe.run(pipe.request(ids, max_new_tokens=max_new_tokens, temperature=0.0),
                         "none").token_ids
        for method in methods:
            spec = pipe.run(pipe.request(ids, max_new_tokens=max_new_tokens, temperature=0.0),
                            method).token_ids
            diff = first_difference(plain, spec)
            entry: dict[str, Any] = {"prompt": i, "method": method, "tokens": len(plain),
                                     "identical": diff is None, "first_difference_at": diff}
            if diff is not None and diff < min(len(plain), len(spec)):
                top2 = _target_top2(pipe, ids + plain[:diff])
                entry["target_top2"] = top2
                entry["near_tie"] = top2["logit_gap"] < NEAR_TIE_LOGITS
            entry["passed"] = diff is None or entry.get("near_tie", False)
            log(f"greedy prompt {i + 1} {method}: "
                + ("identical" if diff is None else f"differs at token {diff} "
                   f"({'near-tie' if entry['passed'] else 'NOT a near-tie'})"))
            results.append(entry)
    return results


@torch.inference_mode()
def check_sampling(pipe: Pipeline, prompts: list[dict[str, Any]], positions: int = 3,
                   support: int = 64, trials: int = 4000, log: Callable[[str], None] = print
                   ) -> list[dict[str, Any]]:
    """Chi-square test of the verifier's output against real target distributions."""
    temperature = pipe.preset.sampling.temperature or 1.0
    params = SamplingParams(temperature, pipe.preset.sampling.top_k, pipe.preset.sampling.top_p)
    target = pipe.engine("none").target
    draft_runner = ModelRunner(pipe.draft.model) if pipe.draft is not None else None
    results = []
    for i, row in enumerate(prompts[:2]):
        ids = encode(pipe, row)
        target.reset()
        p_all = logits_to_probs(target.forward(ids, logits_to_keep=positions), params)
        target.reset()
        q_all = None
        if draft_runner is not None:
            q_logits = draft_runner.forward(ids, logits_to_keep=positions)[:, : p_all.shape[-1]]
            q_all = logits_to_probs(q_logits, params)
        for j in range(positions):
            top = torch.topk(p_all[j], support).indices
            if q_all is not None:
                top = torch.unique(torch.cat([top, torch.topk(q_all[j], support).indices]))
            p = p_all[j][top] / p_all[j][top].sum()
            drafts = [("ngram (one-hot q)", None)]
            if q_all is not None:
                drafts.append(("draft_model", q_all[j][top] / q_all[j][top].sum()))
            for name, q in drafts:
                counts = emitted_token_counts(p, q, trials, seed=1000 * i + j)
                p_value = chi_square_p_value(counts, p)
                results.append({"prompt": i, "position": j, "drafter": name, "trials": trials,
                                "p_value": p_value, "passed": p_value >= P_VALUE_THRESHOLD})
                log(f"sampling prompt {i + 1} position {j} {name}: chi-square p = {p_value:.3f}")
    return results


def run_checks(pipe: Pipeline, prompts: list[dict[str, Any]], max_new_tokens: int,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    methods = ["ngram"] + (["draft_model"] if pipe.draft is not None else [])
    greedy = check_greedy(pipe, prompts, methods, max_new_tokens, log)
    sampling = check_sampling(pipe, prompts, log=log)
    return {
        "preset": pipe.preset.name,
        "greedy": greedy,
        "sampling": sampling,
        "passed": all(r["passed"] for r in greedy + sampling),
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"preset: {report['preset']}", "", "greedy equality (plain vs speculative):"]
    for r in report["greedy"]:
        status = "identical" if r["identical"] else (
            f"differs at token {r['first_difference_at']}: target's top-2 logit gap "
            f"{r['target_top2']['logit_gap']:.3f} (p = {r['target_top2']['probs'][0]:.3f} vs "
            f"{r['target_top2']['probs'][1]:.3f}) -> "
            f"{'near-tie, numerical' if r['passed'] else 'FAIL'}"
            if "target_top2" in r else "differs in length -> FAIL")
        lines.append(f"  prompt {r['prompt'] + 1:2d} {r['method']:12s} {r['tokens']:4d} tokens  "
                     f"{status}")
    lines += ["", f"sampling (chi-square of emitted token vs p, pass if p-value >= "
                  f"{P_VALUE_THRESHOLD}):"]
    for r in report["sampling"]:
        lines.append(f"  prompt {r['prompt'] + 1} position {r['position']} {r['drafter']:18s} "
                     f"p-value {r['p_value']:.3f}  {'ok' if r['passed'] else 'FAIL'}")
    lines += ["", "PASSED" if report["passed"] else "FAILED"]
    return "\n".join(lines)
