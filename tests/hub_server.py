"""A local stand-in for the Hugging Face Hub, for the download tests: the routes
``huggingface_hub`` 2.4 calls for a download, served from repos the tests build in memory.

- ``GET /api/models/{org}/{name}/revision/{rev}`` (``HfApi.model_info``): the repo's id, commit
  and files with their sizes (``?blobs=true``);
- ``HEAD /{org}/{name}/resolve/{rev}/{file}`` (``get_hf_file_metadata``): ``X-Repo-Commit``,
  ``ETag``, ``Content-Length``;
- ``GET`` of the same (``http_get``): the bytes, or the rest of them for ``Range: bytes=N-``
  (206 with ``Content-Range``);
- ``GET /api/models/{org}/{name}/tree/{rev}`` (``snapshot_download``'s listing, for the tests
  that fill a Hugging Face cache).

A missing repo answers 404 with ``X-Error-Code: RepoNotFound`` and a gated one 401 or 403 with
``GatedRepo``, as the Hub does (``hf_raise_for_status`` turns those into its errors). Faults
the tests ask for: ``drop_once`` cuts the first transfer of a file halfway (the connection is
closed mid-body), ``hold`` sends the first half of a file and then waits, on every GET until
the test releases it (to interrupt the client at a known byte, even one that timed out and
resumed). Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: int = 0  # 0: open; 401 or 403: gated, answered with that status
    sha: str = ""

    def __post_init__(self) -> None:
        self.sha = self.sha or hashlib.sha1(repr(sorted(self.files)).encode()).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_once: set[str] = field(default_factory=set)  # file names: cut the first GET halfway
    hold: set[str] = field(default_factory=set)  # file names: each GET stops halfway, waits
    held: threading.Event = field(default_factory=threading.Event)  # set once a hold began
    release: threading.Event = field(default_factory=threading.Event)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    url: str = ""


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/?]+))?(?:\?.*)?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/?]+)(?:\?.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def _refuse(self, repo_id: str) -> bool:
            """Answer for a missing or gated repo; True when it did."""
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._answer(404, b"", {"X-Error-Code": "RepoNotFound",
                                        "X-Error-Message": "Repository not found"})
                return True
            if repo.gated:
                self._answer(repo.gated, b"", {"X-Error-Code": "GatedRepo",
                                               "X-Error-Message": "Access to this model is "
                                                                  "restricted"})
                return True
            return False

        def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            api = _API.match(self.path)
            if api:
                repo_id = api.group(1)
                if self._refuse(repo_id):
                    return
                repo = hub.repos[repo_id]
                if api.group(2) not in (None, "main", repo.sha):
                    self._answer(404, b"", {"X-Error-Code": "RevisionNotFound"})
                    return
                siblings = [{"rfilename": name, "size": len(data),
                             "blobId": hashlib.sha1(data).hexdigest()}
                            for name, data in repo.files.items()]
                body = json.dumps({"id": repo_id, "sha": repo.sha, "siblings": siblings})
                self._answer(200, body.encode(), {"Content-Type": "application/json"})
                return
            tree = _TREE.match(self.path)
            if tree:  # snapshot_download's listing (HfApi.list_repo_tree)
                if self._refuse(tree.group(1)):
                    return
                listing = [{"type": "file", "path": name, "size": len(data),
                            "oid": hashlib.sha1(data).hexdigest()}
                           for name, data in hub.repos[tree.group(1)].files.items()]
                self._answer(200, json.dumps(listing).encode(),
                             {"Content-Type": "application/json"})
                return
            resolve = _RESOLVE.match(self.path)
            if not resolve:
                self._answer(404, b"", {})
                return
            repo_id, _, name = resolve.groups()
            if self._refuse(repo_id):
                return
            repo = hub.repos[repo_id]
            if name not in repo.files:
                self._answer(404, b"", {"X-Error-Code": "EntryNotFound"})
                return
            self._file(repo, name)

        def _file(self, repo: Repo, name: str) -> None:
            data = repo.files[name]
            headers = {"X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes",
                       "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            start = 0
            wanted = self.headers.get("Range")
            if wanted and self.command == "GET":
                start = int(re.match(r"bytes=(\d+)-", wanted).group(1))  # type: ignore[union-attr]
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            # a held file is held on every GET until the test releases it: a client that
            # timed out and resumed must not get the rest before the test interrupts it
            cut = name in hub.hold and not hub.release.is_set()
            if self.command == "HEAD" or not (name in hub.drop_once or cut):
                self._answer(206 if start else 200, body, headers)
                return
            hub.drop_once.discard(name)
            self.send_response(206 if start else 200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            if cut:
                hub.held.set()
                hub.release.wait(30)
            self.close_connection = True
            self.connection.close()

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    """``hub`` on a free loopback port in a thread, its ``url`` set, for the ``with`` block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
