"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) as an adapter over
the chat-completions path.

A request becomes a chat request (``messages_request``), runs as chat runs (``chat_bridge``), and
its ``chat.completion`` becomes a ``message``: the text as a ``text`` block, each tool call as a
``tool_use`` block (its JSON arguments as ``input``), ``stop_reason`` ``end_turn``,
``max_tokens``, ``stop_sequence`` (with the ``stop_sequence`` that ended it) or ``tool_use``,
``usage`` in Anthropic's terms (``input_tokens`` the prompt tokens read anew,
``cache_read_input_tokens`` those a conversation's cache already held), our ``speculation``
beside it. A stream is Anthropic's events: ``message_start``, ``ping``, per block
``content_block_start``, ``content_block_delta`` (``text_delta`` or ``input_json_delta``)...,
``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``; a
failure mid-stream is an ``error`` event.

Errors on these routes are Anthropic's JSON, ``{"type": "error", "error": {"type", "message"}}``,
with its types for each status (``error_body``); the server shapes them by route.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localspec.api import chat_bridge
from localspec.api.errors import ApiError, ServerError
from localspec.api.messages_request import (
    RENAME,
    CountTokensRequest,
    MessagesRequest,
    chat_body,
)
from localspec.api.service import ApiService, Job

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Anthropic's error type for each status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
ROUTES = ("messages",)  # the first part of these routes' paths under /v1

Block = dict[str, Any]


def is_messages_route(path: str) -> bool:
    """Whether ``path`` (``/v1/messages...``, or without the mount) is one of these routes,
    whose errors are Anthropic's."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["v1"]:
        parts = parts[1:]
    return parts[:1] == list(ROUTES)


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error JSON for ``status``."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(finish_reason: str | None, stop_sequence: str | None,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """Chat's finish reason (and the stop string the engine met) as Anthropic's
    ``stop_reason`` and ``stop_sequence``."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_sequence is not None and stop_sequence in (stop_sequences or ()):
        return "stop_sequence", stop_sequence
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as a ``tool_use`` block's ``input``."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ServerError(f"the model's tool call arguments are not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ServerError("the model's tool call arguments are not a JSON object")
    return value


def content_blocks(message: dict[str, Any]) -> list[Block]:
    """A chat answer's ``message`` as content blocks: its text (when not empty), then a
    ``tool_use`` block per tool call."""
    blocks: list[Block] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks


def usage(job: Job) -> dict[str, int]:
    """Anthropic's usage: prompt tokens read anew, and those the cache held, apart."""
    cached = job.stats.cached_tokens
    return {"input_tokens": job.prompt_tokens - cached, "output_tokens": job.stats.new_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _head(message_id: str, job: Job) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": job.model}


def message_body(message_id: str, answer: chat_bridge.ChatAnswer,
                 stop_sequences: list[str] | None) -> dict[str, Any]:
    """The whole message for a chat answer (``stream: false``)."""
    reason, sequence = stop_reason(answer.finish_reason, answer.stop_sequence, stop_sequences)
    body = {**_head(message_id, answer.job), "content": content_blocks(answer.message),
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(answer.job),
            "speculation": answer.completion["speculation"]}
    if "localspec" in answer.completion:
        body["localspec"] = answer.completion["localspec"]
    return body


@dataclass
class MessageEvents:
    """Anthropic's stream events of a chat stream: ``start``, ``chunk`` for each chat chunk
    (``delta.content``, ``delta.tool_calls``), then ``finish`` (or ``fail``). Pure: chunks in,
    event objects out."""

    head: dict[str, Any]  # id, type, role, model
    input_tokens: int
    blocks: int = 0  # blocks started
    finish_reason: str | None = None
    _open: str | None = None  # the open block's kind: "text", or "tool_use"
    _open_call: int | None = None  # its chat tool-call index
    _tokens: list[dict[str, Any]] = field(default_factory=list)
    _asked_tokens: bool = False
    _speculation: dict[str, Any] | None = None

    def start(self) -> list[dict[str, Any]]:
        message = {**self.head, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if "localspec" in chunk:
            self._asked_tokens = True
            self._tokens.extend(chunk["localspec"]["tokens"])
        self._speculation = chunk.get("speculation", self._speculation)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open != "text":
                    events += self._begin({"type": "text", "text": ""}, "text")
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if self._open != "tool_use" or self._open_call != call.get("index", 0):
                    events += self._begin({"type": "tool_use", "id": call.get("id"),
                                           "name": function.get("name", ""), "input": {}},
                                          "tool_use")
                    self._open_call = call.get("index", 0)
                if function.get("arguments"):
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": function["arguments"]}))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _begin(self, block: Block, kind: str) -> list[dict[str, Any]]:
        events = self._close()
        events.append({"type": "content_block_start", "index": self.blocks,
                       "content_block": block})
        self.blocks += 1
        self._open = kind
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open, self._open_call = None, None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def finish(self, stop_sequence: str | None, stop_sequences: list[str] | None,
               final_usage: dict[str, int]) -> list[dict[str, Any]]:
        reason, sequence = stop_reason(self.finish_reason, stop_sequence, stop_sequences)
        delta: dict[str, Any] = {"type": "message_delta",
                                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": final_usage}
        if self._speculation is not None:
            delta["speculation"] = self._speculation
        if self._asked_tokens:
            delta["localspec"] = {"tokens": self._tokens}
        return [*self._close(), delta, {"type": "message_stop"}]

    @staticmethod
    def fail(error: ApiError) -> list[dict[str, Any]]:
        """An ``error`` event; what was streamed stays streamed."""
        return [error_body(error.status, error.message)]


async def create(service: ApiService, request: Request, body: MessagesRequest) -> Response:
    """``POST /v1/messages``."""
    chat = chat_bridge.chat_request(chat_body(body), RENAME)
    job = await chat_bridge.prepare(service, chat)
    message_id = "msg_" + job.id.removeprefix("chatcmpl-")
    if body.stream:
        chunks = chat_bridge.start_stream(service, job)
        return StreamingResponse(_stream(chunks, message_id, body.stop_sequences),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    answer = await chat_bridge.answer(service, request, chat, job)
    return JSONResponse(message_body(message_id, answer, body.stop_sequences))


async def _stream(chunks: chat_bridge.ChatChunks, message_id: str,
                  stop_sequences: list[str] | None) -> AsyncIterator[bytes]:
    job = chunks.job
    events = MessageEvents(_head(message_id, job), job.prompt_tokens)
    yield chat_bridge.sse(events.start())
    async for data in chat_bridge.relay(chunks, events):
        yield data
    if chunks.failed:
        return
    yield chat_bridge.sse(events.finish(chunks.stop_sequence, stop_sequences, usage(job)))


async def count_tokens(service: ApiService, body: CountTokensRequest) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, through the chat template."""
    job = await chat_bridge.prepare(service, chat_bridge.chat_request(chat_body(body), RENAME))
    return {"input_tokens": job.prompt_tokens}
