"""LocalSpec: lossless speculative decoding for local LLMs, shown token by token."""

__version__ = "0.1.0"
