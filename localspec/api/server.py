"""The HTTP routes: OpenAI's ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and
``/v1/responses``, and Anthropic's ``/v1/messages`` (the last two adapters over chat's path:
``responses_api``, ``messages_api``).

``create_api`` builds an ASGI app over a ``ModelHost``; ``localspec serve`` runs it alone under
uvicorn and the chat app mounts it at ``/v1`` of its own server, so the page and API clients
share the loaded models and the one queue. Every failure is OpenAI's error JSON with its
status (Anthropic's on ``/v1/messages``): a body that is not JSON, not UTF-8, too large or of
the wrong shape is a 400 or 413 that says what is wrong, never a traceback; a bug is logged and
answered 500 in the same shape. With an API key, every route needs ``Authorization: Bearer
KEY`` or ``x-api-key: KEY`` (Anthropic's header), compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Mount, Route

from localspec.api import messages_api, responses, responses_api
from localspec.api.errors import (
    ApiError,
    BadRequest,
    NotFound,
    ServerError,
    TooLarge,
    Unauthorized,
)
from localspec.api.messages_request import CountTokensRequest, MessagesRequest
from localspec.api.responses_request import ResponsesRequest
from localspec.api.schemas import ChatRequest, CompletionRequest, describe
from localspec.api.service import ApiService, Generation, Job
from localspec.chats.store import ChatStore
from localspec.config import API_KEY_ENV, API_MAX_QUEUED
from localspec.errors import LocalSpecError
from localspec.files import decode_text, parse_json
from localspec.host import ModelHost

logger = logging.getLogger(__name__)

API_MAX_BODY_BYTES = 8 * 2**20  # a request body past this is answered 413
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


Body = TypeVar("Body", bound=BaseModel)


def _error(exc: ApiError, request: Request | None = None) -> JSONResponse:
    """``exc`` as the route's API says errors: Anthropic's shape on its routes, else OpenAI's."""
    body = (messages_api.error_body(exc.status, exc.message)
            if request is not None and messages_api.is_messages_route(request.url.path)
            else exc.body())
    return JSONResponse(body, status_code=exc.status, headers=exc.headers())


def _sse(data: object) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``: 413 past the size limit, 400 for anything that
    is not UTF-8 JSON of the right shape (with where it went wrong)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > API_MAX_BODY_BYTES:
        raise TooLarge(f"the request body is {int(declared):,} bytes, over the limit of "
                       f"{API_MAX_BODY_BYTES:,}", code="request_too_large")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > API_MAX_BODY_BYTES:
            raise TooLarge(f"the request body is over the limit of {API_MAX_BODY_BYTES:,} bytes",
                           code="request_too_large")
    if not data:
        raise BadRequest("the request has no body: send a JSON object")
    value = parse_json(decode_text(bytes(data), "the request body", BadRequest),
                       "the request body", BadRequest)
    if not isinstance(value, dict):
        raise BadRequest(f"the request body is JSON but not an object ({type(value).__name__})")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        message, param = describe(exc)
        raise BadRequest(message, param=param) from exc


def create_api(host: ModelHost, api_key: str | None = None,
               max_queued: int = API_MAX_QUEUED, store: ChatStore | None = None) -> FastAPI:
    """The API over ``host`` (routes without the ``/v1`` prefix: mount it there), saving each
    chat request in ``store`` when one is given."""
    service = ApiService(host, max_queued, store)
    kept = responses_api.ResponseStore()  # the Responses API's, for previous_response_id

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [token.strip()] if scheme.lower() == "bearer" else []
        given += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
        if not any(hmac.compare_digest(key.encode(), api_key.encode()) for key in given):
            raise Unauthorized("a valid API key is needed: send the header "
                               "'Authorization: Bearer KEY' (or 'x-api-key: KEY')")

    api = FastAPI(title="LocalSpec", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authorize)])

    @api.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc, request)

    @api.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(NotFound(f"no route {request.method} {request.url.path}",
                                   code="not_found"), request)
        error = ApiError(str(exc.detail))
        error.status = exc.status_code
        return _error(error, request)

    @api.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        """A bug: 500 in the route's error shape (Starlette logs the traceback)."""
        return _error(ServerError("internal error (the details are in the server log)"),
                      request)

    @api.get("/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": service.models()}

    @api.get("/models/{name:path}")
    async def model(name: str) -> dict[str, object]:
        return service.model(name)

    @api.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await _answer(service, request, await read_body(request, ChatRequest), "chat")

    @api.post("/completions")
    async def completions(request: Request) -> Response:
        return await _answer(service, request, await read_body(request, CompletionRequest),
                             "text")

    @api.post("/responses")
    async def create_response(request: Request) -> Response:
        return await responses_api.create(service, kept, request,
                                          await read_body(request, ResponsesRequest))

    @api.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, object]:
        return responses_api.get(kept, response_id)

    @api.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, object]:
        return responses_api.delete(kept, response_id)

    @api.post("/messages")
    async def messages(request: Request) -> Response:
        return await messages_api.create(service, request,
                                         await read_body(request, MessagesRequest))

    @api.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, int]:
        return await messages_api.count_tokens(service,
                                               await read_body(request, CountTokensRequest))

    return api


async def _answer(service: ApiService, request: Request, body: ChatRequest | CompletionRequest,
                  kind: str) -> Response:
    job = await run_in_threadpool(service.prepare, body, kind)  # tokenizing a long prompt
    generation = service.start(job)
    if body.stream:
        return StreamingResponse(_stream(generation, kind, body.include_usage()),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        events = [event async for batch in generation.batches(request.is_disconnected)
                  for event in batch]
    except ApiError:
        raise
    except LocalSpecError as exc:  # the generation failed (a model file gone bad, ...)
        logger.warning("API generation stopped: %s", exc)
        raise ServerError(str(exc)) from exc
    return JSONResponse(responses.completion(job, kind, events))


async def _stream(generation: Generation, kind: str, include_usage: bool,
                  ) -> AsyncIterator[bytes]:
    """Server-sent events: the assistant's role, a piece of text per step that adds any (each
    step's tokens too when asked), the finish reason with the speculation, usage when asked,
    then ``[DONE]``. A failure mid-answer is an error event, what was said stays said."""
    job: Job = generation.job
    texts = responses.token_texts(job) if job.want_tokens else None
    if kind == "chat":
        yield _sse(responses.chunk(job, kind, "", role=True))
    reason = None
    chat = responses.ChatStream(job) if kind == "chat" else None
    try:
        async for batch in generation.batches():
            pieces = []
            for event in batch:
                tokens = responses.step_tokens(event, texts) if texts is not None else None
                reason = responses.finish_reason(event)
                if chat is not None:
                    pieces += [_sse(c) for c in chat.step(event, tokens)]
                elif event.text_delta or tokens or reason is not None:
                    pieces.append(_sse(responses.chunk(job, kind, event.text_delta or None,
                                                       reason, tokens=tokens)))
            if pieces:
                yield b"".join(pieces)
    except LocalSpecError as exc:
        logger.warning("API generation stopped: %s", exc)
        yield _sse(ServerError(str(exc)).body())
        return
    except Exception:  # a bug below the API: logged; the client is told in the stream
        logger.exception("API generation failed mid-answer")
        yield _sse(ServerError("internal error (the details are in the server log)").body())
        return
    if reason is None:  # ended without a final step (stopped while waiting)
        yield b"".join(_sse(c) for c in chat.end()) if chat is not None \
            else _sse(responses.chunk(job, kind, None, "stop"))
    if include_usage:
        yield _sse(responses.usage_chunk(job, kind))
    yield b"data: [DONE]\n\n"


def api_key(given: str | None) -> str | None:
    """The key clients must send: ``given`` (a flag), else the environment's, else none."""
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    return key or None


def root_app(api: FastAPI) -> Starlette:
    """``localspec serve``'s whole server: the API at ``/v1``, and ``/`` saying where it is."""

    async def index(_: Request) -> JSONResponse:
        return JSONResponse({"name": "LocalSpec", "api": "/v1",
                             "routes": ["/v1/chat/completions", "/v1/completions",
                                        "/v1/models", "/v1/responses", "/v1/messages",
                                        "/v1/messages/count_tokens"]})

    return Starlette(routes=[Route("/", index), Mount("/v1", app=api)])
