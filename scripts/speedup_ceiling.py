"""The speedup no drafting policy can beat on this machine, per bench prompt (``engine.ceiling``).

For each prompt: the target's greedy answer; the draft model's and n-gram lookup's runs over it
(one teacher-forced pass of the draft; lookup asked at every position); this machine's costs
measured in the same process (a target pass over 1..k_max + 1 rows, a draft token through the
drafter the engine runs, both prefills, the engine's own time per pass from a plain run); then
the oracle's time against plain decoding's, each with the prompt's prefill, as ``bench`` times
them. ``--compare`` also runs the preset's method, timed as ``bench`` does, against a plain
run made right before it.

Beside the oracle, the *blind* bound (``engine.ceiling.blind_time``): the draft's guesses kept
independently with the chance its confidence gives (calibrated over the whole prompt set, in
10 bins, the way the engine's ``Calibration`` learns it), known before drafting; lookup still
an oracle. It is what a policy that reads the draft's confidence could reach, at best.
``--prompts chat`` (or ``code``) takes the held-out prompts instead of the bench's.

    python3 scripts/speedup_ceiling.py --preset cpu-qwen-coder-auto --compare auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from policy_clock import COSTS, HELDOUT

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.ngram import find_ngram_continuation
from localspec.engine.ceiling import DrafterRuns, blind_time, oracle_time, runs_from_agreement
from localspec.pipeline import Pipeline
from localspec.presets import load_preset
from localspec.runtime.runner import ModelRunner, common_prefix
from localspec.sampling import SamplingParams
from localspec.training.prompts import encode_prompts, load_prompts


def draft_member(pipe: Pipeline) -> DraftModelDrafter:
    for member in pipe.engine("draft_model").drafters:
        if isinstance(member, DraftModelDrafter):
            return member
    raise SystemExit("this preset has no draft model")


def interleaved(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The median seconds of each call over ``rounds`` rounds of all of them in turn: the VM's
    speed drifts, and interleaving gives every call the same drift. (The least of each would
    favour short calls, which fit between a busy VM's stalls more often than long ones.)"""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class Answer:
    """The target's greedy answer to one prompt, each drafter's runs over it, and what a
    plain run spent outside the target's forwards per pass."""

    def __init__(self, pipe: Pipeline, drafter: DraftModelDrafter, ids: list[int],
                 tokens: int) -> None:
        sc = pipe.preset.speculative_config
        target, draft, rows = pipe.target_runner(), drafter.runner, drafter.runner.vocab_rows
        inside = [0.0]
        forward = target.forward

        def timed_forward(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start

        target.forward = timed_forward
        try:
            plain = pipe.run(pipe.request(ids, max_new_tokens=tokens, temperature=0.0), "none")
        finally:
            del target.forward
        self.tokens = answer = list(plain.token_ids)
        self.per_pass = (plain.stats.wall_time - inside[0]) / plain.stats.target_forward_passes
        # the draft's guess after every true prefix, in one pass (row-exact in the native stack)
        draft.reset()
        logits = draft.forward(ids + answer[:-1], spread=rows is None)[len(ids) - 1:]
        if rows is not None:
            logits = logits.masked_fill(rows >= len(pipe.tokenizer), float("-inf"))
        confidences, picks = torch.softmax(logits.float(), dim=-1).max(-1)
        guesses = (rows[picks] if rows is not None else picks).tolist()
        self.confidences = confidences.tolist()
        self.agree = [g == a for g, a in zip(guesses, answer, strict=True)]
        self.draft_runs = runs_from_agreement(self.agree)
        self.lookup_runs = [common_prefix(find_ngram_continuation(
            ids + answer[:i], sc.num_speculative_tokens, sc.prompt_lookup_max,
            sc.prompt_lookup_min), answer[i:]) for i in range(len(answer))]


def calibrated(answers: list[Answer], bins: int = 10) -> list[list[float]]:
    """Each answer's chance per position that the draft's guess is kept: the share kept among
    all the set's guesses in the same confidence bin (as ``drafters.base.Calibration``)."""
    kept, seen = [0] * bins, [0] * bins
    for answer in answers:
        for confidence, agree in zip(answer.confidences, answer.agree, strict=True):
            b = min(int(confidence * bins), bins - 1)
            seen[b] += 1
            kept[b] += agree
    return [[kept[b] / seen[b] for b in (min(int(c * bins), bins - 1)
                                         for c in answer.confidences)] for answer in answers]


def prefill(runner: ModelRunner, ids: list[int]) -> None:
    runner.reset()
    runner.forward(ids, logits_to_keep=1)


def machine_costs(pipe: Pipeline, drafter: DraftModelDrafter, context: list[int],
                  rounds: int) -> tuple[list[float], float]:
    """A target pass over 1..k_max + 1 rows after ``context``, and a draft token through the
    drafter the engine runs (the slope from 1 to 5 tokens, so its fixed cost stays out)."""
    k_max = pipe.preset.speculative_config.num_speculative_tokens
    target, greedy = pipe.target_runner(), SamplingParams(0.0, 0, 1.0)
    target.reset()
    target.forward(context[:-k_max - 1], logits_to_keep=1)
    base = target.length
    drafter.reset()

    def verify_pass(width: int) -> None:
        target.forward(context[base:base + width])
        target.crop(base)

    def draft(k: int) -> None:
        drafter.propose(context, k, greedy, torch.Generator())

    draft(1)  # the prompt read once
    calls: dict[str, Callable[[], object]] = {f"v{w}": partial(verify_pass, w)
                                              for w in range(1, k_max + 2)}
    calls.update(d1=partial(draft, 1), d5=partial(draft, 5))
    threshold, drafter.confidence_threshold = drafter.confidence_threshold, 0.0
    try:  # every draft of 5 drafts 5, however unsure
        best = interleaved(calls, rounds)
    finally:
        drafter.confidence_threshold = threshold
    return [best[f"v{w}"] for w in range(1, k_max + 2)], (best["d5"] - best["d1"]) / 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-qwen-coder-auto")
    parser.add_argument("--tokens", type=int, default=128, help="as bench's --max-new-tokens")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the cost measures")
    parser.add_argument("--compare", default=None, help="also time this method per prompt")
    parser.add_argument("--prompts", default="bench", choices=["bench", "chat", "code"],
                        help="the bench's prompts or a held-out set (localspec/data/heldout)")
    parser.add_argument("--clock-costs", action="store_true",
                        help="price everything by scripts/policy_clock.py's cost model instead "
                             "of measuring (its runs and this bound on the same terms)")
    args = parser.parse_args()
    pipe = Pipeline.load(load_preset(args.preset))
    target, drafter = pipe.target_runner(), draft_member(pipe)
    if args.prompts == "bench":
        prompts = load_prompts(None)
    else:
        lines = (HELDOUT / f"{args.prompts}.jsonl").read_text(encoding="utf-8").splitlines()
        prompts = [json.loads(line) for line in lines if line.strip()]
    encoded = encode_prompts(pipe, prompts, args.tokens)
    answers = [Answer(pipe, drafter, ids, args.tokens) for ids in encoded]
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]) + len(answers[i].tokens))
    if args.clock_costs:
        c = {name: ms / 1e3 for name, ms in COSTS.items()}
        verify = [c["t1"] + c["row"] * min(w, 4) + c["row_wide"] * max(0, w - 4)
                  for w in range(pipe.preset.speculative_config.num_speculative_tokens + 1)]
        per_token, per_pass, source = c["draft"], c["pass"], "policy_clock.py's model"
    else:
        verify, per_token = machine_costs(
            pipe, drafter, encoded[longest] + answers[longest].tokens[:-1], args.rounds)
        per_pass = statistics.median(a.per_pass for a in answers)
        source = f"median of {args.rounds} rounds, interleaved"
    print(f"costs ({source}): target pass over 1/2/5/{len(verify)} rows "
          f"{verify[0] * 1e3:.1f}/{verify[1] * 1e3:.1f}/{verify[4] * 1e3:.1f}/"
          f"{verify[-1] * 1e3:.1f} ms, draft token {per_token * 1e3:.1f} ms, engine per pass "
          f"{per_pass * 1e3:.1f} ms")
    print(f"{'#':>2s} {'category':16s} {'tokens':>6s} {'plain s':>8s} {'ceiling s':>9s} "
          f"{'ceiling':>8s} {'blind':>7s} {'passes':>6s} {'by draft':>8s} {'by lookup':>9s}"
          + (f" {args.compare + ', run':>11s}" if args.compare else ""))
    ceilings, blinds = [], []
    for n, (row, ids, answer, chances) in enumerate(zip(prompts, encoded, answers,
                                                        calibrated(answers), strict=True), 1):
        if args.clock_costs:
            prefills = {"target": c["prefill_row"] * len(ids),
                        "draft": c["draft"] + c["draft_row"] * (len(ids) - 1)}
        else:
            prefills = interleaved({"target": partial(prefill, target, ids),
                                    "draft": partial(prefill, drafter.runner, ids)}, 3)
        tokens = len(answer.tokens)
        plain_time = prefills["target"] + tokens * (verify[0] + per_pass)
        with_draft = oracle_time(tokens, verify, [DrafterRuns("draft", answer.draft_runs,
                                                              per_token),
                                                  DrafterRuns("lookup", answer.lookup_runs, 0.0)],
                                 per_pass)
        lookup_only = oracle_time(tokens, verify, [DrafterRuns("lookup", answer.lookup_runs, 0.0)],
                                  per_pass)
        oracle, spent = min((with_draft, with_draft.seconds + prefills["draft"]),
                            (lookup_only, lookup_only.seconds), key=lambda pair: pair[1])
        ceiling_time = prefills["target"] + spent
        ceilings.append(plain_time / ceiling_time)
        lookup = DrafterRuns("lookup", answer.lookup_runs, 0.0)
        blind = min(blind_time(verify, chances, per_token, per_pass, lookup) + prefills["draft"],
                    lookup_only.seconds)
        blinds.append(plain_time / (prefills["target"] + blind))
        kept = {name: sum(k for d, k in oracle.steps if d == name) for name in ("draft", "lookup")}
        line = (f"{n:2d} {row['category']:16s} {tokens:6d} {plain_time:8.2f} {ceiling_time:9.2f} "
                f"{ceilings[-1]:7.2f}x {blinds[-1]:6.2f}x {oracle.passes:6d} {kept['draft']:8d} "
                f"{kept['lookup']:9d}")
        if args.compare:  # against a plain run right before it (the VM drifts in minutes)
            request = pipe.request(ids, max_new_tokens=args.tokens, temperature=0.0)
            plain_speed = pipe.run(request, "none").stats.tokens_per_second
            run = pipe.run(request, args.compare)
            line += f" {run.stats.tokens_per_second / plain_speed:10.2f}x"
        print(line, flush=True)
    print(f"median over the set: ceiling {statistics.median(ceilings):.2f}x, blind "
          f"{statistics.median(blinds):.2f}x; mean: {statistics.mean(ceilings):.2f}x, "
          f"{statistics.mean(blinds):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
