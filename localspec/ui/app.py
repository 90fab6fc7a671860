"""The Gradio app: chat with colour-coded speculation, a live readout, presets and race mode.

Where things are: ``handlers`` (``ChatApp``: the handlers by subject, plain generators tested
without a browser: ``chat_handlers``, ``race``, ``preset_handlers``, and ``turns``, what the
generating ones share), ``layout`` (the ``gr.Blocks`` over them), ``streaming`` (the one loop
from StepEvents to snapshots), ``views`` (``Settings`` and the outputs' shapes), the saved
conversations (``saving``: a turn as it happens; ``conversations`` and ``chats_panel``: the side
list), and the pure renderers ``render`` (tokens, readout, race, status), ``chat_view`` (the
conversation: Markdown rendered by ``markdown`` into HTML that cannot fetch, and the verbatim
text) and ``preset_view``. The models come from a ``ModelHost``, which the app is given; nothing
here touches tensors.
"""

from __future__ import annotations

import gradio as gr

from localspec.chats.store import ChatStore
from localspec.host import ModelHost
from localspec.models.hardware import Hardware
from localspec.ui.chat_view import CHAT_CSS
from localspec.ui.chats_panel import CHATS_CSS
from localspec.ui.conversations import Conversations
from localspec.ui.handlers import ChatApp
from localspec.ui.layout import build
from localspec.ui.preset_view import api_html
from localspec.ui.render import CSS
from localspec.ui.views import ChatView, RaceView, Settings, SwitchView

__all__ = ["APP_CSS", "CHAT_OUTPUTS", "RACE_OUTPUTS", "SWITCH_OUTPUTS", "ChatApp", "Settings",
           "build_app"]

CHAT_OUTPUTS = ChatView._fields
SWITCH_OUTPUTS = SwitchView._fields
RACE_OUTPUTS = RaceView._fields
EXTRA_CSS = """
.ls-error { color: #b91c1c; font-weight: 600; }
.ls-loading progress { vertical-align: middle; width: 160px; }
#ls-notice { min-height: 1.5em; }
"""
APP_CSS = CSS + CHAT_CSS + CHATS_CSS + EXTRA_CSS


def build_app(host: ModelHost, hardware: Hardware, default_preset: str,
              api_url: str | None = None, api_key_needed: bool = False,
              store: ChatStore | None = None, store_problem: str = "") -> gr.Blocks:
    """The app over ``host`` (which the caller starts loading), saying where its API is when
    ``api_url`` is given, saving conversations in ``store`` (None: nowhere, and the page says
    why: ``store_problem``). Launch with ``css=APP_CSS``."""
    app = ChatApp(host, hardware, default_preset, store=store)
    return build(app, api_html(api_url, api_key_needed), Conversations(app.chat, store_problem))
