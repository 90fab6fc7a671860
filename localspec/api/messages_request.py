"""What ``POST /v1/messages`` and ``/v1/messages/count_tokens`` accept (Anthropic's Messages API),
and the chat-completions request it becomes.

``system`` (a string or text blocks) is a system message first. Each message's ``content`` is a
string or blocks: ``text``; an assistant's ``tool_use`` blocks are its ``tool_calls`` (the input
as JSON arguments); a user's ``tool_result`` blocks are ``tool`` messages, before the user's own
text (an ``is_error`` result is prefixed ``Error:``). ``tools`` (``name``, ``description``,
``input_schema``) become chat's function tools; ``tool_choice`` ``auto``, ``any`` (chat's
``required``), ``tool`` (a named function) and ``none``; ``stop_sequences`` is ``stop``.
``max_tokens`` is required and ``temperature`` runs 0 to 1, as Anthropic has them.

``output_config.format`` (a JSON schema) is chat's ``response_format``. ``temperature``,
``top_p`` and ``top_k`` are read as older clients send them (newer ones send them as extra body
fields, if at all).

A field Anthropic defines that cannot change an answer here (``metadata``, ``service_tier``,
``cache_control``, ``speed``, ``inference_geo``, ``output_config.effort``) is accepted and
ignored; ``thinking`` only when disabled; anything else is refused by name (``Extra inputs are
not permitted``, Anthropic's words). Our own ``localspec`` extension is read as in chat.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from localspec.api.errors import BadRequest
from localspec.api.schemas import LocalSpecOptions
from localspec.config import NewTokens, TopK, TopP

ChatMessage = dict[str, Any]
Temperature = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]  # Anthropic's range

IGNORED = frozenset({"metadata", "service_tier", "cache_control", "speed", "inference_geo",
                     "diagnostics", "user_profile_id", "workspace_id"})
NEUTRAL: dict[str, tuple[Any, ...]] = {"thinking": ({"type": "disabled"},), "mcp_servers": ([],),
                                       "container": ()}


class OutputConfig(BaseModel):
    """``output_config``: the answer's format (a JSON schema), and an effort level for
    Anthropic's reasoning models (no effect here)."""

    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    format: dict[str, Any] | None = None

ANSWER_ONLY = frozenset({"max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                         "stream"})


class _Body(BaseModel):
    """What ``/messages`` and ``/messages/count_tokens`` share."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    localspec: LocalSpecOptions = Field(default_factory=LocalSpecOptions)

    @model_validator(mode="after")
    def _check(self) -> _Body:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in NEUTRAL:
                raise ValueError(f"{name}: Extra inputs are not permitted")
            if value is not None and not any(value == n for n in NEUTRAL[name]):
                raise ValueError(f"{name}={value!r} is not supported: ignoring it would change "
                                 "the answer")
        return self


class MessagesRequest(_Body):
    """``POST /v1/messages``."""

    max_tokens: NewTokens
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: a request's input. What shapes only the answer
    (``max_tokens``, sampling, stop sequences, ``stream``) is accepted and ignored: a client
    may count the very body it is about to send."""

    @model_validator(mode="before")
    @classmethod
    def _answer_fields(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if k not in ANSWER_ONLY}
        return value


def _blocks(content: object, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}: a string or a list of content blocks", param=where)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise BadRequest(f"{where}.{i}: a content block object", param=f"{where}.{i}")
    return content


def _text_of(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"{where}.text: a string is required", param=f"{where}.text")
    return block["text"]


def _content(parts: list[str]) -> str | list[dict[str, str]]:
    """Text blocks as chat's content: one string, or text parts (chat joins them)."""
    return parts[0] if len(parts) == 1 else [{"type": "text", "text": p} for p in parts]


ALLOWED = {"assistant": "text and tool_use", "user": "text and tool_result", "system": "text",
           "tool_result": "text"}


def _unsupported(block: dict[str, Any], where: str, place: str) -> BadRequest:
    """A block of a type ``place`` (a role, ``system``, a tool result) cannot hold here."""
    return BadRequest(f"{where}.type: content blocks of type {block.get('type')!r} are not "
                      f"supported in {place} content ({ALLOWED[place]} only)",
                      param=f"{where}.type")


def _tool_result(block: dict[str, Any], where: str) -> ChatMessage:
    if not isinstance(block.get("tool_use_id"), str):
        raise BadRequest(f"{where}.tool_use_id: a string is required",
                         param=f"{where}.tool_use_id")
    inner = block.get("content", "")
    parts = []
    for i, part in enumerate(_blocks(inner, f"{where}.content")):
        if part.get("type") != "text":
            raise _unsupported(part, f"{where}.content.{i}", "tool_result")
        parts.append(_text_of(part, f"{where}.content.{i}"))
    text = "\n".join(parts)
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise BadRequest(f"{where}: a tool_use block needs an id and a name", param=where)
    arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": arguments}}


def chat_messages(request: _Body) -> list[ChatMessage]:
    """``system`` and ``messages`` as chat messages (OpenAI's chat shapes, tools included)."""
    messages: list[ChatMessage] = []
    if request.system is not None:
        parts = []
        for i, block in enumerate(_blocks(request.system, "system")):
            if block.get("type") != "text":
                raise _unsupported(block, f"system.{i}", "system")
            parts.append(_text_of(block, f"system.{i}"))
        if parts:
            messages.append({"role": "system", "content": _content(parts)})
    for m, message in enumerate(request.messages):
        where, role = f"messages.{m}", message.get("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role: 'user' or 'assistant', got {role!r}",
                             param=f"{where}.role")
        parts, calls = [], []
        for b, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            at, kind = f"{where}.content.{b}", block.get("type")
            if kind == "text":
                parts.append(_text_of(block, at))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_call(block, at))
            elif kind == "tool_result" and role == "user":
                messages.append(_tool_result(block, at))
            else:
                raise _unsupported(block, at, role)
        if role == "assistant":
            turn: ChatMessage = {"role": "assistant",
                                 "content": _content(parts) if parts else None}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn if parts or calls else {"role": "assistant", "content": ""})
        elif parts or not messages or messages[-1]["role"] != "tool":
            messages.append({"role": "user", "content": _content(parts) if parts else ""})
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools as chat's function tools; a server tool (web search, a text
    editor, bash) is a 400."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise BadRequest(f"tools.{i}.type: only client tools (name, description, "
                             f"input_schema) are supported, got {tool.get('type')!r}",
                             param=f"tools.{i}.type")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"),
                                                                   dict):
            raise BadRequest(f"tools.{i}: a tool needs a name and an input_schema object",
                             param=f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "auto" | "any" | "tool" | "none"}`` as chat's ``tool_choice``."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice: {choice!r} is not one of auto, any, tool (with a name), "
                     "none", param="tool_choice")


def response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema"}``) as chat's
    ``response_format``."""
    if config is None or config.format is None:
        return None
    if config.format.get("type") != "json_schema" or not isinstance(
            config.format.get("schema"), dict):
        raise BadRequest("output_config.format: {\"type\": \"json_schema\", \"schema\": {...}} "
                         "is the format supported", param="output_config.format")
    return {"type": "json_schema",
            "json_schema": {"name": "output", "schema": config.format["schema"]}}


# chat's field names, as an Anthropic client knows them (for chat's refusals)
RENAME = {"stop": "stop_sequences", "messages": "messages",
          "response_format": "output_config.format"}


def chat_body(request: _Body) -> dict[str, Any]:
    """The chat-completions request ``request`` is."""
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request),
                            "localspec": request.localspec.model_dump()}
    optional: dict[str, Any] = {"tools": chat_tools(request.tools),
                                "tool_choice": chat_tool_choice(request.tool_choice),
                                "response_format": response_format(request.output_config)}
    if request.tool_choice is not None and "disable_parallel_tool_use" in request.tool_choice:
        optional["parallel_tool_calls"] = not request.tool_choice["disable_parallel_tool_use"]
    if isinstance(request, MessagesRequest):
        optional.update(max_tokens=request.max_tokens, stop=request.stop_sequences,
                        temperature=request.temperature, top_p=request.top_p,
                        top_k=request.top_k, stream=request.stream)
    body.update({k: v for k, v in optional.items() if v is not None})
    return body
