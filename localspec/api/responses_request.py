"""What ``POST /v1/responses`` accepts (OpenAI's Responses API), and the chat-completions request
it becomes.

``input`` is a string (one user message) or a list of items: messages (``role`` user, system,
developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` parts),
``function_call`` items (an assistant's tool call) and ``function_call_output`` items (its
result). They become chat messages in order: an assistant's text and the tool calls that follow
it are one assistant message with ``tool_calls``, a result is a ``tool`` message.
``instructions`` is a system message first; a ``previous_response_id``'s conversation (without
its instructions, as OpenAI does) comes before the new input. ``tools`` in the Responses' flat
shape (``{"type": "function", "name", "parameters"}``) become chat's nested one,
``text.format`` becomes ``response_format``, ``max_output_tokens`` ``max_tokens``.

As for chat, a field that cannot change the answer is accepted and ignored, one at its neutral
value likewise, and any other refused by name, as is a field nobody sends.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from localspec.api.errors import BadRequest
from localspec.api.schemas import LocalSpecOptions, Temperature
from localspec.config import NewTokens, TopP

ChatMessage = dict[str, Any]

# Fields that never change an answer here: accepted, ignored. ``truncation`` matters only past
# the context, which is a 413 either way; ``include`` asks for data we never produce.
IGNORED = frozenset({"user", "metadata", "service_tier", "include",
                     "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
                     "stream_options", "truncation", "reasoning"})
# Fields ignored at these values only.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (0,), "background": (False,), "max_tool_calls": (), "conversation": (),
    "prompt": (), "context_management": ([],),
}
TEXT_PARTS = ("input_text", "output_text", "text")


class TextOptions(BaseModel):
    """``text``: the answer's format (``{"type": "text"}``, ``json_object``, or ``json_schema``
    with ``name``, ``schema``, ``strict``)."""

    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: NewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    localspec: LocalSpecOptions = Field(default_factory=LocalSpecOptions)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in NEUTRAL:
                raise ValueError(f"unrecognized request argument supplied: {name}")
            if value is not None and not any(value == n for n in NEUTRAL[name]):
                raise ValueError(f"{name}={value!r} is not supported: ignoring it would change "
                                 "the answer")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: empty (send a message)")
        return self


def _text(content: object, where: str, role: str) -> str | list[dict[str, str]]:
    """A message's content as chat takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: a string or a list of content parts", param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and role == "assistant":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.{i}: only text parts are supported, got a part of type "
                             f"{kind!r}", param=f"{where}.{i}")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{name}: a string is required", param=f"{where}.{name}")
    return value


def _output_text(output: object, where: str) -> str | list[dict[str, str]]:
    """A ``function_call_output``'s ``output``: a string, or text parts."""
    return _text(output, f"{where}.output", "tool")


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The Responses ``input`` as chat messages (OpenAI's chat shapes, tool calls included)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role: one of 'user', 'system', 'developer', "
                                 f"'assistant', got {role!r}", param=f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{where}.content", role)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where),
                                 "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _output_text(item.get("output"), where)})
        else:
            raise BadRequest(f"{where}.type: input items of type {kind!r} are not supported "
                             "(messages, function_call and function_call_output are)",
                             param=f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's (``{"type": "function", "function": {...}}``);
    a built-in tool (web search, files, a computer) is a 400."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise BadRequest(f"tools.{i}.type: only function tools are supported, got "
                             f"{tool.get('type')!r}", param=f"tools.{i}.type")
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools.{i}.name: a string is required", param=f"tools.{i}.name")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice``: "none", "auto", "required" as they are; ``{"type": "function",
    "name"}`` as chat's ``{"type": "function", "function": {"name"}}``."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice: {choice!r} is not supported (none, auto, required, or "
                     "{\"type\": \"function\", \"name\": ...})", param="tool_choice")


def response_format(text: TextOptions | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None or text.format is None:
        return None
    fmt = dict(text.format)
    kind = fmt.pop("type", None)
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise BadRequest("text.format.schema: a JSON schema object is required",
                             param="text.format.schema")
        return {"type": "json_schema", "json_schema": fmt}
    raise BadRequest(f"text.format.type: one of 'text', 'json_object', 'json_schema', got "
                     f"{kind!r}", param="text.format.type")


# chat's field names, as a Responses client knows them (for chat's refusals)
RENAME = {"max_tokens": "max_output_tokens", "response_format": "text.format",
          "messages": "input"}


def chat_body(request: ResponsesRequest, conversation: list[ChatMessage]) -> dict[str, Any]:
    """The chat-completions request ``request`` is, over ``conversation`` (a previous
    response's messages and this input's, ``input_messages``); its instructions go first."""
    messages = ([{"role": "system", "content": request.instructions}]
                if request.instructions is not None else [])
    body: dict[str, Any] = {"messages": messages + conversation, "stream": request.stream,
                            "localspec": request.localspec.model_dump()}
    optional = {"model": request.model, "max_tokens": request.max_output_tokens,
                "temperature": request.temperature, "top_p": request.top_p,
                "tools": chat_tools(request.tools),
                "tool_choice": chat_tool_choice(request.tool_choice),
                "parallel_tool_calls": request.parallel_tool_calls,
                "response_format": response_format(request.text)}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body
