"""What the structured-output tests share: a character-level tokenizer of exactly the tiny
models' 97 tokens (so every toy drafter and head of the engine tests runs under a grammar),
formats over it, and the obviously-correct reference: one token per full forward of the
target, its logits masked by a fresh matcher, argmax."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from localspec.engine.grammar import CompiledGrammar, GrammarVocab, grammar_vocab
from localspec.output_format import OutputFormat, TaggedJson

VOCAB = 97
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # 96 characters, then the end token
EOS = 96

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "mood": {"enum": ["ok", "fine", "bad"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "mood", "age"], "additionalProperties": False}
ARGS = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 99},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["x", "unit"], "additionalProperties": False}
TAG = TaggedJson('<call>{"name": "f", "arguments": ', ARGS, "}</call>")
FORMATS = {
    "json": OutputFormat(json=PERSON),
    "tags-only": OutputFormat(tags=(TAG,), tags_only=True),
    "one-tag": OutputFormat(tags=(TAG,), tags_only=True, single_tag=True),
    "json-or-tag": OutputFormat(json=PERSON, tags=(TAG,), tags_only=True, single_tag=True),
    "triggered": OutputFormat(tags=(TAG,), triggers=("<call>",)),
}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Token i < 96 is the character CHARS[i]; 96 is the end. No merges: every text has one
    spelling, so a literal forces its characters one by one."""
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<|endoftext|>"] = EOS
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def char_vocab() -> GrammarVocab:
    return grammar_vocab(char_tokenizer(), VOCAB, EOS)


def text_of(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids if i != EOS)


def reference_tokens(model: PreTrainedModel, prompt: list[int], grammar: CompiledGrammar,
                     max_new: int) -> list[int]:
    """Plain constrained greedy decoding, the slow obvious way: a full forward per token."""
    matcher = grammar.matcher()
    bits = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_new:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        matcher.unsafe_compute_mask_ptr(bits[0].data_ptr(), bits[0].numel() * 4)
        allowed = [bool(bits[0, t // 32] >> (t % 32) & 1) for t in range(VOCAB)]
        if matcher.is_stopped() or not any(allowed):
            allowed = [t == EOS for t in range(VOCAB)]
        logits[torch.tensor(allowed).logical_not()] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return out


def calls_of(text: str) -> list[dict[str, object]]:
    """The complete tool calls in ``text`` (TAG's format), parsed."""
    calls = []
    for part in text.split("<call>")[1:]:
        if "</call>" not in part:
            break
        calls.append(json.loads(part.split("</call>")[0]))
    return calls
