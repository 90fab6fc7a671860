"""What the API accepts: OpenAI's request bodies, checked field by field.

Clients send more than the fields that shape an answer. A field that cannot change the answer
(``user``, ``store``, ``metadata``) is accepted and ignored; a field at its neutral value
(``frequency_penalty: 0``, ``tools: []``, ``logprobs: false``) likewise; at any other value
ignoring it would change the answer, so it is refused with a 400 that names it, as is a field
nobody sends (a typo such as ``temprature`` must not pass silently). ``top_k`` is read, as vLLM
and llama.cpp's server do. Our own extension lives under ``localspec``: ``tokens`` asks for
each token's kind and its rejected drafts, ``method`` picks one of the preset's methods.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from localspec.config import MAX_SEED, NewTokens, TopK, TopP

API_MAX_STOP = 4  # stop strings per request, as OpenAI allows
API_MAX_TEMPERATURE = 2.0  # OpenAI's range

# Fields that never change an answer: accepted, ignored.
IGNORED = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls",
                     "reasoning_effort", "prompt_cache_key", "safety_identifier", "stream_options",
                     "web_search_options"})
# Fields ignored at these values only (what clients send by default); other values are refused.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "min_p": (0,), "logprobs": (False, 0), "top_logprobs": (0,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
    "modalities": (["text"],), "audio": (), "prediction": (), "echo": (False,),
    "best_of": (1,), "suffix": ("",),
}
WHY_REFUSED = {
    "tools": "tool calling is not supported",
    "functions": "tool calling is not supported",
    "logprobs": "log probabilities are not returned (ask for localspec.tokens: each token's "
                "probability under the target)",
    "response_format": "only free text is supported (no JSON mode)",
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
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: NewTokens | None = None

    def chat(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them (a developer message is a system one)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

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
