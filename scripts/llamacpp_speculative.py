"""llama.cpp's own speculative decoding on LocalSpec's bench prompts, to set beside `bench`.

Runs llama.cpp's `llama-speculative-simple` (built from the `llama-cpp-python` sdist's
`vendor/llama.cpp`: `cmake --build build --target llama-speculative-simple`) on the six built-in
bench prompts, each put through the target's chat template as LocalSpec does, greedy, 128 new
tokens, once per draft setting (`--spec-draft-n-max N --spec-draft-p-min P`), the settings
interleaved prompt by prompt. Its speed is counted as `bench` counts LocalSpec's: new tokens
over the prompt's processing plus decoding. (The tool does not run without a draft; llama.cpp's
plain decoding is `llama-bench -p 0 -n 128`, decoding alone.)

    python3 scripts/llamacpp_speculative.py --llama-bin LLAMA/build/bin \\
        --target TARGET.gguf --draft DRAFT.gguf --settings 8:0,16:0.75
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

PROMPTS = Path(__file__).resolve().parent.parent / "localspec" / "data" / "bench_prompts.jsonl"
_TIMES = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")


def chat_prompts(target: Path) -> list[tuple[str, str]]:
    """(category, text) of each bench prompt through the target's own chat template."""
    tokenizer = AutoTokenizer.from_pretrained(target.parent, gguf_file=target.name)
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return [(row["category"], tokenizer.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
        tokenize=False)) for row in rows]


def run(binary: Path, args: list[str], prompt: str) -> tuple[int, float, float | None]:
    """(new tokens, seconds of prompt and decoding, acceptance % or None) of one run."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(prompt)
        f.flush()
        out = subprocess.run([str(binary), "-f", f.name, *args], capture_output=True,
                             text=True, check=True)
    times = {kind: (int(n), float(s)) for kind, n, s in _TIMES.findall(out.stderr)}
    if "decoded" not in times:
        raise SystemExit(f"no timing in {binary.name}'s output:\n{out.stderr[-2000:]}")
    accept = _ACCEPT.search(out.stderr)
    seconds = times["decoded"][1] + times.get("encoded", (0, 0.0))[1]
    return times["decoded"][0], seconds, float(accept.group(1)) if accept else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--settings", default="8:0,16:0.75",
                        help="draft settings N:P (--spec-draft-n-max N --spec-draft-p-min P)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    binary = args.llama_bin / "llama-speculative-simple"
    common = ["-m", str(args.target), "-md", str(args.draft), "-n", str(args.tokens),
              "-t", str(args.threads), "-td", str(args.threads), "-c", "2048", "--temp", "0",
              "--top-k", "1", "--seed", "42"]
    setups: dict[str, list[str]] = {}
    for setting in args.settings.split(","):
        n, p = setting.split(":")
        setups[f"draft {n}, p {p}"] = ["--spec-type", "draft-simple", "--spec-draft-n-max", n,
                                       "--spec-draft-p-min", p]
    totals = {name: [0, 0.0] for name in setups}
    print(f"{'#':>2} {'category':16s} " + " ".join(f"{name:>22s}" for name in setups))
    for index, (category, prompt) in enumerate(chat_prompts(args.target), 1):
        cells = []
        for name, extra in setups.items():  # interleaved: the VM's drift falls on all alike
            tokens, seconds, accept = run(binary, [*common, *extra], prompt)
            totals[name][0] += tokens
            totals[name][1] += seconds
            cells.append(f"{tokens / seconds:8.2f}" + (f" ({accept:3.0f}% kept)"
                                                        if accept is not None else " " * 12))
        print(f"{index:2d} {category:16s} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    print("all prompts: " + ", ".join(
        f"{name} {t / s:.2f} tok/s" for name, (t, s) in totals.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
