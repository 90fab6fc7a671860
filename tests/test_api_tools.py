"""Tool calls and structured output over HTTP, on a tiny model whose chat template has Qwen's
tool-call format: the official ``openai`` client (calls whole and streamed, ``parse`` with a
Pydantic model) and raw HTTP for every refusal. The model's answers are scripted (its stream
replaced) so that the wire format is tested on known text; what the grammar and the template
get from a request is checked on the request the pipeline is handed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_helpers import serving
from conftest import TOKENIZER_TEXTS, make_tiny_model, train_tokenizer, write_preset
from openai import OpenAI
from pydantic import BaseModel

from localspec.api.server import API_MAX_BODY_BYTES
from localspec.engine.engine import GenerationRequest, StepEvent
from localspec.host import ModelHost
from localspec.output_format import OutputFormat

# Qwen's way in miniature (the tiny model's context is 256 tokens): tools offered by name,
# an assistant's calls as <tool_call> blocks with their arguments as JSON, tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "add"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> ModelHost:
    root: Path = tmp_path_factory.mktemp("tool-model")
    tokenizer = train_tokenizer(TOKENIZER_TEXTS)
    tokenizer.chat_template = TOOL_TEMPLATE
    make_tiny_model(seed=0, vocab_size=300).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(write_preset(root, root / "target", method="none")), host.status().error
    return host


@pytest.fixture(scope="module")
def url(host: ModelHost) -> Iterator[str]:
    with serving(host) as url:
        yield url


class Script:
    """The pipeline's stream replaced: the answer is ``pieces``, one step each; the requests it
    was handed are kept."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.requests: list[GenerationRequest] = []

    def __call__(self, request: GenerationRequest, *_args: object, **_kwargs: object,
                 ) -> Iterator[StepEvent]:
        self.requests.append(request)
        for i, piece in enumerate(self.pieces):
            yield StepEvent(step=i, k=0, drafted=(), accepted=0, target_token=1,
                            target_token_kind="bonus", tokens=(1,), p_target=(1.0,),
                            q_draft=(), text_delta=piece, draft_time=0.0, verify_time=0.0,
                            finish_reason="eos" if i == len(self.pieces) - 1 else None)


@pytest.fixture
def script(host: ModelHost, monkeypatch: pytest.MonkeyPatch) -> Script:
    script = Script()
    monkeypatch.setattr(host.pipeline, "stream", script)
    return script


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="none", max_retries=0)


def chop(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def streamed_message(url: str, **kwargs: object) -> tuple[str, list[dict], list[str], str]:
    """A streamed answer put together as a client does: content, calls by index, every piece
    of content as sent, the finish reason."""
    content, calls, reasons = [], {}, []
    for c in client(url).chat.completions.create(stream=True, **kwargs):
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += [delta.content] if delta.content else []
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += d.function.name or "" if d.function else ""
            call["arguments"] += d.function.arguments or "" if d.function else ""
        reasons += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
    assert len(reasons) == 1
    return "".join(content), [calls[i] for i in sorted(calls)], content, reasons[0]


def test_calls_whole_and_streamed_are_the_same(url: str, script: Script) -> None:
    script.pieces = ["Sure.", "\n", *chop(WEATHER), "\n", *chop(WEATHER.replace("Paris",
                                                                                "Oslo"))]
    reply = client(url).chat.completions.create(model=None, messages=USER, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    calls = [(c.type, c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert calls == [("function", "get_weather", {"city": "Paris"}),
                     ("function", "get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)
    content, streamed, pieces, reason = streamed_message(url, model=None, messages=USER,
                                                         tools=TOOLS)
    assert reason == "tool_calls" and content == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
        [(name, args) for _, name, args in calls]
    assert all(c["id"].startswith("call_") for c in streamed)
    assert not any("tool_call" in p for p in pieces)  # no raw tag leaked
    # the client sends the message back with a result for each call, as agents do
    script.pieces = ["It is 18 C in Paris and 9 C in Oslo."]
    history = [*USER, choice.message, *({"role": "tool", "tool_call_id": c.id, "content": t}
                                        for c, t in zip(choice.message.tool_calls,
                                                        ("18 C", "9 C"), strict=True))]
    again = client(url).chat.completions.create(model=None, messages=history, tools=TOOLS)
    assert again.choices[0].message.content == script.pieces[0]
    assert again.choices[0].finish_reason == "stop"


def test_text_and_a_malformed_call_come_back_as_text(url: str, script: Script) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'
    for answer in ("Just text, <b>kept</b> as is.  ", f"I would call {broken}"):
        script.pieces = chop(answer, 3)
        reply = client(url).chat.completions.create(model=None, messages=USER, tools=TOOLS)
        assert reply.choices[0].message.content == answer
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason == "stop"
        content, calls, _, reason = streamed_message(url, model=None, messages=USER,
                                                     tools=TOOLS)
        assert (content, calls, reason) == (answer, [], "stop")


def handed(request: GenerationRequest) -> dict[str, object]:
    """The OutputFormat a request's grammar was compiled from (its ``key``, as JSON)."""
    assert request.grammar is not None
    return json.loads(request.grammar.key)


def test_what_the_grammar_and_the_template_are_handed(url: str, host: ModelHost,
                                                      script: Script) -> None:
    script.pieces = ["{}"]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    c = client(url)
    c.chat.completions.create(model=None, messages=history, tools=TOOLS, tool_choice="required")
    request = script.requests[-1]
    prompt = host.pipeline.tokenizer.decode(request.prompt_ids)
    assert "tools: get_weather add" in prompt
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in prompt
    assert "<|tool|>18 C" in prompt
    fmt = handed(request)  # the format the grammar was compiled from
    assert fmt["tags_only"] and [begin for begin, _, _ in fmt["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "add", "arguments": ']
    assert fmt["tags"][0][1] == PARAMS
    c.chat.completions.create(model=None, messages=USER, tools=TOOLS,
                              tool_choice={"type": "function", "function": {"name": "add"}})
    assert [begin for begin, _, _ in handed(script.requests[-1])["tags"]] == [
        '<tool_call>\n{"name": "add", "arguments": ']
    c.chat.completions.create(model=None, messages=USER, tools=TOOLS)
    assert handed(script.requests[-1])["triggers"] == ["<tool_call>"]
    c.chat.completions.create(model=None, messages=USER, tools=TOOLS, tool_choice="none")
    request = script.requests[-1]
    assert request.grammar is None
    assert "tools:" not in host.pipeline.tokenizer.decode(request.prompt_ids)
    c.chat.completions.create(model=None, messages=USER, tools=TOOLS,
                              parallel_tool_calls=False)
    assert "</tool_call>" in script.requests[-1].stop_strings
    c.chat.completions.create(model=None, messages=USER,
                              response_format={"type": "json_object"})
    assert handed(script.requests[-1]) == json.loads(OutputFormat(json={"type": "object"}).key())


class Weather(BaseModel):
    city: str
    celsius: int


def test_parse_with_a_pydantic_model(url: str, script: Script) -> None:
    script.pieces = chop('{"city": "Paris", "celsius": 18}')
    c = client(url)
    parse = c.chat.completions.parse if hasattr(c.chat.completions, "parse") \
        else c.beta.chat.completions.parse
    reply = parse(model=None, messages=USER, response_format=Weather)
    assert reply.choices[0].message.parsed == Weather(city="Paris", celsius=18)
    schema = handed(script.requests[-1])["json"]
    assert schema["properties"]["celsius"] == {"title": "Celsius", "type": "integer"}
    assert schema["additionalProperties"] is False  # the client's strict schema, as sent


def error(response: httpx.Response, status: int, needle: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and needle in body["message"], body
    return body


@pytest.mark.parametrize(("fields", "needle", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "strnig"}}}}}]},
     "invalid schema for function 'get_weather'", "tools.0.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope' is not among the tools", None),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]},
     "must answer a tool call", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "has no 'schema'", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "description": "x" * 200_000}}}}, "over the limit", None),
    ({"functions": [{"name": "f", "parameters": {}}]}, "send them as tools", None),
])
def test_refusals_over_http(url: str, fields: dict, needle: str, param: str | None) -> None:
    body = error(httpx.post(f"{url}/chat/completions",
                            json={"messages": USER, "max_tokens": 2, **fields}), 400, needle)
    assert body["type"] == "invalid_request_error"
    if param is not None:
        assert body["param"] == param


def test_a_schema_past_the_body_limit_is_413(url: str) -> None:
    schema = {"type": "object", "description": "x" * API_MAX_BODY_BYTES}
    body = error(httpx.post(f"{url}/chat/completions", json={
        "messages": USER, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": schema}}]}), 413, "over the limit")
    assert body["code"] == "request_too_large"


def test_tools_on_a_model_without_a_tool_format(tiny_presets: dict[str, str]) -> None:
    """The conftest model's template has no tool-call format: offering it tools is a 400,
    tool_choice "none" is fine."""
    plain = ModelHost(warm_up=False, audit=False)
    assert plain.load(tiny_presets["plain"]), plain.status().error
    with serving(plain) as url:
        error(httpx.post(f"{url}/chat/completions", json={
            "messages": USER, "tools": TOOLS, "max_tokens": 2}), 400, "no tool-call format")
        assert httpx.post(f"{url}/chat/completions", json={
            "messages": USER, "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 2}).status_code == 200
