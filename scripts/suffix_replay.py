"""Lookup drafters replayed on recorded answers: tokens each would have had kept, no model run.

Each assistant message of the agent transcripts (``localspec/data/agent_transcript.jsonl``, its
tool calls and file contents rendered by the Qwen chat template) is taken as the target's greedy
output after the conversation before it. Stepping through it as the engine would with a fixed k
(``--k``), each drafter proposes from the context so far; the tokens it would have had kept are
the proposal's common prefix with the recorded answer, and the step moves on by those plus the
target's own token. Printed per drafter: target passes, drafted and kept tokens, tokens per pass.
``n-gram+suffix`` asks n-gram lookup first and the suffix drafter when lookup has nothing; with
``--history`` the suffix drafter also holds the earlier answers of every transcript replayed
before (a user's history), and ``--again`` replays each answer a second time with its first
replay in the history (a regenerated answer).

    PYTHONPATH=. python3 scripts/suffix_replay.py --tokenizer PATH/TO/tokenizer/folder
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.suffix import SuffixDrafter
from localspec.drafters.suffix_index import AnswerHistory
from localspec.engine.drafter import Drafter
from localspec.sampling import SamplingParams

DATA = Path(__file__).resolve().parent.parent / "localspec" / "data"


def answers(tokenizer: object, path: Path) -> list[tuple[list[int], list[int]]]:
    """(context, answer) token ids for each assistant message of each transcript."""
    def encode(messages: list[dict], tools: list | None, generation: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation)
        return tokenizer.encode(text, add_special_tokens=False)

    pairs = []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    row = max(rows, key=lambda r: len(r["messages"]))  # the others are its earlier stages
    messages, tools = row["messages"], row.get("tools")
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before, whole = encode(messages[:i], tools, True), encode(messages[: i + 1], tools)
            if whole[: len(before)] == before and len(whole) > len(before):
                pairs.append((before, whole[len(before):]))
    return pairs


def replay(drafters: list[Drafter], context: list[int], answer: list[int], k: int
           ) -> tuple[int, int, int]:
    """(target passes, drafted, kept) over ``answer`` with the first drafter that proposes."""
    for drafter in drafters:
        drafter.reset()
    params, generator = SamplingParams(), torch.Generator()
    done = passes = drafted = kept = 0
    while done < len(answer):
        now = context + answer[:done]
        tokens: list[int] = []
        for drafter in drafters:
            tokens = drafter.propose(now, k, params, generator).tokens[:k]
            if tokens:
                break
        good = 0
        while (good < len(tokens) and done + good < len(answer)
               and tokens[good] == answer[done + good]):
            good += 1
        passes, drafted, kept = passes + 1, drafted + len(tokens), kept + good
        done += good + 1
    return passes, drafted, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--history", action="store_true")
    parser.add_argument("--again", action="store_true")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    pairs = answers(tokenizer, DATA / "agent_transcript.jsonl")
    history = AnswerHistory(10**7)
    setups = {"ngram": [NgramDrafter(4, 1)], "suffix": [SuffixDrafter(history)],
              "n-gram+suffix": [NgramDrafter(4, 1), SuffixDrafter(history)],
              "suffix+n-gram": [SuffixDrafter(history), NgramDrafter(4, 1)]}
    totals = {name: [0, 0, 0] for name in setups}
    tokens = 0
    for context, answer in pairs:
        for _ in range(2 if args.again else 1):
            tokens += len(answer)
            for name, drafters in setups.items():
                result = replay(drafters, context, answer, args.k)
                totals[name] = [a + b for a, b in zip(totals[name], result, strict=True)]
            if args.history or args.again:
                history.add(answer)
    print(f"{len(pairs)} answers, {tokens} tokens, k={args.k}, history={args.history}, "
          f"again={args.again}")
    for name, (passes, drafted, kept) in totals.items():
        print(f"{name:14s} passes {passes:5d}  drafted {drafted:6d}  kept {kept:6d} "
              f"({kept / max(1, drafted):4.0%})  tokens/pass {tokens / passes:5.2f}")


if __name__ == "__main__":
    main()
