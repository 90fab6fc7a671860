"""The suffix drafter's global index at scale: build time, memory and per-step cost.

A synthetic history of ``--answers`` answers of about ``--tokens`` tokens each (Zipf-distributed
token ids over a 152k vocabulary, with stock phrases repeated across answers as real answers
repeat code idioms and boilerplate) is learnt in one ``AnswerHistory.extend``, as the app does
at start, and then:

- build: seconds to learn them all, the index's arrays (bytes) and the peak of Python's traced
  allocations while building (numpy's arrays included);
- add: seconds to learn one more answer (the app, when an answer finishes), its median and worst
  over ``--adds`` answers (the worst includes a re-sort of the index);
- step: ``outlook`` + ``propose`` of a ``SuffixDrafter`` over a 2,000-token context that grows by
  one token a step, with and without the history (median and 99th percentile, milliseconds).

With ``--tokenizer FOLDER`` it also times what the app does first at start: encoding the
saved answers' texts with the target's tokenizer (``--answers`` chunks of ~1,200 characters of
the package's held-out Python and prose texts). No model, no torch forward: it runs in seconds.

    PYTHONPATH=. python3 scripts/suffix_history_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

from localspec.config import HISTORY_DRAFT_TOKENS
from localspec.drafters.suffix import SuffixDrafter
from localspec.drafters.suffix_index import AnswerHistory
from localspec.sampling import SamplingParams

VOCAB = 151_936


def synthetic_answers(count: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` answers of about ``length`` tokens: Zipf words, a third of them stock phrases."""
    rng = np.random.default_rng(seed)
    phrases = [np.minimum(rng.zipf(1.3, rng.integers(4, 24)), VOCAB - 1) for _ in range(2000)]
    answers = []
    for _ in range(count):
        parts, size = [], 0
        target = int(rng.integers(length // 2, length * 3 // 2))
        while size < target:
            if rng.random() < 0.33:
                part = phrases[int(rng.zipf(1.5)) % len(phrases)]
            else:
                part = np.minimum(rng.zipf(1.3, int(rng.integers(3, 12))), VOCAB - 1)
            parts.append(part)
            size += part.size
        answers.append(np.concatenate(parts)[:target].astype(np.int64))
    return answers


def step_costs(drafter: SuffixDrafter, context: list[int], steps: int) -> list[float]:
    """Milliseconds of ``outlook`` + ``propose`` (k=8) per step, the context growing by the
    first drafted token (else a fixed token) each step."""
    params, generator, costs = SamplingParams(), torch.Generator(), []
    for _ in range(steps):
        start = time.perf_counter()
        drafter.outlook(context)
        proposal = drafter.propose(context, 8, params, generator)
        costs.append((time.perf_counter() - start) * 1000)
        context = [*context, proposal.tokens[0] if proposal.tokens else 13]
    return costs


def time_tokenizer(folder: str, count: int) -> None:
    """Seconds to encode ``count`` answer-sized texts in one batch, as the app does."""
    from transformers import AutoTokenizer

    quality = Path(__file__).resolve().parent.parent / "localspec" / "data" / "quality"
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(quality.glob("*.txt")))
    texts = [text[(i * 1200) % (len(text) - 1200):][:1200] for i in range(count)]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = time.perf_counter()
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    print(f"tokenize: {count:,} texts ({sum(map(len, ids)):,} tokens) in "
          f"{time.perf_counter() - start:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--cap", type=int, default=None,
                        help=f"history cap in tokens (default: all of them; the app's is "
                             f"{HISTORY_DRAFT_TOKENS:,})")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--adds", type=int, default=300)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder to time too")
    args = parser.parse_args()
    if args.tokenizer:
        time_tokenizer(args.tokenizer, args.answers)

    answers = synthetic_answers(args.answers + args.adds, args.tokens)
    history_part, later = answers[: args.answers], answers[args.answers :]
    total = sum(a.size for a in history_part)
    history = AnswerHistory(args.cap or total + sum(a.size for a in later))
    tracemalloc.start()
    start = time.perf_counter()
    history.extend(history_part)
    build = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"history: {len(history_part):,} answers, {total:,} tokens "
          f"({history.tokens:,} kept under the cap)")
    print(f"build: {build:.2f} s, index arrays {history.nbytes() / 2**20:.1f} MiB, "
          f"peak traced allocations {peak / 2**20:.1f} MiB")

    adds = []
    for answer in later:
        start = time.perf_counter()
        history.add(answer)
        adds.append((time.perf_counter() - start) * 1000)
    print(f"add one answer: median {statistics.median(adds):.2f} ms, worst {max(adds):.0f} ms")

    # a context: a prompt, then an answer that partly repeats earlier answers
    context = [int(t) for t in np.concatenate([*synthetic_answers(7, 300, seed=2),
                                               later[-1][:120], history_part[-7][:200]])]
    context = context[:2000] if len(context) > 2000 else context
    for name, drafter in (("no history", SuffixDrafter()),
                          ("with history", SuffixDrafter(history))):
        costs = step_costs(drafter, list(context), args.steps)
        costs.sort()
        print(f"step ({name}, {len(context):,}-token context): median "
              f"{statistics.median(costs):.3f} ms, p99 {costs[int(len(costs) * 0.99)]:.3f} ms")


if __name__ == "__main__":
    main()
