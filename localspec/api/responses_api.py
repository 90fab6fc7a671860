"""OpenAI's Responses API (``/v1/responses``) as an adapter over the chat-completions path.

A request becomes a chat request (``responses_request``), runs as chat runs (``chat_bridge``),
and its ``chat.completion`` becomes a ``response`` object: the assistant's text as a ``message``
item with one ``output_text`` part, each tool call as a ``function_call`` item, ``usage`` in
input and output tokens, our ``speculation`` beside them (and ``localspec.tokens`` when asked).
A stream's chat chunks become the Responses events, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, per item ``response.output_item.added``, for
text ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, for a tool call
``response.function_call_arguments.delta``..., ``.done``, then ``response.output_item.done``;
last ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it short,
``response.failed`` after an ``error`` event when the generation failed).

Responses are kept, unless ``store: false``, in this server's memory (``ResponseStore``,
bounded: the oldest go first) for ``GET``/``DELETE /v1/responses/{id}`` and for a follow-up's
``previous_response_id``, which continues that conversation.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localspec.api import chat_bridge, responses
from localspec.api.errors import ApiError, NotFound
from localspec.api.responses_request import (
    RENAME,
    ChatMessage,
    ResponsesRequest,
    chat_body,
    input_messages,
)
from localspec.api.responses_store import ResponseStore
from localspec.api.service import ApiService, Job

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ---------------------------------------------------------------------------------- shapes


def output_text(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> Item:
    """An assistant message item; ``text`` None: just opened, no part yet."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [output_text(text)]}


def function_item(item_id: str, call: dict[str, Any], status: str) -> Item:
    """A ``function_call`` item from a chat tool call (``{"id", "function": {"name",
    "arguments"}}``)."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def output_items(message: dict[str, Any], status: str) -> list[Item]:
    """A chat answer's ``message`` (``content``, ``tool_calls``) as Responses output items:
    the text (when there is some, or nothing else), then each tool call."""
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    items = [message_item(new_id("msg"), text, status)] if text or not calls else []
    return items + [function_item(new_id("fc"), call, status) for call in calls]


def assistant_message(items: list[Item]) -> ChatMessage:
    """Output items as the chat assistant message a follow-up's conversation holds."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: ChatMessage = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses' names."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def status_of(finish_reason: str | None) -> str:
    """A response's (and its items') status: ``incomplete`` when the token limit cut it."""
    return "incomplete" if finish_reason == "length" else "completed"


@dataclass
class Head:
    """What every state of one response object says: its id, the request and the job."""

    id: str
    request: ResponsesRequest
    job: Job

    def body(self, status: str, output: list[Item], extra: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
        """The response object with ``status`` and ``output`` (``extra``: usage, speculation,
        tokens, error, once known)."""
        r, sampling = self.request, self.job.request.sampling
        text_format = (r.text.format if r.text is not None and r.text.format is not None
                       else {"type": "text"})
        body = {"id": self.id, "object": "response", "created_at": self.job.created,
                "status": status, "error": None,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "model": self.job.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "store": r.store,
                "temperature": sampling.temperature, "text": {"format": text_format},
                "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
                "top_p": sampling.top_p, "truncation": "disabled", "usage": None,
                "user": None, "metadata": {}}
        body.update(extra or {})
        return body


def response_body(head: Head, answer: chat_bridge.ChatAnswer) -> dict[str, Any]:
    """The whole response to a chat answer (``stream: false``)."""
    status = status_of(answer.finish_reason)
    completion = answer.completion
    extra = {"usage": usage(completion["usage"]), "speculation": completion["speculation"]}
    if "localspec" in completion:
        extra["localspec"] = completion["localspec"]
    return head.body(status, output_items(answer.message, status), extra)


# ---------------------------------------------------------------------------------- streaming


@dataclass
class ResponseEvents:
    """The Responses stream events of a chat stream: ``start``, then ``chunk`` for each chat
    chunk (``delta.content``, ``delta.tool_calls``), then ``finish`` (or ``fail``). Pure: chunks
    in, event objects out, each numbered."""

    head: Callable[..., dict[str, Any]]  # Head.body
    output: list[Item] = field(default_factory=list)  # items done
    finish_reason: str | None = None
    _seq: int = 0
    _open: Item | None = None  # the item being streamed
    _open_call: int | None = None  # its chat tool-call index, when it is a call
    _tokens: list[dict[str, Any]] = field(default_factory=list)
    _speculation: dict[str, Any] | None = None
    _asked_tokens: bool = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = self.head("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if "localspec" in chunk:
            self._asked_tokens = True
            self._tokens.extend(chunk["localspec"]["tokens"])
        self._speculation = chunk.get("speculation", self._speculation)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        events = self._close("completed")
        self._open = message_item(new_id("msg"), None, "in_progress")
        events.append(self._event("response.output_item.added", **self._at(item=False),
                                  item=dict(self._open, content=[])))
        events.append(self._event("response.content_part.added", **self._at(True),
                                  part=output_text("")))
        self._open["content"] = [output_text("")]
        return events

    def _text(self, piece: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._open_message()
        self._open["content"][0]["text"] += piece
        events.append(self._event("response.output_text.delta", **self._at(True), delta=piece,
                                  logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = call.get("function") or {}
        if self._open is None or self._open_call != call.get("index", 0):
            events += self._close("completed")
            self._open_call = call.get("index", 0)
            self._open = function_item(new_id("fc"), {
                "id": call.get("id") or new_id("call"),
                "function": {"name": function.get("name", ""), "arguments": ""}},
                "in_progress")
            events.append(self._event("response.output_item.added", **self._at(item=False),
                                      item=dict(self._open)))
        piece = function.get("arguments") or ""
        if piece:
            self._open["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._at(), delta=piece))
        return events

    def _at(self, part: bool = False, item: bool = True) -> dict[str, Any]:
        """Where an event is: the open item's index, id (``item``) and part (``part``)."""
        where: dict[str, Any] = {"output_index": len(self.output)}
        if item and self._open is not None:
            where["item_id"] = self._open["id"]
        if part:
            where["content_index"] = 0
        return where

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events, with its final ``status``."""
        item = self._open
        if item is None:
            return []
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", **self._at(True),
                                      text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", **self._at(True),
                                      part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", **self._at(),
                                      name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        events.append(self._event("response.output_item.done", **self._at(item=False),
                                  item=item))
        self.output.append(item)
        self._open, self._open_call = None, None
        return events

    def finish(self, chat_usage: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events, and the response object they end with."""
        status = status_of(self.finish_reason)
        events = []
        if self._open is None and not self.output:  # nothing said: an empty message
            events += self._open_message()
        events += self._close(status)
        extra: dict[str, Any] = {"usage": usage(chat_usage)}
        if self._speculation is not None:
            extra["speculation"] = self._speculation
        if self._asked_tokens:
            extra["localspec"] = {"tokens": self._tokens}
        response = self.head(status, self.output, extra)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=response)], response

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """An ``error`` event, then ``response.failed``; what was streamed stays streamed."""
        events = self._close("incomplete")
        code = error.code or error.type
        events.append(self._event("error", code=code, message=error.message, param=None))
        response = self.head("failed", self.output,
                             {"error": {"code": code, "message": error.message}})
        events.append(self._event("response.failed", response=response))
        return events


# ---------------------------------------------------------------------------------- routes


async def create(service: ApiService, store: ResponseStore, request: Request,
                 body: ResponsesRequest) -> Response:
    """``POST /v1/responses``."""
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        kept = store.get(body.previous_response_id)
        if kept is None:
            raise NotFound(f"previous response with id '{body.previous_response_id}' not "
                           f"found: this server keeps the last {store.max_responses} responses "
                           "in memory until it stops, and none made with store: false",
                           param="previous_response_id", code="previous_response_not_found")
        history = kept.conversation
    conversation = history + input_messages(body.input)
    chat = chat_bridge.chat_request(chat_body(body, conversation), RENAME)
    job = await chat_bridge.prepare(service, chat)
    head = Head("resp_" + job.id.removeprefix("chatcmpl-"), body, job)
    if body.stream:
        chunks = chat_bridge.start_stream(service, job)
        return StreamingResponse(_stream(chunks, head, store, conversation),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    answer = await chat_bridge.answer(service, request, chat, job)
    response = response_body(head, answer)
    if body.store:
        store.put(response, [*conversation, assistant_message(response["output"])])
    return JSONResponse(response)


async def _stream(chunks: chat_bridge.ChatChunks, head: Head, store: ResponseStore,
                  conversation: list[ChatMessage]) -> AsyncIterator[bytes]:
    events = ResponseEvents(head.body)
    yield chat_bridge.sse(events.start())
    async for data in chat_bridge.relay(chunks, events):
        yield data
    if chunks.failed:
        return
    closing, response = events.finish(responses.usage(chunks.job))  # the job's, complete now
    if head.request.store:
        store.put(response, [*conversation, assistant_message(response["output"])])
    yield chat_bridge.sse(closing)


def get(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """``GET /v1/responses/{id}``."""
    kept = store.get(response_id)
    if kept is None:
        raise _unknown(response_id)
    return kept.response


def delete(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """``DELETE /v1/responses/{id}``."""
    if not store.delete(response_id):
        raise _unknown(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _unknown(response_id: str) -> NotFound:
    return NotFound(f"no response with id '{response_id}': this server keeps responses in "
                    "memory (the most recent, until it stops), and none made with store: false",
                    param="response_id", code="not_found")
