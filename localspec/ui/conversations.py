"""The saved conversations' side panel: the list (newest first, filtered by a search), open,
new, rename, delete with undo, export one or all as Markdown or JSON, import a JSON export.

Plain functions over the chat's handlers (``ChatHandlers``) and their ``ChatStore``, returning
views (``PanelView``, and a ``ChatView`` for what changes the chat): tests call them without a
browser, ``chats_panel`` wires them. Opening a conversation (or starting a new one, or deleting
the open one) first stops this tab's running answer, as Clear does; the tab then holds the
opened messages and id, and the next message continues that conversation with the loaded preset
(each answer keeps the preset it was made with). Every failure a user can meet (a conversation
deleted in another tab, a title too long, a file that is not an export, a store that stopped
working) is said in the panel's status line; with no store at all, the panel says why nothing is
saved and the chat works as before. Titles are shown by Gradio as text, never as HTML.
"""

from __future__ import annotations

import html
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr

from localspec.chats.export import read_export, to_json, to_markdown
from localspec.chats.store import Conversation, Summary
from localspec.errors import InputFileError, LocalSpecError
from localspec.ui.chat_handlers import ChatHandlers
from localspec.ui.chat_view import chat_html
from localspec.ui.render import spans_html
from localspec.ui.views import ChatView, PanelView, view

FORMATS = {"md": "Markdown", "json": "JSON"}


def shown(visible: bool) -> Any:
    """An update that shows or hides a button (the Undo button)."""
    return gr.update(visible=visible)


def status_html(text: str) -> str:
    """The panel's status line, escaped (it quotes titles, paths and file contents)."""
    if not text:
        return ""
    kind = "ls-error" if text.startswith("⚠") else "ls-info"
    return f'<div class="ls-chats-status {kind}">{html.escape(text, quote=False)}</div>'


def label(row: Summary) -> str:
    """A line of the list: the title and when it last changed (this computer's time)."""
    when = time.strftime("%d %b %H:%M", time.localtime(row.updated_ms / 1000))
    return f"{row.title} · {when}"


class Conversations:
    """The side panel's handlers over ``chat.store`` (None: nothing saved, ``problem`` says
    why); ``chat`` clears the tab before it shows another conversation."""

    def __init__(self, chat: ChatHandlers, problem: str = "") -> None:
        self.chat = chat
        self.store = chat.store
        self.problem = problem
        self._exports: Path | None = None  # a folder of this app's own for export files

    # ------------------------------------------------------------------ the list

    def intro(self) -> str:
        """The status line when a page opens: where conversations are saved, and what became
        of a damaged database; or why nothing is saved."""
        if self.store is None:
            why = self.problem or "no store was given"
            return status_html(f"⚠ Conversations are not being saved: {why}")
        aside = self.store.set_aside_to
        if aside is not None:
            return status_html(f"⚠ The conversations database could not be read; it was kept "
                               f"as {aside} and a new one started.")
        return status_html(f"Saved on this computer in {self.store.path}")

    def listing(self, search: str | None = "", current: int | None = None, *,
                retitle: bool = True, **fields: Any) -> PanelView:
        """The list (newest first; only those holding ``search``), ``current`` selected, and,
        with ``retitle``, its title in the rename box (without, the box keeps what the user
        may be typing there); ``fields``: the panel's other outputs."""
        if self.store is None:
            return view(PanelView, chats=gr.Radio(choices=[], value=None), **fields)
        try:
            rows = self.store.list(search or "")
            title = self.store.get(current).title if current is not None else ""
        except LocalSpecError as exc:
            return view(PanelView, status=status_html(f"⚠ {exc}"), **fields)
        listed = {row.id for row in rows}
        choices = [(label(row), row.id) for row in rows]
        if retitle:
            fields["title"] = title
        return view(PanelView, chats=gr.Radio(choices=choices,
                                              value=current if current in listed else None),
                    **fields)

    def page(self) -> PanelView:
        """What a page opening shows: the list and the status line."""
        return self.listing(status=self.intro())

    # ------------------------------------------------------------------ open, new, delete

    def _opened(self, c: Conversation, search: str | None, says: str, **fields: Any) -> tuple:
        messages = [{"role": m.role, "content": m.content} for m in c.messages]
        chat = ChatView(messages, chat_html(messages), gr.skip(), spans_html([]), "", "", "",
                        [], c.id)
        return (*chat, *self.listing(search, c.id, status=status_html(says), undo=shown(False),
                                     **fields))

    def open(self, conversation: int | None, session: str = "local",
             search: str | None = "") -> tuple:
        """Show ``conversation`` in this tab (its running answer stopped first): the chat's
        views, then the panel's."""
        if conversation is None or self.store is None:
            return (*view(ChatView), *view(PanelView))
        self.chat.clear(session)
        try:
            c = self.store.get(conversation)
        except LocalSpecError as exc:
            return (*self.chat.clear(session), *self.listing(search, None,
                                                            status=status_html(f"⚠ {exc}")))
        presets = {m.preset for m in c.messages if m.preset}
        made = f"; answered with {', '.join(sorted(presets))}" if presets else ""
        cut = sum(not m.complete for m in c.messages)
        cuts = f"; {cut} answer{'s' * (cut > 1)} cut short" if cut else ""
        return self._opened(c, search, f"Opened '{c.title}' ({len(c.messages)} messages"
                                       f"{made}{cuts}). Send a message to go on with it.")

    def new(self, session: str = "local", search: str | None = "") -> tuple:
        """A new conversation in this tab (the open one stays saved)."""
        return (*self.chat.clear(session), *self.listing(search, None, undo=shown(False)))

    def delete(self, conversation: int | None, session: str = "local",
               search: str | None = "") -> tuple:
        """Delete the open conversation (Undo brings it back) and start a new one."""
        if self.store is None or conversation is None:
            return (*view(ChatView), *view(PanelView, status=status_html(
                "No saved conversation is open: nothing to delete.")))
        try:
            title = self.store.get(conversation).title
            self.store.delete(conversation)
        except LocalSpecError as exc:
            return (*view(ChatView), *view(PanelView, status=status_html(f"⚠ {exc}")))
        return (*self.chat.clear(session), *self.listing(
            search, None, status=status_html(f"Deleted '{title}'."), deleted=conversation,
            undo=shown(True)))

    def undo(self, deleted: int | None, session: str = "local",
             search: str | None = "") -> tuple:
        """Bring back the conversation this tab deleted last, and open it."""
        if self.store is None or deleted is None:
            return (*view(ChatView), *view(PanelView, undo=shown(False)))
        try:
            self.store.restore(deleted)
            c = self.store.get(deleted)
        except LocalSpecError as exc:
            return (*view(ChatView), *view(PanelView, status=status_html(f"⚠ {exc}"),
                                           undo=shown(False)))
        self.chat.clear(session)
        return self._opened(c, search, f"Restored '{c.title}'.", deleted=None)

    def rename(self, conversation: int | None, title: str | None,
               search: str | None = "") -> PanelView:
        """Give the open conversation the title in the box."""
        if self.store is None or conversation is None:
            return view(PanelView, status=status_html(
                "Open a saved conversation (or send a message) to rename it."))
        try:
            name = self.store.rename(conversation, title or "")
        except LocalSpecError as exc:
            return view(PanelView, status=status_html(f"⚠ {exc}"))
        return self.listing(search, conversation, status=status_html(f"Renamed to '{name}'."))

    # ------------------------------------------------------------------ export, import

    def export(self, conversation: int | None, fmt: str, every: bool) -> PanelView:
        """The open conversation (or, ``every``, all of them) as a file to download."""
        if self.store is None:
            return view(PanelView, status=self.intro())
        if not every and conversation is None:
            return view(PanelView, status=status_html(
                "Open a saved conversation to export it (or export all)."))
        try:
            ids = ([conversation] if not every
                   else [row.id for row in reversed(self.store.list(limit=None))])
            chats = [self.store.get(i) for i in ids]
        except LocalSpecError as exc:
            return view(PanelView, status=status_html(f"⚠ {exc}"))
        if self._exports is None:
            self._exports = Path(tempfile.mkdtemp(prefix="localspec-exports-"))
        name = "localspec-chats" if every else f"localspec-chat-{conversation}"
        path = self._exports / f"{name}.{fmt}"
        text = (json.dumps(to_json(chats, round(time.time() * 1000)), ensure_ascii=False,
                           indent=1) if fmt == "json" else to_markdown(chats)) + "\n"
        path.write_text(text, encoding="utf-8")
        count = f"{len(chats)} conversation{'s' * (len(chats) != 1)}"
        return view(PanelView, file=str(path), status=status_html(
            f"Exported {count} as {FORMATS[fmt]}: download it below."))

    def import_file(self, path: str | None, search: str | None = "",
                    current: int | None = None) -> PanelView:
        """Add the conversations of an uploaded JSON export (those already saved are
        skipped)."""
        if self.store is None:
            return view(PanelView, status=self.intro())
        if not path:
            return view(PanelView)
        name = Path(path).name
        try:
            added, skipped = self.store.add(read_export(path))
        except InputFileError as exc:  # named by the upload's temporary path: use its name
            return view(PanelView, status=status_html(f"⚠ {str(exc).replace(path, name)}"))
        except LocalSpecError as exc:
            return view(PanelView, status=status_html(f"⚠ {exc}"))
        already = f"; {skipped} already saved" if skipped else ""
        return self.listing(search, current, status=status_html(
            f"Imported {added} conversation{'s' * (added != 1)} from {name}{already}."))
