"""The Messages adapter's conversions, without a model: Anthropic requests into chat requests,
and synthetic chat-completion outputs (text and tool calls, whole and streamed) into messages
and Anthropic's events, read by the official ``anthropic`` client's own stream accumulator.
"""

from __future__ import annotations

import anthropic
import pytest
from adapter_helpers import MESSAGE, chunk, sse_client, tool_chunks

from localspec.api import chat_bridge, messages_request
from localspec.api.errors import BadRequest, ServerError
from localspec.api.messages_api import (
    MessageEvents,
    content_blocks,
    error_body,
    is_messages_route,
    stop_reason,
)
from localspec.api.messages_request import CountTokensRequest, MessagesRequest

# ------------------------------------------------------------------------ Messages


def test_messages_become_chat_messages() -> None:
    request = MessagesRequest(model="m", max_tokens=5, system=[
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        stop_sequences=["END"], temperature=0.5, top_k=3,
        tools=[{"name": "get_weather", "description": "d",
                "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And?"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no such city"}]}]},
        ])
    body = messages_request.chat_body(request)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
    ]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}, "description": "d"}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert (body["max_tokens"], body["stop"], body["temperature"], body["top_k"]) == (
        5, ["END"], 0.5, 3)
    assert [messages_request.chat_tool_choice({"type": t}) for t in ("auto", "none")] == [
        "auto", "none"]
    assert messages_request.chat_tool_choice({"type": "tool", "name": "f"}) == {
        "type": "function", "function": {"name": "f"}}
    counted = messages_request.chat_body(CountTokensRequest.model_validate({
        "model": "m", "max_tokens": 5, "stream": True, "temperature": 0.5,
        "messages": [{"role": "user", "content": "hi"}]}))  # the body about to be sent
    assert "max_tokens" not in counted and "stream" not in counted
    structured = messages_request.chat_body(MessagesRequest(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
        output_config={"effort": "low", "format": {"type": "json_schema",
                                                   "schema": {"type": "object"}}}))
    assert structured["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": {"type": "object"}}}
    with pytest.raises(BadRequest, match="json_schema"):
        messages_request.response_format(messages_request.OutputConfig(format={"type": "xml"}))


@pytest.mark.parametrize(("fields", "needle", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'image' are not supported in user content", "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x"}]}]},
     "'tool_result' are not supported in assistant content", "messages.0.content.0.type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'",
     "messages.0.role"),
    ({"system": [{"type": "image"}]}, "in system content", "system.0.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "only client tools", "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "input_schema", "tools.0"),
    ({"tool_choice": {"type": "sometimes"}}, "not one of", "tool_choice"),
])
def test_messages_requests_refused_with_where(fields: dict, needle: str, param: str) -> None:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}], **fields})
    with pytest.raises(BadRequest) as caught:
        messages_request.chat_body(request)
    assert needle in caught.value.message and caught.value.param == param


@pytest.mark.parametrize(("fields", "needle"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "less than or equal to 1"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking="),
    ({"temprature": 1}, "temprature: Extra inputs are not permitted"),
    ({"messages": []}, "at least 1"),
])
def test_messages_fields_refused(fields: dict, needle: str) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValueError, match=needle):
        MessagesRequest.model_validate(body)
    MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}], "metadata": {"user_id": "u"},
        "thinking": {"type": "disabled"}})


def test_messages_blocks_stop_reasons_and_errors() -> None:
    assert content_blocks(MESSAGE) == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {"zone": "CET"}}]
    assert content_blocks({"content": ""}) == []
    with pytest.raises(ServerError, match="not JSON"):
        content_blocks({"content": None, "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{oops"}}]})
    assert stop_reason("tool_calls", None, None) == ("tool_use", None)
    assert stop_reason("length", None, ["x"]) == ("max_tokens", None)
    assert stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", "</tool_call>", ["END"]) == ("end_turn", None)  # not the user's
    assert stop_reason("stop", None, None) == ("end_turn", None)
    assert error_body(529, "busy") == {"type": "error", "error": {"type": "overloaded_error",
                                                                  "message": "busy"}}
    assert [error_body(s, "")["error"]["type"] for s in (400, 401, 404, 413, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
        "rate_limit_error", "api_error", "overloaded_error"]
    assert is_messages_route("/v1/messages") and is_messages_route("/v1/messages/count_tokens")
    assert is_messages_route("/messages") and not is_messages_route("/v1/chat/completions")


def test_messages_stream_events_read_by_the_official_client() -> None:
    events = MessageEvents({"id": "msg_1", "type": "message", "role": "assistant",
                            "model": "m"}, input_tokens=5)
    out = events.start() + [e for c in tool_chunks() for e in events.chunk(c)]
    out += events.finish(None, None, {"input_tokens": 3, "output_tokens": 7,
                                      "cache_creation_input_tokens": 0,
                                      "cache_read_input_tokens": 2})
    assert [e["type"] for e in out] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    client = sse_client(anthropic.Anthropic, chat_bridge.sse(out))
    with client.messages.stream(model="m", max_tokens=5, messages=[
            {"role": "user", "content": "x"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == "Let me check."
    assert [(b.id, b.name, b.input) for b in final.content[1:]] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_time", {"zone": "CET"})]
    assert final.stop_reason == "tool_use"
    assert (final.usage.input_tokens, final.usage.output_tokens,
            final.usage.cache_read_input_tokens) == (3, 7, 2)


def test_messages_stream_error_is_raised_by_the_official_client() -> None:
    events = MessageEvents({"id": "msg_1", "type": "message", "role": "assistant",
                            "model": "m"}, input_tokens=5)
    out = events.start() + events.chunk(chunk({"content": "ab"}))
    out += events.fail(ServerError("the model file went bad"))
    client = sse_client(anthropic.Anthropic, chat_bridge.sse(out))
    with pytest.raises(anthropic.APIStatusError, match="the model file went bad"), \
            client.messages.stream(model="m", max_tokens=5,
                                   messages=[{"role": "user", "content": "x"}]) as stream:
        stream.get_final_message()
