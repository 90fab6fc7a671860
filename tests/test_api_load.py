"""The API under load: many clients at once, clients that go away mid-answer or while queued.

Answers are served one at a time through the host's generation lock; what is tested is that
none is lost or mixed up, and that a departed client frees the engine within a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from api_helpers import serving
from openai import OpenAI

from localspec.engine.engine import StepEvent
from localspec.host import ModelHost

STEP_S = 0.05  # how long each step of a slowed generation takes


@pytest.fixture
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(tiny_presets["draft"]), host.status().error
    return host


def slow_down(host: ModelHost, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Each step of the host's generations takes STEP_S; counts the steps run."""
    pipe, seen = host.pipeline, {"steps": 0}
    real = pipe.stream

    def stream(request: object, method: str | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> Iterator[StepEvent]:
        for event in real(request, method, cancelled):
            seen["steps"] += 1
            time.sleep(STEP_S)
            yield event

    monkeypatch.setattr(pipe, "stream", stream)
    return seen


def lock_freed_within(host: ModelHost, seconds: float) -> float:
    """Seconds until the generation lock is free (fails past ``seconds``)."""
    start = time.monotonic()
    assert host.generation_lock.acquire(timeout=seconds), "the engine was not freed"
    host.generation_lock.release()
    return time.monotonic() - start


def test_eight_clients_streaming_at_once(host: ModelHost) -> None:
    """8 clients, each two streamed requests in a row: every answer arrives, whole, in order,
    equal to the same request made alone."""
    prompts = [f"tell me about {word}" for word in
               ("owls", "tea", "rain", "salt", "maps", "ink", "bees", "snow")]
    with serving(host) as url:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0)

        def ask(prompt: str, n: int, stream: bool) -> str:
            kwargs = {"model": "tiny draft_model", "max_tokens": n, "temperature": 0,
                      "messages": [{"role": "user", "content": prompt}]}
            if not stream:
                return client.chat.completions.create(**kwargs).choices[0].message.content
            chunks = client.chat.completions.create(stream=True, **kwargs)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        alone = {(p, n): ask(p, n, stream=False) for p in prompts for n in (6, 10)}
        got: dict[str, list[str]] = {}

        def client_run(prompt: str) -> None:
            got[prompt] = [ask(prompt, 6, stream=True), ask(prompt, 10, stream=True)]

        threads = [threading.Thread(target=client_run, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert got == {p: [alone[p, 6], alone[p, 10]] for p in prompts}


def test_a_client_gone_mid_stream_frees_the_engine(host: ModelHost,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen = slow_down(host, monkeypatch)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with serving(host) as url:
        with httpx.stream("POST", f"{url}/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert next(lines) == ""
            assert next(lines).startswith("data: ")
        gone = time.monotonic()
        freed = lock_freed_within(host, 5.0)
        steps = seen["steps"]
        assert steps < 20 and freed < 5 * STEP_S + 0.5, (steps, freed)
        after = httpx.post(f"{url}/chat/completions", json={**body, "stream": False,
                                                             "max_tokens": 3})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
        assert time.monotonic() - gone < 5


def test_a_client_gone_before_the_whole_answer_frees_the_engine(
        host: ModelHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not streaming: the server polls for the departure while it generates."""
    seen = slow_down(host, monkeypatch)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200,
            "temperature": 0}
    with serving(host) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/chat/completions", json=body, timeout=0.3)
        lock_freed_within(host, 3.0)
        assert seen["steps"] < 40, seen
        assert httpx.post(f"{url}/chat/completions",
                          json={**body, "max_tokens": 2}).status_code == 200


def test_a_client_gone_while_queued_leaves_the_queue(host: ModelHost) -> None:
    """With one place in the queue: a streamed request waits (the lock is held, as by the page),
    its client leaves, and its place is free again for the next."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
    with serving(host, max_queued=1) as url:
        host.generation_lock.acquire()
        try:
            with httpx.stream("POST", f"{url}/chat/completions", json=body) as response:
                assert next(response.iter_lines()).startswith("data: ")  # the role, at once
                deadline = time.monotonic() + 5
                while host.status().waiting == 0:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            deadline = time.monotonic() + 5
            while host.status().waiting:
                assert time.monotonic() < deadline, "the departed client still waits"
                time.sleep(0.01)
        finally:
            host.generation_lock.release()
        after = httpx.post(f"{url}/chat/completions", json={**body, "stream": False})
        assert after.status_code == 200, after.text
