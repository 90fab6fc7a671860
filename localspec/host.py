"""The models the app serves: one Pipeline at a time, loaded in the background, swapped safely.

A preset switch loads the new models while the old ones stay active; only when the new ones are
ready does the swap happen, so a failure (bad file, missing model, foreign tokenizer, out of
memory) leaves the previous preset in place with the reason recorded. A target (or draft) whose
spec is unchanged is reused instead of reloaded; the warm-up and the swap wait for a running
generation (the new pipeline may share its models). Generation is serialised by one lock (with
``parallel`` > 1 the API's requests run together in slots, ``localspec.slots``, which hold the
lock while any runs), and each generation has a cancel flag, grouped by a key (a browser
session and tab) that its Stop button sets.

Every generation runs on the host's one engine thread (``on_engine``), whichever thread asks
for it (Gradio's workers, the API's): the CPU kernels and torch run on OpenMP, whose worker
threads spin briefly between parallel regions, but once the process holds more OpenMP threads
than cores (each thread that has run a parallel region keeps a pool of its own while it lives)
they sleep at once and every region wakes them: successive answers on different long-lived
worker threads decoded at less than half the speed of answers on one thread
(docs/research-log.md).

Nothing here renders or knows Gradio.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from localspec.chats.store import ChatStore
from localspec.config import HISTORY_DRAFT_TOKENS
from localspec.errors import ChatStoreError, LocalSpecError
from localspec.models.cache import Progress
from localspec.models.loading import audit_cache
from localspec.pipeline import Pipeline
from localspec.presets import Preset, load_preset
from localspec.slots import Scheduler

logger = logging.getLogger(__name__)

Loader = Callable[[Preset, "Pipeline | None", Progress], Pipeline]
T = TypeVar("T")
HISTORY_CHARS_PER_TOKEN = 4  # the saved answers read at start: ~the history's cap in tokens


def assemble_pipeline(preset: Preset, previous: Pipeline | None, progress: Progress) -> Pipeline:
    """Load what ``preset`` needs, reusing ``previous``'s target/draft where the spec matches."""
    return Pipeline.load(preset, progress=progress, previous=previous)


def warm_up(pipeline: Pipeline) -> None:
    """Two tokens with the preset's method: the first pass of a process is slow (kernel set-up),
    and a broken combination should fail at load time, not on the user's first message."""
    ids = pipeline.encode_chat([{"role": "user", "content": "Hi"}])
    pipeline.run(pipeline.request(ids, max_new_tokens=2))


@dataclass(frozen=True)
class HostStatus:
    """A snapshot for the status line."""

    active: str | None  # preset key in use
    active_title: str | None
    loading: str | None  # preset key being loaded
    message: str  # progress message of the load
    fraction: float
    error: str | None  # why the last load failed
    waiting: int  # sessions waiting for the generation lock


class ModelHost:
    """Holds the active Pipeline; loads presets in a background thread."""

    def __init__(self, loader: Loader = assemble_pipeline, warm_up: bool = True,
                 audit: bool = True, parallel: int = 1, history: ChatStore | None = None
                 ) -> None:
        """``parallel`` > 1: the API's requests run in that many slots whose target passes
        are shared (``scheduler``); 1: one generation at a time, as the app's own.
        ``history``: the saved conversations whose answers the suffix drafter learns, read
        when a preset loads and added to as saved answers finish (None: no history)."""
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self._loader = loader
        self._warm_up = warm_up
        self._audit = audit  # hash the cached files in full after a load (background)
        self.history = history
        self._history_thread: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self.generation_lock = threading.Lock()
        self._pipeline: Pipeline | None = None
        self._active: str | None = None
        self._loading: str | None = None
        self._message = ""
        self._fraction = 0.0
        self._error: str | None = None
        self._waiting = 0
        self._cancel: dict[str, set[threading.Event]] = {}
        self._ready = threading.Condition(self._state_lock)  # a load ended
        self._ended = threading.Condition(self._state_lock)  # a generation ended
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-engine")
        self.parallel = parallel
        self.scheduler = (Scheduler(parallel, self.run_on_engine, self.generation_lock,
                                    self.set_waiting) if parallel > 1 else None)

    # ------------------------------------------------------------------ the engine thread

    def on_engine(self, events: Iterator[T]) -> Iterator[T]:
        """``events`` (a generation's stream) advanced on the engine thread, one item at a
        time, and closed there when the caller stops early; what it raises is raised here."""
        end = object()
        try:
            while True:
                item = self._engine.submit(next, events, end).result()
                if item is end:
                    return
                yield item
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                self._engine.submit(close).result()

    def run_on_engine(self, work: Callable[[], T]) -> T:
        """``work()`` on the engine thread; its result, or what it raised."""
        return self.submit_on_engine(work).result()

    def submit_on_engine(self, work: Callable[[], T]) -> Future[T]:
        """``work()`` queued on the engine thread, not waited for (a long job whose progress
        the caller shows meanwhile)."""
        return self._engine.submit(work)

    # ------------------------------------------------------------------ loading

    @property
    def pipeline(self) -> Pipeline | None:
        return self._pipeline

    def status(self) -> HostStatus:
        with self._state_lock:
            title = self._pipeline.preset.name if self._pipeline is not None else None
            return HostStatus(self._active, title, self._loading, self._message,
                              self._fraction, self._error, self._waiting)

    def _progress(self, message: str, fraction: float) -> None:
        with self._state_lock:
            self._message, self._fraction = message, fraction

    def load(self, key: str) -> bool:
        """Load preset ``key`` (a name or a path) now; on failure keep the active one."""
        with self._state_lock:
            if self._loading is not None:
                self._error = f"already loading '{self._loading}': wait for it to finish"
                return False
            self._loading, self._message, self._fraction = key, "reading preset", 0.0
        try:
            pipeline = self._loader(load_preset(key), self._pipeline, self._progress)
            self._read_history(pipeline)
            # The warm-up and the swap wait for a running generation: the new pipeline may
            # share the old one's models, which must not run two passes at once.
            with self.generation_lock:
                if self._warm_up:
                    self._progress("compiling for this GPU (once, ~1 min)" if
                                   pipeline.cuda_graphs else "warming up (a first short answer)",
                                   1.0)
                    self.run_on_engine(lambda: warm_up(pipeline))
                with self._state_lock:
                    self._pipeline, self._active, self._error = pipeline, key, None
            if self._audit:
                threading.Thread(target=self._audit_cache, args=(pipeline,), daemon=True,
                                 name=f"audit-{key}").start()
        except LocalSpecError as exc:  # a bad file, a missing model, a foreign tokenizer ...
            logger.warning("loading preset %s failed: %s", key, exc)
            self._failed(f"could not load preset '{key}': {exc}")
            return False
        except Exception as exc:  # out of memory, a bug: never fatal to the app, but logged
            logger.exception("loading preset %s failed", key)
            self._failed(f"could not load preset '{key}': {type(exc).__name__}: {exc}")
            return False
        finally:
            with self._state_lock:
                self._loading = None
                self._ready.notify_all()
        return True

    def _read_history(self, pipeline: Pipeline) -> None:
        """Teach a new pipeline the saved answers, in the background: encoding 10,000 of them
        takes seconds, and the models are ready meanwhile (the suffix drafter drafts from the
        request alone until they are in). Not a history already read (a predecessor's on the
        same target, which the pipeline kept)."""
        if (self.history is None or pipeline.history.seeded
                or pipeline.answer_history() is None):
            return
        pipeline.history.seeded = True
        self._history_thread = threading.Thread(
            target=self._encode_history, args=(pipeline, self.history), daemon=True,
            name="history-drafts")
        self._history_thread.start()

    @staticmethod
    def _encode_history(pipeline: Pipeline, store: ChatStore) -> None:
        try:
            texts = store.answer_texts(HISTORY_DRAFT_TOKENS * HISTORY_CHARS_PER_TOKEN)
        except ChatStoreError as exc:
            logger.warning("history drafts: the saved answers could not be read: %s", exc)
            return
        if texts:  # a tokenizer of its own: the engine's encodes and decodes meanwhile
            tokenizer = copy.deepcopy(pipeline.tokenizer)
            pipeline.remember(tokenizer(texts, add_special_tokens=False)["input_ids"])

    def wait_history(self, timeout: float) -> bool:
        """Block up to ``timeout`` s while the saved answers are read; True once they are."""
        thread = self._history_thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def remember_answer(self, pipeline: Pipeline, token_ids: list[int],
                        prompt_ids: list[int]) -> None:
        """A saved answer to ``prompt_ids`` has finished: ``pipeline``'s history learns it
        (with a history)."""
        if self.history is not None and token_ids:
            pipeline.remember([token_ids], [prompt_ids])

    def _audit_cache(self, pipeline: Pipeline) -> None:
        """Hash the loaded models' cached files in full, in the background (the start-up check
        samples blocks only); a damaged file is reported in the status line."""
        for loaded in (pipeline.target, pipeline.draft):
            problem = audit_cache(loaded) if loaded is not None else None
            if problem is not None and self._pipeline is pipeline:
                self._failed(f"the cached copy of {loaded.name} is damaged ({problem}): answers "
                             "may be wrong; restart the app to rebuild it")

    def _failed(self, error: str) -> None:
        with self._state_lock:
            self._error = error

    def load_async(self, key: str) -> threading.Thread:
        thread = threading.Thread(target=self.load, args=(key,), name=f"load-{key}", daemon=True)
        thread.start()
        return thread

    def is_loading(self) -> bool:
        return self._loading is not None

    def wait_loaded(self, timeout: float) -> bool:
        """Block up to ``timeout`` s while a load runs; True once none runs."""
        with self._state_lock:
            return self._ready.wait_for(lambda: self._loading is None, timeout)

    # ------------------------------------------------------------------ sessions

    def begin(self, session: str) -> threading.Event:
        """A fresh cancel flag for one of ``session``'s generations (a tab may run a chat and
        a race at once; its Stop stops both)."""
        event = threading.Event()
        with self._state_lock:
            self._cancel.setdefault(session, set()).add(event)
        return event

    def end(self, session: str, event: threading.Event) -> None:
        with self._state_lock:
            events = self._cancel.get(session, set())
            events.discard(event)
            if not events:
                self._cancel.pop(session, None)
            self._ended.notify_all()

    def wait_ended(self, session: str, timeout: float) -> bool:
        """Block up to ``timeout`` s until ``session`` has no generation; True if none has."""
        with self._state_lock:
            return self._ended.wait_for(lambda: session not in self._cancel, timeout)

    def cancel(self, session: str) -> bool:
        """Set the cancel flags of ``session``'s generations; False if none runs or waits."""
        with self._state_lock:
            events = list(self._cancel.get(session, ()))
        for event in events:
            event.set()
        return bool(events)

    def acquire(self, cancelled: threading.Event, timeout: float) -> bool | None:
        """Try to take the generation lock for up to ``timeout`` s. None if cancelled meanwhile."""
        if cancelled.is_set():
            return None
        return self.generation_lock.acquire(timeout=timeout)

    def set_waiting(self, delta: int) -> int:
        with self._state_lock:
            self._waiting += delta
            return self._waiting
