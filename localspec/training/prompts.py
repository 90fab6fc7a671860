"""Prompt sets for ``bench``, ``verify`` and ``tune``: a JSONL file read, checked and encoded up
front.

One JSON object a line: ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...},
...]}``, with an optional ``"category"``. A conversation may be an agent's: ``"tools"`` (OpenAI's
function specs, offered through the chat template), assistant messages with ``"tool_calls"``
(``{"type": "function", "function": {"name", "arguments"}}``, the arguments an object or, as the
OpenAI API sends them, a string holding one) and ``"tool"`` messages with their results.

Everything that can be wrong with the file (missing, a directory, not UTF-8, not JSON, JSON
nested too deeply or with an endless integer, a lone surrogate from a ``\ud800`` escape, a wrong
key or type, a conversation the chat template refuses, a prompt longer than the model's context)
is an ``InputFileError`` naming the file and line, raised before the first generation: a
benchmark must not fail an hour in on line 40.

It does not run anything; ``bench`` and ``check`` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Any

from localspec.errors import InputFileError, LocalSpecError
from localspec.files import parse_json, read_user_text
from localspec.pipeline import Pipeline

KEYS = ("prompt", "messages", "tools", "category")
# the keys a message of each role may hold beside "role" and "content"
MESSAGE_EXTRAS: Mapping[str, frozenset[str]] = MappingProxyType(
    {"assistant": frozenset({"tool_calls"}), "tool": frozenset({"tool_call_id", "name"})})
BUILTIN = "built-in prompts"


def _read_text(path: str | None) -> tuple[str, str]:
    """(text, where): the file's text, or the built-in set's; InputFileError if unreadable."""
    if path is None:
        text = resources.files("localspec").joinpath("data/bench_prompts.jsonl").read_text("utf-8")
        return text, BUILTIN
    return read_user_text(path, "prompts file"), path


def _check_call(call: object, where: str) -> dict[str, Any]:
    """One tool call, its arguments an object (as chat templates render them)."""
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(call, dict) or set(call) - {"id", "type", "function"}
            or call.get("type", "function") != "function" or not isinstance(function, dict)
            or set(function) != {"name", "arguments"} or not isinstance(function["name"], str)
            or not function["name"]):
        raise InputFileError(f'{where} must be {{"type": "function", "function": {{"name": '
                             f'..., "arguments": ...}}}}, got {call!r:.80}')
    arguments = function["arguments"]
    if isinstance(arguments, str):
        arguments = parse_json(arguments, f"{where} arguments")
    if not isinstance(arguments, dict):
        raise InputFileError(f"{where} arguments must be a JSON object, got "
                             f"{type(arguments).__name__}")
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def _check_message(message: object, where: str) -> dict[str, Any]:
    """{"role": str, "content": str}; an assistant's may add "tool_calls" (its content then
    may be null), a tool's "tool_call_id" and "name"."""
    if not isinstance(message, dict) or not {"role", "content"} <= set(message):
        raise InputFileError(f"{where} must be an object with the keys 'role' and 'content', "
                             f"got {message!r:.80}")
    role = message["role"]
    if not isinstance(role, str) or not role.strip():
        raise InputFileError(f"{where} 'role' must be a non-empty string, got {role!r:.80}")
    allowed = {"role", "content"} | MESSAGE_EXTRAS.get(role, frozenset())
    extra = sorted(set(message) - allowed)
    if extra:
        raise InputFileError(f"{where}: key(s) {', '.join(extra)} not allowed in a '{role}' "
                             f"message; allowed: {', '.join(sorted(allowed))}")
    calls = message.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not calls):
        raise InputFileError(f"{where} 'tool_calls' must be a non-empty list")
    if not isinstance(message["content"], str) and not (calls and message["content"] is None):
        raise InputFileError(f"{where} 'content' must be a string, got "
                             f"{type(message['content']).__name__}")
    for key in ("tool_call_id", "name"):
        if key in message and not isinstance(message[key], str):
            raise InputFileError(f"{where} '{key}' must be a string")
    if calls is None:
        return message
    return {**message, "content": message["content"] or "",
            "tool_calls": [_check_call(c, f"{where} tool_calls[{i}]")
                           for i, c in enumerate(calls)]}


def _check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    """A non-empty list of messages (``_check_message``)."""
    if not isinstance(messages, list) or not messages:
        raise InputFileError(f"{where}: 'messages' must be a non-empty list of "
                             f'{{"role": ..., "content": ...}} objects, got '
                             f"{type(messages).__name__}")
    return [_check_message(m, f"{where}: messages[{i}]") for i, m in enumerate(messages)]


def _check_tools(tools: object, where: str) -> None:
    """A non-empty list of OpenAI function specs: ``{"type": "function", "function": {"name":
    str, ...}}``."""
    if not isinstance(tools, list) or not tools:
        raise InputFileError(f"{where}: 'tools' must be a non-empty list of function specs")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not function["name"]):
            raise InputFileError(f'{where}: tools[{i}] must be {{"type": "function", '
                                 f'"function": {{"name": ..., ...}}}}, got {tool!r:.80}')


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
        row = {**row, "messages": _check_messages(row["messages"], where)}
    if "tools" in row:
        if "messages" not in row:
            raise InputFileError(f"{where}: 'tools' needs 'messages' (a conversation)")
        _check_tools(row["tools"], where)
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
    """A row's token ids: messages (with any tools) or a prompt through the chat template."""
    if "messages" in row:
        return pipe.encode_chat(row["messages"], row.get("tools"))
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
