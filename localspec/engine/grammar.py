"""Structured output's grammars: an ``OutputFormat`` compiled against a tokenizer, once.

The library is llguidance (chosen by measurement, docs/research-log.md 2026-12-04): JSON Schema
with ``$ref`` and recursion, Lark grammars with inline JSON schemas (``%json``), lazy triggers
in free text, roll back, token masks in tens of microseconds on a 152k vocabulary, and limits of
its own on every compile and mask step (its "fuel"), so no schema can make it run unbounded.

An ``OutputFormat`` becomes one Lark grammar: a JSON value (``start: %json {...}``), one or more
tool-call tags, or free text in which a trigger starts one. A literal text (a tag's begin or
end, a trigger) that holds an added token of the tokenizer (Qwen's ``<tool_call>``) refers to
that token by id, as the model emits it, not to its spelling in ordinary tokens.

``compile_format`` checks what can be checked before any token: the format's size, that it
compiles within ``GRAMMAR_COMPILE_TIMEOUT_S`` and that it admits at least one answer; every
failure is a ``FormatError`` whose message names what is wrong (the API answers it with a
400). ``GrammarCache`` keeps a pipeline's compiled formats by ``OutputFormat.key()``.

Knows tokens and texts, not models or requests; the engine's ``Constraint`` walks a compiled
grammar's matcher through one answer.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from localspec.config import (
    GRAMMAR_CACHE_SIZE,
    GRAMMAR_COMPILE_TIMEOUT_S,
    JSON_WHITESPACE,
    MAX_FORMAT_CHARS,
)
from localspec.errors import LocalSpecError
from localspec.output_format import JsonSchema, OutputFormat


class FormatError(LocalSpecError):
    """An answer's format cannot be used: a malformed or unsupported schema, one too large or
    too slow to compile, or one that no answer satisfies. The message says which."""


@dataclass(frozen=True)
class GrammarVocab:
    """A tokenizer as the grammar library sees it, built once per pipeline (about 1-3 s for
    Qwen's 152k tokens).

    ``vocab_size``: rows of the target's logits (may exceed the tokenizer's tokens: padding
    rows are never allowed); ``eos``: the one token that ends a constrained answer;
    ``added``: the added tokens' texts by id, longest first, which a literal refers to by id."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int
    eos: int
    added: tuple[tuple[str, int], ...]


def grammar_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                  eos: int) -> GrammarVocab:
    """Wrap a fast Hugging Face tokenizer for the grammar library; ``eos`` ends an answer."""
    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    added = sorted(((text, i) for i, text in _added_tokens(tokenizer)
                    if i < vocab_size and info.is_special_token(i)),
                   key=lambda pair: -len(pair[0]))
    return GrammarVocab(info, vocab_size, eos, tuple(added))


def _added_tokens(tokenizer: PreTrainedTokenizerBase) -> Iterable[tuple[int, str]]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ((int(i), str(token)) for i, token in decoder.items())


@dataclass(frozen=True)
class CompiledGrammar:
    """One format compiled for one vocabulary: ``matcher()`` gives each answer its own."""

    key: str
    lark: str  # the grammar, as compiled (shown in errors and tests)
    vocab: GrammarVocab
    _template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the answer's start (a copy: no compile)."""
        return self._template.deep_copy()


def compile_format(output: OutputFormat, vocab: GrammarVocab,
                   timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
                   max_chars: int = MAX_FORMAT_CHARS) -> CompiledGrammar:
    """``output`` as a grammar over ``vocab``; FormatError when it is too large, does not
    compile within ``timeout_s`` seconds, or admits no answer."""
    key = output.key()
    if len(key) > max_chars:
        raise FormatError(f"the answer's format is {len(key):,} characters of JSON; at most "
                          f"{max_chars:,} are accepted: send a smaller schema or fewer tools")
    lark = to_lark(output, vocab)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
    try:
        # The library bounds its own work (fuel); the wall clock bounds what that still allows.
        template = pool.submit(_build, lark, vocab).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise FormatError(f"the answer's format did not compile within {timeout_s:g} s: "
                          "simplify the schema") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return CompiledGrammar(key, lark, vocab, template)


def _build(lark: str, vocab: GrammarVocab) -> llguidance.LLMatcher:
    """Compile ``lark`` and compute the first mask; FormatError with the library's words."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(lark, vocab.tokenizer)
    if failed:
        raise FormatError(f"the answer's format cannot be used: {_first_line(messages)}")
    matcher = llguidance.LLMatcher(vocab.tokenizer, lark)
    if not matcher.is_error():
        fill_mask(matcher, torch.zeros((1, mask_words(vocab.vocab_size)), dtype=torch.int32), 0)
    if matcher.is_error():  # compiled, yet no first token leads anywhere
        raise FormatError(f"no answer satisfies the answer's format (an unsatisfiable or "
                          f"endlessly recursive schema): {_first_line([matcher.get_error()])}")
    return matcher


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row of a token bitmask."""
    return (vocab_size + 31) // 32


def fill_mask(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write the tokens ``matcher`` allows next into ``bitmask[row]`` (int32 words, CPU)."""
    view = bitmask[row]
    matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())


def _first_line(messages: Iterable[str]) -> str:
    """The library's message without its dump of parser state and grammar."""
    text = "; ".join(m.strip().splitlines()[0] for m in messages if m.strip()) or "unknown error"
    text = re.sub(r"^at \d+\(\d+\): ", "", text)
    return text if len(text) <= 500 else text[:500] + "..."


# ----------------------------------------------------------------------------- to Lark


def to_lark(output: OutputFormat, vocab: GrammarVocab) -> str:
    """The Lark grammar (llguidance's dialect) of ``output``; FormatError for a schema that is
    not a JSON Schema document or a tag that no trigger starts."""
    head = "%llguidance {}\n"
    if not output.tags:
        return head + f"start: {_json(output.json)}\n"
    rules = [f"tag_{i}: {_literal(t.begin, vocab)} {_json(t.schema)} {_literal(t.end, vocab)}"
             for i, t in enumerate(output.tags)]
    if output.tags_only:
        calls = "call" if output.single_tag else "call (SEP? call)*"
        answer = calls if output.json is None else f"({calls}) | {_json(output.json)}"
        tags = " | ".join(f"tag_{i}" for i in range(len(output.tags)))
        return head + "\n".join([f"start: {answer}", "SEP: /\\n{1,2}/", f"call: {tags}",
                                  *rules]) + "\n"
    return head + "\n".join(_triggered(output, vocab)) + "\n"


def _triggered(output: OutputFormat, vocab: GrammarVocab) -> list[str]:
    """Free text in which each trigger starts one of the tags whose begin it opens."""
    lines = ["TEXT: /(.|\\n)*/"]
    starts = []
    for j, trigger in enumerate(output.triggers):
        if not trigger:
            raise FormatError("a tool-call trigger is empty")
        tails = [f"{_literal(t.begin[len(trigger):], vocab)} {_json(t.schema)} "
                 f"{_literal(t.end, vocab)}" for t in output.tags if t.begin.startswith(trigger)]
        if not tails:
            continue
        token = dict(vocab.added).get(trigger)
        if token is not None:  # an added token: free text cannot hold it, so it ends the text
            lines.append(f"seg_{j}: TEXT <[{token}]> ({' | '.join(tails)})")
        else:  # free text ends at the trigger's first occurrence
            lines.append(f"trig_{j}[lazy]: TEXT {_literal(trigger, vocab)}")
            lines.append(f"seg_{j}: trig_{j} ({' | '.join(tails)})")
        starts.append(f"seg_{j}")
    orphans = [t.begin for t in output.tags if not any(t.begin.startswith(trigger)
                                                       for trigger in output.triggers if trigger)]
    if orphans:
        raise FormatError(f"the tool-call begin {orphans[0]!r} starts with none of the "
                          f"triggers {list(output.triggers)}")
    return [f"start: ({' | '.join(starts)})* TEXT", *lines]


def _json(schema: JsonSchema) -> str:
    """``%json`` of ``schema`` with the whitespace bound; FormatError if it is no schema."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise FormatError(f"a JSON schema is an object (or true), got {_kind(schema)}")
    guidance = {"whitespace_pattern": JSON_WHITESPACE}
    try:
        text = json.dumps({**schema, "x-guidance": guidance}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"the JSON schema is not JSON: {exc}") from None
    return f"%json {text}"


def _kind(value: object) -> str:
    return "false (no value matches it)" if value is False else type(value).__name__


def _literal(text: str, vocab: GrammarVocab) -> str:
    """``text`` as Lark: string pieces, and each added token it holds by id ("" is nothing)."""
    if not text:
        return ""
    if not vocab.added:
        return json.dumps(text)
    pattern = "|".join(re.escape(t) for t, _ in vocab.added)
    ids = dict(vocab.added)
    parts = []
    for piece in re.split(f"({pattern})", text):
        if piece in ids:
            parts.append(f"<[{ids[piece]}]>")
        elif piece:
            parts.append(json.dumps(piece))
    return " ".join(parts)


class GrammarCache:
    """A pipeline's compiled formats by ``OutputFormat.key()``, the least recently used
    dropped past ``size``. Errors are not cached: a retry gets the same message anew."""

    def __init__(self, vocab: GrammarVocab, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.vocab = vocab
        self.size = size
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def get(self, output: OutputFormat) -> CompiledGrammar:
        key = output.key()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        compiled = compile_format(output, self.vocab)
        self._compiled[key] = compiled
        while len(self._compiled) > self.size:
            self._compiled.popitem(last=False)
        return compiled


