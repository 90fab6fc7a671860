"""What an answer must look like: the torch-free description the API builds from a request
(``response_format``, ``tools`` with ``tool_choice``) and the grammar engine compiles.

The API knows requests and the model's tool-call format; the engine knows tokens and masks.
This is the one shape between them: a JSON value for the whole answer, or tool calls, each a
JSON value between two literal texts in the model's own format (Qwen's
``<tool_call>\\n{"name": "f", "arguments": `` ... ``}\\n</tool_call>``), either as the whole
answer or inside free text where a trigger text starts one.

Torch-free, on the floor of ``config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

JsonSchema = Mapping[str, object] | bool  # a JSON Schema document (True: any JSON value)


@dataclass(frozen=True)
class TaggedJson:
    """A JSON value matching ``schema`` between the literal texts ``begin`` and ``end``: one
    tool call in the model's format."""

    begin: str
    schema: JsonSchema
    end: str


@dataclass(frozen=True)
class OutputFormat:
    """The grammar of one answer.

    ``json``: the answer is one JSON value matching this schema (``response_format``
    ``json_object`` is ``{"type": "object"}``, ``json_schema`` its schema). ``tags`` are the
    tool calls the answer may make: with ``tags_only`` (``tool_choice`` "required" or a named
    function) the answer is one or more of them and nothing else (``single_tag``: exactly one);
    without, it is free text in which each of ``triggers`` starts one of the tags
    (``tool_choice`` "auto"). Both ``json`` and ``tags`` (``tags_only``): the answer is either
    the JSON value or the calls (an agent's tools beside its structured final answer).
    """

    json: JsonSchema | None = None
    tags: tuple[TaggedJson, ...] = ()
    triggers: tuple[str, ...] = ()
    tags_only: bool = False
    single_tag: bool = False

    def __post_init__(self) -> None:
        if self.json is None and not self.tags:
            raise ValueError("an OutputFormat is one JSON value, tool-call tags, or either")
        if self.json is not None and self.tags and not self.tags_only:
            raise ValueError("a JSON answer beside calls leaves no free text for triggers")
        if self.tags and not self.tags_only and not self.triggers:
            raise ValueError("tags inside free text need the triggers that start them")
        if self.single_tag and not self.tags_only:
            raise ValueError("single_tag bounds an answer of tags only")

    def key(self) -> str:
        """A stable text of the whole format: what a cache of compiled grammars is keyed by."""
        return json.dumps({"json": self.json, "triggers": list(self.triggers),
                           "tags_only": self.tags_only, "single_tag": self.single_tag,
                           "tags": [[t.begin, t.schema, t.end] for t in self.tags]},
                          sort_keys=True, separators=(",", ":"))
