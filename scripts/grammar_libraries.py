"""Measure the grammar libraries LocalSpec could mask the target's logits with (xgrammar,
llguidance, outlines-core) on the built-in target's tokenizer (Qwen2.5-Coder, 151,936 rows).

For each library: the tokenizer-info build, the compile of a few JSON schemas (a simple object,
a nested tool call, a big object, a recursive ``$ref``) and the mean time of one token's mask
plus one token's advance while walking a valid answer. The figures went into
docs/research-log.md (2026-12-04); they are noisy on a shared machine.

    PYTHONPATH=. python3 scripts/grammar_libraries.py [--libs xgrammar,llguidance,outlines]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from localspec.config import cache_root

SIMPLE = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOL = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {
        "location": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "options": {"type": "object", "properties": {
            "hourly": {"type": "boolean"},
            "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
            "required": ["hourly"]}},
        "required": ["location", "unit"]}},
    "required": ["name", "arguments"]}
BIG = {"type": "object", "properties": {
    f"field_{i}": ([{"type": "string"}, {"type": "integer"}, {"type": "number"},
                    {"type": "boolean"}, {"enum": ["a", "b", "c"]},
                    {"type": "array", "items": {"type": "integer"}},
                    {"type": "object", "properties": {"x": {"type": "string"},
                                                      "y": {"type": "number"}},
                     "required": ["x"]}][i % 7])
    for i in range(120)}, "required": [f"field_{i}" for i in range(0, 120, 3)]}
RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value", "children"]}}, "$ref": "#/$defs/node"}

ANSWERS = {
    "simple": {"name": "Ada Lovelace", "age": 36},
    "tool": {"name": "get_weather", "arguments": {"location": "Paris, France",
                                                  "unit": "celsius", "days": 3,
                                                  "options": {"hourly": True,
                                                              "fields": ["rain", "wind"]}}},
    "big": {f"field_{i}": ([f"text {i}", i, i + 0.5, True, "b", [1, 2, 3],
                            {"x": "value", "y": 2.5}][i % 7]) for i in range(120)},
    "recursive": {"value": 1, "children": [{"value": 2, "children": []},
                                           {"value": 3, "children": [{"value": 4,
                                                                      "children": []}]}]},
}
SCHEMAS = {"simple": SIMPLE, "tool": TOOL, "big": BIG, "recursive": RECURSIVE}


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_xgrammar(tokenizer: object, vocab: int, eos: int) -> dict[str, object]:
    import xgrammar as xgr

    info, t_info = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out: dict[str, object] = {"tokenizer_info_s": t_info}
    for name, schema in SCHEMAS.items():
        try:
            compiled, t = timed(lambda s=schema: compiler.compile_json_schema(
                json.dumps(s), any_whitespace=False))
        except RuntimeError as exc:
            out[name] = f"error: {exc}"
            continue
        ids = tokenizer.encode(json.dumps(ANSWERS[name]), add_special_tokens=False)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token), (name, tokenizer.decode([token]))
        per_token = (time.perf_counter() - start) / len(ids)
        matcher.fill_next_token_bitmask(bitmask)
        ends = bool(bitmask[0, eos // 32] >> (eos % 32) & 1)
        out[name] = {"compile_s": t, "mask_ms": 1e3 * per_token, "eos_after": ends}
    return out


def bench_llguidance(tokenizer: object, vocab: int, eos: int) -> dict[str, object]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    info, t_info = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                              eos_token=eos))
    out: dict[str, object] = {"tokenizer_info_s": t_info}
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher, t = timed(lambda g=grammar: llguidance.LLMatcher(info, g))
        if matcher.is_error():
            out[name] = f"error: {matcher.get_error()}"
            continue
        ids = tokenizer.encode(json.dumps(ANSWERS[name], separators=(",", ":")),
                               add_special_tokens=False)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for token in ids:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), (name, matcher.get_error())
        per_token = (time.perf_counter() - start) / len(ids)
        out[name] = {"compile_s": t, "mask_ms": 1e3 * per_token,
                     "eos_after": matcher.is_accepting()}
    return out


def bench_outlines(tokenizer: object, vocab: int, eos: int) -> dict[str, object]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def build() -> Vocabulary:
        tokens: dict[str, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():
            if i != eos:
                tokens.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(i)
        return Vocabulary(eos, tokens)

    vocabulary, t_info = timed(build)
    out: dict[str, object] = {"tokenizer_info_s": t_info}
    for name, schema in SCHEMAS.items():
        try:
            regex = build_regex_from_schema(json.dumps(schema))
        except (ValueError, RuntimeError) as exc:  # recursion: not expressible as a regex
            out[name] = f"error: {exc}"
            continue
        index, t = timed(lambda r=regex: Index(r, vocabulary))
        guide = Guide(index)
        ids = tokenizer.encode(json.dumps(ANSWERS[name], separators=(",", ":")),
                               add_special_tokens=False)
        start = time.perf_counter()
        ok = True
        for token in ids:
            allowed = guide.get_tokens()
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[allowed] = True
            if token not in allowed:
                ok = False
                break
            guide.advance(token, return_tokens=False)
        per_token = (time.perf_counter() - start) / len(ids)
        out[name] = {"compile_s": t, "mask_ms": 1e3 * per_token, "walked": ok,
                     "eos_after": guide.is_finished()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", default="xgrammar,llguidance,outlines")
    args = parser.parse_args()
    folder = Path(cache_root()) / "meta" / "qwen2.5-coder-1.5b-instruct.bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab, eos = 151936, tokenizer.eos_token_id
    benches = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance,
               "outlines": bench_outlines}
    for lib in args.libs.split(","):
        print(lib, json.dumps(benches[lib](tokenizer, vocab, eos), indent=1, default=str),
              flush=True)


if __name__ == "__main__":
    main()
