"""The Responses adapter's conversions, without a model: requests into chat requests, and
synthetic chat-completion outputs (text and tool calls, whole and streamed, in OpenAI's
documented shapes) into Responses objects and events. The streams are read by the official
``openai`` client's own stream accumulator (over a mock transport), so an event it would reject,
or a tool call it would assemble wrongly, fails here.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import openai
import pytest
from adapter_helpers import CALLS, MESSAGE, SPECULATION, USAGE, chunk, sse_client, tool_chunks

from localspec.api import chat_bridge, responses_api, responses_request
from localspec.api.errors import BadRequest, ServerError
from localspec.api.responses_api import ResponseEvents
from localspec.api.responses_request import ResponsesRequest
from localspec.api.responses_store import ResponseStore

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
    client = sse_client(openai.OpenAI, chat_bridge.sse(events))
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
