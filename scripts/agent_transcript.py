"""Writes ``localspec/data/agent_transcript.jsonl``: a coding agent's session, one bench row per
assistant turn, each row the history before that turn (``localspec bench --prompts``).

The scenario: an agent with three tools (``read_file``, ``write_file``, ``run_tests``, as
OpenAI function specs) is asked to fix a bug in a 50-line ``stats.py``; it reads the file,
writes the whole corrected file back as the tool call's arguments, runs the tests (pytest, run
for real on that file) and answers. The tool results are the tools' real outputs.

The assistant turns in the history are the target's own greedy answers where it makes the
scripted call in the template's format (and the template renders its answer back token for
token), else the script's. Qwen2.5-Coder-1.5B mostly does not: it writes its calls as
fenced JSON instead of ``<tool_call>`` tags and copies the file without fixing it, so the
histories are what a capable agent would send (in the exact ``<tool_call>`` shape the
template renders); the benchmarked generations are still the target's own, whatever it
answers. The script prints each answer and whether it was kept.

    PYTHONPATH=. python3 scripts/agent_transcript.py --preset cpu-qwen-coder-draft
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from localspec.pipeline import Pipeline
from localspec.presets import load_preset

OUT = Path(__file__).resolve().parent.parent / "localspec" / "data" / "agent_transcript.jsonl"
MAX_TURNS = 8
MAX_NEW_TOKENS = 1024

SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to inspect and "
    "change the code: read a file before you change it, write the complete new content of a "
    "file with write_file, and run the tests before you answer. When the tests pass, reply "
    "with a short summary of what you changed and why."
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file of the repository and return its content.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file",
        "description": "Replace the whole content of a file of the repository (it is created "
                       "if missing).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "content": {"type": "string", "description": "The complete new content."}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run_tests",
        "description": "Run the test suite with pytest and return its output.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string",
                     "description": "A test file or folder; the whole suite if omitted."}},
            "required": []}}},
]

USER = (
    "The test suite fails: `median([1, 2, 3, 4])` returns 3 but it should be 2.5. "
    "The function is in stats.py. Please fix it."
)

STATS_PY = '''\
"""Small statistics helpers used by the report generator."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean of a non-empty sequence."""
    if not values:
        raise ValueError("mean() of an empty sequence")
    return sum(values) / len(values)


def median(values: Sequence[float]) -> float:
    """Middle value of a non-empty sequence (the mean of the two middle ones if even)."""
    if not values:
        raise ValueError("median() of an empty sequence")
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle]


def mode(values: Sequence[float]) -> float:
    """Most common value; the smallest one on a tie."""
    if not values:
        raise ValueError("mode() of an empty sequence")
    counts = Counter(values)
    best = max(counts.values())
    return min(v for v, c in counts.items() if c == best)


def variance(values: Sequence[float]) -> float:
    """Sample variance (n - 1 in the denominator)."""
    if len(values) < 2:
        raise ValueError("variance() needs at least two values")
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / (len(values) - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100), linearly interpolated."""
    if not values:
        raise ValueError("percentile() of an empty sequence")
    if not 0 <= p <= 100:
        raise ValueError("p must be between 0 and 100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
'''

TEST_STATS_PY = '''\
import pytest

from stats import mean, median, mode, percentile, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([1, 2, 3, 4]) == 2.5
    assert median([4, 1]) == 2.5


def test_median_empty():
    with pytest.raises(ValueError):
        median([])


def test_mode_tie():
    assert mode([2, 1, 2, 1, 3]) == 1


def test_variance():
    assert variance([1, 2, 3, 4]) == pytest.approx(5 / 3)


def test_percentile():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4], 25) == pytest.approx(1.75)
'''

FIXED_MEDIAN = """\
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 0:
        return (ordered[middle - 1] + ordered[middle]) / 2
    return ordered[middle]
"""

# The agent's turns before the final answer: (text before the calls, the calls).
SCRIPT: list[tuple[str, list[dict[str, Any]]]] = [
    ("", [{"name": "read_file", "arguments": {"path": "stats.py"}}]),
    ("The bug is in `median`: for an even number of values it returns the upper of the two "
     "middle values instead of their mean. I will return the mean of the two middle values "
     "when the length is even.",
     [{"name": "write_file", "arguments": {
         "path": "stats.py",
         "content": STATS_PY.replace("    ordered = sorted(values)\n    middle = len(ordered) "
                                     "// 2\n    return ordered[middle]\n", FIXED_MEDIAN)}}]),
    ("", [{"name": "run_tests", "arguments": {"path": "test_stats.py"}}]),
]

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_answer(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """(content, tool calls) of an answer in Qwen's format (the text before the first
    ``<tool_call>``, each call's ``{"name", "arguments"}``); None if a call is not JSON."""
    try:
        calls = [json.loads(body) for body in TOOL_CALL.findall(text)]
    except json.JSONDecodeError:
        return None
    return (text.split("<tool_call>", 1)[0].strip() if calls else text), calls


def assistant(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": c} for c in calls]}


def run_tool(repo: Path, name: str, arguments: dict[str, Any]) -> str:
    """What the tool returns to the model: a file, a confirmation, or pytest's output
    (without the timing, so that a rerun writes the same file)."""
    if name == "read_file":
        return (repo / arguments["path"]).read_text(encoding="utf-8")
    if name == "write_file":
        content = arguments["content"]
        (repo / arguments["path"]).write_text(content, encoding="utf-8")
        return f"wrote {len(content.encode('utf-8'))} bytes to {arguments['path']}"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           arguments["path"]], cwd=repo, capture_output=True, text=True,
                          timeout=120, check=False)
    return re.sub(r" in \d+\.\d+s", "", done.stdout.strip())


def own_turn(pipe: Pipeline, method: str, messages: list[dict[str, Any]], content: str,
             calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message of this turn: the target's own greedy answer where it makes the
    scripted calls and the template renders it back token for token, else the script's."""
    ids = pipe.encode_chat(messages, TOOLS)
    result = pipe.run(pipe.request(ids, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0), method)
    print(f"--- the target's answer ({len(ids)} prompt tokens, {len(result.token_ids)} new):\n"
          f"{result.text}", file=sys.stderr)
    parsed = parse_answer(result.text)
    if parsed is not None and parsed[1] == calls:
        own = assistant(*parsed)
        rendered = pipe.encode_chat([*messages, own, {"role": "user", "content": "."}], TOOLS)
        if rendered[:len(ids) + len(result.token_ids)] == ids + result.token_ids:
            print("--- kept: the target's own", file=sys.stderr)
            return own
    print("--- scripted instead", file=sys.stderr)
    return assistant(content, calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-qwen-coder-draft")
    parser.add_argument("--method", default="ngram",
                        help="how to generate (any lossless method gives the same tokens)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    pipe = Pipeline.load(load_preset(args.preset), load_draft=args.method == "draft_model")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": USER}]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch)
        (repo / "stats.py").write_text(STATS_PY, encoding="utf-8")
        (repo / "test_stats.py").write_text(TEST_STATS_PY, encoding="utf-8")
        for turn, (content, calls) in enumerate(SCRIPT, start=1):
            names = ", ".join(c["name"] for c in calls)
            rows.append({"category": f"agent {turn}: {names}", "messages": list(messages),
                         "tools": TOOLS})
            messages.append(own_turn(pipe, args.method, messages, content, calls))
            for call in calls:
                messages.append({"role": "tool", "name": call["name"],
                                 "content": run_tool(repo, call["name"], call["arguments"])})
        rows.append({"category": f"agent {len(SCRIPT) + 1}: answer", "messages": messages,
                     "tools": TOOLS})
    if "7 passed" not in messages[-1]["content"]:
        raise SystemExit(f"the fixed file fails its tests:\n{messages[-1]['content']}")
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8")
    print(f"{len(rows)} turns written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
