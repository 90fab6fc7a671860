"""Write chat requests with the target itself (self-instruct), for training a head on chat.

Each request is the target's greedy answer to "write one request a person might type to an AI
assistant about TOPIC, as STYLE": every pair of the topics and styles below, so the set is the
same on every machine. Output: one ``{"prompt": ...}`` per line, the ``.jsonl`` request format
``train-drafter --corpus`` reads (the target then answers them with ``--answers target``).

The topics are kept apart from the held-out prompts in ``docs/heldout/`` and from the built-in
bench prompts: none of those is about a topic listed here, and none was written by the target.

    python3 scripts/self_instruct.py --out localspec/data/corpus/chat_requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from localspec.pipeline import Pipeline
from localspec.presets import load_preset

TOPICS = (
    "cooking dinner on a budget", "baking bread", "planning a trip to Japan", "packing for a hike",
    "saving for retirement", "paying off a credit card", "the French Revolution",
    "the Roman Empire", "how vaccines work", "black holes", "photosynthesis", "climate change",
    "learning Spanish", "writing a cover letter", "preparing for a job interview",
    "asking for a raise", "a wedding speech", "a birthday message for a friend",
    "training a puppy", "keeping houseplants alive", "growing tomatoes", "running a first 5k",
    "strength training for beginners", "sleeping better", "meditation", "time management",
    "public speaking", "learning the guitar", "classical music", "choosing a laptop",
    "home Wi-Fi problems", "fixing a leaking tap", "buying a used car", "photography basics",
    "chess openings", "the rules of cricket", "raising a teenager", "moving to a new city",
    "renting a first apartment", "writing a short story", "poetry", "Greek mythology",
    "the history of the printing press", "basic statistics", "probability puzzles",
    "compound interest", "the stock market", "starting a small business", "email etiquette",
    "negotiating a salary", "volunteering", "recycling", "electric cars", "renewable energy",
    "the human immune system", "nutrition and protein", "making coffee", "wine and food pairing",
    "board games for a family evening", "learning to draw", "world capitals", "volcanoes",
    "ocean tides", "the Moon landing", "ancient Egypt", "philosophy of ethics",
    "stoicism", "psychology of habits", "the difference between two common words",
    "grammar questions", "summarising a news article", "explaining a joke",
    "Git for beginners", "choosing a first programming language", "what an API is",
    "how the internet works", "password safety", "backing up a phone",
)
STYLES = (
    "a short factual question",
    "a request for practical advice",
    "a request to explain an idea simply",
    "a request to write something short (a message, a list or a few lines)",
)
ASK = ("Write one question or request that a person might type to an AI assistant about "
       "{topic}, as {style}. Reply with the request only, with no preamble and no quotes.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-qwen-coder-auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    pipe = Pipeline.load(load_preset(args.preset))
    requests: list[str] = []
    for topic in TOPICS:
        for style in STYLES:
            prompt = ASK.format(topic=topic, style=style)
            request = pipe.request(pipe.encode_prompt(prompt),
                                   max_new_tokens=args.max_new_tokens, temperature=0.0)
            result = pipe.run(request)
            text = result.text.strip().strip('"').strip()
            if text and text not in requests and len(result.token_ids) < args.max_new_tokens:
                requests.append(text)  # not empty, a repeat, or cut off
    random.Random(0).shuffle(requests)  # topics mixed: a token budget spans them
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt": r}, ensure_ascii=False) + "\n"
                                for r in requests), encoding="utf-8")
    print(f"{len(requests)} requests written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
