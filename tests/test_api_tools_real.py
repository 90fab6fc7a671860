"""Tool calling and structured output on the built-in Qwen2.5-Coder-1.5B, as an agent uses it:
``localspec serve --preset cpu-qwen-coder-ngram`` in a process of its own, driven by the
official ``openai`` client. A greedy question the model answers with a call comes back as
``tool_calls``, streamed and whole alike; the next turn, with the tool's result in the history,
is answered in words from that result.

The tests that take the ``grammar`` fixture need the engine to mask the target's logits with
the request's ``OutputFormat`` (a forced call, a Pydantic model's JSON): they are skipped,
saying "GenerationRequest has no grammar engine", where a tiny model under a JSON grammar does
not answer JSON.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from pydantic import BaseModel
from test_api_real import running
from test_browser import free_port

from localspec.output_format import OutputFormat
from localspec.pipeline import Pipeline
from localspec.presets import load_preset

pytestmark = pytest.mark.real_model

PRESET = "cpu-qwen-coder-ngram"
SYSTEM = ("You are a helpful assistant. When a tool result arrives, answer the user in one "
          "plain sentence.")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}
ASK = [{"role": "system", "content": SYSTEM},
       {"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    port = free_port()
    log: Path = tmp_path_factory.mktemp("serve-tools") / "serve.log"
    with running(["-m", "localspec", "serve", "--preset", PRESET, "--port", str(port)], port,
                 log) as client:
        yield client
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def grammar(tiny_presets: dict[str, str]) -> None:
    """Skips unless the engine masks with an OutputFormat: a tiny random model's greedy answer
    under the grammar of a JSON object must open one."""
    pipeline = Pipeline.load(load_preset(tiny_presets["plain"]))
    request = pipeline.request(pipeline.encode_prompt("hello"), max_new_tokens=8,
                               temperature=0, output=OutputFormat(json={"type": "object"}))
    if not pipeline.run(request).text.lstrip().startswith("{"):
        pytest.skip("GenerationRequest has no grammar engine")


def ask(client: OpenAI, **kwargs: object):
    return client.chat.completions.create(model=PRESET, messages=ASK, tools=[WEATHER],
                                          temperature=0, max_tokens=64, **kwargs)


def test_a_question_answered_with_a_call_streamed_and_whole(client: OpenAI) -> None:
    choice = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    content, calls, reasons = "", {}, []
    for chunk in ask(client, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert reasons == ["tool_calls"] and content == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_the_next_turn_reads_the_tools_result(client: OpenAI) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": '{"city": "Paris", "celsius": 18, "sky": "sunny"}'}]
    reply = client.chat.completions.create(model=PRESET, messages=history, tools=[WEATHER],
                                           temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert "18" in choice.message.content and "sunny" in choice.message.content


class Weather(BaseModel):
    city: str
    celsius: int
    sunny: bool


def test_parse_into_a_pydantic_model(client: OpenAI, grammar: None) -> None:
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") \
        else client.beta.chat.completions.parse
    reply = parse(model=PRESET, temperature=0, max_tokens=64, response_format=Weather,
                  messages=[{"role": "user", "content": "It is 18 degrees and sunny in Paris. "
                                                        "Describe the weather there."}])
    assert isinstance(reply.choices[0].message.parsed, Weather)
    assert reply.choices[0].message.parsed.city == "Paris"


def test_a_named_tool_is_called_even_off_topic(client: OpenAI, grammar: None) -> None:
    reply = client.chat.completions.create(
        model=PRESET, temperature=0, max_tokens=64, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Write a haiku about the sea."}])
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert reply.choices[0].finish_reason == "tool_calls"


def weather_agent(client: OpenAI, asked: list[str], instructions: str, **settings: object):
    """An Agents SDK agent on the served preset through its chat-completions model, with a
    ``get_weather`` tool that notes each city it is asked about in ``asked``."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return json.dumps({"city": city, "celsius": 18, "sky": "sunny"})

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(
        model=PRESET, openai_client=AsyncOpenAI(base_url=str(client.base_url), api_key="none"))
    return agents.Agent(name="weather", instructions=instructions, tools=[get_weather],
                        model=model, **settings,
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=64))


def test_an_openai_agents_sdk_agent_calls_the_tool_and_answers(client: OpenAI) -> None:
    """The OpenAI Agents SDK's own loop, whole and streamed: the model calls the tool, the SDK
    runs it and sends the result back, the model answers from it."""
    asked: list[str] = []
    agent = weather_agent(client, asked, SYSTEM)
    from agents import Runner

    async def run() -> tuple[str, str]:
        whole = await Runner.run(agent, "What's the weather in Paris?")
        streamed = Runner.run_streamed(agent, "What's the weather in Tokyo?")
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output

    paris, tokyo = asyncio.run(run())
    assert asked == ["Paris", "Tokyo"]
    assert "Paris" in paris and "18" in paris and "Tokyo" in tokyo and "18" in tokyo


def test_an_agent_with_tools_and_a_structured_answer(client: OpenAI) -> None:
    """The Agents SDK's ``output_type`` beside tools sends a JSON schema with ``tool_choice``
    "auto": the answer is a call or that JSON, so the loop calls the tool, then answers in the
    schema from its result."""

    class Report(BaseModel):
        city: str
        celsius: int

    asked: list[str] = []
    agent = weather_agent(client, asked, "Look the weather up with the tool, then report it.",
                          output_type=Report)
    from agents import Runner

    result = asyncio.run(Runner.run(agent, "What's the weather in Paris?"))
    # 18 is the tool's (unprompted, the model guessed 15); it may look twice before answering
    assert set(asked) == {"Paris"} and result.final_output == Report(city="Paris", celsius=18)
