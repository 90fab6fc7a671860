"""A real API server for the tests: uvicorn on a loopback port of its own, in a thread.

The tests talk to it as clients do, over HTTP: with the official ``openai`` package, or with
raw requests (httpx) for what that client would refuse to send.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from localspec.api.server import create_api, root_app
from localspec.chats.store import ChatStore
from localspec.cli.serve import bind
from localspec.config import API_MAX_QUEUED
from localspec.host import ModelHost


@contextmanager
def serving(host: ModelHost, api_key: str | None = None, max_queued: int = API_MAX_QUEUED,
            store: ChatStore | None = None) -> Iterator[str]:
    """The API over ``host`` (saving chat requests in ``store``, if given) served on a free
    loopback port; yields its ``/v1`` URL."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    api = create_api(host, api_key, max_queued, store)
    server = uvicorn.Server(uvicorn.Config(root_app(api),
                                           log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
