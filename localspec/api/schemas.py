"""What the API accepts: OpenAI's request bodies, checked field by field.

Clients send more than the fields that shape an answer. A field that cannot change the answer
(``user``, ``store``, ``metadata``) is accepted and ignored; a field at its neutral value
(``frequency_penalty: 0``, ``tools: []``, ``logprobs: false``) likewise; at any other value
ignoring it would change the answer, so it is refused with a 400 that names it, as is a field
nobody sends (a typo such as ``temprature`` must not pass silently). ``top_k`` is read, as vLLM
and llama.cpp's server do. Our own extension lives under ``localspec``: ``tokens`` asks for
each token's kind and its rejected drafts, ``method`` picks one of the preset's methods.

A chat request may offer ``tools`` (``tool_schemas``) and carry earlier calls in its history:
an assistant message's ``tool_calls`` and the ``tool`` messages that answer them, each of which
must answer a call of the assistant message just before its run, as OpenAI requires.
``chat()`` gives the messages in the shape chat templates take (a call's arguments as an
object), ``saved()`` as the app's conversations keep them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from localspec.api.tool_schemas import (
    API_MAX_TOOLS,
    AllowedToolsChoice,
    MessageToolCall,
    NamedTool,
    ResponseFormat,
    Tool,
    ToolChoice,
)
from localspec.config import MAX_SEED, NewTokens, TopK, TopP

API_MAX_STOP = 4  # stop strings per request, as OpenAI allows
API_MAX_TEMPERATURE = 2.0  # OpenAI's range

# Fields that never change an answer: accepted, ignored.
IGNORED = frozenset({"user", "store", "metadata", "service_tier", "reasoning_effort",
                     "prompt_cache_key", "safety_identifier", "stream_options",
                     "web_search_options"})
# Fields ignored at these values only (what clients send by default); other values are refused.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "min_p": (0,), "logprobs": (False, 0), "top_logprobs": (0,), "logit_bias": ({},),
    "functions": ([],), "function_call": ("none", "auto"),
    "modalities": (["text"],), "audio": (), "prediction": (), "echo": (False,),
    "best_of": (1,), "suffix": ("",),
}
WHY_REFUSED = {
    "functions": "the legacy functions are not supported: send them as tools",
    "function_call": "the legacy function_call is not supported: send tool_choice",
    "logprobs": "log probabilities are not returned (ask for localspec.tokens: each token's "
                "probability under the target)",
}

Temperature = Annotated[float, Field(ge=0.0, le=API_MAX_TEMPERATURE, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


def _is_neutral(name: str, value: object) -> bool:
    return value is None or any(value == neutral for neutral in NEUTRAL[name])


class LocalSpecOptions(BaseModel):
    """The ``localspec`` extension object of a request."""

    model_config = ConfigDict(extra="forbid")
    tokens: bool = False  # each token's kind and its rejected drafts
    method: str | None = None  # one of the preset's methods (default: the preset's own)


class _Request(BaseModel):
    """The fields chat and completions share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_tokens: NewTokens | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int | None = None
    localspec: LocalSpecOptions = Field(default_factory=LocalSpecOptions)

    @model_validator(mode="after")
    def _check(self) -> _Request:
        if self.n not in (None, 1):
            raise ValueError(f"n: only n=1 is supported (one answer per request), got {self.n}")
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in NEUTRAL:
                raise ValueError(f"unrecognized request argument supplied: {name}")
            if not _is_neutral(name, value):
                why = WHY_REFUSED.get(name, "ignoring it would change the answer")
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        if len(self.stop_strings()) > API_MAX_STOP:
            raise ValueError(f"stop: at most {API_MAX_STOP} stop strings")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        options = (self.model_extra or {}).get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True


class TextPart(BaseModel):
    """A text part of a message's content (images and audio are refused)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, annotations: no effect here
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @field_validator("role", mode="before")
    @classmethod
    def _no_legacy_role(cls, value: object) -> object:
        if value == "function":
            raise ValueError("the legacy role 'function' is not supported: send the result as "
                             "a 'tool' message with the call's tool_call_id")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        """A part that is not text (an image, audio) said plainly, not as a union's error."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"only text parts are supported, got a part of type "
                                     f"{kind!r}")
        return value

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers "
                             "(and only a tool message has one)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: NewTokens | None = None
    tools: list[Tool] | None = Field(default=None, max_length=API_MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools: the function name '{twice[0]}' is declared twice")
        for name in self._chosen():
            if name not in names:
                raise ValueError(f"tool_choice: the function '{name}' is not among the tools "
                                 f"({', '.join(names) or 'none declared'})")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        self._answered_calls()
        return self

    def _chosen(self) -> list[str]:
        """The function names ``tool_choice`` names (none for its plain modes)."""
        choice = self.tool_choice
        if isinstance(choice, NamedTool):
            return [choice.function.name]
        if isinstance(choice, AllowedToolsChoice):
            return [t.function.name for t in choice.allowed_tools.tools]
        return []

    def _answered_calls(self) -> None:
        """Each tool message answers a call of the assistant message before its run of tool
        messages, as OpenAI requires."""
        calls: dict[str, str] = {}  # the open calls: id -> function name
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                if m.tool_call_id not in calls:
                    raise ValueError(f"messages.{i}: a 'tool' message must answer a tool call "
                                     f"of the assistant message before it; tool_call_id "
                                     f"'{m.tool_call_id}' names none")
            else:
                calls = {c.id: c.function.name for c in m.tool_calls or ()}

    def allowed_tools(self) -> tuple[str, ...]:
        """The functions the answer may call (none: tools are not offered at all)."""
        if not self.tools or self.tool_choice == "none":
            return ()
        return tuple(self._chosen()) or tuple(t.function.name for t in self.tools)

    def calls_required(self) -> bool:
        """Whether the answer must be tool calls and nothing else."""
        choice = self.tool_choice
        return (choice == "required" or isinstance(choice, NamedTool)
                or (isinstance(choice, AllowedToolsChoice)
                    and choice.allowed_tools.mode == "required"))

    def template_tools(self) -> list[dict[str, object]] | None:
        """The tools as the chat template offers them (all declared ones: a narrower choice is
        the grammar's), None under tool_choice "none"."""
        if not self.allowed_tools():
            return None
        return [t.function.template() for t in self.tools or ()]

    def chat(self) -> list[dict[str, object]]:
        """The messages as a chat template takes them: a developer message is a system one, an
        assistant's calls carry their arguments as objects, a tool message the function's name
        beside the call's id."""
        names: dict[str, str] = {}
        out: list[dict[str, object]] = []
        for m in self.messages:
            entry: dict[str, object] = {"role": "system" if m.role == "developer" else m.role,
                                        "content": m.text()}
            if m.tool_calls:
                entry["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.function.name,
                                                     "arguments": c.function.parsed()}}
                                       for c in m.tool_calls]
                names.update((c.id, c.function.name) for c in m.tool_calls)
            if m.tool_call_id is not None:
                entry.update(tool_call_id=m.tool_call_id, name=names.get(m.tool_call_id, ""))
            out.append(entry)
        return out

    def saved(self) -> list[dict[str, str]]:
        """The messages as the app's conversations keep them (system, user, assistant): calls
        and tool results written out as text."""
        out = []
        for m in self.chat():
            text = str(m["content"])
            for call in m.get("tool_calls", ()):
                function = call["function"]
                text += f"\n[tool call] {function['name']}({json.dumps(function['arguments'])})"
            if m["role"] == "tool":
                m["role"], text = "user", f"[tool result {m['name']}] {text}"
            out.append({"role": str(m["role"]), "content": text.strip()})
        return out

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    """``POST /v1/completions``: one raw prompt (text or token ids), no chat template."""

    prompt: str | list[str] | list[int]

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: empty")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) \
                and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a list of several is a batch)")
        return self

    def new_tokens(self) -> int | None:
        return self.max_tokens


def describe(error: ValidationError) -> tuple[str, str | None]:
    """OpenAI's ``message`` and ``param`` for a request that failed validation: the first
    problem, with where it is."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), (where or None)
