"""``python app.py`` (or ``localspec-app``): the LocalSpec chat in your browser.

Thin: parse flags, start loading the preset in the background, open the saved conversations
(``localspec.chats``; a folder that cannot be written leaves the app working without saving, and
the page says so), open the page at once (it shows the loading progress), serve on loopback
unless ``--host`` says otherwise, with the OpenAI-compatible API (``localspec/api/``) at ``/v1``
of the same server. The UI lives in ``localspec/ui/``.
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from localspec.config import API_KEY_ENV, DEFAULT_PRESET, MAX_PARALLEL

    def parallel(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= MAX_PARALLEL:
            raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_PARALLEL}, got "
                                             f"{text!r}")
        return int(text)

    parser = argparse.ArgumentParser(description="LocalSpec: chat with speculative decoding")
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help="a shipped preset (see `localspec presets`) or a .toml path")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true",
                        help="also open a public Gradio share link (off by default)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on the API's routes under "
                             f"/v1 (default: ${API_KEY_ENV} if set, else no key)")
    parser.add_argument("--parallel", type=parallel, default=1,
                        help="API requests (under /v1) generated at once, sharing target "
                             "passes; the page's own answers stay one at a time (default 1)")
    parser.add_argument("--no-history-drafts", action="store_true",
                        help="the suffix drafter reads no saved answers (by default it learns "
                             "from your conversations, on this machine only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from starlette.routing import Mount

    from localspec.api.server import api_key, create_api
    from localspec.chats.store import ChatStore
    from localspec.errors import ChatStoreError
    from localspec.host import ModelHost
    from localspec.models.hardware import detect_hardware
    from localspec.ui.app import APP_CSS, build_app

    store, problem = None, ""
    try:
        store = ChatStore()
    except ChatStoreError as exc:
        problem = str(exc)
        logging.getLogger(__name__).warning("%s", exc)
    host = ModelHost(parallel=args.parallel, history=None if args.no_history_drafts else store)
    host.load_async(args.preset)
    key = api_key(args.api_key)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    demo = build_app(host, detect_hardware(), args.preset,
                     api_url=f"http://{shown}:{args.port}/v1", api_key_needed=key is not None,
                     store=store, store_problem=problem)
    demo.queue()
    # The API is a route of the app's own server: the page and API clients share the models
    # and the one queue.
    demo.launch(server_name=args.host, server_port=args.port, share=args.share,
                inbrowser=not args.no_browser, css=APP_CSS, ssr_mode=False,
                footer_links=["settings"],
                app_kwargs={"routes": [Mount("/v1", app=create_api(host, key))]})


if __name__ == "__main__":
    main()
