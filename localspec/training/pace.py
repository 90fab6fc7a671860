"""A time estimate for a phase of many equal units (chunks, steps), announced once.

The first unit is left out of the measure: it pays for warm-up (oneDNN primitives, first
allocations, optimizer state), 2-3 times a later unit's time on this CPU. The estimate is
logged after the third unit, from the second and third.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MEASURED_AFTER = 3  # units done when the estimate is made


class Pace:
    """Call ``done(n)`` after unit n (1-based) of ``total``; logs one estimate."""

    def __init__(self, what: str, unit: str, total: int, log: Callable[[str], None]) -> None:
        self.what, self.unit, self.total, self.log = what, unit, total, log
        self._after_first: float | None = None

    def done(self, n: int) -> None:
        if n == 1:
            self._after_first = time.perf_counter()
        elif n == MEASURED_AFTER and self._after_first is not None and self.total > n:
            each = (time.perf_counter() - self._after_first) / (n - 1)
            self.log(f"{self.what}: {each:.2f} s per {self.unit}, about "
                     f"{each * (self.total - n) / 60:.1f} min for the {self.total - n} left")
