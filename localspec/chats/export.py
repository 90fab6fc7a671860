"""Conversations out and in: Markdown to read, JSON to keep or move, and a JSON export read back.

JSON (``to_json``): ``{"format": "localspec-chats", "version": 1, "exported": TIME,
"conversations": [{"id", "title", "created", "updated", "messages": [{"role", "content",
"created", "complete", and an answer's "finish_reason", "preset", "settings", "stats"}]}]}``,
times in ISO 8601 UTC to the millisecond (what the store keeps), so an export read back and
exported again is the same. ``id`` is the conversation's lasting id: importing a conversation
that is already saved skips it, so an import can be repeated.

Reading (``read_export``) trusts nothing: the file is read through ``localspec.files`` (bounded,
UTF-8, JSON nesting and lone surrogates checked) and every field against a strict schema whose
errors name the place (``conversations[2].messages[0].role``), with the store's own limits
(``MAX_CHAT_MESSAGE_CHARS``, ``MAX_CHAT_TITLE_CHARS``); any error refuses the whole file, so an
import adds all of it or nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from localspec.chats.store import MAX_CHAT_MESSAGE_CHARS, Conversation, Message, clean_title
from localspec.errors import ChatStoreError, InputFileError
from localspec.files import parse_json, read_user_text

FORMAT = "localspec-chats"
VERSION = 1
MAX_CHAT_MESSAGES = 100_000  # per conversation, in an import
MAX_ANSWER_DETAILS_CHARS = 64 * 1024  # an answer's settings or stats, as JSON
ROLE_NAMES = {"user": "You", "assistant": "LocalSpec", "system": "System"}
FINISHED = {"cancelled": "stopped by the user", "error": "ended by an error"}


def iso(ms: int) -> str:
    """Milliseconds since the epoch as ISO 8601 UTC, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def _ms(text: str) -> int:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not an ISO 8601 time: {text!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"a time needs its UTC offset (e.g. {iso(0)!r}), got {text!r}")
    return round(moment.timestamp() * 1000)


def _details(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None:
        try:
            size = len(json.dumps(value, allow_nan=False))
        except ValueError:
            raise ValueError("holds NaN or Infinity, which JSON does not have") from None
        if size > MAX_ANSWER_DETAILS_CHARS:
            raise ValueError(f"is {size:,} characters as JSON, more than the "
                             f"{MAX_ANSWER_DETAILS_CHARS:,} kept")
    return value


def _title(text: str) -> str:
    try:
        return clean_title(text)
    except ChatStoreError as exc:
        raise ValueError(str(exc)) from None


_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
Time = Annotated[str, AfterValidator(_ms)]  # an ISO 8601 time in, milliseconds since the epoch out
Details = Annotated[dict[str, Any] | None, AfterValidator(_details)]


class _Message(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_CHAT_MESSAGE_CHARS)]
    created: Time | None = None
    complete: bool = True
    finish_reason: Annotated[str, Field(max_length=64)] | None = None
    preset: Annotated[str, Field(max_length=4096)] | None = None
    settings: Details = None
    stats: Details = None


class _Conversation(BaseModel):
    model_config = _STRICT

    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    title: Annotated[str, AfterValidator(_title)]
    created: Time | None = None
    updated: Time | None = None
    messages: Annotated[list[_Message], Field(max_length=MAX_CHAT_MESSAGES)]


class _Export(BaseModel):
    model_config = _STRICT

    format: Literal["localspec-chats"]
    version: int
    exported: Time | None = None
    conversations: list[_Conversation]


# ----------------------------------------------------------------------------- writing


def _message_json(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content, "created": iso(m.created_ms),
                           "complete": m.complete}
    for name in ("finish_reason", "preset", "settings", "stats"):
        if getattr(m, name) is not None:
            out[name] = getattr(m, name)
    return out


def to_json(conversations: Sequence[Conversation], now_ms: int) -> dict[str, Any]:
    """The export of ``conversations`` as a JSON value (``json.dumps`` writes it)."""
    return {"format": FORMAT, "version": VERSION, "exported": iso(now_ms),
            "conversations": [{"id": c.uid, "title": c.title, "created": iso(c.created_ms),
                               "updated": iso(c.updated_ms),
                               "messages": [_message_json(m) for m in c.messages]}
                              for c in conversations]}


def _number(stats: dict[str, Any], key: str) -> float | None:
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def answer_line(m: Message) -> str:
    """What is known of how an answer was made, on one line: preset, method, speed,
    acceptance, tokens per target pass, and how it ended ("" for a user's message)."""
    if m.role != "assistant":
        return ""
    stats = m.stats or {}
    parts = [f"preset `{m.preset}`"] if m.preset else []
    if isinstance(stats.get("method"), str):
        parts.append(f"method {stats['method']}")
    if (speed := _number(stats, "tokens_per_second")) is not None:
        parts.append(f"{speed:.1f} tok/s")
    if (accept := _number(stats, "acceptance_rate")) is not None:
        parts.append(f"acceptance {accept:.0%}")
    if (per_pass := _number(stats, "tokens_per_pass")) is not None:
        parts.append(f"{per_pass:.2f} tokens per target pass")
    if not m.complete:
        parts.append("cut: the answer was interrupted before it ended")
    elif m.finish_reason in FINISHED:
        parts.append(FINISHED[m.finish_reason])
    return " · ".join(parts)


def _fence(text: str) -> str:
    """A backtick fence longer than any run of backticks in ``text``."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def to_markdown(conversations: Sequence[Conversation]) -> str:
    """The conversations to read: a heading each, then every message under its author and
    time; an answer with how it was made. A system prompt is set in a code block."""
    parts = []
    for c in conversations:
        lines = [f"# {c.title}", "",
                 f"*{len(c.messages)} messages, {iso(c.created_ms)[:16].replace('T', ' ')} to "
                 f"{iso(c.updated_ms)[:16].replace('T', ' ')} UTC*", ""]
        for m in c.messages:
            when = iso(m.created_ms)[:19].replace("T", " ")
            lines += [f"## {ROLE_NAMES[m.role]} · {when}", ""]
            if details := answer_line(m):
                lines += [f"*{details}*", ""]
            if m.role == "system":
                fence = _fence(m.content)
                lines += [fence, m.content, fence, ""]
            else:
                lines += [m.content, ""]
        parts.append("\n".join(lines))
    return "\n---\n\n".join(parts)


# ----------------------------------------------------------------------------- reading


def _where(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def parse_export(value: object, where: str) -> list[Conversation]:
    """The conversations of a parsed JSON export, checked; ``InputFileError`` naming ``where``
    and the field otherwise."""
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise InputFileError(f"{where}: not a LocalSpec conversations export (it has no "
                             f'"format": "{FORMAT}"); export one with `localspec chats export '
                             "--format json` or the app's Export")
    version = value.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise InputFileError(f"{where}: export version {version} comes from a newer LocalSpec "
                             f"(this one reads up to {VERSION})")
    try:
        export = _Export.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        shown = "; ".join(f"{_where(tuple(e['loc']))}: "
                          f"{str(e['msg']).removeprefix('Value error, ')}" for e in errors[:3])
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise InputFileError(f"{where}: {shown}{more}") from None
    if export.version < 1:
        raise InputFileError(f"{where}: version: an export's version is 1 or more, not "
                             f"{export.version}")
    out = []
    for c in export.conversations:
        messages = tuple(Message(m.role, m.content, m.complete, m.finish_reason, m.preset,
                                 m.settings, m.stats, m.created or 0, m.created or 0)
                         for m in c.messages)
        extra = {"uid": c.id} if c.id else {}
        out.append(Conversation(c.title, messages, created_ms=c.created or 0,
                                updated_ms=c.updated or 0, **extra))
    return out


def read_export(path: str | Path) -> list[Conversation]:
    """The conversations of the JSON export file ``path``, checked (``InputFileError``)."""
    text = read_user_text(path, "conversations export")
    return parse_export(parse_json(text, str(path)), str(path))
