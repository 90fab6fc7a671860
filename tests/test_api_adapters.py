"""The Responses and Messages adapters' conversions, without a model: requests into chat
requests, and synthetic chat-completion outputs (text and tool calls, whole and streamed, in
OpenAI's documented shapes) into each API's objects and events. The streams are read by the
official ``openai`` and ``anthropic`` clients' own stream accumulators (over a mock transport),
so an event they would reject, or a tool call they would assemble wrongly, fails here.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from localspec.api import (
    chat_bridge,
    messages_api,
    messages_request,
    responses_api,
    responses_request,
)
from localspec.api.errors import BadRequest, ServerError
from localspec.api.messages_api import (
    MessageEvents,
    content_blocks,
    error_body,
    is_messages_route,
    stop_reason,
)
from localspec.api.messages_request import CountTokensRequest, MessagesRequest
from localspec.api.responses_api import ResponseEvents, ResponseStore
from localspec.api.responses_request import ResponsesRequest

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


# ------------------------------------------------------------------------ Responses: requests


def test_responses_input_items_become_chat_messages() -> None:
    request = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
    ])
    history = [{"role": "user", "content": "earlier"}]
    body = responses_request.chat_body(request, history + responses_request.input_messages(
        request.input))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "earlier"},
        {"role": "user", "content": "Weather?"},
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text",
                                                                 "text": "noon"}]},
    ]
    assert responses_request.input_messages("hi") == [{"role": "user", "content": "hi"}]
    # a call with no assistant text before it is an assistant message of its own
    alone = responses_request.input_messages([{"type": "function_call", "call_id": "c",
                                               "name": "f", "arguments": "{}"}])
    assert alone == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_responses_tools_choice_and_format_become_chats() -> None:
    request = ResponsesRequest(
        input="x", max_output_tokens=9, temperature=0, top_p=0.5,
        tools=[{"type": "function", "name": "f", "description": "d", "strict": True,
                "parameters": {"type": "object", "properties": {}}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "out", "strict": True,
                         "schema": {"type": "object"}}})
    body = responses_request.chat_body(request, [])
    assert body["tools"] == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}},
        "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "strict": True, "schema": {"type": "object"}}}
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (9, 0, 0.5)
    for choice in ("auto", "none", "required"):
        assert responses_request.chat_tool_choice(choice) == choice
    assert responses_request.response_format(
        responses_request.TextOptions(format={"type": "json_object"})) == {"type": "json_object"}


@pytest.mark.parametrize(("convert", "needle", "param"), [
    (lambda: responses_request.input_messages([{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]), "only text parts", "input.0.content.0"),
    (lambda: responses_request.input_messages([{"type": "reasoning", "summary": []}]),
     "'reasoning' are not supported", "input.0.type"),
    (lambda: responses_request.input_messages([{"role": "tool", "content": "x"}]),
     "one of 'user'", "input.0.role"),
    (lambda: responses_request.input_messages([{"type": "function_call_output",
                                                "output": "x"}]),
     "call_id: a string", "input.0.call_id"),
    (lambda: responses_request.chat_tools([{"type": "web_search"}]), "only function tools",
     "tools.0.type"),
    (lambda: responses_request.chat_tool_choice({"type": "web_search"}), "not supported",
     "tool_choice"),
    (lambda: responses_request.response_format(responses_request.TextOptions(
        format={"type": "json_schema", "name": "x"})), "schema object", "text.format.schema"),
])
def test_responses_requests_refused_with_where(convert: Any, needle: str, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        convert()
    assert needle in caught.value.message and caught.value.param == param


@pytest.mark.parametrize(("fields", "needle"), [
    ({"temprature": 1}, "unrecognized request argument supplied: temprature"),
    ({"background": True}, "background=True is not supported"),
    ({"input": []}, "input: empty"),
    ({"max_output_tokens": 0}, "greater than or equal to 1"),
    ({"text": {"verbosity": "high"}}, "Input should be 'medium'"),
])
def test_responses_fields_refused(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ResponsesRequest.model_validate({"input": "x", **fields})
    # what clients send by default is accepted
    ResponsesRequest.model_validate({"input": "x", "include": [], "truncation": "disabled",
                                     "parallel_tool_calls": True, "store": False,
                                     "metadata": {}, "reasoning": None, "top_logprobs": 0})


def test_chat_request_names_chats_refusals_as_the_adapter_knows_them() -> None:
    with pytest.raises(BadRequest) as caught:
        chat_bridge.chat_request({"messages": [{"role": "user", "content": [
            {"type": "image_url"}]}]}, responses_request.RENAME)
    assert caught.value.param == "input" and caught.value.message.startswith("input: ")


def test_tool_turns_are_read_by_chat_or_refused() -> None:
    """A conversation with tool calls reaches the service whole, or is a 400: never an
    answer to a conversation with its tool calls dropped."""
    body = responses_request.chat_body(ResponsesRequest(input="x"), [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    try:
        request = chat_bridge.chat_request(body)
    except BadRequest as exc:
        assert "tool calls and tool results" in exc.message
    else:  # a chat schema with tool calling
        assert chat_bridge._tool_turns(request.chat()) == 3
    assert chat_bridge._tool_turns(body["messages"]) == 3


# ------------------------------------------------------------------------ Responses: outputs


def test_responses_output_items_and_the_conversation_they_continue() -> None:
    items = responses_api.output_items(MESSAGE, "completed")
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0] == {"type": "output_text", "text": "Let me check.",
                                      "annotations": [], "logprobs": []}
    assert [(i["call_id"], i["name"], i["arguments"]) for i in items[1:]] == [
        ("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "get_time",
                                                         '{"zone": "CET"}')]
    assert all(i["id"].startswith(("msg_", "fc_")) for i in items)
    assert responses_api.assistant_message(items) == MESSAGE
    only_calls = responses_api.output_items({"content": None, "tool_calls": CALLS}, "completed")
    assert [i["type"] for i in only_calls] == ["function_call"] * 2
    assert responses_api.assistant_message(only_calls)["content"] is None
    empty = responses_api.output_items({"content": ""}, "incomplete")
    assert empty[0]["content"][0]["text"] == "" and empty[0]["status"] == "incomplete"
    assert responses_api.usage(USAGE) == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}


def head(status: str, output: list, extra: dict | None = None) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 0, "status": status,
            "model": "m", "output": copy.deepcopy(output), "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], **(extra or {})}


def response_stream(chunks: list[dict[str, Any]]) -> tuple[list[dict], dict]:
    events = ResponseEvents(head)
    out = events.start() + [e for c in chunks for e in events.chunk(c)]
    closing, response = events.finish(USAGE)
    return out + closing, response


def test_responses_stream_events_read_by_the_official_client() -> None:
    events, response = response_stream(tool_chunks())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["output_index"] for e in events if e["type"].endswith("item.added")] == [0, 1, 2]
    assert response["speculation"] == SPECULATION and response["status"] == "completed"
    client = sse_client(openai.OpenAI, responses_api.sse(events))
    with client.responses.stream(model="m", input="x") as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen == [e["type"] for e in events]
    assert final.output_text == "Let me check."
    calls = [(o.call_id, o.name, json.loads(o.arguments)) for o in final.output
             if o.type == "function_call"]
    assert calls == [("call_1", "get_weather", {"city": "Paris"}),
                     ("call_2", "get_time", {"zone": "CET"})]
    assert final.usage.output_tokens == 7 and final.speculation == SPECULATION


def test_responses_stream_cut_short_empty_and_failed() -> None:
    events, response = response_stream([chunk({"content": "ab"}), chunk({}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert response["status"] == "incomplete" and response["output"][0]["status"] == "incomplete"
    events, response = response_stream([chunk({}, "stop")])  # nothing said
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert response["output"][0]["content"][0]["text"] == ""
    stream = ResponseEvents(head)
    out = stream.start() + stream.chunk(chunk({"content": "ab"}))
    out += stream.fail(ServerError("the model file went bad"))
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    assert out[-1]["response"]["error"]["message"] == "the model file went bad"
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "ab"


def test_the_response_store_is_bounded_and_forgets_the_oldest() -> None:
    store = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(4):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and len(store) == 3
    assert store.get("r1") is not None  # used: now the newest
    store.put({"id": "r4"}, [])
    assert store.get("r2") is None and store.get("r1") is not None
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 9_990}])
    assert len(store) == 1 and store.get("big") is not None  # alone over the chars: kept, alone
    assert store.delete("big") and not store.delete("big") and len(store) == 0


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
    client = sse_client(anthropic.Anthropic, messages_api.sse(out))
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
    client = sse_client(anthropic.Anthropic, messages_api.sse(out))
    with pytest.raises(anthropic.APIStatusError, match="the model file went bad"), \
            client.messages.stream(model="m", max_tokens=5,
                                   messages=[{"role": "user", "content": "x"}]) as stream:
        stream.get_final_message()
