"""Synthetic chat-completion outputs for the adapters' tests, in OpenAI's documented shapes (a
message with text and two tool calls, whole and streamed), and an official client that reads a
given stream over a mock transport.
"""

from __future__ import annotations

from typing import Any

import httpx2
import openai

CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
MESSAGE = {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS}
USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 2}}
SPECULATION = {"method": "ngram", "k": 4}


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if finish is not None:
        body["speculation"] = SPECULATION
    return body


def tool_chunks() -> list[dict[str, Any]]:
    """``MESSAGE`` streamed as OpenAI streams it: the role, text pieces, each call's head then
    its arguments in pieces, the finish reason."""
    return [chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Let me "}), chunk({"content": "check."}),
            chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
            chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                   "function": {"name": "get_time",
                                                "arguments": '{"zone": "CET"}'}}]}),
            chunk({}, "tool_calls")]


def sse_client(cls: type, body: bytes) -> Any:
    """An official client whose every request is answered with ``body`` as a stream."""
    def answer(_: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return cls(api_key="k", base_url="http://test/v1" if cls is openai.OpenAI else "http://test",
               http_client=httpx2.Client(transport=httpx2.MockTransport(answer)), max_retries=0)
