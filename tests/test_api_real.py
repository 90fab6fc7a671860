"""The API on the small real model, as a user starts it: ``localspec serve`` and ``python app.py``
in processes of their own, driven by the official ``openai`` client. Greedy answers are those
of ``localspec generate --json``, token for token; the app serves the API beside its page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from test_browser import free_port

REPO = Path(__file__).resolve().parent.parent
PRESET = "cpu-smollm2-ngram"
PROMPT = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."
MAX_NEW = 24

pytestmark = pytest.mark.real_model


@contextmanager
def running(args: list[str], port: int, log: Path, key: str | None = None,
            timeout: float = 300) -> Iterator[OpenAI]:
    """The command in a subprocess; yields an OpenAI client once its models answer (the
    server answers 503 while they load)."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    env.pop("LOCALSPEC_API_KEY", None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no answer in {timeout} s:\n{log.read_text()}"
                try:
                    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                          json={"prompt": "Hi", "max_tokens": 1},
                                          headers=headers, timeout=30)
                    if response.status_code == 200:
                        break
                    assert response.status_code == 503, response.text
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key or "none",
                         max_retries=0)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def generated() -> dict:
    """``localspec generate --json``'s greedy answer to PROMPT."""
    out = subprocess.run(
        [sys.executable, "-m", "localspec", "generate", "--preset", PRESET, "--prompt", PROMPT,
         "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)["samples"][0]


def api_answer(client: OpenAI, stream: bool) -> tuple[list[int], str]:
    kwargs = {"model": PRESET, "messages": [{"role": "user", "content": PROMPT}],
              "max_tokens": MAX_NEW, "temperature": 0,
              "extra_body": {"localspec": {"tokens": True}}}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return [t["id"] for t in reply.localspec["tokens"]], reply.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    ids = [t["id"] for c in chunks if getattr(c, "localspec", None) for t in c.localspec["tokens"]]
    return ids, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_serve_answers_as_generate_does(generated: dict, tmp_path: Path) -> None:
    port = free_port()
    with running(["-m", "localspec", "serve", "--preset", PRESET, "--port", str(port)], port,
                 tmp_path / "serve.log") as client:
        for stream in (False, True):
            ids, text = api_answer(client, stream)
            assert ids == generated["token_ids"] and text == generated["text"]
        assert [m.id for m in client.models.list() if m.loaded] == [PRESET]
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "ready" in log, log


def test_the_app_serves_the_api_beside_its_page(generated: dict, tmp_path: Path) -> None:
    """``python app.py --api-key KEY``: the page needs no key, the API does; its greedy answer
    is generate's."""
    port = free_port()
    with running(["app.py", "--preset", PRESET, "--no-browser", "--port", str(port),
                  "--api-key", "k3y"], port, tmp_path / "app.log", key="k3y") as client:
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                   max_retries=0).models.list()
        ids, text = api_answer(client, stream=True)
        assert ids == generated["token_ids"] and text == generated["text"]
    assert "Traceback" not in (tmp_path / "app.log").read_text()


def test_serve_refuses_a_taken_port_and_a_missing_preset(tmp_path: Path) -> None:
    """Exit 2 with a message, before any model loads."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "localspec", "serve", "--preset", PRESET,
                                 "--port", str(port)], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 2 and "cannot listen on" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "localspec", "serve", "--preset", "nope"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "nope" in result.stderr, result.stderr
