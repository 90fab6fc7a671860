"""The models the app serves: one Pipeline at a time, loaded in the background, swapped safely.

A preset switch loads the new models while the old ones stay active; only when the new ones are
ready does the swap happen, so a failure (bad file, missing model, foreign tokenizer, out of
memory) leaves the previous preset in place with the reason recorded. A target (or draft) whose
spec is unchanged is reused instead of reloaded. Generation is serialised by one lock, and each
browser session has a cancel flag that its Stop button sets.

Nothing here renders or knows Gradio.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from localspec.models.cache import Progress
from localspec.pipeline import Pipeline
from localspec.presets import Preset, load_preset

logger = logging.getLogger(__name__)

Loader = Callable[[Preset, "Pipeline | None", Progress], Pipeline]


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

    def __init__(self, loader: Loader = assemble_pipeline, warm_up: bool = True) -> None:
        self._loader = loader
        self._warm_up = warm_up
        self._state_lock = threading.Lock()
        self.generation_lock = threading.Lock()
        self._pipeline: Pipeline | None = None
        self._active: str | None = None
        self._loading: str | None = None
        self._message = ""
        self._fraction = 0.0
        self._error: str | None = None
        self._waiting = 0
        self._cancel: dict[str, threading.Event] = {}
        self._ready = threading.Condition(self._state_lock)

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
            preset = load_preset(key)
            pipeline = self._loader(preset, self._pipeline, self._progress)
            if self._warm_up:
                self._progress("warming up (a first short answer)", 1.0)
                warm_up(pipeline)
        except Exception as exc:  # any load failure is reported, never fatal to the app
            logger.warning("loading preset %s failed: %s", key, exc)
            with self._state_lock:
                self._error = f"could not load preset '{key}': {exc}"
                self._loading = None
                self._ready.notify_all()
            return False
        with self.generation_lock, self._state_lock:  # never swap under a running generation
            self._pipeline, self._active, self._error = pipeline, key, None
            self._loading = None
            self._ready.notify_all()
        return True

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
        """A fresh cancel flag for ``session``'s generation."""
        event = threading.Event()
        with self._state_lock:
            self._cancel[session] = event
        return event

    def end(self, session: str, event: threading.Event) -> None:
        with self._state_lock:
            if self._cancel.get(session) is event:
                del self._cancel[session]

    def cancel(self, session: str) -> bool:
        """Set ``session``'s cancel flag; False if it has no generation running or waiting."""
        with self._state_lock:
            event = self._cancel.get(session)
        if event is None:
            return False
        event.set()
        return True

    def acquire(self, cancelled: threading.Event, timeout: float) -> bool | None:
        """Try to take the generation lock for up to ``timeout`` s. None if cancelled meanwhile."""
        if cancelled.is_set():
            return None
        return self.generation_lock.acquire(timeout=timeout)

    def set_waiting(self, delta: int) -> int:
        with self._state_lock:
            self._waiting += delta
            return self._waiting
