"""The API's side of the model host: checking a request against the loaded preset, admitting it
to the one queue, and running it on a worker thread while the server's event loop streams.

Answers come one at a time, the app's and the API's alike: a generation holds the host's
generation lock; with ``localspec serve --parallel N`` the API's requests run together in N
slots instead (``localspec.slots``: each answer the one it gets alone), whose batch holds the
lock while it runs. At most ``max_queued`` API requests are held at once (waiting or generating);
one more is refused with 429 at once rather than left to hang. A generation stops within one
speculation step of its client going away: a stream's consumer sets the cancel flag when the
server closes it, a non-streaming request polls for the disconnect, and a consumer that is
dropped without either lets go of the worker's only link to it (a weak reference).

Given a ``ChatStore`` (``localspec serve --save-chats``; off by default), each chat request is
saved as a conversation of its own as it is answered (``localspec.chats.answers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from localspec.api.answer_plan import AnswerPlan, answer_plan
from localspec.api.errors import BadRequest, Busy, Loading, NotFound, TooLarge
from localspec.api.schemas import ChatRequest, CompletionRequest
from localspec.chats.answers import SavedRequest, answer_settings, answer_summary
from localspec.chats.store import ChatStore
from localspec.config import API_MAX_QUEUED, Preset
from localspec.drafter_set import DrafterSet
from localspec.engine.batch import Outcome
from localspec.engine.engine import GenerationRequest, StepEvent
from localspec.engine.stats import GenerationStats
from localspec.errors import LocalSpecError, PresetError
from localspec.host import ModelHost
from localspec.pipeline import Pipeline
from localspec.presets import list_preset_names
from localspec.slots import Scheduler, SlotJob

logger = logging.getLogger(__name__)

API_STREAM_INTERVAL_S = 0.05  # a stream's events go out together at most this often
POLL_S = 0.25  # how often a waiting or non-streaming request looks for its client's departure


@dataclass
class Job:
    """One admitted request: what to generate and with which models."""

    id: str
    created: int
    model: str
    pipeline: Pipeline
    request: GenerationRequest
    drafters: DrafterSet  # the method, resolved once
    want_tokens: bool
    stats: GenerationStats = field(default_factory=GenerationStats)
    messages: list[dict[str, str]] | None = None  # a chat request's, to save
    plan: AnswerPlan = field(default_factory=AnswerPlan)  # tools offered, grammar, calls read

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def method(self) -> str:
        return self.drafters.method


def _model_ids(preset: Preset, key: str) -> set[str]:
    """The names a request's ``model`` may give the loaded preset: its key (or path), its name,
    and the target model's name."""
    return {key, preset.name, preset.target.model}


class ApiService:
    """Requests checked, admitted and run against ``host``'s loaded pipeline."""

    def __init__(self, host: ModelHost, max_queued: int = API_MAX_QUEUED,
                 store: ChatStore | None = None) -> None:
        self.host = host
        self.max_queued = max_queued
        self.store = store  # where chat requests are saved (None: nowhere)
        self._lock = threading.Lock()
        self._admitted = 0

    # ------------------------------------------------------------------ models

    def loaded(self) -> tuple[Pipeline, str]:
        """The pipeline in use and its preset key; Loading (503) while there is none."""
        pipeline, status = self.host.pipeline, self.host.status()
        if pipeline is None or status.active is None:
            if status.loading is not None:
                raise Loading(f"the models are loading (preset '{status.loading}': "
                              f"{status.message}, {status.fraction:.0%}); try again shortly")
            raise Loading(f"no model is loaded{': ' + status.error if status.error else ''}")
        return pipeline, status.active

    def models(self) -> list[dict[str, object]]:
        """``GET /v1/models``: every shipped preset, and the loaded one (a path, perhaps) marked."""
        pipeline, active = self.host.pipeline, self.host.status().active
        names = list_preset_names()
        if active is not None and active not in names:
            names.append(active)
        return [{"id": name, "object": "model", "created": 0, "owned_by": "localspec",
                 "loaded": name == active,
                 **({"target": pipeline.preset.target.model,
                     "method": pipeline.preset.speculative_config.method}
                    if name == active and pipeline is not None else {})}
                for name in names]

    def model(self, name: str) -> dict[str, object]:
        for entry in self.models():
            if entry["id"] == name:
                return entry
        raise NotFound(f"the model '{name}' does not exist", param="model")

    # ------------------------------------------------------------------ requests

    def prepare(self, body: ChatRequest | CompletionRequest, kind: str) -> Job:
        """A Job for ``body`` on the loaded preset, every check done before any model work:
        the model's name, the method, the settings' ranges, the prompt against the context."""
        pipeline, active = self.loaded()
        if body.model is not None and body.model not in _model_ids(pipeline.preset, active):
            if body.model in list_preset_names():
                raise BadRequest(f"the model '{body.model}' is not loaded: this server runs "
                                 f"'{active}' (switch presets in the app, or restart `localspec "
                                 f"serve --preset {body.model}`)", param="model",
                                 code="model_not_loaded")
            raise NotFound(f"the model '{body.model}' does not exist: this server runs "
                           f"'{active}' (GET /v1/models lists the presets)", param="model")
        try:
            drafters = pipeline.preset.drafter_set(body.localspec.method)
        except PresetError as exc:  # not a method, or one this preset cannot run
            raise BadRequest(str(exc), param="localspec.method") from exc
        plan = (answer_plan(body, pipeline.tokenizer.chat_template)
                if isinstance(body, ChatRequest) else AnswerPlan())
        try:
            prompt = (pipeline.encode_chat(body.chat(), plan.tools)
                      if isinstance(body, ChatRequest)
                      else self._raw_prompt(pipeline, body.prompt))
            request = pipeline.request(prompt, stop_strings=body.stop_strings() + plan.stops,
                                       reuse_prefix=True, output=plan.output,
                                       max_new_tokens=body.new_tokens(),
                                       temperature=body.temperature, top_p=body.top_p,
                                       top_k=body.top_k, seed=body.seed)
        except LocalSpecError as exc:  # a template's refusal, a setting out of range, ...
            if isinstance(exc, BadRequest):
                raise
            raise BadRequest(str(exc)) from exc
        context = pipeline.target_runner().max_length
        if len(request.prompt_ids) >= context:
            raise TooLarge(f"the prompt is {len(request.prompt_ids)} tokens and the model's "
                           f"context holds {context}: shorten it", param="messages")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Job(f"{prefix}-{secrets.token_hex(12)}", int(time.time()), body.model or active,
                   pipeline, request, drafters, body.localspec.tokens,
                   messages=body.saved() if isinstance(body, ChatRequest) else None, plan=plan)

    @staticmethod
    def _raw_prompt(pipeline: Pipeline, prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return pipeline.encode_prompt(prompt, raw=True)
        if isinstance(prompt[0], str):
            return pipeline.encode_prompt(str(prompt[0]), raw=True)
        vocab = pipeline.target.vocab_size
        ids = [int(t) for t in prompt]
        if not all(0 <= t < vocab for t in ids):
            raise BadRequest(f"prompt: token ids must be in [0, {vocab})", param="prompt")
        return ids

    # ------------------------------------------------------------------ running

    def start(self, job: Job) -> Generation:
        """Admit ``job`` to the queue (Busy, 429, when it is full) and start its worker."""
        with self._lock:
            if self._admitted >= self.max_queued:
                raise Busy(f"the server holds {self._admitted} requests, its limit: try again "
                           "shortly")
            self._admitted += 1
        generation = Generation(job, asyncio.get_running_loop())
        thread = threading.Thread(target=self._work, args=(generation.link(),), daemon=True,
                                  name=f"api-{job.id}")
        try:
            thread.start()
        except RuntimeError:
            self._leave()
            raise
        return generation

    def _generate(self, link: _Link, cancel: threading.Event) -> None:
        """The generation itself, on the host's engine thread (the lock is held): each event
        counted, saved when asked, and handed to the consumer straight from there."""
        deliver = _Delivery(link, self._saved(link.job), self.host.remember_answer)
        stream = link.job.pipeline.stream(link.job.request, link.job.drafters,
                                          cancelled=lambda: cancel.is_set() or link.gone())
        for event in stream:
            deliver(event)
        deliver.close()

    def _in_slot(self, link: _Link, cancel: threading.Event, scheduler: Scheduler) -> None:
        """The generation in one of the host's parallel slots (``localspec.slots``): its
        events come from the scheduler's thread as the batch steps; this worker waits."""
        deliver = _Delivery(link, self._saved(link.job), self.host.remember_answer)
        failed: list[Exception] = []

        def sink(outcome: Outcome) -> None:
            if isinstance(outcome, Exception):
                failed.append(outcome)
            else:
                deliver(outcome)

        job = SlotJob(link.job.pipeline, link.job.request, link.job.drafters,
                      lambda: cancel.is_set() or link.gone(), sink)
        scheduler.submit(job)
        job.done.wait()
        if failed:
            raise failed[0]
        deliver.close()

    def _leave(self) -> None:
        with self._lock:
            self._admitted -= 1

    def _work(self, link: _Link) -> None:
        """The worker: wait for the turn, generate, pass each event to the consumer."""
        session = f"api/{link.job.id}"
        cancel = self.host.begin(session)
        waiting = False
        try:
            if self.host.scheduler is not None:
                self._in_slot(link, cancel, self.host.scheduler)
                link.put(_END)
                return
            got = self.host.acquire(cancel, 0.0)
            if not got:
                waiting = True
                self.host.set_waiting(+1)
            while not got:
                if got is None or link.gone():
                    link.put(_END)
                    return
                got = self.host.acquire(cancel, POLL_S)
            if waiting:
                waiting = False
                self.host.set_waiting(-1)
            try:
                self.host.run_on_engine(lambda: self._generate(link, cancel))
            finally:
                self.host.generation_lock.release()
            link.put(_END)
        except Exception as exc:  # handed to the consumer: a message, or a bug logged there
            link.put(exc)
        finally:
            if waiting:
                self.host.set_waiting(-1)
            self.host.end(session, cancel)
            self._leave()


    def _saved(self, job: Job) -> SavedRequest | None:
        """A chat request's record in the store, when requests are saved."""
        if self.store is None or job.messages is None:
            return None
        return SavedRequest(self.store, job.messages, preset=self.host.status().active,
                            settings=answer_settings(job.request, job.method))


_END = object()


class _Delivery:
    """A job's events on their way out: counted in its stats, saved when asked, handed to
    the consumer; ``close`` ends the saved answer."""

    def __init__(self, link: _Link, saved: SavedRequest | None,
                 learn: Callable[[Pipeline, list[int], list[int]], None] = lambda *_: None
                 ) -> None:
        """``learn``: given the saved answer's tokens at its end (``remember_answer``)."""
        self.link, self.saved, self.learn = link, saved, learn
        self.start = time.perf_counter()
        self.finish: str | None = None
        self.token_ids: list[int] = []

    def __call__(self, event: StepEvent) -> None:
        job = self.link.job
        job.stats.add(event)
        job.stats.wall_time = time.perf_counter() - self.start
        if self.saved is not None:
            self.saved.add(event.text_delta, len(event.tokens))
            self.finish = event.finish_reason or self.finish
            self.token_ids.extend(event.tokens)
        self.link.put(event)

    def close(self) -> None:
        if self.saved is not None:
            self.saved.finish(self.finish, answer_summary(self.link.job.method,
                                                          self.link.job.stats))
            job = self.link.job
            self.learn(job.pipeline, self.token_ids, job.request.prompt_ids)


def _put_all(queue: asyncio.Queue, items: list[object]) -> None:
    for item in items:
        queue.put_nowait(item)


class _Link:
    """The worker's side: the job, and a weak reference to the consumer's queue. Events are
    handed over together at most every ``API_STREAM_INTERVAL_S`` (the first, the last and the
    end at once): each hand-over wakes the server's loop and the client, and on a machine
    whose cores all decode, those wake-ups cost the decode more than the latency they save."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.job = job
        self.loop = loop
        self._queue = weakref.ref(queue)
        self.closed = False  # the consumer stopped listening
        self._held: list[object] = []
        self._sent = float("-inf")

    def gone(self) -> bool:
        return self.closed or self._queue() is None

    def put(self, item: object) -> None:
        self._held.append(item)
        now = time.monotonic()
        final = not isinstance(item, StepEvent) or item.finish_reason is not None
        if not final and now - self._sent < API_STREAM_INTERVAL_S:
            return
        self._sent, held, self._held = now, self._held, []
        queue = self._queue()
        if queue is None:
            return
        with contextlib.suppress(RuntimeError):  # the server's loop has closed: nobody listens
            self.loop.call_soon_threadsafe(_put_all, queue, held)


class Generation:
    """The consumer's side of a running job: its events, in order, as they come."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._link = _Link(job, loop, self._queue)

    def link(self) -> _Link:
        return self._link

    def cancel(self) -> None:
        """Stop the generation (at its next step) or its wait for a turn."""
        self._link.closed = True

    async def batches(self, disconnected: Callable[[], Awaitable[bool]] | None = None,
                      ) -> AsyncIterator[list[StepEvent]]:
        """The job's events until it ends, each time all that have come (one when the consumer
        keeps up, more when it fell behind: a stream then writes them at once); a
        LocalSpecError or bug raised in the worker is raised here. ``disconnected`` is polled
        (a non-streaming request) every POLL_S; a consumer closed or cancelled early stops the
        worker."""
        last = time.monotonic()
        try:
            while True:
                try:
                    items = [self._queue.get_nowait()]
                except asyncio.QueueEmpty:
                    try:
                        items = [await asyncio.wait_for(self._queue.get(), POLL_S)]
                    except TimeoutError:
                        items = []
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                if disconnected is not None and time.monotonic() - last >= POLL_S:
                    last = time.monotonic()
                    if await disconnected():
                        return
                events: list[StepEvent] = []
                ended: object = None  # _END, or what the worker raised
                for item in items:
                    if item is _END or isinstance(item, Exception):
                        ended = item
                        break
                    events.append(item)
                if events:
                    yield events
                if isinstance(ended, Exception):
                    raise ended
                if ended is _END:
                    return
        finally:
            self.cancel()
