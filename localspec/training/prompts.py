"""Prompt sets for ``bench``, ``verify`` and ``tune``: a JSONL file read, checked and encoded up
front.

One JSON object a line: ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...},
...]}``, with an optional ``"category"``. Everything that can be wrong with the file (missing,
a directory, not UTF-8, not JSON, JSON nested too deeply or with an endless integer, a lone
surrogate from a ``\ud800`` escape, a wrong key or type, a conversation the chat template
refuses, a prompt longer than the model's context) is an ``InputFileError`` naming the file and
line, raised before the first generation: a benchmark must not fail an hour in on line 40.

It does not run anything; ``bench`` and ``check`` do.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from localspec.errors import InputFileError, LocalSpecError
from localspec.files import parse_json, read_user_text
from localspec.pipeline import Pipeline

KEYS = ("prompt", "messages", "category")
BUILTIN = "built-in prompts"


def _read_text(path: str | None) -> tuple[str, str]:
    """(text, where): the file's text, or the built-in set's; InputFileError if unreadable."""
    if path is None:
        text = resources.files("localspec").joinpath("data/bench_prompts.jsonl").read_text("utf-8")
        return text, BUILTIN
    return read_user_text(path, "prompts file"), path


def _check_messages(messages: object, where: str) -> None:
    """A non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(messages, list) or not messages:
        raise InputFileError(f"{where}: 'messages' must be a non-empty list of "
                             f'{{"role": ..., "content": ...}} objects, got '
                             f"{type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise InputFileError(f"{where}: messages[{i}] must be an object with exactly the "
                                 f"keys 'role' and 'content', got {message!r:.80}")
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise InputFileError(f"{where}: messages[{i}] '{key}' must be a string, got "
                                     f"{type(message[key]).__name__}")
        if not message["role"].strip():
            raise InputFileError(f"{where}: messages[{i}] 'role' is empty")


def parse_row(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as ``{"category", "prompt" | "messages", "where"}``; ``where`` names the
    file and line for errors found later (chat template, context length)."""
    row = parse_json(line, where)
    if not isinstance(row, dict):
        raise InputFileError(f"{where}: need a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - set(KEYS))
    if unknown:
        raise InputFileError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: "
                             f"{', '.join(KEYS)}")
    if ("prompt" in row) == ("messages" in row):
        raise InputFileError(f"{where}: need exactly one of 'prompt' and 'messages'")
    if "prompt" in row and (not isinstance(row["prompt"], str) or not row["prompt"].strip()):
        raise InputFileError(f"{where}: 'prompt' must be a non-empty string, got "
                             f"{row['prompt']!r:.80}")
    if "messages" in row:
        _check_messages(row["messages"], where)
    category = row.get("category", "")
    if not isinstance(category, str):
        raise InputFileError(f"{where}: 'category' must be a string, got "
                             f"{type(category).__name__}")
    return {**row, "category": category, "where": where}


def load_prompts(path: str | None) -> list[dict[str, Any]]:
    """The prompts of a JSONL file (None: the built-in set), every line checked."""
    text, name = _read_text(path)
    prompts = [parse_row(line, f"{name} line {number}")
               for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not prompts:
        raise InputFileError(f"{name}: no prompts (one JSON object a line)")
    return prompts


def encode(pipe: Pipeline, row: dict[str, Any]) -> list[int]:
    """A row's token ids: messages or a prompt through the chat template."""
    if "messages" in row:
        return pipe.encode_chat(row["messages"])
    return pipe.encode_prompt(row["prompt"])


def encode_prompts(pipe: Pipeline, rows: list[dict[str, Any]], max_new_tokens: int
                   ) -> list[list[int]]:
    """Every row encoded and checked against the engine's limits (context length) before any
    runs; an error names the row's file and line."""
    engine = pipe.engine("none")
    encoded = []
    for row in rows:
        where = row.get("where", BUILTIN)
        try:
            ids = encode(pipe, row)
            engine.check(pipe.request(ids, max_new_tokens=max_new_tokens, temperature=0.0))
        except LocalSpecError as exc:
            raise InputFileError(f"{where}: {exc}") from exc
        encoded.append(ids)
    return encoded
