"""Structured output on the built-in Qwen2.5-Coder 1.5B target with its 0.5B draft: a
JSON-schema answer and a tool call in Qwen's own format (``<tool_call>`` is an added token of
its tokenizer) are token for token the plain constrained answer with every drafter, parse and
validate; a bad schema is a FormatError before any token."""

from __future__ import annotations

import json

import jsonschema
import pytest

from localspec.engine.grammar import FormatError
from localspec.output_format import OutputFormat, TaggedJson
from localspec.pipeline import Pipeline
from localspec.presets import load_preset

pytestmark = pytest.mark.real_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "languages"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "description": "Current weather in a city",
                                         "parameters": WEATHER}}
CALL = TaggedJson('<tool_call>\n{"name": "get_weather", "arguments": ', WEATHER,
                  "}\n</tool_call>")
METHODS = ("draft_model", "ngram")


@pytest.fixture(scope="module")
def qwen() -> Pipeline:
    return Pipeline.load(load_preset("cpu-qwen-coder-draft"))


def answers(qwen: Pipeline, ids: list[int], output: OutputFormat,
            max_new: int) -> dict[str, list[int]]:
    request = qwen.request(ids, output=output, max_new_tokens=max_new, temperature=0.0)
    return {method: qwen.run(request, method).token_ids for method in ("none", *METHODS)}


def test_json_schema_answer_is_plain_constrained_decoding(qwen: Pipeline) -> None:
    ids = qwen.encode_prompt("Describe Ada Lovelace as a JSON object with her name, her age "
                             "when she died and the languages she knew.")
    runs = answers(qwen, ids, OutputFormat(json=PERSON), 60)
    for method in METHODS:
        assert runs[method] == runs["none"], method
    text = qwen.tokenizer.decode(runs["none"], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), PERSON)


def test_tool_call_in_qwens_format(qwen: Pipeline) -> None:
    ids = qwen.encode_chat([{"role": "user", "content": "What's the weather in Paris?"}],
                           tools=[TOOL])
    runs = answers(qwen, ids, OutputFormat(tags=(CALL,), tags_only=True), 60)
    for method in METHODS:
        assert runs[method] == runs["none"], method
    assert runs["none"][0] == qwen.tokenizer.convert_tokens_to_ids("<tool_call>")
    text = qwen.tokenizer.decode(runs["none"], skip_special_tokens=True)
    body = text.split("<tool_call>")[1].split("</tool_call>")[0]
    call = json.loads(body)
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER)


def test_a_bad_schema_is_refused_before_generating(qwen: Pipeline) -> None:
    with pytest.raises(FormatError, match="Unimplemented keys"):
        qwen.request([1, 2, 3], output=OutputFormat(json={"type": "object",
                                                          "dependentSchemas": {"a": {}}}))
