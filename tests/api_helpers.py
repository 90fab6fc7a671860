"""A real API server for the tests: uvicorn on a loopback port of its own, in a thread.

The tests talk to it as clients do, over HTTP: with the official ``openai`` package, or with
raw requests (httpx) for what that client would refuse to send. The server is the package's
own ``serve_in_thread``, the one ``bench --api`` measures through.
"""

from __future__ import annotations

from localspec.api.local_server import serve_in_thread

# serving(host, api_key=None, max_queued=API_MAX_QUEUED, store=None): the API over ``host``
# (saving chat requests in ``store``, if given) on a free loopback port while the block runs;
# yields its ``/v1`` URL.
serving = serve_in_thread
