"""Parallel requests over one pipeline: N slots whose generations share every target pass.

``localspec serve --parallel N`` (and the app's ``--parallel``) gives the host a ``Scheduler``:
requests in flight sit in slots (``Pipeline.slot``: each its own target and drafter caches,
the weights shared), and one ``engine.batch.Batch`` steps them together, so each target pass
reads the weights once for every request's rows. Each answer is token for token the one it
gets alone (``engine/batch.py``).

Requests join the batch and leave it between passes: a new one is admitted (and its prompt
prefilled) while a slot is free, and leaves at its end, its cancellation (checked before each
step) or its error, without disturbing the others. While the batch holds anything the
scheduler holds the host's generation lock, so the app's own answers and a preset's swap wait
for the batch to empty as they wait for a single answer; every pass runs on the host's engine
thread (``ModelHost.on_engine``: OpenMP threads stay warm). Admission limits are the caller's
(the API's queue): here every submitted job waits for a slot.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from localspec.drafter_set import DrafterSet
from localspec.engine.batch import Batch, Outcome
from localspec.engine.engine import Generation, GenerationRequest
from localspec.pipeline import Pipeline

logger = logging.getLogger(__name__)

T = TypeVar("T")
LOCK_POLL_S = 0.25  # how often a scheduler waiting for the generation lock drops cancelled jobs


@dataclass
class SlotJob:
    """One request for a slot: what to generate, where its events go (``sink``: each step's
    event, or the exception that ended it; called on the scheduler's thread, in order), and
    ``done``, set once it has left (ended, cancelled, failed or dropped while waiting)."""

    pipeline: Pipeline
    request: GenerationRequest
    method: DrafterSet | str | None
    cancelled: Callable[[], bool]
    sink: Callable[[Outcome], None]
    done: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    """``slots`` slots over the jobs' pipeline, stepped together on the engine thread."""

    def __init__(self, slots: int, run_on_engine: Callable[[Callable[[], T]], T],
                 lock: threading.Lock, waiting: Callable[[int], object] = lambda _: None) -> None:
        """``run_on_engine``: runs work on the host's engine thread; ``lock``: the host's
        generation lock, held while any job is in the batch; ``waiting(delta)``: the host's
        count of requests waiting for their turn."""
        if slots < 1:
            raise ValueError(f"a scheduler needs at least one slot, got {slots}")
        self.slots = slots
        self._run = run_on_engine
        self._lock = lock
        self._waiting = waiting
        self._cond = threading.Condition()
        self._pending: deque[SlotJob] = deque()
        self._thread: threading.Thread | None = None
        self.peak = 0  # the most requests one pass has served so far

    def submit(self, job: SlotJob) -> None:
        """Queue ``job`` for the next free slot (the driver thread starts on first use)."""
        with self._cond:
            self._pending.append(job)
            self._waiting(+1)
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive, daemon=True,
                                                name="localspec-slots")
                self._thread.start()
            self._cond.notify_all()

    def _drive(self) -> None:
        """The driver: take the lock while there is work, admit jobs to free slots, step."""
        batch = Batch()
        members: dict[int, tuple[SlotJob, int]] = {}  # id(generation) -> job, slot
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
            if not self._acquire():
                continue
            try:
                self._run_batch(batch, members)
            except Exception as exc:  # a bug outside any one request: every member ends
                logger.exception("the parallel batch failed")
                for job, _ in members.values():
                    self._deliver(job, exc)
                    job.done.set()
                members.clear()
                batch = Batch()
            finally:
                self._lock.release()

    def _run_batch(self, batch: Batch, members: dict[int, tuple[SlotJob, int]]) -> None:
        """Admit and step until the batch is empty and nothing waits."""
        while True:
            self._admit(batch, members)
            if not batch.members:
                return
            self.peak = max(self.peak, len(batch.members))
            for generation, outcome in self._run(batch.step):
                job, _ = members[id(generation)]
                self._deliver(job, outcome)
                if generation not in batch.members:
                    members.pop(id(generation))
                    job.done.set()

    def _acquire(self) -> bool:
        """Take the generation lock, dropping jobs cancelled meanwhile; False if none is left."""
        while not self._lock.acquire(timeout=LOCK_POLL_S):
            if not self._drop_cancelled():
                return False
        if self._drop_cancelled():
            return True
        self._lock.release()
        return False

    def _drop_cancelled(self) -> bool:
        """Let go of waiting jobs that were cancelled; whether any job still waits."""
        with self._cond:
            for job in [j for j in self._pending if j.cancelled()]:
                self._pending.remove(job)
                self._waiting(-1)
                job.done.set()
            return bool(self._pending)

    def _admit(self, batch: Batch, members: dict[int, tuple[SlotJob, int]]) -> None:
        """Start waiting jobs in free slots (their prompts prefilled on the engine thread); a
        job of another pipeline than the batch's waits until the batch is empty."""
        self._drop_cancelled()
        while True:
            taken = {slot for _, slot in members.values()}
            free = [i for i in range(self.slots) if i not in taken]
            with self._cond:
                if not free or not self._pending:
                    return
                job = self._pending[0]
                if members and any(j.pipeline is not job.pipeline for j, _ in members.values()):
                    return
                self._pending.popleft()
                self._waiting(-1)
            slot = free[0]
            try:
                generation: Generation = self._run(
                    lambda job=job, slot=slot: job.pipeline.slot(slot).engine(job.method).start(
                        job.request, job.cancelled))
            except Exception as exc:  # this request's failure (a bad setting, a bug): its own
                self._deliver(job, exc)
                job.done.set()
                continue
            batch.add(generation)
            members[id(generation)] = (job, slot)

    @staticmethod
    def _deliver(job: SlotJob, outcome: Outcome) -> None:
        try:
            job.sink(outcome)
        except Exception:  # a consumer's bug must not stop the other requests
            logger.exception("a request's event consumer failed")
