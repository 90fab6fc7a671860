"""The app's handlers, by subject, over one ``ModelHost``: ``ChatApp`` only builds them and
holds them together for ``layout`` (and the tests) to reach.

- ``chat`` (``chat_handlers.ChatHandlers``): send, regenerate, clear, saving each turn;
- ``race`` (``race.RaceHandlers``): plain decoding against speculation on one prompt;
- ``presets`` (``preset_handlers.PresetHandlers``): the status line, the picker, a switch;
- ``turns`` (``turns.Turns``): what the generating ones share: waiting for the model, starting
  a generation, Stop (the tuning button's handler, in ``tuning_view``, uses it too).

Each is a plain class that takes its dependencies, tested without a browser.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from localspec.chats.store import ChatStore
from localspec.host import ModelHost
from localspec.models.hardware import Hardware
from localspec.ui.chat_handlers import ChatHandlers
from localspec.ui.preset_handlers import PresetHandlers
from localspec.ui.race import RaceHandlers
from localspec.ui.turns import STOP_WAIT_S, Turns


class ChatApp:
    """The handlers of the app over ``host`` on ``hardware``: ``default_preset`` is what a page
    shows before anything is loaded, ``store`` where conversations are saved (None: nowhere);
    ``min_update_interval``, ``clock`` and ``stop_wait_s``: see ``Turns``."""

    def __init__(self, host: ModelHost, hardware: Hardware, default_preset: str,
                 min_update_interval: float = 0.08,
                 clock: Callable[[], float] = time.perf_counter,
                 stop_wait_s: float = STOP_WAIT_S, store: ChatStore | None = None) -> None:
        self.host = host
        self.turns = Turns(host, min_update_interval, clock, stop_wait_s)
        self.chat = ChatHandlers(self.turns, store)
        self.race = RaceHandlers(self.turns)
        self.presets = PresetHandlers(host, hardware, default_preset)
