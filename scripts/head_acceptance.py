"""Acceptance by draft position of a head on prompt files, through the engine the app runs.

Greedy, fixed k, no confidence cut-off (``training.evaluate``): it measures the head alone, so
two heads compare on the same prompts. The held-out sets in ``localspec/data/heldout/`` were
written apart from the heads' training requests and from the built-in bench prompts.

    python3 scripts/head_acceptance.py --head qwen2.5-coder-1.5b-eagle3 \
        --prompts localspec/data/heldout/chat.jsonl localspec/data/heldout/code.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from localspec.files import read_user_text
from localspec.pipeline import Pipeline
from localspec.presets import builtin_head_folder, load_preset
from localspec.training.evaluate import measure_acceptance


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-qwen-coder-eagle")
    parser.add_argument("--method", default="eagle3")
    parser.add_argument("--head", required=True, help="a built-in head's name or a folder")
    parser.add_argument("--prompts", nargs="+", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    pipe = Pipeline.load(preset, load_draft=False)
    folder = Path(args.head)
    if not folder.is_dir():
        folder = builtin_head_folder(args.head)
    for path in args.prompts:
        rows = [json.loads(line) for line in read_user_text(str(path), "prompts").splitlines()
                if line.strip()]
        prompts = [pipe.encode_prompt(row["prompt"]) for row in rows]
        result = measure_acceptance(preset, pipe.target, args.method, folder, prompts,
                                    args.tokens, args.k)
        print(json.dumps({"head": args.head, "prompts": str(path), **result.as_dict()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
