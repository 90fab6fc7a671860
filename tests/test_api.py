"""The OpenAI-compatible API driven by the official ``openai`` client, as users drive it: chat and
completions, streaming and not, the models list, the speculation and per-token extensions.

A real uvicorn server on a loopback port over tiny random models (``tiny_presets``: a draft model
that is always wrong, so every kind of token shows up); the answers are checked against the
pipeline's own greedy output for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_helpers import serving
from openai import NotFoundError, OpenAI

from localspec.host import ModelHost
from localspec.pipeline import Pipeline

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False)
    assert host.load(tiny_presets["draft"]), host.status().error
    return host


@pytest.fixture(scope="module")
def client(host: ModelHost) -> Iterator[OpenAI]:
    with serving(host) as url:
        yield OpenAI(base_url=url, api_key="unused", max_retries=0)


def direct(pipe: Pipeline, prompt_ids: list[int], method: str | None = None,
           **settings: object) -> tuple[list[int], str]:
    """The pipeline's own answer: token ids and text."""
    result = pipe.run(pipe.request(prompt_ids, **settings), method)
    return result.token_ids, result.text


def token_ids(extension: dict) -> list[int]:
    return [t["id"] for t in extension["tokens"]]


def test_chat_is_the_pipelines_greedy_answer(client: OpenAI, host: ModelHost) -> None:
    """Greedy chat equals the engine's answer token for token, with usage and speculation."""
    pipe = host.pipeline
    ids, text = direct(pipe, pipe.encode_chat(HELLO), max_new_tokens=10, temperature=0.0)
    reply = client.chat.completions.create(model=pipe.preset.name, messages=HELLO,
                                           max_tokens=10, temperature=0,
                                           extra_body={"localspec": {"tokens": True}})
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == "length" and reply.object == "chat.completion"
    assert token_ids(reply.localspec) == ids
    assert reply.usage.prompt_tokens == len(pipe.encode_chat(HELLO))
    assert reply.usage.completion_tokens == len(ids) == 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 10
    # OpenAI's field for a kept prompt cache; these tiny models run outside the native stack,
    # whose caches alone are kept (test_prefix_reuse.py, test_real_models.py)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    spec = reply.speculation
    assert spec["method"] == "draft_model" and spec["k"] == 4
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["acceptance"] == pytest.approx(spec["accepted"] / spec["drafted"], abs=1e-4)
    assert spec["tokens_per_pass"] == pytest.approx(10 / spec["target_passes"], abs=1e-3)
    assert spec["tokens_per_second"] > 0 and spec["wall_time_s"] > 0


def test_token_kinds_and_rejected_drafts(client: OpenAI, host: ModelHost) -> None:
    """Each token's kind; a recovered token carries the drafts it replaced. The random draft
    model is wrong nearly always, so recovered tokens with rejected drafts must appear."""
    reply = client.chat.completions.create(model="tiny draft_model", messages=HELLO,
                                           max_tokens=12, temperature=0,
                                           extra_body={"localspec": {"tokens": True}})
    tokens = reply.localspec["tokens"]
    assert {t["kind"] for t in tokens} <= {"accepted", "recovered", "bonus", "plain"}
    recovered = [t for t in tokens if t["kind"] == "recovered"]
    assert recovered and all(t["rejected"] for t in recovered)
    assert all(0 < t["p_target"] <= 1 for t in tokens)
    rejected = sum(len(t.get("rejected", [])) for t in tokens)
    assert reply.speculation["drafted"] - reply.speculation["accepted"] >= rejected > 0
    plain = client.chat.completions.create(messages=HELLO, model="tiny draft_model",
                                           max_tokens=12, temperature=0,
                                           extra_body={"localspec": {"tokens": True,
                                                                     "method": "none"}})
    assert {t["kind"] for t in plain.localspec["tokens"]} == {"plain"}
    assert token_ids(plain.localspec) == [t["id"] for t in tokens]  # lossless
    assert plain.speculation["method"] == "none" and plain.speculation["drafted"] == 0


def test_stream_carries_the_same_answer(client: OpenAI, host: ModelHost) -> None:
    """Streaming: the role first, the deltas add up to the non-streaming answer, the finish
    reason with the speculation, then usage when asked."""
    whole = client.chat.completions.create(model="tiny draft_model", messages=HELLO,
                                           max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny draft_model", messages=HELLO, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].speculation["method"] == "draft_model"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    without = list(client.chat.completions.create(model="tiny draft_model", messages=HELLO,
                                                  max_tokens=12, temperature=0, stream=True))
    assert all(c.usage is None for c in without)


def test_stream_tokens_add_up(client: OpenAI) -> None:
    """Per-step token details in a stream add up to the whole answer's."""
    whole = client.chat.completions.create(model="tiny draft_model", messages=HELLO,
                                           max_tokens=12, temperature=0,
                                           extra_body={"localspec": {"tokens": True}})
    chunks = client.chat.completions.create(model="tiny draft_model", messages=HELLO,
                                            max_tokens=12, temperature=0, stream=True,
                                            extra_body={"localspec": {"tokens": True}})
    streamed = [t for c in chunks if getattr(c, "localspec", None)
                for t in c.localspec["tokens"]]
    assert streamed == whole.localspec["tokens"]


def test_completions_take_a_raw_prompt(client: OpenAI, host: ModelHost) -> None:
    """/v1/completions: no chat template; text or token ids; streamed or not."""
    pipe = host.pipeline
    _, text = direct(pipe, pipe.encode_prompt("def add", raw=True), max_new_tokens=6,
                     temperature=0.0)
    reply = client.completions.create(model="tiny draft_model", prompt="def add", max_tokens=6,
                                      temperature=0)
    assert reply.choices[0].text == text and reply.object == "text_completion"
    assert reply.usage.prompt_tokens == len(pipe.encode_prompt("def add", raw=True))
    by_ids = client.completions.create(model="tiny draft_model",
                                       prompt=pipe.encode_prompt("def add", raw=True),
                                       max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text
    stream = client.completions.create(model="tiny draft_model", prompt="def add", max_tokens=6,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text


def test_stop_strings_end_the_answer_before_them(client: OpenAI) -> None:
    whole = client.completions.create(model="tiny draft_model", prompt="def add",
                                      max_tokens=12, temperature=0).choices[0].text
    stop = next(whole[i:i + 2] for i in range(2, len(whole) - 1)
                if whole[i:i + 2].strip() and whole.find(whole[i:i + 2]) == i)
    cut = client.completions.create(model="tiny draft_model", prompt="def add", max_tokens=12,
                                    temperature=0, stop=[stop, "never-in-it"]).choices[0]
    assert cut.text == whole[:whole.index(stop)] and cut.finish_reason == "stop"


def test_seeded_sampling_repeats(client: OpenAI) -> None:
    """The same seed gives the same sampled answer; the sampling settings reach the engine."""
    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model="tiny draft_model", messages=HELLO, max_tokens=12, temperature=1.0,
            top_p=0.95, seed=seed).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_messages_with_parts_and_developer_role(client: OpenAI, host: ModelHost) -> None:
    """Text parts are joined; a developer message is a system message."""
    pipe = host.pipeline
    expected = direct(pipe, pipe.encode_chat([{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "a\nb"}]),
                      max_new_tokens=5, temperature=0.0)[1]
    reply = client.chat.completions.create(
        model="tiny draft_model", max_tokens=5, temperature=0,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}])
    assert reply.choices[0].message.content == expected


def test_models_list_the_presets_and_mark_the_loaded_one(client: OpenAI,
                                                         tiny_presets: dict[str, str]) -> None:
    models = {m.id: m for m in client.models.list()}
    assert "cpu-qwen-coder-draft" in models and not models["cpu-qwen-coder-draft"].loaded
    loaded = [m for m in models.values() if m.loaded]
    assert [m.id for m in loaded] == [tiny_presets["draft"]]
    assert client.models.retrieve(tiny_presets["draft"]).method == "draft_model"
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4o")


def test_model_may_be_named_by_preset_key_name_or_target(client: OpenAI, host: ModelHost,
                                                         tiny_presets: dict[str, str]) -> None:
    target = host.pipeline.preset.target.model
    for name in (tiny_presets["draft"], "tiny draft_model", target):
        reply = client.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
        assert reply.model == name
