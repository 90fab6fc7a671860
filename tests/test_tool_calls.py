"""Tool calls without models: each family's format read from its template, the grammar a
request makes, calls read from an answer whole and as it streams (in pieces of every size the
same), and what is refused in a request's tools, tool messages and response_format."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from localspec.api.answer_plan import answer_plan
from localspec.api.errors import BadRequest
from localspec.api.schemas import ChatRequest
from localspec.api.tool_calls import CallReader, read_answer
from localspec.api.tool_format import LLAMA3, QWEN, answer_format, detect_format
from localspec.api.tool_schemas import API_MAX_SCHEMA_CHARS
from localspec.output_format import OutputFormat, TaggedJson

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NAMES = {"get_weather": PARAMS, "add": {"type": "object"}}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "add"}}]
USER = [{"role": "user", "content": "hi"}]
QWEN_TEMPLATE = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>"


def streamed(text: str, size: int, fmt=QWEN, names=NAMES) -> tuple[str, list[tuple[str, str]]]:
    """``text`` fed to a reader in pieces of ``size``: the text and the calls it gave out."""
    reader = CallReader(fmt, names)
    pieces = [p for i in range(0, len(text), size) for p in reader.feed(text[i:i + size])]
    pieces += reader.finish()
    return ("".join(p.text for p in pieces),
            [(p.call.name, p.call.arguments) for p in pieces if p.call is not None])


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Plain text, kept exactly.  \n", "Plain text, kept exactly.  \n", []),
    ("a < b <tool", "a < b <tool", []),
    (WEATHER, None, [("get_weather", '{"city": "Paris"}')]),
    (f"Let me check.\n{WEATHER}\n{ADD}\n", "Let me check.",
     [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]),
    (f"{WEATHER}\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    # a call cut off by the stop after its JSON (parallel_tool_calls false) is whole
    (WEATHER.removesuffix("</tool_call>"), None, [("get_weather", '{"city": "Paris"}')]),
    # Qwen2.5-Coder's own habit, a Markdown block of the call
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     None, [("get_weather", '{"city": "Paris"}')]),
    # arguments as a JSON string are read too
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None,
     [("add", '{"a": 1}')]),
])
def test_calls_are_read_whole_and_streamed_alike(text: str, content: str | None,
                                                 calls: list) -> None:
    whole = read_answer(text, QWEN, NAMES)
    assert (whole[0], [(c.name, c.arguments) for c in whole[1]]) == (content, calls)
    for size in (1, 2, 3, 5, 11, len(text)):
        got_text, got_calls = streamed(text, size)
        assert got_calls == calls and (got_text or None if calls else got_text) == content
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in whole[1])
    assert len({c.id for c in whole[1]}) == len(whole[1])


@pytest.mark.parametrize("text", [
    'x \n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> y',  # undeclared name
    '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{{"name": "add", "arguments": {}}}\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by the limit
    '```json\n{"name": "nope", "arguments": {}}\n```',
    '```json\n{"a": 1}\n```',
    '```json\n{"name": "add", "arguments": {}}\n```\nand some text',
    '```json\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n```',  # off its schema
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7}}\n</tool_call>',
])
def test_a_malformed_call_is_given_back_as_the_text_it_was(text: str) -> None:
    assert read_answer(text, QWEN, NAMES) == (text, [])
    for size in (1, 4, len(text)):
        assert streamed(text, size) == (text, [])


def test_no_raw_tag_is_sent_before_the_call_is_read() -> None:
    reader = CallReader(QWEN, NAMES)
    sent = [p for piece in ("Sure.", "\n<tool", '_call>\n{"name": "add", ', '"arguments": {}}')
            for p in reader.feed(piece)]
    assert [p.text for p in sent] == ["Sure."]
    sent = reader.feed("\n</tool_call>")
    assert len(sent) == 1 and sent[0].call is not None and sent[0].call.name == "add"


def test_llama3_json_calls() -> None:
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}'
    content, calls = read_answer(text, LLAMA3, NAMES)
    assert content is None and [c.arguments for c in calls] == ['{"a": 1}', '{"b": 2}']
    for size in (1, 3, len(text)):
        assert streamed(text, size, LLAMA3) == ("", [("add", '{"a": 1}'), ("add", '{"b": 2}')])
    cut = '{"name": "add", "parameters": {"a": '
    assert read_answer(cut, LLAMA3, NAMES) == (cut, [])


def test_the_family_is_read_from_the_template() -> None:
    assert detect_format(QWEN_TEMPLATE) is QWEN
    assert detect_format({"default": "x", "tool_use": "<tool_call>"}) is QWEN
    assert detect_format('{{ "<|python_tag|>" }}<|eot_id|>') is LLAMA3
    assert detect_format('"parameters": <|eot_id|>') is LLAMA3
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None
    def spelled(tag: TaggedJson) -> str:
        return tag.begin + "{}" + tag.end

    assert spelled(QWEN.tag("f", {})) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert spelled(QWEN.tag("f", {}, fenced=True)) == '```json\n{"name": "f", "arguments": {}}\n```'
    assert spelled(LLAMA3.tag("f", {})) == '{"name": "f", "parameters": {}}'


def test_the_grammar_of_each_tool_choice() -> None:
    schemas = {"get_weather": PARAMS, "add": {"type": "object", "properties": {}}}
    required = answer_format(QWEN, schemas, ("get_weather",), True, None)
    assert required == OutputFormat(tags=(TaggedJson(
        '<tool_call>\n{"name": "get_weather", "arguments": ', PARAMS, "}\n</tool_call>"),),
        tags_only=True, single_tag=True)
    several = answer_format(QWEN, schemas, ("get_weather",), True, None, parallel=True)
    assert several.tags_only and not several.single_tag
    auto = answer_format(QWEN, schemas, ("get_weather", "add"), False, None)
    assert auto.triggers == ("<tool_call>",) and not auto.tags_only and len(auto.tags) == 2
    assert all(t.begin.startswith(auto.triggers[0]) for t in auto.tags)
    assert answer_format(None, {}, (), False, None) is None
    assert answer_format(None, {}, (), False, {"type": "object"}) == \
        OutputFormat(json={"type": "object"})
    either = answer_format(QWEN, schemas, ("add",), False, {"type": "object"})
    assert either.json == {"type": "object"} and either.tags_only and either.single_tag
    assert either.tags == (QWEN.tag("add", schemas["add"]), QWEN.tag("add", schemas["add"], True))
    assert answer_format(QWEN, schemas, ("add",), True, {"type": "object"}).json is None


def plan(**fields: object):
    return answer_plan(ChatRequest.model_validate({"messages": USER, **fields}), QWEN_TEMPLATE)


def test_a_requests_plan() -> None:
    p = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert p.output.tags_only and p.output.tags == (QWEN.tag("add", p.functions["add"]),)
    assert p.output.single_tag
    assert not plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=True
                    ).output.single_tag
    assert p.output.tags[0].schema == {"type": "object", "properties": {}}
    assert p.functions == {"add": {"type": "object", "properties": {}}}
    assert [t["function"]["name"] for t in p.tools] == ["get_weather", "add"]
    p = plan(tools=TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}})
    assert list(p.functions) == ["get_weather"] and p.output.triggers == ("<tool_call>",)
    p = plan(tools=TOOLS, tool_choice="none")
    assert p.tools is None and p.output is None and p.reader is None
    assert plan(tools=TOOLS, parallel_tool_calls=False).stops == ("</tool_call>",)
    assert plan(tools=TOOLS).stops == ()
    p = plan(response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": PARAMS, "strict": True}})
    assert p.output == OutputFormat(json=PARAMS) and p.reader is None
    assert plan(response_format={"type": "json_object"}).output == \
        OutputFormat(json={"type": "object"})
    assert plan(response_format={"type": "text"}).output is None
    with pytest.raises(BadRequest, match="no tool-call format"):
        answer_plan(ChatRequest.model_validate({"messages": USER, "tools": TOOLS}), "{{ x }}")
    assert answer_plan(ChatRequest.model_validate(
        {"messages": USER, "tools": TOOLS, "tool_choice": "none"}), "{{ x }}").output is None


HISTORY = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def test_a_history_with_calls_in_the_templates_shape() -> None:
    request = ChatRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    chat = request.chat()
    assert chat[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert chat[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1",
                       "name": "get_weather"}
    saved = request.saved()
    assert [m["role"] for m in saved] == ["user", "assistant", "user"]
    assert "get_weather" in saved[1]["content"] and "18 C" in saved[2]["content"]


@pytest.mark.parametrize(("fields", "needle"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "invalid schema for function 'f'"),
    ({"tools": [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": 5}}}]}, "invalid schema for function 'g'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "pattern"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "only function tools"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "declared twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope' is not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
     "must answer a tool call"),
    ({"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "'call_9' names none"),
    ({"messages": [*HISTORY[:2], *USER, HISTORY[2]]}, "must answer a tool call"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "needs the tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]},
     "only an assistant message has tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{broken"}}]}]}, "not a JSON object"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "legacy role"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "has no 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 3}}}}, "invalid schema for response_format 'x'"),
    ({"response_format": {"type": "json_schema"}}, "'json_schema' goes with"),
    ({"response_format": {"type": "yaml"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "x" * API_MAX_SCHEMA_CHARS}}}}, "over the limit"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        '{"items": ' * 40 + "{}" + "}" * 40)}}}, "deeper than"),
    ({"tools": [TOOLS[1]] * 129}, "at most 128"),
    ({"functions": [{"name": "f"}]}, "send them as tools"),
    ({"function_call": {"name": "f"}}, "send tool_choice"),
])
def test_what_is_refused(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ChatRequest.model_validate({"messages": USER, **fields})
    assert needle in str(caught.value), str(caught.value)


def test_what_clients_send_by_default_passes() -> None:
    request = ChatRequest.model_validate({
        "messages": USER, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
        "response_format": {"type": "text"}, "functions": [], "function_call": "none"})
    assert request.allowed_tools() == () and request.template_tools() is None
