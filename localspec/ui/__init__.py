"""The browser app: pure renderers (``render``, ``chat_view``, ``preset_view``), the model host
(``host``), the handlers (``handlers``) and the Gradio layout (``layout``); ``app`` puts them
together. The engine never imports from here."""

import os

# Before anything here imports gradio: the app never phones home.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
