"""``localspec models add ORG/NAME``: the real huggingface_hub client against a local stand-in
for the Hub (``hub_server``) serving tiny repos built here: a model folder, GGUF repos, a repo
big enough to be cut mid-file, gated, missing and broken ones.

huggingface_hub reads ``HF_ENDPOINT`` once, at import: a subprocess gets it in its
environment; in this process both ``constants.ENDPOINT`` and the URL template ``hf_hub_url``
formats (``HUGGINGFACE_CO_URL_TEMPLATE``) are pointed at the server, as that import would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_user_error, run_cli
from hub_server import FakeHub, Repo, serve
from huggingface_hub import constants
from library_files import write_gguf

REPO_ROOT = Path(__file__).resolve().parent.parent
CHUNK = constants.DOWNLOAD_CHUNK_SIZE  # what http_get writes at a time (10 MiB)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory,
          tiny_folders: dict[str, Path]) -> dict[str, Repo]:
    root = tmp_path_factory.mktemp("hub-repos")
    folder = {p.name: p.read_bytes() for p in tiny_folders["target"].iterdir() if p.is_file()}
    q4 = write_gguf(root / "q4.gguf", hidden=256, types={"*": "Q4_K", "ffn_down": "Q6_K"})
    q8 = write_gguf(root / "q8.gguf", hidden=256, types={"*": "Q8_0"})
    big = write_gguf(root / "big.gguf", bulk=(2 * CHUNK + CHUNK // 2) // 4)  # 25 MiB
    broken = q4.read_bytes()[:-1000]
    return {
        "org/tiny": Repo(folder),
        "org/tiny-GGUF": Repo({"tiny-Q4_K_M.gguf": q4.read_bytes(),
                               "tiny-Q8_0.gguf": q8.read_bytes(), "README.md": b"# tiny\n"}),
        "org/big-GGUF": Repo({"big.gguf": big.read_bytes()}),
        "org/broken-GGUF": Repo({"broken.gguf": broken}),
        "org/pickles": Repo({"config.json": folder["config.json"], "pytorch_model.bin": b"x"}),
        "org/gated-401": Repo(folder, gated=401),
        "org/gated-403": Repo(folder, gated=403),
    }


def point_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """What importing huggingface_hub with HF_ENDPOINT=url sets."""
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def models(own_folders: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty models folder (and cache, data folder, Hugging Face cache; no built-in models)."""
    monkeypatch.setattr("localspec.models.library.builtin_entries", list)
    return own_folders / "models"


@pytest.fixture
def hub(repos: dict[str, Repo], monkeypatch: pytest.MonkeyPatch, models: Path
        ) -> Iterator[FakeHub]:
    with serve(FakeHub(dict(repos))) as running:
        point_at(monkeypatch, running.url)
        yield running


def _downloads(hub: FakeHub) -> list[tuple[str, str | None]]:
    return [(path, rng) for method, path, rng in hub.requests
            if method == "GET" and "/resolve/" in path]


def _nothing_added(models: Path) -> None:
    """No model folder, no staging folder: at most an empty models folder."""
    assert not models.exists() or [p for p in models.rglob("*")] == []


def test_a_model_folder_is_downloaded_and_listed(hub: FakeHub, models: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 repos: dict[str, Repo]) -> None:
    code, out, err = run_cli(capsys, "models", "add", "org/tiny")
    assert code == 0, err
    folder = models / "org" / "tiny"
    wanted = {n: d for n, d in repos["org/tiny"].files.items() if not n.endswith(".txt")
              or n == "merges.txt"}
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == wanted
    assert "org/tiny" in out and not (models / ".downloads").exists()
    code, listing, _ = run_cli(capsys, "models", "list")
    assert code == 0 and "org/tiny" in listing
    fetched = len(_downloads(hub))
    assert run_cli(capsys, "models", "add", "org/tiny")[0] == 0  # there already: nothing fetched
    assert len(_downloads(hub)) == fetched


def test_a_gguf_repo_needs_a_pattern_then_gets_only_that_file(
        hub: FakeHub, models: Path, capsys: pytest.CaptureFixture[str],
        repos: dict[str, Repo]) -> None:
    assert_user_error(run_cli(capsys, "models", "add", "org/tiny-GGUF"), "2 GGUF files",
                      "--include", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf")
    _nothing_added(models)
    code, out, err = run_cli(capsys, "models", "add", "org/tiny-GGUF", "--include",
                             "*Q4_K_M.gguf")
    assert code == 0, err
    assert [p.name for p in (models / "org" / "tiny-GGUF").iterdir()] == ["tiny-Q4_K_M.gguf"]
    assert (models / "org" / "tiny-GGUF" / "tiny-Q4_K_M.gguf").read_bytes() == \
        repos["org/tiny-GGUF"].files["tiny-Q4_K_M.gguf"]
    assert "native" in out and [p for p, _ in _downloads(hub)] == [
        f"/org/tiny-GGUF/resolve/{repos['org/tiny-GGUF'].sha}/tiny-Q4_K_M.gguf"]


@pytest.mark.parametrize(("repo", "args", "needles"), [
    ("org/tiny-GGUF", ["--include", "*Q5_K_M.gguf"], ["no file of org/tiny-GGUF matches",
                                                      "tiny-Q8_0.gguf"]),
    ("org/tiny-GGUF", ["--include", "*.md"], ["are not a model", "README.md"]),
    ("org/nothing-here", [], ["no repo org/nothing-here on the Hub"]),
    ("org/gated-401", [], ["org/gated-401 is gated", "HF_TOKEN"]),
    ("org/gated-403", [], ["org/gated-403 is gated", "accept its terms"]),
    ("org/pickles", [], ["no model LocalSpec can run", "pickle"]),
    ("org/broken-GGUF", [], ["not a model LocalSpec can run, so nothing was added",
                             "truncated GGUF"]),
    ("org/tiny", ["--revision", "v9"], ["org/tiny has no revision 'v9'"]),
])
def test_what_cannot_be_added_is_one_line_and_leaves_nothing(
        hub: FakeHub, models: Path, capsys: pytest.CaptureFixture[str], repo: str,
        args: list[str], needles: list[str]) -> None:
    assert_user_error(run_cli(capsys, "models", "add", repo, *args), *needles)
    _nothing_added(models)


def test_a_models_folder_that_cannot_be_written_is_one_line(
        hub: FakeHub, models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models.write_text("a file where the folder should be", encoding="utf-8")
    assert_user_error(run_cli(capsys, "models", "add", "org/tiny"),
                      "cannot write in the models folder", "LOCALSPEC_MODELS")
    assert run_cli(capsys, "models", "list")[0] == 0


def test_offline_is_one_line(models: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with serve(FakeHub()) as gone:
        url = gone.url  # a port where nothing listens once the block ends
    point_at(monkeypatch, url)
    assert_user_error(run_cli(capsys, "models", "add", "org/tiny"), "cannot reach the Hub",
                      url, "offline?")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert_user_error(run_cli(capsys, "models", "add", "org/tiny"), "HF_HUB_OFFLINE is set")
    _nothing_added(models)


def test_a_disk_too_small_is_refused_before_any_byte(
        hub: FakeHub, models: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], repos: dict[str, Repo]) -> None:
    """The repo's file sizes plus the margin must fit in the free space: one byte less is
    refused before any file is fetched, exactly enough is downloaded."""
    import shutil

    from localspec.models.hub import DOWNLOAD_FREE_MARGIN

    size = len(repos["org/big-GGUF"].files["big.gguf"])
    real, free = shutil.disk_usage, [size + DOWNLOAD_FREE_MARGIN - 1]

    def usage(path: object) -> object:
        found = real(path)
        return type(found)(found.total, found.total - free[0], free[0])

    monkeypatch.setattr("localspec.models.hub.shutil.disk_usage", usage)
    assert_user_error(run_cli(capsys, "models", "add", "org/big-GGUF"), "not enough disk",
                      f"{size / 2**20:.1f} MiB left to download", "LOCALSPEC_MODELS")
    assert _downloads(hub) == []
    _nothing_added(models)
    free[0] += 1
    assert run_cli(capsys, "models", "add", "org/big-GGUF")[0] == 0


def test_a_dropped_connection_continues_where_it_stopped(
        hub: FakeHub, models: Path, capsys: pytest.CaptureFixture[str],
        repos: dict[str, Repo]) -> None:
    """The server closes the connection halfway once; the same add asks for the rest with
    a Range header from the last whole chunk written, and the file is exact."""
    hub.drop_once.add("big.gguf")
    code, _, err = run_cli(capsys, "models", "add", "org/big-GGUF")
    assert code == 0, err
    assert [rng for _, rng in _downloads(hub)] == [None, f"bytes={CHUNK}-"]
    assert (models / "org" / "big-GGUF" / "big.gguf").read_bytes() == \
        repos["org/big-GGUF"].files["big.gguf"]


# `python3 -m localspec` as a terminal starts it: Ctrl-C raises KeyboardInterrupt. A child
# inherits an ignored SIGINT, and Python then installs no handler; after earlier tests of a
# full run the child ignored Ctrl-C and kept retrying its held read past the test's 60 s.
_AS_FROM_A_TERMINAL = ("import runpy, signal; "
                       "signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "runpy.run_module('localspec', run_name='__main__', alter_sys=True)")


def _cli(hub: FakeHub, models: Path, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "LOCALSPEC_MODELS": str(models),
           "LOCALSPEC_DATA": str(tmp_path / "data"), "HF_HOME": str(tmp_path / "hf-home")}
    return subprocess.Popen([sys.executable, "-c", _AS_FROM_A_TERMINAL, "models", "add", *args],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_an_interrupted_download_resumes_in_the_next_add(
        hub: FakeHub, models: Path, tmp_path: Path, repos: dict[str, Repo],
        stop: signal.Signals) -> None:
    """Ctrl-C (or kill -9) halfway through a file, the server holding the rest back, keeps
    what arrived; the next `models add` of the repo asks only for the rest (Range) and the
    file is exact. (huggingface_hub's own snapshot_download deletes its partial file on a
    failure, and after kill -9 leaves it under a name no later run reads: it starts over.)"""
    hub.hold.add("big.gguf")
    first = _cli(hub, models, tmp_path, "org/big-GGUF")
    partial = models / ".downloads" / "org--big-GGUF" / "big.gguf.incomplete"
    deadline = time.monotonic() + 120
    while not (partial.is_file() and partial.stat().st_size >= CHUNK):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    first.send_signal(stop)
    _, err = first.communicate(timeout=60)
    hub.release.set()
    if stop == signal.SIGINT:
        assert first.returncode == 130, err
        assert "interrupted" in err and "run the same command again" in err
    kept = partial.stat().st_size
    assert kept % CHUNK == 0 and kept >= CHUNK and not (models / "org").exists()
    second = _cli(hub, models, tmp_path, "org/big-GGUF")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert _downloads(hub)[-1][1] == f"bytes={kept}-"
    assert (models / "org" / "big-GGUF" / "big.gguf").read_bytes() == \
        repos["org/big-GGUF"].files["big.gguf"]
    assert not (models / ".downloads").exists() and "big.gguf" in out
