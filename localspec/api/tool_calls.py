"""Reading tool calls out of an answer's text, as it streams or whole.

``CallReader`` takes the answer's text piece by piece and gives back what a client may be sent
so far: text (``content``) and whole tool calls. Text that may turn out to be a call is held
back: from the family's trigger (``<tool_call>``) until the call ends and is parsed, so no raw
tag reaches a client; a bit of text that might be the start of the trigger; whitespace that
stands just before a call. A non-streaming answer is the same reader fed the whole text at
once, so a stream's pieces always add up to the non-streamed message.

A call is valid when its text is one JSON object with a ``name`` among the request's tools and
its arguments a JSON object (or a string holding one) that follows the tool's parameters'
schema (the grammar engine makes a call in the model's tags follow it; an unconstrained one, a
Markdown block, is checked here). Anything else, a call cut short by the token limit, a name
the request did not declare, broken JSON, is given back as the text it was, never dropped and
never an error. An answer without calls comes back exactly as
generated. Torch-free.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import regex
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from localspec.api.tool_format import ToolFormat
from localspec.output_format import JsonSchema

# The start of a Markdown JSON block holding a call: enough to tell it from other JSON.
FENCE_HEAD = r'\s*```(?:json)?[ \t]*\r?\n\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"'
FENCE_BLOCK = regex.compile(r"\s*```(?:json)?[ \t]*\r?\n(?P<body>.*?)\r?\n?```\s*", regex.DOTALL)


def new_call_id() -> str:
    """An id in OpenAI's shape: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, object]:
        """OpenAI's ``tool_calls`` entry of a message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Piece:
    """What may be sent: a piece of text, or a whole call."""

    text: str = ""
    call: ToolCall | None = None


def follows(value: object, schema: JsonSchema) -> bool:
    """Whether ``value`` is valid under the JSON Schema ``schema``."""
    if isinstance(schema, bool):
        return schema
    return validator_for(schema, default=Draft202012Validator)(schema).is_valid(value)


def parse_call(body: str | object, fmt: ToolFormat, tools: Mapping[str, JsonSchema],
               ) -> ToolCall | None:
    """The call that ``body`` (a JSON text, or a value already decoded) is, to one of ``tools``
    (name -> parameters' schema) with arguments of its schema, or None."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(body, dict) or body.get("name") not in tools:
        return None
    args = body.get(fmt.args_key, body.get("arguments", body.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict) or not follows(args, tools[body["name"]]):
        return None
    return ToolCall(new_call_id(), str(body["name"]), json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, literal: str) -> int:
    """The length of the longest end of ``text`` that begins ``literal`` (but is not all of
    it): text that may still become ``literal``."""
    for size in range(min(len(text), len(literal) - 1), 0, -1):
        if literal.startswith(text[-size:]):
            return size
    return 0


class CallReader:
    """The text and tool calls of one answer, read as its text streams in (``feed``, then
    ``finish`` once at its end)."""

    def __init__(self, fmt: ToolFormat, tools: Mapping[str, JsonSchema]) -> None:
        self.fmt = fmt
        self.tools = tools  # the functions it may call: name -> parameters' schema
        self.calls = 0  # valid calls read so far
        self._state = "start" if fmt.fenced else "text"
        self._pending = ""  # read, not yet given out
        self._gap = ""  # whitespace held before a call's trigger
        self._after_call = False  # drop the separators that follow a call

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """What is left at the answer's end: a last call whose end tag a stop cut off, text
        held back (whitespace trailing calls is dropped; an answer without calls is given back
        exactly)."""
        out: list[Piece] = []
        pending, self._pending = self._pending, ""
        if self._state == "fenced":
            calls = self._fenced_calls(pending)
            if calls is None:
                self._say(out, pending)
            out.extend(Piece(call=c) for c in calls or ())
            self.calls += len(calls or ())
        elif self._state == "tag":
            self._call_or_text(out, pending.strip(), self.fmt.trigger + pending)
        elif self._state == "json":
            self._call_or_text(out, pending.strip(), pending)
        elif self.calls:
            self._say(out, pending.rstrip())
        else:
            self._say(out, self._gap + pending)
        self._state, self._gap = "done", ""
        return out

    # ------------------------------------------------------------------ the states

    def _step(self, out: list[Piece]) -> bool:
        """One move of the reader on what is pending; False when it must wait for more."""
        if self._state == "start":
            return self._start()
        if self._state == "text":
            return self._text(out)
        if self._state == "tag":
            return self._tag(out)
        if self._state == "json":
            return self._json(out)
        return False  # fenced: held to the end

    def _start(self) -> bool:
        """An answer that opens a Markdown JSON block: a call (held to the end) or text."""
        match = regex.match(FENCE_HEAD, self._pending, partial=True)
        if match is not None and match.partial:
            return False
        called = match is not None and match.group("name") in self.tools
        self._state = "fenced" if called else "text"
        return not called

    def _text(self, out: list[Piece]) -> bool:
        trigger = self.fmt.trigger
        at = self._pending.find(trigger)
        if at >= 0:
            before = self._pending[:at]
            text = before.rstrip()
            self._say(out, self._gap + text)
            self._gap = before[len(text):]
            if self.fmt.open:  # the tag is not part of the call's JSON
                self._pending, self._state = self._pending[at + len(trigger):], "tag"
            else:
                self._pending, self._state = self._pending[at:], "json"
            return True
        keep = len(self._pending) - _partial_suffix(self._pending, trigger)
        safe = len(self._pending[:keep].rstrip())
        if safe:
            self._say(out, self._gap + self._pending[:safe])
            self._gap, self._pending = "", self._pending[safe:]
        return False

    def _tag(self, out: list[Piece]) -> bool:
        close = self.fmt.close.strip()
        at = self._pending.find(close)
        if at < 0:
            return False
        body, self._pending = self._pending[:at], self._pending[at + len(close):]
        self._call_or_text(out, body.strip(), self.fmt.trigger + body + close)
        self._state = "text"
        return True

    def _json(self, out: list[Piece]) -> bool:
        if "}" not in self._pending:
            return False
        try:
            value, end = json.JSONDecoder().raw_decode(self._pending)
        except (json.JSONDecodeError, RecursionError):
            return False  # not whole yet (or never: then it is given back as text at the end)
        raw, self._pending = self._pending[:end], self._pending[end:]
        self._call_or_text(out, value, raw)
        self._state = "text"
        return True

    # ------------------------------------------------------------------ helpers

    def _call_or_text(self, out: list[Piece], body: str | object, raw: str) -> None:
        call = parse_call(body, self.fmt, self.tools)
        if call is None:
            self._say(out, self._gap + raw)
        else:
            out.append(Piece(call=call))
            self.calls += 1
            self._after_call = True
        self._gap = ""

    def _say(self, out: list[Piece], text: str) -> None:
        if self._after_call:
            text = text.lstrip(self.fmt.separators)
        if text:
            self._after_call = False
            out.append(Piece(text=text))

    def _fenced_calls(self, text: str) -> list[ToolCall] | None:
        """The calls of an answer made only of Markdown JSON blocks of calls, else None."""
        calls, at = [], 0
        while at < len(text):
            block = FENCE_BLOCK.match(text, at)
            call = parse_call(block.group("body"), self.fmt, self.tools) if block else None
            if block is None or call is None:
                return None
            calls.append(call)
            at = block.end()
        return calls or None


def read_answer(text: str, fmt: ToolFormat, tools: Mapping[str, JsonSchema],
                ) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when it is only calls) and its calls to ``tools``."""
    reader = CallReader(fmt, tools)
    pieces = reader.feed(text) + reader.finish()
    calls = [p.call for p in pieces if p.call is not None]
    content = "".join(p.text for p in pieces)
    return (content or None) if calls else content, calls
