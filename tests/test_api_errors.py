"""Every error the API documents, produced over raw HTTP (what the ``openai`` client would refuse
to send): each is OpenAI's error JSON with the right status, never a traceback or a bare 500.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from api_helpers import serving

from localspec.api.errors import API_RETRY_AFTER_S
from localspec.api.server import API_MAX_BODY_BYTES
from localspec.host import ModelHost
from localspec.pipeline import Pipeline

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(tiny_presets["ngram"]), host.status().error
    return host


@pytest.fixture(scope="module")
def url(host: ModelHost) -> Iterator[str]:
    with serving(host) as url:
        yield url


def error(response: httpx.Response, status: int, *needles: str) -> dict:
    """The OpenAI error object of ``response``, which must have ``status`` and say ``needles``."""
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}, body
    for needle in needles:
        assert needle in body["message"], (needle, body["message"])
    return body


def chat(url: str, **fields: object) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json={**CHAT, **fields})


@pytest.mark.parametrize(("body", "needle"), [
    (b"{bad", "not JSON"),
    (b"", "no body"),
    (b"[1, 2]", "not an object"),
    (b'{"messages": "\xff\xfe"}', "UTF-8"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "digits"),
])
def test_a_body_that_is_not_a_json_object(url: str, body: bytes, needle: str) -> None:
    error(httpx.post(f"{url}/chat/completions", content=body), 400, needle)


@pytest.mark.parametrize(("fields", "needle", "param"), [
    ({"messages": []}, "at least 1", "messages"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "Input should be", "messages.0.role"),
    ({"messages": [{"role": "function", "content": "x"}]}, "legacy role", "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text parts are supported", "messages.0.content"),
    ({"temperature": "hot"}, "valid number", "temperature"),
    ({"temperature": 2.5}, "less than or equal to 2", "temperature"),
    ({"top_p": 0}, "greater than 0", "top_p"),
    ({"max_tokens": 0}, "greater than or equal to 1", "max_tokens"),
    ({"seed": -1}, "greater than or equal to 0", "seed"),
    ({"n": 2}, "only n=1", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4", None),
    ({"temprature": 0.5}, "unrecognized request argument supplied: temprature", None),
    ({"frequency_penalty": 0.5}, "would change the answer", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "no tool-call format",
     "tools"),
    ({"logprobs": True}, "localspec.tokens", None),
    ({"function_call": {"name": "f"}}, "send tool_choice", None),
    ({"localspec": {"method": "warp"}}, "unknown method 'warp'", "localspec.method"),
    ({"localspec": {"method": "eagle3"}}, "needs a head", None),
    ({"localspec": {"colour": True}}, "Extra inputs", "localspec.colour"),
])
def test_a_field_out_of_range_or_unsupported(url: str, fields: dict, needle: str,
                                             param: str | None) -> None:
    body = error(chat(url, **fields), 400, needle)
    assert body["type"] == "invalid_request_error"
    if param is not None:
        assert body["param"] == param


def test_fields_at_their_neutral_values_are_ignored(url: str) -> None:
    """What clients send by default changes nothing and is accepted."""
    response = chat(url, frequency_penalty=0, presence_penalty=0.0, logprobs=False, tools=[],
                    tool_choice="auto", user="me", store=False, metadata={"a": "b"},
                    response_format={"type": "text"}, parallel_tool_calls=True, n=1)
    assert response.status_code == 200, response.text


def test_unknown_model_and_route_are_404(url: str) -> None:
    assert error(chat(url, model="gpt-4o"), 404, "gpt-4o")["code"] == "model_not_found"
    assert error(httpx.get(f"{url}/models/gpt-4o"), 404)["param"] == "model"
    error(httpx.get(f"{url}/embeddings"), 404, "no route")
    body = error(chat(url, model="cpu-qwen-coder-draft"), 400, "not loaded")
    assert body["code"] == "model_not_loaded"
    error(httpx.get(f"{url}/chat/completions"), 405)


def test_a_body_too_large_and_a_prompt_over_the_context_are_413(url: str) -> None:
    big = json.dumps({**CHAT, "user": "x" * API_MAX_BODY_BYTES}).encode()
    assert error(httpx.post(f"{url}/chat/completions", content=big), 413,
                 "over the limit")["code"] == "request_too_large"
    long = chat(url, messages=[{"role": "user", "content": "hello world " * 300}])
    assert error(long, 413, "context holds")["code"] == "context_length_exceeded"


def test_an_api_key_guards_every_route(host: ModelHost) -> None:
    with serving(host, api_key="s3cret") as url:
        for given in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                      {"Authorization": "Basic s3cret"}):
            response = httpx.post(f"{url}/chat/completions", json=CHAT, headers=given)
            assert error(response, 401, "API key")["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"
        error(httpx.get(f"{url}/models"), 401)
        ok = httpx.get(f"{url}/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_503_while_the_models_load(tiny_presets: dict[str, str]) -> None:
    """Before the first preset is loaded: 503 with Retry-After, then answers."""
    release = threading.Event()

    def slow(preset: object, previous: Pipeline | None, progress: object) -> Pipeline:
        release.wait(30)
        return Pipeline.load(preset, previous=previous)

    host = ModelHost(loader=slow, warm_up=False, audit=False)
    loading = host.load_async(tiny_presets["ngram"])
    with serving(host) as url:
        response = chat(url)
        assert error(response, 503, "loading")["code"] == "model_loading"
        assert response.headers["retry-after"] == str(API_RETRY_AFTER_S)
        release.set()
        loading.join(30)
        assert chat(url).status_code == 200


def test_429_when_the_queue_is_full(host: ModelHost) -> None:
    """With one place in the queue: a request waits for the generation lock (held here, as
    the page's answer would hold it), the next is refused at once with Retry-After."""
    with serving(host, max_queued=1) as url:
        host.generation_lock.acquire()
        waiting = []
        first = threading.Thread(target=lambda: waiting.append(chat(url)))
        try:
            first.start()
            while host.status().waiting == 0:
                first.join(0.01)
            response = chat(url)
            assert error(response, 429, "try again")["type"] == "rate_limit_error"
            assert response.headers["retry-after"] == str(API_RETRY_AFTER_S)
        finally:
            host.generation_lock.release()
        first.join(30)
        assert waiting[0].status_code == 200


def test_a_bug_is_a_500_in_openais_shape_and_the_server_goes_on(
        url: str, host: ModelHost, monkeypatch: pytest.MonkeyPatch, expects_bug: None) -> None:
    def broken(*_args: object, **_kwargs: object) -> Iterator[object]:
        raise RuntimeError("injected")
        yield

    monkeypatch.setattr(host.pipeline, "stream", broken)
    body = error(chat(url), 500, "internal error")
    assert body["type"] == "server_error" and "injected" not in body["message"]
    with httpx.stream("POST", f"{url}/chat/completions", json={**CHAT, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and "internal error" in events[-1]
    monkeypatch.undo()
    assert chat(url).status_code == 200
