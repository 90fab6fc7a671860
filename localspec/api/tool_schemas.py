"""What a chat request may say about tools and the answer's shape, checked as OpenAI does.

``tools`` are function tools: a name of OpenAI's pattern, unique, and ``parameters`` a JSON
Schema of an object (checked against JSON Schema's meta-schema, so a schema the grammar engine
could not compile is a 400 that names the tool, not a failure mid-answer). ``tool_choice``
"auto", "none", "required", a named function, or OpenAI's ``allowed_tools`` (a subset, "auto"
or "required"). ``response_format`` ``text``, ``json_object`` or ``json_schema``. A schema is
held to a size and a nesting depth: what one answer's grammar is compiled from must stay small.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_MAX_TOOLS = 128  # functions per request, as OpenAI allows
API_MAX_SCHEMA_CHARS = 100_000  # one schema's JSON text
API_MAX_SCHEMA_DEPTH = 32  # one schema's nesting of objects and lists

FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


def _depth(value: object) -> int:
    """How deeply ``value`` nests objects and lists (iteratively: a deep one must not recurse)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > API_MAX_SCHEMA_DEPTH:
                return depth
            todo.extend((child, depth + 1) for child in
                        (item.values() if isinstance(item, dict) else item))
    return deepest


def check_schema(schema: dict[str, Any], what: str, object_only: bool) -> None:
    """ValueError saying what is wrong with ``schema`` (of ``what``): too large, too deep, not
    JSON Schema, or (``object_only``) not the schema of an object."""
    if _depth(schema) > API_MAX_SCHEMA_DEPTH:
        raise ValueError(f"{what}: the schema nests deeper than {API_MAX_SCHEMA_DEPTH} levels")
    size = len(json.dumps(schema))
    if size > API_MAX_SCHEMA_CHARS:
        raise ValueError(f"{what}: the schema is {size:,} characters of JSON, over the limit of "
                         f"{API_MAX_SCHEMA_CHARS:,}")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"{what}: not a valid JSON Schema: {exc.message}"
                         f"{f' (at {where})' if where else ''}") from None
    kind = schema.get("type", "object")
    if object_only and kind != "object":
        raise ValueError(f"{what}: the schema must be of 'type: \"object\"', got 'type: "
                         f"{json.dumps(kind)}'")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema here (the grammar)

    @model_validator(mode="after")
    def _schema(self) -> FunctionDef:
        if self.parameters is not None:
            check_schema(self.parameters, f"invalid schema for function '{self.name}'", True)
        return self

    def template(self) -> dict[str, object]:
        """As the chat template offers it (OpenAI's function spec, unset fields left out)."""
        return {"type": "function", "function": {
            "name": self.name, **({"description": self.description} if self.description else {}),
            "parameters": self.parameters if self.parameters is not None
            else {"type": "object", "properties": {}}}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    function: FunctionDef

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"only function tools are supported, got a tool of type {value!r}")
        return value


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName


class NamedTool(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "required"]
    tools: list[NamedTool] = Field(min_length=1)


class AllowedToolsChoice(BaseModel):
    """``{"type": "allowed_tools", ...}``: only these of the declared tools, "auto" or
    "required"."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedTool | AllowedToolsChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> JsonSchemaFormat:
        if self.schema_ is None:
            raise ValueError(f"json_schema '{self.name}' has no 'schema': send the JSON Schema "
                             "the answer must follow")
        check_schema(self.schema_, f"invalid schema for response_format '{self.name}'", False)
        return self


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with type 'json_schema', and only with it")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The schema the answer must follow; None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None else None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any]

    def parsed(self) -> dict[str, Any]:
        """The arguments as an object (a template writes them as JSON of its own)."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments)
        except (json.JSONDecodeError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"the arguments of the call to '{self.name}' are not a JSON object")
        return value


class MessageToolCall(BaseModel):
    """A call an earlier answer made, as the client sends it back in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    @model_validator(mode="after")
    def _arguments(self) -> MessageToolCall:
        self.function.parsed()
        return self
