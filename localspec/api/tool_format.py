"""How a model family writes a tool call, and the grammar a request's tools make of it.

A chat model is taught one way of calling tools by its chat template, and answers in it:

* Qwen2.5 / Qwen3 (and Hermes-style templates): ``<tool_call>\\n{"name": "f", "arguments":
  {...}}\\n</tool_call>``, one block per call, several in one answer;
* Llama 3.1-3.3: the answer is the JSON object ``{"name": "f", "parameters": {...}}``.

The family is read from the template's own text (what it teaches the model), not guessed from
a model's name, so a fine-tune that keeps its family's template works, and a template with no
tool format (SmolLM2) is told apart: tools are refused there rather than ignored.

``answer_format`` turns a request's tools, ``tool_choice`` and ``response_format`` into the
``OutputFormat`` the grammar engine masks the target's logits with: with ``tool_choice``
"required" or a named function the answer is tool calls only, one tag per allowed tool (the
literal up to the arguments, the tool's parameters' schema, the literal after them), and one call
unless the request asks for parallel calls in so many words (``parallel_tool_calls: true``, as
llama.cpp's server: a small model held to calls rarely ends a run of them itself); with
"auto" the tags may start anywhere in free text at the family's trigger, and with "auto" and a
JSON ``response_format`` the answer is that JSON value or the calls. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from localspec.output_format import JsonSchema, OutputFormat, TaggedJson

EMPTY_PARAMETERS: dict[str, object] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call text: ``open`` + ``{"name": NAME, "<args_key>": ARGS}`` +
    ``close``.

    ``trigger`` starts a call inside free text (the begin of every tag starts with it);
    ``stop_after_call``: a text that ends one call and nothing else (a stop string that keeps
    an answer to one call, ``parallel_tool_calls: false``); ``fenced``: also read an answer
    that is only Markdown ```json blocks of calls as calls (Qwen2.5-Coder, taught the tags,
    writes those when nothing constrains it); ``separators``: what may stand between calls.
    """

    family: str
    open: str
    args_key: str
    close: str
    trigger: str
    stop_after_call: str | None
    fenced: bool
    separators: str

    def tag(self, name: str, schema: JsonSchema, fenced: bool = False) -> TaggedJson:
        """A call to ``name`` with arguments of ``schema`` as the grammar's tag: the literal
        text up to the arguments and after them, in the family's own tags or (``fenced``) in
        the Markdown block its model writes when unconstrained."""
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": '
        if fenced:
            return TaggedJson("```json\n" + head, schema, "}\n```")
        return TaggedJson(self.open + head, schema, "}" + self.close)


QWEN = ToolFormat(family="qwen", open="<tool_call>\n", args_key="arguments",
                  close="\n</tool_call>", trigger="<tool_call>",
                  stop_after_call="</tool_call>", fenced=True, separators=" \t\r\n")
LLAMA3 = ToolFormat(family="llama3", open="", args_key="parameters", close="",
                    trigger='{"name": ', stop_after_call=None, fenced=False,
                    separators=" \t\r\n;")


def template_text(chat_template: str | Mapping[str, str] | None) -> str:
    """A tokenizer's template as one text (a tokenizer may carry named templates)."""
    if chat_template is None:
        return ""
    if isinstance(chat_template, str):
        return chat_template
    return "\n".join(str(t) for t in chat_template.values())


def detect_format(chat_template: str | Mapping[str, str] | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches, or None for a template without one."""
    text = template_text(chat_template)
    if "<tool_call>" in text:
        return QWEN
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|eot_id|>" in text):
        return LLAMA3
    return None


def parameters(schema: Mapping[str, object] | None) -> JsonSchema:
    """A function's parameters' schema (none given: a call with no arguments)."""
    return dict(schema) if schema is not None else EMPTY_PARAMETERS


def answer_format(fmt: ToolFormat | None, tools: Mapping[str, JsonSchema],
                  allowed: tuple[str, ...], required: bool,
                  json_schema: JsonSchema | None, parallel: bool = False,
                  ) -> OutputFormat | None:
    """The grammar of an answer: ``tools`` (name -> parameters' schema) may be called, those in
    ``allowed`` only; ``required``: the answer is calls and nothing else, one call unless
    ``parallel``; ``json_schema``: the answer is one JSON value of that schema, or (tools
    allowed) the calls instead, with no free text. None: free text."""
    if not allowed:
        return OutputFormat(json=json_schema) if json_schema is not None else None
    if fmt is None:
        raise ValueError("this model's chat template has no tool-call format")
    tags = tuple(fmt.tag(name, tools[name]) for name in allowed)
    if required:
        return OutputFormat(tags=tags, tags_only=True, single_tag=not parallel)
    if json_schema is not None:  # the first token chooses: a call, as the model writes one, or JSON
        if fmt.fenced:
            tags += tuple(fmt.tag(name, tools[name], fenced=True) for name in allowed)
        return OutputFormat(json=json_schema, tags=tags, tags_only=True, single_tag=not parallel)
    return OutputFormat(tags=tags, triggers=(fmt.trigger,))
