"""What the handlers take and give: one ``Settings`` per generation, and the views they yield
(named tuples in the order ``layout`` wires the outputs; a field left as ``gr.skip()`` leaves
that output as it is). The conversation travels as plain-text messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import gradio as gr

View = TypeVar("View")
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Settings:
    """What the side panel says about the next generation, as the controls give it. ``None``
    keeps the preset's value; nothing is checked here (``Pipeline.request`` does)."""

    system: str = ""
    method: str = "preset"  # "preset" or a registered method (localspec.registry)
    temperature: float | None = None
    top_p: float | None = None
    top_k: float | None = None
    max_new_tokens: float | None = None
    k: float | None = None
    seed: float | None = None
    show_rejected: bool = True

    def overrides(self) -> dict[str, Any]:
        """Keyword overrides for ``Pipeline.request``."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "num_speculative_tokens": self.k,
                "seed": self.seed}


class ChatView(NamedTuple):
    """The chat tab's outputs, in the order ``layout`` wires them."""

    history: Any  # gr.State: the conversation as plain-text messages
    chat: Any  # its HTML view
    message: Any  # the message box
    tokens: Any
    stats: Any
    summary: Any
    notice: Any
    spans: Any  # gr.State: the last answer's spans (re-rendered by "show rejected")


class RaceView(NamedTuple):
    race: Any
    notice: Any


class SwitchView(NamedTuple):
    status: Any
    preset: Any
    info: Any
    method: Any
    temperature: Any
    top_p: Any
    top_k: Any
    max_new_tokens: Any
    k: Any
    seed: Any


def view(kind: type[View], **fields: Any) -> View:
    """A view with the given fields; every other output is left as it is (gr.skip())."""
    return kind(**{**{name: gr.skip() for name in kind._fields}, **fields})  # type: ignore[attr-defined]


def text_of(content: Any) -> str:
    """Message content as plain text (a list of parts, a dict with "text", or a string)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, list | tuple):
        return "".join(text_of(part) for part in content)
    return "" if content is None else str(content)


def plain_history(history: Sequence[dict] | None) -> Messages:
    return [{"role": str(m["role"]), "content": text_of(m.get("content"))}
            for m in history or []]


@dataclass(frozen=True)
class Turn:
    """A conversation to answer, and what to put back if no answer comes."""

    messages: Messages  # ends with the user's message
    before: Messages  # the conversation as it was before the request
    message: str | None  # what goes back into the box (None: leave the box alone)
