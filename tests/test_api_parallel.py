"""``localspec serve --parallel``: concurrent ``openai`` clients over real HTTP get the answers
they get one at a time (greedy and seeded sampling, chat and completions), while their
requests share target passes; a client that leaves mid-stream does not disturb the others."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from api_helpers import serving
from openai import OpenAI

from localspec.engine.batch import Outcome
from localspec.engine.engine import GenerationError, StepEvent
from localspec.host import ModelHost
from localspec.slots import Scheduler, SlotJob

QUESTIONS = ["hello", "def add(a, b):", "hello world", "return a + b"]


@pytest.fixture(scope="module")
def host(tiny_presets: dict[str, str]) -> ModelHost:
    host = ModelHost(warm_up=False, audit=False, parallel=2)
    assert host.load(tiny_presets["draft"]), host.status().error
    return host


@pytest.fixture(scope="module")
def client(host: ModelHost) -> Iterator[OpenAI]:
    with serving(host) as url:
        yield OpenAI(base_url=url, api_key="unused", max_retries=0)


def ask(client: OpenAI, i: int) -> str:
    """Request i: chat or completion, greedy or sampled with its own seed."""
    settings = {"max_tokens": 30, "temperature": 0.0 if i % 2 == 0 else 1.0, "seed": 100 + i}
    if i < 2:
        return client.chat.completions.create(
            model="tiny draft_model", messages=[{"role": "user", "content": QUESTIONS[i]}],
            **settings).choices[0].message.content or ""
    return client.completions.create(model="tiny draft_model", prompt=QUESTIONS[i],
                                     **settings).choices[0].text


def at_once(host: ModelHost, work: list[Callable[[], str]]) -> list[str]:
    """Run ``work`` concurrently; the generation lock is held until all have been submitted,
    so they start together in the slots."""
    with ThreadPoolExecutor(len(work)) as pool:
        with host.generation_lock:
            futures = [pool.submit(w) for w in work]
            while host.status().waiting < len(work):
                threading.Event().wait(0.01)
        return [f.result(timeout=60) for f in futures]


def test_concurrent_clients_get_their_answers_alone(client: OpenAI, host: ModelHost) -> None:
    alone = [ask(client, i) for i in range(len(QUESTIONS))]
    assert host.scheduler is not None and host.scheduler.peak == 1
    together = at_once(host, [lambda i=i: ask(client, i) for i in range(len(QUESTIONS))])
    assert together == alone
    assert host.scheduler.peak == 2  # two slots: four requests, two at a time
    assert len(set(alone)) == len(alone)


def test_a_client_leaving_mid_stream_disturbs_no_other(client: OpenAI, host: ModelHost,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One streaming client closes its stream after three chunks: its generation ends
    "cancelled" at a step; the other's answer is its answer alone, and the slot is free again
    for the next request."""
    alone = ask(client, 1)
    finishes: list[str | None] = []
    submit = Scheduler.submit

    def watched(scheduler: Scheduler, job: SlotJob) -> None:
        sink = job.sink

        def recording(outcome: Outcome) -> None:
            if isinstance(outcome, StepEvent) and outcome.finish_reason is not None:
                finishes.append(outcome.finish_reason)
            sink(outcome)

        job.sink = recording
        submit(scheduler, job)

    monkeypatch.setattr(Scheduler, "submit", watched)

    def leaver() -> str:
        stream = client.chat.completions.create(
            model="tiny draft_model", messages=[{"role": "user", "content": "hello"}],
            max_tokens=2000, temperature=1.0, seed=5, stream=True)
        for n, _ in enumerate(stream):
            if n == 3:
                break
        stream.close()
        return "left"

    assert at_once(host, [leaver, lambda: ask(client, 1)]) == ["left", alone]
    for _ in range(500):  # the server sees the departure within a step or two
        if len(finishes) == 2:
            break
        threading.Event().wait(0.01)
    assert sorted(finishes) == ["cancelled", "length"]
    assert [ask(client, 1) for _ in range(2)] == [alone, alone]


def test_a_request_that_cannot_start_fails_alone(host: ModelHost) -> None:
    """A job the engine refuses (no new tokens allowed) gets its error; the job beside it runs
    to its end with its answer alone; both leave (``done``)."""
    pipe = host.pipeline
    assert pipe is not None and host.scheduler is not None
    good = pipe.request(pipe.encode_prompt("hello"), max_new_tokens=8, temperature=0.0)
    bad = dataclasses.replace(good, max_new_tokens=0)
    alone = [t for e in pipe.stream(good) for t in e.tokens]
    outcomes: dict[str, list[Outcome]] = {"good": [], "bad": []}
    jobs = {name: SlotJob(pipe, request, None, lambda: False, outcomes[name].append)
            for name, request in (("bad", bad), ("good", good))}
    with host.generation_lock:  # both wait, then start together
        for job in jobs.values():
            host.scheduler.submit(job)
    assert all(job.done.wait(30) for job in jobs.values())
    assert len(outcomes["bad"]) == 1 and isinstance(outcomes["bad"][0], GenerationError)
    assert [t for e in outcomes["good"] for t in e.tokens] == alone  # type: ignore[union-attr]
