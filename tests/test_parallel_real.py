"""Parallel requests on the real built-in models: requests stepped together (one target pass
for all, ``engine.batch``) give each the answer it gets alone, token for token, for plain
decoding, n-gram lookup and the default preset's draft model (the 1.5B's native stack batches
its slots; SmolLM2-135M's int8 layers run them one after another), greedy and sampled with
seeds; and ``serve --parallel 2`` answers concurrent ``openai`` clients as it answers them one
at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from api_helpers import serving
from openai import OpenAI

from localspec.engine.batch import run_together
from localspec.host import ModelHost
from localspec.pipeline import Pipeline
from localspec.presets import load_preset

pytestmark = pytest.mark.real_model
QUESTIONS = ["Write a Python function that reverses a string.", "What is 2 + 2?",
             "Name three colours."]


@pytest.fixture(scope="module")
def qwen_pair() -> Pipeline:
    return Pipeline.load(load_preset("cpu-qwen-coder-draft"))


def tokens(events: list) -> list[int]:
    return [t for e in events for t in e.tokens]


def check_together(pipe: Pipeline, method: str | None, sampled: bool) -> None:
    settings = ({"temperature": 0.8, "top_p": 0.95, "adaptive": False} if sampled
                else {"temperature": 0.0})
    requests = [pipe.request(pipe.encode_prompt(q), max_new_tokens=24, seed=3 + i, **settings)
                for i, q in enumerate(QUESTIONS)]
    alone = [tokens(list(pipe.engine(method).generate(r))) for r in requests]
    together = run_together([(pipe.slot(i).engine(method), r) for i, r in enumerate(requests)])
    assert [tokens(events) for events in together] == alone, (method, sampled)


@pytest.mark.parametrize("method", ["none", "ngram", None])
@pytest.mark.parametrize("sampled", [False, True])
def test_qwen_requests_together_are_each_alone(qwen_pair: Pipeline, method: str | None,
                                               sampled: bool) -> None:
    assert qwen_pair.slot(1).target_runner().batches_with(qwen_pair.target_runner())
    check_together(qwen_pair, method, sampled)


def test_smollm_requests_together_are_each_alone() -> None:
    pipe = Pipeline.load(load_preset("cpu-smollm2-ngram"))
    for method in ("none", "ngram"):
        check_together(pipe, method, sampled=False)


def test_serve_parallel_answers_concurrent_clients_as_alone(qwen_pair: Pipeline) -> None:
    host = ModelHost(loader=lambda _preset, _previous, _progress: qwen_pair, warm_up=False,
                     audit=False, parallel=2)
    assert host.load("cpu-qwen-coder-draft"), host.status().error
    with serving(host) as url:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0)

        def ask(question: str) -> str:
            return client.chat.completions.create(
                model="cpu-qwen-coder-draft", messages=[{"role": "user", "content": question}],
                max_tokens=20, temperature=0).choices[0].message.content or ""

        alone = [ask(q) for q in QUESTIONS[:2]]
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, QUESTIONS[:2])) == alone
