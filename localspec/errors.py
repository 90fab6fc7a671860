"""The errors a user can cause and fix, as one family.

Every layer raises a subclass of ``LocalSpecError`` for an expected failure (a bad preset, a
missing model, a corrupted cache, an over-long prompt, an out-of-range setting) with a message
that says what is wrong and what to do. The command line turns these, and only these, into a
one-line message and exit status 2; the app shows them in the chat. Anything else is a bug and
is logged with its traceback.
"""

from __future__ import annotations


class LocalSpecError(Exception):
    """An expected failure; the message is meant for the user."""


class ConfigError(LocalSpecError, ValueError):
    """A preset or a request setting is invalid; the message names the key and what is allowed."""


class PresetError(ConfigError):
    """A preset is missing, unreadable or invalid; the message says where and why."""


class RequestError(ConfigError):
    """A generation request's settings are out of range."""


class InputFileError(LocalSpecError):
    """A file the user pointed at (prompts, models) cannot be used as given."""


class ModelLoadError(LocalSpecError):
    """A model could not be found, assembled, converted or loaded; the message says what to do."""


class ChatStoreError(LocalSpecError):
    """The saved conversations cannot be used as asked: a folder that cannot be written, a
    database another process holds too long, a title or an import that is not valid."""


class ChatNotFoundError(ChatStoreError):
    """No saved conversation has the id given (or it was deleted)."""
