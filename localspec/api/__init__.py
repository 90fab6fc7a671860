"""The OpenAI-compatible HTTP API over the model host (``localspec serve``, ``/v1`` of the app)."""
