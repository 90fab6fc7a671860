"""The browser app: pure renderers (``render``), the model host (``host``) and the Gradio layout
(``app``). The engine never imports from here."""
