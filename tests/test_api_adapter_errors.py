"""Every error of the Responses and Messages APIs over raw HTTP: OpenAI's error JSON on
``/v1/responses``, Anthropic's (``{"type": "error", "error": {"type", "message"}}``, with its
type for each status) on ``/v1/messages``, never a traceback or a bare 500.
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

RESPONSES = {"input": "hello", "max_output_tokens": 3}
MESSAGES = {"model": "tiny ngram", "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello"}]}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error"}


@pytest.fixture(scope="module")
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(tiny_presets["ngram"]), host.status().error
    return host


@pytest.fixture(scope="module")
def url(host: ModelHost) -> Iterator[str]:
    with serving(host) as url:
        yield url


def openai_error(response: httpx.Response, status: int, *needles: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}, body
    for needle in needles:
        assert needle in body["message"], (needle, body["message"])
    return body


def anthropic_error(response: httpx.Response, status: int, *needles: str) -> str:
    """The message of Anthropic's error JSON, whose type must be the status's."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body == {"type": "error", "error": {"type": ANTHROPIC_TYPES[status],
                                               "message": body["error"]["message"]}}, body
    for needle in needles:
        assert needle in body["error"]["message"], (needle, body["error"]["message"])
    return body["error"]["message"]


def responses(url: str, **fields: object) -> httpx.Response:
    return httpx.post(f"{url}/responses", json={**RESPONSES, **fields})


def messages(url: str, route: str = "messages", **fields: object) -> httpx.Response:
    return httpx.post(f"{url}/{route}", json={**MESSAGES, **fields})


@pytest.mark.parametrize(("body", "needle"), [
    (b"{bad", "not JSON"), (b"", "no body"), (b"[1]", "not an object"),
    (b'{"input": "\xff"}', "UTF-8"),
])
def test_a_body_that_is_not_a_json_object(url: str, body: bytes, needle: str) -> None:
    openai_error(httpx.post(f"{url}/responses", content=body), 400, needle)
    anthropic_error(httpx.post(f"{url}/messages", content=body), 400, needle)
    anthropic_error(httpx.post(f"{url}/messages/count_tokens", content=body), 400, needle)


@pytest.mark.parametrize(("fields", "needle", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text parts", "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'",
     "input.0.type"),
    ({"tools": [{"type": "web_search"}]}, "only function tools", "tools.0.type"),
    ({"text": {"format": {"type": "xml"}}}, "one of 'text'", "text.format.type"),
    ({"max_output_tokens": 0}, "greater than or equal to 1", "max_output_tokens"),
    ({"temperature": 3}, "less than or equal to 2", "temperature"),
    ({"temprature": 1}, "unrecognized request argument supplied: temprature", None),
    ({"input": None}, "input", "input.str"),
    ({"localspec": {"method": "warp"}}, "unknown method 'warp'", "localspec.method"),
])
def test_responses_bad_fields_are_400(url: str, fields: dict, needle: str,
                                      param: str | None) -> None:
    body = openai_error(responses(url, **fields), 400, needle)
    assert body["type"] == "invalid_request_error" and body["param"] == param


@pytest.mark.parametrize(("fields", "needle"), [
    ({"max_tokens": None}, "max_tokens: Field required"),
    ({"model": None}, "model: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'image' are not supported"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "'user' or 'assistant'"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "only client tools"),
    ({"temperature": 1.5}, "less than or equal to 1"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking="),
    ({"temprature": 1}, "temprature: Extra inputs are not permitted"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "at most 4"),
])
def test_messages_bad_fields_are_400(url: str, fields: dict, needle: str) -> None:
    body = {k: v for k, v in {**MESSAGES, **fields}.items() if v is not None}
    anthropic_error(httpx.post(f"{url}/messages", json=body), 400, needle)


def test_neutral_fields_are_accepted(url: str) -> None:
    assert responses(url, include=[], truncation="disabled", store=True, metadata={},
                     parallel_tool_calls=True, tools=[], tool_choice="auto",
                     text={"format": {"type": "text"}}, user="me").status_code == 200
    assert messages(url, metadata={"user_id": "me"}, thinking={"type": "disabled"},
                    service_tier="auto", tools=[], stop_sequences=[]).status_code == 200
    ok = httpx.post(f"{url}/messages", json=MESSAGES, headers={
        "anthropic-version": "2023-06-01", "anthropic-beta": "anything"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_unknown_models_ids_and_routes_are_404(url: str) -> None:
    assert openai_error(responses(url, model="gpt-5"), 404, "gpt-5")["code"] == "model_not_found"
    anthropic_error(messages(url, model="claude-sonnet-4-5"), 404, "claude-sonnet-4-5")
    anthropic_error(messages(url, "messages/count_tokens", model="claude-x"), 404, "claude-x")
    anthropic_error(httpx.post(f"{url}/messages/batches", json=MESSAGES), 404, "no route")
    for method in ("GET", "DELETE"):
        body = openai_error(httpx.request(method, f"{url}/responses/resp_nope"), 404,
                            "resp_nope")
        assert body["param"] == "response_id"
    body = openai_error(responses(url, previous_response_id="resp_nope"), 404, "resp_nope")
    assert (body["code"], body["param"]) == ("previous_response_not_found",
                                            "previous_response_id")


def test_too_large_is_413(url: str) -> None:
    big = "x" * API_MAX_BODY_BYTES
    body = openai_error(httpx.post(f"{url}/responses", content=json.dumps(
        {**RESPONSES, "user": big})), 413, "over the limit")
    assert body["code"] == "request_too_large"
    anthropic_error(httpx.post(f"{url}/messages", content=json.dumps(
        {**MESSAGES, "metadata": {"user_id": big}})), 413, "over the limit")
    long = "hello world " * 300
    assert openai_error(responses(url, input=long), 413,
                        "context holds")["code"] == "context_length_exceeded"
    anthropic_error(messages(url, messages=[{"role": "user", "content": long}]), 413,
                    "context holds")


def test_a_key_is_needed_401(host: ModelHost) -> None:
    with serving(host, api_key="s3cret") as url:
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"},
                        {"Authorization": "s3cret"}):
            anthropic_error(httpx.post(f"{url}/messages", json=MESSAGES, headers=headers),
                            401, "API key", "x-api-key")
            anthropic_error(httpx.post(f"{url}/messages/count_tokens", json=MESSAGES,
                                       headers=headers), 401)
            body = openai_error(httpx.post(f"{url}/responses", json=RESPONSES,
                                           headers=headers), 401, "API key")
            assert body["type"] == "authentication_error"
        for headers in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            assert httpx.post(f"{url}/messages", json=MESSAGES,
                              headers=headers).status_code == 200
            counted = httpx.post(f"{url}/messages/count_tokens", json=MESSAGES,
                                 headers=headers)
            assert counted.json()["input_tokens"] > 0
            assert httpx.post(f"{url}/responses", json=RESPONSES,
                              headers=headers).status_code == 200


def test_503_while_the_models_load(tiny_presets: dict[str, str]) -> None:
    release = threading.Event()

    def slow(preset: object, previous: Pipeline | None, progress: object) -> Pipeline:
        release.wait(30)
        return Pipeline.load(preset, previous=previous)

    host = ModelHost(loader=slow, warm_up=False, audit=False)
    loading = host.load_async(tiny_presets["ngram"])
    try:
        with serving(host) as url:
            response = messages(url)
            anthropic_error(response, 503, "loading")
            assert response.headers["retry-after"] == str(API_RETRY_AFTER_S)
            assert openai_error(responses(url), 503, "loading")["code"] == "model_loading"
            release.set()
            loading.join(30)
            assert messages(url).status_code == 200 and responses(url).status_code == 200
    finally:
        release.set()


def test_429_when_the_queue_is_full(host: ModelHost) -> None:
    with serving(host, max_queued=1) as url:
        host.generation_lock.acquire()
        waiting: list[httpx.Response] = []
        first = threading.Thread(target=lambda: waiting.append(messages(url)))
        try:
            first.start()
            while host.status().waiting == 0:
                first.join(0.01)
            response = messages(url)
            anthropic_error(response, 429, "try again")
            assert response.headers["retry-after"] == str(API_RETRY_AFTER_S)
            assert openai_error(responses(url), 429, "try again")["type"] == "rate_limit_error"
        finally:
            host.generation_lock.release()
        first.join(30)
        assert waiting[0].status_code == 200


def test_a_bug_is_a_500_and_mid_stream_an_error_event(
        url: str, host: ModelHost, monkeypatch: pytest.MonkeyPatch, expects_bug: None) -> None:
    def broken(*_args: object, **_kwargs: object) -> Iterator[object]:
        raise RuntimeError("injected")
        yield

    monkeypatch.setattr(host.pipeline, "stream", broken)
    body = openai_error(responses(url), 500, "internal error")
    assert body["type"] == "server_error" and "injected" not in body["message"]
    message = anthropic_error(messages(url), 500, "internal error")
    assert "injected" not in message
    with httpx.stream("POST", f"{url}/responses", json={**RESPONSES, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error",
                                           "response.failed"]
    assert "internal error" in events[2]["message"]
    assert events[3]["response"]["status"] == "failed"
    with httpx.stream("POST", f"{url}/messages", json={**MESSAGES, "stream": True}) as r:
        lines = list(r.iter_lines())
    assert r.status_code == 200 and "event: error" in lines
    error = json.loads(lines[lines.index("event: error") + 1][6:])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    monkeypatch.undo()
    assert responses(url).status_code == 200 and messages(url).status_code == 200
