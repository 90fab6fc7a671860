"""The saved conversations' side panel on the page: its components and their events.

Layout and wiring only; ``conversations.Conversations`` does the work. The list is a radio of
titles whose values are conversation ids; the tab's open conversation is a ``gr.State`` beside
its messages (``ChatTab.conversation``), so each browser tab has its own. The list follows that
id: it is drawn again when the id changes (the first message of a new conversation), when an
answer ends (a continued conversation moves to the top), and after each action of the panel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr

from localspec.ui.conversations import FORMATS, Conversations
from localspec.ui.views import PanelView, session_of

CHATS_CSS = """
#ls-chats { max-height: 460px; overflow-y: auto; }
#ls-chats label { width: 100%; }
.ls-chats-status { font-size: 0.85em; overflow-wrap: anywhere; }
"""


@dataclass
class ChatsPanel:
    """The side panel's components, for wiring."""

    chats: gr.Radio
    search: gr.Textbox
    new: gr.Button
    title: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    undo: gr.Button
    deleted: gr.State
    format: gr.Radio
    export_one: gr.Button
    export_all: gr.Button
    load: gr.UploadButton
    file: gr.File
    status: gr.HTML

    def outputs(self) -> list[gr.components.Component]:
        return [getattr(self, name) for name in PanelView._fields]


def build_panel() -> ChatsPanel:
    """The panel's components, in the column the caller opened."""
    gr.Markdown("**Conversations**")
    new = gr.Button("+ New conversation", size="sm", elem_id="ls-chat-new")
    search = gr.Textbox(placeholder="Search…", show_label=False, max_lines=1,
                        elem_id="ls-chat-search")
    chats = gr.Radio([], value=None, show_label=False, elem_id="ls-chats")
    status = gr.HTML("", elem_id="ls-chats-status", js_on_load=None)
    undo = gr.Button("Undo delete", size="sm", visible=False, elem_id="ls-chat-undo")
    with gr.Accordion("Rename, delete, export, import", open=False, elem_id="ls-chat-tools"):
        title = gr.Textbox(label="Title", max_lines=1, elem_id="ls-chat-title")
        with gr.Row():
            rename = gr.Button("Rename", size="sm", elem_id="ls-chat-rename")
            delete = gr.Button("Delete", size="sm", variant="stop", elem_id="ls-chat-delete")
        fmt = gr.Radio([(name, key) for key, name in FORMATS.items()], value="md",
                       label="Export as", elem_id="ls-chat-format")
        with gr.Row():
            export_one = gr.Button("Export this", size="sm", elem_id="ls-chat-export")
            export_all = gr.Button("Export all", size="sm", elem_id="ls-chat-export-all")
        load = gr.UploadButton("Import JSON…", size="sm", file_types=[".json"],
                               type="filepath", elem_id="ls-chat-import")
        file = gr.File(label="Download", interactive=False, elem_id="ls-chat-file")
    return ChatsPanel(chats, search, new, title, rename, delete, undo, gr.State(None), fmt,
                      export_one, export_all, load, file, status)


def wire_panel(conversations: Conversations, panel: ChatsPanel, conversation: gr.State,
               chat_outputs: Sequence[gr.components.Component],
               answers: Sequence[Any]) -> None:
    """The panel's events. ``conversation``: the tab's open conversation (the chat's state);
    ``chat_outputs``: the chat's outputs (a ``ChatView``); ``answers``: the events that
    generate an answer (the list is drawn again when each ends)."""
    outputs = panel.outputs()
    both = [*chat_outputs, *outputs]

    def listing(search: str | None, current: int | None) -> PanelView:
        return conversations.listing(search, current)

    def refresh(search: str | None, current: int | None) -> PanelView:
        """The list drawn again; the rename box keeps what the user may be typing."""
        return conversations.listing(search, current, retitle=False)

    def open_(chosen: int | None, search: str | None, request: gr.Request) -> tuple:
        return conversations.open(chosen, session_of(request), search)

    def new(search: str | None, request: gr.Request) -> tuple:
        return conversations.new(session_of(request), search)

    def delete(current: int | None, search: str | None, request: gr.Request) -> tuple:
        return conversations.delete(current, session_of(request), search)

    def undo(deleted: int | None, search: str | None, request: gr.Request) -> tuple:
        return conversations.undo(deleted, session_of(request), search)

    def export(every: bool) -> Any:
        return lambda current, fmt: conversations.export(current, fmt, every)

    conversation.change(listing, [panel.search, conversation], outputs, queue=False,
                        show_progress="hidden")
    for event in answers:
        event.then(refresh, [panel.search, conversation], outputs, queue=False,
                   show_progress="hidden")
    panel.search.change(refresh, [panel.search, conversation], outputs, queue=False,
                        show_progress="hidden")  # typed, pasted or cleared
    panel.chats.input(open_, [panel.chats, panel.search], both, show_progress="hidden")
    panel.new.click(new, [panel.search], both, queue=False)
    panel.delete.click(delete, [conversation, panel.search], both, queue=False)
    panel.undo.click(undo, [panel.deleted, panel.search], both, queue=False)
    for trigger in (panel.rename.click, panel.title.submit):
        trigger(conversations.rename, [conversation, panel.title, panel.search], outputs,
                queue=False)
    panel.export_one.click(export(False), [conversation, panel.format], outputs)
    panel.export_all.click(export(True), [conversation, panel.format], outputs)
    panel.load.upload(conversations.import_file, [panel.load, panel.search, conversation],
                      outputs)
