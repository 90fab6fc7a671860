"""What a chat request's tools and ``response_format`` make of its answer: the tools offered
to the chat template, the grammar the engine masks with, and how the answer is read back.

``tool_choice`` "none" offers no tools and constrains nothing (the history may still hold
earlier calls: the template renders them). Otherwise the model's tool-call format is read from
its chat template; a template without one is a 400 (the tools could neither be offered nor
their calls read). Under "required" or a named function the grammar allows one call unless
``parallel_tool_calls`` is true; under "auto", ``parallel_tool_calls: false`` stops the answer
after its first call where the format has a text that ends one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from localspec.api.errors import BadRequest
from localspec.api.schemas import ChatRequest
from localspec.api.tool_format import ToolFormat, answer_format, detect_format, parameters
from localspec.output_format import JsonSchema, OutputFormat


@dataclass(frozen=True)
class AnswerPlan:
    """``tools``: what the chat template offers (None: nothing); ``output``: the grammar (None:
    free text); ``reader``: the format calls are read in and ``functions`` those they may call
    (name -> parameters' schema; no reader: the answer is text only); ``stops``: stop strings
    added to the request's."""

    tools: list[dict[str, object]] | None = None
    output: OutputFormat | None = None
    reader: ToolFormat | None = None
    functions: Mapping[str, JsonSchema] = field(default_factory=dict)
    stops: tuple[str, ...] = ()


def answer_plan(body: ChatRequest, chat_template: str | Mapping[str, str] | None,
                ) -> AnswerPlan:
    """The plan for ``body`` on a model with ``chat_template``; BadRequest for tools the model
    cannot call."""
    allowed = body.allowed_tools()
    json_schema = body.response_format.answer_schema() if body.response_format else None
    fmt = detect_format(chat_template) if allowed else None
    if allowed and fmt is None:
        raise BadRequest("this model's chat template has no tool-call format, so it cannot be "
                         "offered tools: use a model made for tool calling (the Qwen presets), "
                         "or send tool_choice 'none'", param="tools")
    schemas = {t.function.name: parameters(t.function.parameters) for t in body.tools or ()}
    output = answer_format(fmt, schemas, allowed, body.calls_required(), json_schema,
                           parallel=body.parallel_tool_calls is True)
    stops = ((fmt.stop_after_call,) if fmt is not None and fmt.stop_after_call is not None
             and body.parallel_tool_calls is False else ())
    return AnswerPlan(tools=body.template_tools(), output=output, reader=fmt,
                      functions={name: schemas[name] for name in allowed},
                      stops=stops)
