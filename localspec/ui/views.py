"""What the handlers take and give: one ``Settings`` per generation, and the views they yield
(named tuples in the order ``layout`` wires the outputs; a field left as ``gr.skip()`` leaves
that output as it is). The conversation travels as plain-text messages; ``not_unicode`` says
why a request whose text is not valid Unicode is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import gradio as gr

from localspec.files import count_lone_surrogates

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
    conversation: Any  # gr.State: the saved conversation's id (None: not saved yet)


class PanelView(NamedTuple):
    """The saved conversations' side panel, in the order ``chats_panel`` wires it."""

    chats: Any  # the list (a radio of titles: id values)
    title: Any  # the open conversation's title, to rename it
    status: Any  # what the last action did, or why nothing is saved
    undo: Any  # the Undo button (shown after a delete)
    deleted: Any  # gr.State: the id the Undo button restores
    file: Any  # an export to download


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


def session_of(request: gr.Request | None) -> str:
    """The browser session a request comes from (its Stop button cancels only its own)."""
    return getattr(request, "session_hash", None) or "local"


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


def not_unicode(history: Messages, s: Settings, **typed: str) -> str | None:
    """Why a request is refused when its text holds lone surrogates (``typed``: the message or
    prompt, by name), else None."""
    for name, text in typed.items():
        if count := count_lone_surrogates(text):
            return (f"⚠ Your {name} holds {count} character{'s' * (count > 1)} that "
                    f"{'are' if count > 1 else 'is'} not valid Unicode (text that was not "
                    "UTF-8), shown as \ufffd: edit it, or send it as it is now.")
    if count_lone_surrogates(s.system or ""):
        return "⚠ The system prompt holds text that is not valid Unicode: edit it."
    if any(count_lone_surrogates(m["role"] + m["content"]) for m in history):
        return ("⚠ The conversation holds text that is not valid Unicode: press Clear to "
                "start a new one.")
    return None


def plain_history(history: Sequence[dict] | None) -> Messages:
    return [{"role": str(m["role"]), "content": text_of(m.get("content"))}
            for m in history or []]


@dataclass(frozen=True)
class Turn:
    """A conversation to answer, and what to put back if no answer comes."""

    messages: Messages  # ends with the user's message
    before: Messages  # the conversation as it was before the request
    message: str | None  # what goes back into the box (None: leave the box alone)
