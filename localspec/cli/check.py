"""``localspec verify``: prove on the user's own preset and hardware that speculation is lossless.

Two checks:
1. **Greedy equality**: every prompt is generated with plain decoding and with each speculative
   method; token ids must be identical. Where they differ, the target's own logits at the first
   differing position are examined: if its two best tokens are a near-tie (logit gap below
   ``NEAR_TIE_LOGITS``), the difference is numerical noise of the batched verify pass and is
   reported with its margin; otherwise the check fails.
2. **Sampling distribution**: on real target/draft distributions (p, q) taken from the models at
   positions of the prompts, the verifier is run thousands of times with k = 1 and the emitted
   token's frequencies are compared with p by a chi-square test (SciPy's, small-expectation
   bins pooled). For speed the rows are restricted to the union of the top tokens of p and q
   (renormalised): the test checks the verifier's arithmetic on real shapes, not the tail mass.
   Both models start each prompt from an empty cache, so q is the draft's distribution for
   that prompt alone.

Prompts are encoded and checked (context length, chat template) before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from scipy.stats import chisquare

from localspec.cli.bench import first_difference
from localspec.engine.verify import verify_sampling
from localspec.errors import PresetError
from localspec.pipeline import Pipeline
from localspec.registry import AUTO, drafter_spec, drafters
from localspec.runtime.runner import ModelRunner
from localspec.sampling import SamplingParams, logits_to_probs, sample
from localspec.training.prompts import encode_prompts

NEAR_TIE_LOGITS = 0.5
P_VALUE_THRESHOLD = 1e-3


def _no_log(_line: str) -> None:
    """The default progress sink: the library prints nothing unless asked."""


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
                       ) -> float:
    """Goodness of fit of observed ``counts`` to ``probs`` by SciPy's chi-square test.

    Bins expected to hold fewer than ``min_expected`` counts are pooled into one (the
    chi-square approximation needs it); a pool still too small joins the smallest large bin,
    unless that would leave a single bin (nothing to test: a p concentrated on one token).
    A count where ``probs`` is 0 is an impossible token: p-value 0.
    """
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    big = expected >= min_expected
    obs, exp = counts[big].tolist(), expected[big].tolist()
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_exp >= min_expected or len(exp) < 2:  # never merge into a lone bin: no test left
        if rest_exp > 0:
            obs.append(rest_obs)
            exp.append(rest_exp)
    else:
        smallest = exp.index(min(exp))
        obs[smallest] += rest_obs
        exp[smallest] += rest_exp
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def emitted_token_counts(p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int
                         ) -> torch.Tensor:
    """Run speculative sampling with k = 1 ``trials`` times; count the first emitted token.

    p, q: [vocab]. The draft token is drawn from q (or is q's argmax for a one-hot draft).
    """
    generator = torch.Generator(device=p.device).manual_seed(seed)
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
                 max_new_tokens: int, log: Callable[[str], None] = _no_log
                 ) -> list[dict[str, Any]]:
    """Plain vs each speculative method, greedy, on every prompt (all checked first)."""
    results = []
    for i, ids in enumerate(encode_prompts(pipe, prompts, max_new_tokens)):
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


def _draft_probs(runner: ModelRunner, ids: list[int], positions: int, width: int,
                 params: SamplingParams) -> torch.Tensor:
    """q at the last ``positions`` positions of ``ids`` from an empty cache, on ``width``
    (the target's vocabulary: extra draft rows cut, missing ones impossible)."""
    runner.reset()  # q must depend on this prompt only, not on the previous one's cache
    logits = runner.forward(ids, logits_to_keep=positions)  # [positions, vocab_draft]
    runner.reset()
    out = torch.full((logits.shape[0], width), float("-inf"), device=logits.device)
    cols = min(width, logits.shape[-1])
    out[:, :cols] = logits[:, :cols]
    return logits_to_probs(out, params)


@torch.inference_mode()
def check_sampling(pipe: Pipeline, prompts: list[dict[str, Any]], positions: int = 3,
                   support: int = 64, trials: int = 4000, log: Callable[[str], None] = _no_log
                   ) -> list[dict[str, Any]]:
    """Chi-square test of the verifier's output against real target distributions (first two
    prompts, last ``positions`` positions of each, one-hot and draft-model q)."""
    temperature = pipe.preset.sampling.temperature or 1.0
    params = SamplingParams(temperature, pipe.preset.sampling.top_k, pipe.preset.sampling.top_p)
    target = pipe.engine("none").target
    draft_runner = pipe.draft.runner() if pipe.draft is not None else None
    results = []
    for i, ids in enumerate(encode_prompts(pipe, prompts[:2], 1)):
        positions_i = min(positions, len(ids))
        target.reset()
        p_all = logits_to_probs(target.forward(ids, logits_to_keep=positions_i), params)
        target.reset()
        q_all = None
        if draft_runner is not None:
            q_all = _draft_probs(draft_runner, ids, positions_i, p_all.shape[-1], params)
        for j in range(positions_i):
            size = min(support, p_all.shape[-1])
            top = torch.topk(p_all[j], size).indices
            if q_all is not None:
                top = torch.unique(torch.cat([top, torch.topk(q_all[j], size).indices]))
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


def greedy_methods(pipe: Pipeline) -> list[str]:
    """Every registered speculative method the pipeline can run: its preset meets the
    method's needs (a head only for the preset's own method) and a draft model it needs is
    loaded; "auto" only where it has two drafters or more (with one it is that drafter's
    method)."""
    methods = []
    for spec in drafters():
        try:
            members = pipe.preset.drafter_set(spec.name).members
        except PresetError:
            continue
        needs = [drafter_spec(name).needs for name in members]
        if not members or (pipe.draft is None and "draft_model" in needs):
            continue
        if spec.name == AUTO and len(members) < 2:
            continue
        methods.append(spec.name)
    return methods


def run_checks(pipe: Pipeline, prompts: list[dict[str, Any]], max_new_tokens: int,
               log: Callable[[str], None] = _no_log) -> dict[str, Any]:
    """Greedy equality for every speculative method the pipeline can run (``greedy_methods``),
    then sampling (one-hot and draft-model q: a head's q comes from features of the live
    sequence, and the verifier treats every q alike)."""
    methods = greedy_methods(pipe)
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
