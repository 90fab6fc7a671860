"""The API served inside this process: uvicorn on a free loopback port, in a thread.

For what drives the API over real HTTP from the same process as the models: ``bench --api``
(the API's overhead against the engine called directly, on one loaded pipeline) and the tests.
The port is the system's choice (port 0), so two of these never collide; only the loopback
interface listens. ``localspec serve`` runs uvicorn in the main thread instead, on a socket
from the same ``bind``, at the address and port the user names.
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
from localspec.errors import ConfigError
from localspec.host import ModelHost

START_TIMEOUT_S = 10.0  # uvicorn starts in milliseconds; this long means it cannot
STOP_TIMEOUT_S = 10.0


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ConfigError (exit 2) when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: not an address this machine has ({exc})") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror} (another server "
                          "there? choose one with --port)") from exc
    return sock


@contextmanager
def serve_in_thread(host: ModelHost, api_key: str | None = None,
                    max_queued: int = API_MAX_QUEUED,
                    store: ChatStore | None = None) -> Iterator[str]:
    """The API over ``host`` served on a free loopback port while the block runs; yields its
    ``/v1`` URL. The server is stopped (and its thread joined) on leaving the block; a server
    that does not start is a RuntimeError (a bug, not something a user can cause)."""
    sock = bind("127.0.0.1", 0)
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
