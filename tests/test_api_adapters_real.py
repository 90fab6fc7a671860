"""The Responses and Messages APIs on real models, as a user starts the server (``localspec
serve --api-key``), driven by the official ``openai`` (``responses.create``, plain, streamed,
continued by ``previous_response_id``) and ``anthropic`` (``messages.create``,
``messages.stream``, with ``x-api-key``) clients. Greedy text through each API is the
chat-completions answer to the same messages, token for token.

Tool calls need a model with a tool-calling template (the Qwen preset) and the chat path's tool
calling: those tests skip, saying so, where chat does not take ``tools``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from openai import NotFoundError, OpenAI
from pydantic import ValidationError
from test_api_real import running
from test_browser import free_port

from localspec.api.schemas import ChatRequest

pytestmark = pytest.mark.real_model

PRESET = "cpu-smollm2-ngram"
TOOL_PRESET = "cpu-qwen-coder-ngram"
KEY = "k3y"
PROMPT = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."
MAX_NEW = 48
TOKENS = {"localspec": {"tokens": True}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def ids(extension: dict) -> list[int]:
    return [t["id"] for t in extension["tokens"]]


def serve(preset: str, tmp: Path) -> Iterator[tuple[OpenAI, anthropic.Anthropic]]:
    port = free_port()
    log = tmp / f"serve-{preset}.log"
    with running(["-m", "localspec", "serve", "--preset", preset, "--port", str(port),
                  "--api-key", KEY], port, log, key=KEY) as client:
        yield client, anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY,
                                          max_retries=0)
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[OpenAI, anthropic.Anthropic]]:
    yield from serve(PRESET, tmp_path_factory.mktemp("adapters"))


def chat(client: OpenAI, messages: list[dict], **fields: object) -> tuple[list[int], str]:
    reply = client.chat.completions.create(model=PRESET, messages=messages,
                                           max_tokens=MAX_NEW, temperature=0,
                                           extra_body=TOKENS, **fields)
    return ids(reply.localspec), reply.choices[0].message.content


def test_responses_through_the_openai_client(clients: tuple[OpenAI, anthropic.Anthropic],
                                             ) -> None:
    client, _ = clients
    chat_ids, chat_text = chat(client, [{"role": "user", "content": PROMPT}])
    reply = client.responses.create(model=PRESET, input=PROMPT, max_output_tokens=MAX_NEW,
                                    temperature=0, extra_body=TOKENS)
    assert ids(reply.localspec) == chat_ids and reply.output_text == chat_text
    assert reply.status == "completed" and "quick brown fox" in reply.output_text
    with client.responses.stream(model=PRESET, input=PROMPT, max_output_tokens=MAX_NEW,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == chat_text
    assert final.usage.output_tokens == reply.usage.output_tokens
    follow = client.responses.create(model=PRESET, previous_response_id=reply.id,
                                     input="Now say it once more.", max_output_tokens=MAX_NEW,
                                     temperature=0, extra_body=TOKENS)
    follow_ids, follow_text = chat(client, [
        {"role": "user", "content": PROMPT}, {"role": "assistant", "content": chat_text},
        {"role": "user", "content": "Now say it once more."}])
    assert ids(follow.localspec) == follow_ids and follow.output_text == follow_text
    client.responses.delete(reply.id)
    with pytest.raises(NotFoundError):
        client.responses.create(model=PRESET, previous_response_id=reply.id, input="x")


def test_messages_through_the_anthropic_client(clients: tuple[OpenAI, anthropic.Anthropic],
                                               ) -> None:
    client, claude = clients
    system = "You repeat what you are asked to."
    chat_ids, chat_text = chat(client, [{"role": "system", "content": system},
                                        {"role": "user", "content": PROMPT}])
    reply = claude.messages.create(model=PRESET, max_tokens=MAX_NEW, system=system,
                                   messages=[{"role": "user", "content": PROMPT}],
                                   extra_body={"temperature": 0, **TOKENS})
    assert ids(reply.localspec) == chat_ids and reply.content[0].text == chat_text
    assert reply.stop_reason == "end_turn"
    with claude.messages.stream(model=PRESET, max_tokens=MAX_NEW, system=system,
                                messages=[{"role": "user", "content": PROMPT}],
                                extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == chat_text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == reply.usage.output_tokens
    counted = claude.messages.count_tokens(model=PRESET, system=system,
                                           messages=[{"role": "user", "content": PROMPT}])
    assert counted.input_tokens == reply.usage.input_tokens + (
        reply.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(claude.base_url), api_key="wrong",
                            max_retries=0).messages.create(
            model=PRESET, max_tokens=4, messages=[{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------ tool calls


def chat_takes_tools() -> bool:
    """Whether the chat path reads ``tools`` (the tool-calling work merged)."""
    try:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                    "tools": [{"type": "function",
                                               "function": {"name": "f"}}]})
    except ValidationError:
        return False
    return True


@pytest.fixture(scope="module")
def tool_clients(tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[tuple[OpenAI, anthropic.Anthropic]]:
    if not chat_takes_tools():
        pytest.skip("the chat path does not take tools yet: the tool-call adapters are "
                    "tested on synthetic chat outputs (test_api_adapters.py) until it does")
    yield from serve(TOOL_PRESET, tmp_path_factory.mktemp("adapter-tools"))


ASK = "What is the weather in Paris? Use the tool."
# without it, the 1.5B answers a tool's result by calling the tool again
SYSTEM = "When a tool result arrives, answer the user in one plain sentence."


def test_responses_tool_calls(tool_clients: tuple[OpenAI, anthropic.Anthropic]) -> None:
    client, _ = tool_clients
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    chat_reply = client.chat.completions.create(
        model=TOOL_PRESET, messages=[{"role": "user", "content": ASK}], temperature=0,
        max_tokens=64, tool_choice="required",
        tools=[{"type": "function", "function": {k: v for k, v in tools[0].items()
                                                 if k != "type"}}])
    chat_call = chat_reply.choices[0].message.tool_calls[0]
    reply = client.responses.create(model=TOOL_PRESET, input=ASK, tools=tools,
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=64)
    calls = [o for o in reply.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments == chat_call.function.arguments
    assert "paris" in json.loads(calls[0].arguments)["city"].lower()
    with client.responses.stream(model=TOOL_PRESET, input=ASK, tools=tools,
                                 tool_choice="required", temperature=0,
                                 max_output_tokens=64) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert [o.arguments for o in final.output if o.type == "function_call"] == [
        calls[0].arguments]
    answer = client.responses.create(
        model=TOOL_PRESET, previous_response_id=reply.id, tools=tools, temperature=0,
        instructions=SYSTEM,
        max_output_tokens=64, input=[{"type": "function_call_output",
                                      "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]


def test_messages_tool_use(tool_clients: tuple[OpenAI, anthropic.Anthropic]) -> None:
    _, claude = tool_clients
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER}]
    ask = [{"role": "user", "content": ASK}]
    reply = claude.messages.create(model=TOOL_PRESET, max_tokens=64, tools=tools,
                                   tool_choice={"type": "any"}, messages=ask,
                                   extra_body={"temperature": 0})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    assert "paris" in uses[0].input["city"].lower()
    with claude.messages.stream(model=TOOL_PRESET, max_tokens=64, tools=tools,
                                tool_choice={"type": "any"}, messages=ask,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    assert final.stop_reason == "tool_use"
    answer = claude.messages.create(
        model=TOOL_PRESET, max_tokens=64, tools=tools, extra_body={"temperature": 0},
        system=SYSTEM,
        messages=[*ask, {"role": "assistant", "content": reply.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": uses[0].id,
                                                "content": "sunny, 24 C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
