"""The API served inside this process: uvicorn on a free loopback port, in a thread.

For what drives the API over real HTTP from the same process as the models: ``bench --api``
(the API's overhead against the engine called directly, on one loaded pipeline) and the tests.
The port is the system's choice (port 0), so two of these never collide; only the loopback
interface listens. ``localspec serve`` does not use it: it runs uvicorn in the main thread, on
the address and port the user names.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from localspec.api.server import create_api, root_app
from localspec.chats.store import ChatStore
from localspec.config import API_MAX_QUEUED
from localspec.host import ModelHost

START_TIMEOUT_S = 10.0  # uvicorn starts in milliseconds; this long means it cannot
STOP_TIMEOUT_S = 10.0


def _loopback_socket() -> socket.socket:
    """A socket listening on 127.0.0.1 at a port nobody holds."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


@contextmanager
def serve_in_thread(host: ModelHost, api_key: str | None = None,
                    max_queued: int = API_MAX_QUEUED,
                    store: ChatStore | None = None) -> Iterator[str]:
    """The API over ``host`` served on a free loopback port while the block runs; yields its
    ``/v1`` URL. The server is stopped (and its thread joined) on leaving the block; a server
    that does not start is a RuntimeError (a bug, not something a user can cause)."""
    sock = _loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(root_app(create_api(host, api_key, max_queued, store)),
                                           log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"api-server-{port}")
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server on 127.0.0.1:{port} did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_TIMEOUT_S)
        sock.close()
