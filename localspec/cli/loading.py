"""Loading a preset's models from the command line, with one progress bar per stage on stderr.

Shared by every command that loads models; it neither validates flags nor runs anything.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from localspec.config import Preset
from localspec.pipeline import Pipeline


class ProgressBar:
    """Progress callback for model assembly/loading: one tqdm bar per stage, on stderr."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None
        self._message = ""

    def __call__(self, message: str, fraction: float) -> None:
        if message != self._message:
            self.close()
            self._message = message
            if fraction >= 1.0:  # a stage that is already done needs no bar
                return
            self._bar = tqdm(total=100, desc=message, unit="%", file=sys.stderr, leave=False)
        if self._bar is not None:
            self._bar.update(int(100 * fraction) - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def load_pipeline(preset: Preset, need_draft: bool = True) -> Pipeline:
    """Load ``preset``'s models with a progress bar on stderr."""
    progress = ProgressBar()
    try:
        return Pipeline.load(preset, progress=progress, load_draft=need_draft)
    finally:
        progress.close()
