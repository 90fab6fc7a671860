"""A JSON-schema request on the default preset (Qwen2.5-Coder 1.5B target, 0.5B draft):
plain constrained decoding vs draft_model (and free text for scale), tokens per second and
tokens per target pass, and the time the grammar itself took (shape + mask + advance). Noisy
on a shared machine; the figures went into docs/research-log.md (2026-12-04).

    PYTHONPATH=. python3 scripts/grammar_speed.py [--max-new 96] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from localspec.engine import constraint as constraint_module
from localspec.output_format import OutputFormat
from localspec.pipeline import Pipeline
from localspec.presets import load_preset

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "signature": {"type": "string"},
    "arguments": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "type": {"type": "string"}},
        "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"type": "string"}, "raises": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "signature", "arguments", "returns", "raises"],
    "additionalProperties": False}
PROMPT = ("Describe the Python function `def merge_sorted(a: list[int], b: list[int]) -> "
          "list[int]` that raises ValueError when an input is unsorted, as a JSON object.")


class Timed:
    """Wraps Constraint's three calls to add up their seconds."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("shape", "mask", "advance"):
            real = getattr(constraint_module.Constraint, name)
            setattr(constraint_module.Constraint, name, self._wrap(real))

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    timer = Timed()
    pipeline = Pipeline.load(load_preset("cpu-qwen-coder-draft"))
    ids = pipeline.encode_prompt(PROMPT)
    start = time.perf_counter()
    structured = pipeline.request(ids, output=OutputFormat(json=SCHEMA),
                                  max_new_tokens=args.max_new, temperature=0.0)
    print(f"grammar build + compile: {time.perf_counter() - start:.2f} s", flush=True)
    free = pipeline.request(ids, max_new_tokens=args.max_new, temperature=0.0)
    pipeline.run(free, "none")  # warm-up
    outputs = {}
    for _ in range(args.repeats):
        for label, request, method in (("free text, plain", free, "none"),
                                       ("schema, plain", structured, "none"),
                                       ("schema, draft_model", structured, "draft_model")):
            timer.seconds = 0.0
            result = pipeline.run(request, method)
            stats = result.stats
            outputs.setdefault(label, result.token_ids)
            print(json.dumps({"run": label, "tokens": stats.new_tokens,
                              "tok_per_s": round(stats.tokens_per_second, 2),
                              "tokens_per_pass": round(stats.mean_accepted_length, 2),
                              "passes": stats.target_forward_passes,
                              "grammar_s": round(timer.seconds, 3),
                              "wall_s": round(stats.wall_time, 2),
                              "drafters": stats.drafters(),
                              "finish": result.finish_reason}), flush=True)
    assert outputs["schema, plain"] == outputs["schema, draft_model"]
    print(pipeline.tokenizer.decode(outputs["schema, plain"], skip_special_tokens=True))


if __name__ == "__main__":
    main()
