"""Saved conversations: a local SQLite database of every chat, its answers' presets, settings
and speculation summaries; export and import as Markdown and JSON.

``schema`` opens the file (WAL mode, a schema version and its migrations, a damaged file set
aside), ``store`` reads and writes conversations (``ChatStore``), ``answers`` saves an answer as
it streams, ``export`` writes and reads exports. Torch-free and Gradio-free: the app, the
command line and the API server use it alike.
"""
