"""``localspec chats list | show ID | export [ID] | import FILE``: the app's saved conversations
from the command line.

The same store as the app's (``localspec.chats``), in the data folder (``$LOCALSPEC_DATA``, else
the platform's user data folder); safe to run while the app is open (SQLite's WAL mode lets
both read and write). A damaged database is set aside on open, as the app does, with a warning.
Every failure a user can cause (no such conversation, a file that is not an export, a folder
that cannot be written) ends with one line and exit status 2, like every other command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from localspec.chats.export import iso, read_export, to_json, to_markdown
from localspec.chats.store import ChatStore, Conversation
from localspec.errors import ChatNotFoundError, InputFileError


def _when(ms: int) -> str:
    return iso(ms)[:16].replace("T", " ")


def _list(store: ChatStore, args: argparse.Namespace) -> int:
    rows = store.list(args.search)
    if args.json:
        print(json.dumps({"database": str(store.path), "conversations": [
            {"id": r.id, "title": r.title, "created": iso(r.created_ms),
             "updated": iso(r.updated_ms), "messages": r.messages} for r in rows]},
            ensure_ascii=False))
        return 0
    if not rows:
        holding = f" holding {args.search.strip()!r}" if args.search.strip() else ""
        print(f"No saved conversations{holding} in {store.path}.")
        return 0
    print(f"{'ID':>6}  {'UPDATED (UTC)':<16}  {'MESSAGES':>8}  TITLE")
    for r in rows:
        print(f"{r.id:>6}  {_when(r.updated_ms):<16}  {r.messages:>8}  {r.title}")
    return 0


def _get(store: ChatStore, conversation: int) -> Conversation:
    try:
        return store.get(conversation)
    except ChatNotFoundError as exc:
        raise ChatNotFoundError(f"{exc} in {store.path}; `localspec chats list` lists them") \
            from None


def _show(store: ChatStore, args: argparse.Namespace) -> int:
    conversation = _get(store, args.id)
    if args.json:
        print(json.dumps(to_json([conversation], round(time.time() * 1000)),
                         ensure_ascii=False))
    else:
        print(to_markdown([conversation]))
    return 0


def write_text(path: Path, text: str, what: str) -> None:
    """``text`` into ``path`` as UTF-8, whole or not at all (a temporary file renamed over
    it); ``InputFileError`` naming the file when it cannot be written."""
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        raise InputFileError(f"{path}: cannot write the {what}: {exc.strerror or exc}") from exc


def _export(store: ChatStore, args: argparse.Namespace) -> int:
    if args.id is not None:
        conversations = [_get(store, args.id)]
    else:
        conversations = [store.get(row.id) for row in reversed(store.list(limit=None))]
    if args.format == "json":
        text = json.dumps(to_json(conversations, round(time.time() * 1000)),
                          ensure_ascii=False, indent=1) + "\n"
    else:
        text = to_markdown(conversations) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    write_text(Path(args.out).expanduser(), text, "export")
    print(f"Wrote {len(conversations)} conversation{'s' * (len(conversations) != 1)} to "
          f"{args.out}", file=sys.stderr)
    return 0


def _import(store: ChatStore, args: argparse.Namespace) -> int:
    added, skipped = store.add(read_export(args.file))
    already = f"; {skipped} already saved, skipped" if skipped else ""
    print(f"Imported {added} conversation{'s' * (added != 1)} into {store.path}{already}.")
    return 0


def run_chats(args: argparse.Namespace) -> int:
    """Run ``args.verb`` on the saved conversations."""
    verbs = {"list": _list, "show": _show, "export": _export, "import": _import}
    with ChatStore() as store:
        return verbs[args.verb](store, args)
