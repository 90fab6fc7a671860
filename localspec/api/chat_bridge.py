"""The one path the other APIs take into the service: a chat-completions request in, OpenAI's
chat-completion shapes out.

The Responses API (``responses_api``) and Anthropic's Messages API (``messages_api``) are
adapters: each turns its body into a ``ChatRequest``, runs it here exactly as
``/v1/chat/completions`` runs (``service.prepare``, ``service.start``, ``Generation.batches``),
and turns the ``chat.completion`` (or the stream of ``chat.completion.chunk`` objects) back into
its own shapes. So an answer is the same tokens whichever API asks for it, and what chat learns
(tool calls, JSON mode) reaches the others through the OpenAI shapes alone: ``message.content``
and ``message.tool_calls``, ``delta.content`` and ``delta.tool_calls``, ``finish_reason``.

What the OpenAI shapes do not carry and Anthropic's do, the engine's own finish reason (an
end-of-sequence token or a stop string) and which stop string ended the answer, comes with them
(``ChatAnswer``, ``ChatChunks``). This module knows no API but chat's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from localspec.api import responses
from localspec.api.errors import ApiError, BadRequest, ServerError
from localspec.api.schemas import ChatRequest, describe
from localspec.api.service import ApiService, Generation, Job
from localspec.engine.engine import StepEvent
from localspec.engine.spans import TokenTexts
from localspec.errors import LocalSpecError

logger = logging.getLogger(__name__)


def chat_request(body: dict[str, object], rename: dict[str, str] | None = None) -> ChatRequest:
    """``body`` (a chat-completions request an adapter built) as the chat route reads it; a
    field chat refuses is a 400 named as the adapter's client knows it (``rename``: chat's field
    name to the adapter's). Tool calls and tool results must survive the reading: a chat schema
    that would drop them is a 400, never an answer to a conversation it did not see."""
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        if _tool_turns(body.get("messages")) and exc.errors()[0]["loc"][:1] == ("messages",):
            raise _no_tools() from exc
        raise BadRequest(*_renamed(exc, rename or {})) from exc
    if _tool_turns(body.get("messages")) > _tool_turns(request.chat()):
        raise _no_tools()
    return request


def _no_tools() -> BadRequest:
    return BadRequest("tool calls and tool results in the conversation are not supported by "
                      "this server", param="messages")


def _renamed(error: ValidationError, rename: dict[str, str]) -> tuple[str, str | None]:
    """``describe``'s message and param, with the first part of the field's place named as the
    adapter's client knows it (the rest dropped: chat's indices are not the client's)."""
    message, param = describe(error)
    if param is None:  # a refusal of the whole request: "name=value is not supported"
        for chat_name, own in rename.items():
            if message.startswith(f"{chat_name}="):
                return own + message[len(chat_name):], own
        return message, param
    head = param.split(".")[0]
    if head not in rename:
        return message, param
    return f"{rename[head]}: {message.removeprefix(param + ': ')}", rename[head]


def _tool_turns(messages: object) -> int:
    """The tool calls and tool results ``messages`` hold."""
    if not isinstance(messages, list):
        return 0
    return sum(len(m.get("tool_calls") or ()) + (m.get("role") == "tool")
               for m in messages if isinstance(m, dict))


def matched_stop(job: Job, ids: Sequence[int], text: str) -> str | None:
    """The stop string that ended an answer whose visible text is ``text`` and whose tokens
    are ``ids`` (the stop string's own tokens among them): the one that starts where the text
    ends, the earliest when several do."""
    stops = job.request.stop_strings
    if not stops:
        return None
    full = job.pipeline.tokenizer.decode(list(ids), skip_special_tokens=True)
    found = [(at, -len(s), s) for s in stops if (at := full.find(s, len(text))) >= 0]
    return min(found)[2] if found else None


@dataclass
class ChatAnswer:
    """A whole chat answer: the ``chat.completion`` object and what only the engine knows."""

    job: Job
    completion: dict[str, object]
    engine_reason: str | None  # "eos" | "stop" | "length" | "cancelled" | None
    stop_sequence: str | None  # the stop string that ended it, if one did

    @property
    def message(self) -> dict[str, object]:
        return self.completion["choices"][0]["message"]  # type: ignore[index]

    @property
    def finish_reason(self) -> str:
        return self.completion["choices"][0]["finish_reason"]  # type: ignore[index]


async def prepare(service: ApiService, body: ChatRequest) -> Job:
    """The job for ``body``, every check done (tokenizing a long prompt off the loop)."""
    return await run_in_threadpool(service.prepare, body, "chat")


async def answer(service: ApiService, request: Request, body: ChatRequest,
                 job: Job | None = None) -> ChatAnswer:
    """``body`` answered whole (``stream: false``), as ``/v1/chat/completions`` answers it; a
    generation that fails is a ServerError (500)."""
    job = job or await prepare(service, body)
    generation = service.start(job)
    try:
        events = [event async for batch in generation.batches(request.is_disconnected)
                  for event in batch]
    except ApiError:
        raise
    except LocalSpecError as exc:  # the generation failed (a model file gone bad, ...)
        logger.warning("API generation stopped: %s", exc)
        raise ServerError(str(exc)) from exc
    completion = responses.completion(job, "chat", events)
    reason = events[-1].finish_reason if events else None
    text = completion["choices"][0]["message"]["content"] or ""  # type: ignore[index]
    stop = (matched_stop(job, [t for e in events for t in e.tokens], text)
            if reason == "stop" else None)
    return ChatAnswer(job, completion, reason, stop)


@dataclass
class ChatChunks:
    """A running generation as OpenAI's ``chat.completion.chunk`` objects, a list per batch of
    events (what a stream writes at once), ending with the chunk that has the finish reason.
    A failure is raised from the iteration (LocalSpecError: the generation failed; anything
    else: a bug). After the end, ``engine_reason`` and ``stop_sequence`` say how it ended."""

    generation: Generation
    engine_reason: str | None = None
    stop_sequence: str | None = None
    failed: bool = False  # ``relay`` ended the stream with the adapter's failure event
    _ids: list[int] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _chat: responses.ChatStream | None = None

    @property
    def job(self) -> Job:
        return self.generation.job

    async def batches(self) -> AsyncIterator[list[dict[str, object]]]:
        job = self.job
        texts = responses.token_texts(job) if job.want_tokens else None
        self._chat = responses.ChatStream(job)  # text, and tool calls read as they stream
        reason = None
        async for batch in self.generation.batches():
            chunks = []
            for event in batch:
                chunks.extend(self._chunks(event, texts))
                reason = responses.finish_reason(event) or reason
            if chunks:
                yield chunks
        if reason is None:  # ended without a final step (stopped while waiting)
            yield self._chat.end()
        if self.engine_reason == "stop":
            self.stop_sequence = matched_stop(job, self._ids, "".join(self._text))

    def _chunks(self, event: StepEvent,
                texts: TokenTexts | None) -> list[dict[str, object]]:
        self._ids.extend(event.tokens)
        self._text.append(event.text_delta)
        self.engine_reason = event.finish_reason or self.engine_reason
        tokens = responses.step_tokens(event, texts) if texts is not None else None
        return self._chat.step(event, tokens)


def start_stream(service: ApiService, job: Job) -> ChatChunks:
    """``job`` admitted and started; its chunks to read."""
    return ChatChunks(service.start(job))


class StreamEvents(Protocol):
    """An adapter's stream: its events for each chat chunk, and for a failure mid-answer."""

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...
    def fail(self, error: ApiError) -> list[dict[str, Any]]: ...


def sse(events: list[dict[str, Any]]) -> bytes:
    """Events as server-sent events, each named by its type (as OpenAI sends them; Anthropic's
    clients read the name)."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"
                    .encode() for e in events)


async def relay(chunks: ChatChunks, events: StreamEvents) -> AsyncIterator[bytes]:
    """``chunks`` as ``events``' server-sent events, batch by batch. A failure is logged and
    ends the stream with ``events.fail`` (what was streamed stays streamed), setting
    ``chunks.failed``: the adapter then sends no closing events."""
    try:
        async for batch in chunks.batches():
            out = [event for chunk in batch for event in events.chunk(chunk)]
            if out:
                yield sse(out)
    except LocalSpecError as exc:
        logger.warning("API generation stopped: %s", exc)
        chunks.failed = True
        yield sse(events.fail(ServerError(str(exc))))
    except Exception:  # a bug below the API: logged; the client is told in the stream
        logger.exception("API generation failed mid-answer")
        chunks.failed = True
        yield sse(events.fail(ServerError("internal error (the details are in the server "
                                          "log)")))
