"""OpenAI's Responses API and Anthropic's Messages API driven by the official ``openai`` and
``anthropic`` clients over tiny random models: each answer is the chat-completions answer to
the same messages, token for token; streams add up to the whole answers; a follow-up by
``previous_response_id`` continues the stored conversation; the Messages API takes
``x-api-key``.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest
from api_helpers import serving
from openai import NotFoundError, OpenAI

from localspec.host import ModelHost

MODEL = "tiny draft_model"
TOKENS = {"localspec": {"tokens": True}}
GREEDY = {"temperature": 0}  # the anthropic client sends sampling settings as extra fields


@pytest.fixture(scope="module")
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(tiny_presets["draft"]), host.status().error
    return host


@pytest.fixture(scope="module")
def url(host: ModelHost) -> Iterator[str]:
    with serving(host) as url:
        yield url


@pytest.fixture(scope="module")
def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="unused", max_retries=0)


def chat_answer(client: OpenAI, messages: list[dict], max_tokens: int = 10,
                **fields: object) -> tuple[list[int], str, object]:
    reply = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body=TOKENS, **fields)
    return ([t["id"] for t in reply.localspec["tokens"]], reply.choices[0].message.content,
            reply)


def ids(extension: dict) -> list[int]:
    return [t["id"] for t in extension["tokens"]]


# ------------------------------------------------------------------------ Responses


def test_a_response_is_the_chat_answer(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    chat_ids, chat_text, chat = chat_answer(client, messages)
    reply = client.responses.create(model=MODEL, instructions="Be brief.", input="hello",
                                    max_output_tokens=10, temperature=0, extra_body=TOKENS)
    assert ids(reply.localspec) == chat_ids and reply.output_text == chat_text
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status == "incomplete"  # 10 tokens: the limit, not an end of sequence
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in reply.output] == ["message"]
    assert reply.output[0].role == "assistant" and reply.output[0].status == "incomplete"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == 10 == chat.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + 10
    assert reply.speculation["method"] == "draft_model" and reply.speculation["drafted"] > 0
    # input as items (parts, a developer message) says the same
    items = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                          "text": "hello"}]}],
        max_output_tokens=10, temperature=0, extra_body=TOKENS)
    assert ids(items.localspec) == chat_ids


def test_a_streamed_response_adds_up_to_the_whole(client: OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="hello", max_output_tokens=12,
                                    temperature=0, extra_body=TOKENS)
    events = list(client.responses.create(model=MODEL, input="hello", max_output_tokens=12,
                                          temperature=0, stream=True, extra_body=TOKENS))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12
    assert ids(final.localspec) == ids(whole.localspec)
    assert final.speculation["method"] == "draft_model"
    assert len({events[0].response.id, final.id}) == 1


def test_previous_response_id_continues_the_conversation(client: OpenAI, url: str) -> None:
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="hello",
                                    max_output_tokens=6, temperature=0)
    follow = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="and more", max_output_tokens=6, temperature=0,
                                     extra_body=TOKENS)
    # the previous instructions are not carried over, as OpenAI has it
    chat_ids, chat_text, chat = chat_answer(client, [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and more"}], max_tokens=6)
    assert ids(follow.localspec) == chat_ids and follow.output_text == chat_text
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.previous_response_id == first.id
    # a chain: the follow-up's conversation holds the first's
    third = client.responses.create(model=MODEL, previous_response_id=follow.id, input="end",
                                    max_output_tokens=3, temperature=0, extra_body=TOKENS)
    chat_ids, _, _ = chat_answer(client, [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and more"},
        {"role": "assistant", "content": follow.output_text},
        {"role": "user", "content": "end"}], max_tokens=3)
    assert ids(third.localspec) == chat_ids
    # GET returns it as it was; DELETE forgets it
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.delete(first.id) is None
    with pytest.raises(NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(NotFoundError) as caught:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="x",
                                max_output_tokens=2)
    assert caught.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=MODEL, input="hello", max_output_tokens=2,
                                       store=False)
    assert httpx.get(f"{url}/responses/{unstored.id}").status_code == 404


def test_a_streamed_response_is_kept_for_a_follow_up(client: OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="hello", max_output_tokens=5,
                                          temperature=0, stream=True))
    first = events[-1].response
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input="more",
                                     max_output_tokens=4, temperature=0, extra_body=TOKENS)
    chat_ids, _, _ = chat_answer(client, [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "more"}], max_tokens=4)
    assert ids(follow.localspec) == chat_ids


# ------------------------------------------------------------------------ Messages


def anthropic_client(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=key, max_retries=0)


def test_a_message_is_the_chat_answer(client: OpenAI, url: str) -> None:
    chat_ids, chat_text, chat = chat_answer(client, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
    reply = anthropic_client(url).messages.create(
        model=MODEL, max_tokens=10, system="Be brief.",
        messages=[{"role": "user", "content": "hello"}], extra_body={**TOKENS, **GREEDY})
    assert ids(reply.localspec) == chat_ids
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == chat_text
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == 10
    assert reply.speculation["method"] == "draft_model"
    # text blocks, and count_tokens over the same input
    blocks = anthropic_client(url).messages.create(
        model=MODEL, max_tokens=10, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        extra_body={**TOKENS, **GREEDY})
    assert ids(blocks.localspec) == chat_ids
    counted = anthropic_client(url).messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "hello"}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_stop_sequence_is_named(client: OpenAI, url: str) -> None:
    _, text, _ = chat_answer(client, [{"role": "user", "content": "hello"}], max_tokens=12)
    stop = text[3:5]  # a piece of the greedy answer: it ends there
    assert stop.strip()
    reply = anthropic_client(url).messages.create(
        model=MODEL, max_tokens=12, stop_sequences=[stop], extra_body=GREEDY,
        messages=[{"role": "user", "content": "hello"}])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[:text.index(stop)]
    with anthropic_client(url).messages.stream(
            model=MODEL, max_tokens=12, stop_sequences=["\x00never", stop], extra_body=GREEDY,
            messages=[{"role": "user", "content": "hello"}]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_streamed_message_adds_up_to_the_whole(url: str) -> None:
    whole = anthropic_client(url).messages.create(
        model=MODEL, max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": "hello"}])
    with anthropic_client(url).messages.stream(
            model=MODEL, max_tokens=12, extra_body=GREEDY,
            messages=[{"role": "user", "content": "hello"}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens and final.id.startswith("msg_")
    with httpx.stream("POST", f"{url}/messages", json={
            "model": MODEL, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}) as raw:
        names = [line.removeprefix("event: ") for line in raw.iter_lines()
                 if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_x_api_key_and_bearer_both_open_the_door(host: ModelHost) -> None:
    with serving(host, api_key="s3cret") as url:
        reply = anthropic_client(url, "s3cret").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hello"}])
        assert reply.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic_client(url, "wrong").messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hello"}])
        assert caught.value.body == {"type": "error", "error": {
            "type": "authentication_error", "message": caught.value.body["error"]["message"]}}
        bearer = anthropic.Anthropic(base_url=url.removesuffix("/v1"), auth_token="s3cret",
                                     max_retries=0)
        assert bearer.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hello"}]).usage.output_tokens == 2
        # x-api-key opens OpenAI's routes too
        assert httpx.get(f"{url}/models", headers={"x-api-key": "s3cret"}).status_code == 200
        openai = OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert openai.responses.create(model=MODEL, input="hi",
                                       max_output_tokens=2).usage.output_tokens == 2
