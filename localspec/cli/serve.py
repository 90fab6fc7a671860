"""``localspec serve``: the OpenAI-compatible API over one preset, under uvicorn.

The port is bound and the preset file read before anything loads (a taken port or a typo costs
no model load and ends with exit 2); the models then load in the background while the server
already answers (503 with Retry-After until they are ready, so a client can wait for them).
With ``--save-chats`` each chat request is saved with the app's conversations; a store that
cannot be opened is then an error (exit 2), since saving was asked for. The saved answers are
then the suffix drafter's history too (read at load, added to as answers finish), unless
``--no-history-drafts``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
import threading

from localspec.api.local_server import bind
from localspec.api.server import api_key, create_api, root_app
from localspec.chats.store import ChatStore
from localspec.host import ModelHost
from localspec.presets import load_preset

logger = logging.getLogger("localspec.serve")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _report_load(model_host: ModelHost, preset: str) -> None:
    model_host.wait_loaded(timeout=24 * 3600)
    status = model_host.status()
    if status.active is not None:
        print(f"localspec: preset '{preset}' loaded: ready", file=sys.stderr, flush=True)
    else:
        print(f"localspec: {status.error}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    load_preset(args.preset)  # a missing or broken preset: exit 2 before the port is taken
    key = api_key(args.api_key)
    store = ChatStore() if args.save_chats else None
    sock = bind(args.host, args.port)
    history = None if getattr(args, "no_history_drafts", False) else store
    model_host = ModelHost(parallel=args.parallel, history=history)
    app = root_app(create_api(model_host, key, args.max_queued, store))
    model_host.load_async(args.preset)
    threading.Thread(target=_report_load, args=(model_host, args.preset), daemon=True).start()
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"localspec: OpenAI-compatible API at http://{shown}:{args.port}/v1 (preset "
          f"'{args.preset}', loading; {'an API key is needed' if key else 'no API key'})",
          file=sys.stderr, flush=True)
    if store is not None:
        print(f"localspec: saving chat requests in {store.path}", file=sys.stderr, flush=True)
    if not is_loopback(args.host) and key is None:
        print(f"localspec: warning: listening on {args.host} without an API key: anyone who "
              "can reach this machine can use it (set --api-key)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=2))
    server.run(sockets=[sock])
    return 0
