"""FeatureStore: the hidden states a runner keeps per position for feature-level drafters.

EAGLE, EAGLE-3 and Medusa draft from the target's hidden states of verified tokens. A runner
told to record them (``ModelRunner.record_features``) writes each forward's rows here, at their
positions, like keys and values: a drafter then reads the verify pass the engine already ran
instead of running its own. Rolling back is a change of the valid range only; the next forward
overwrites stale rows. The store knows positions and rows, not layers or models: which layers
are concatenated into a row is the runner's business, how they are computed the backend's.
"""

from __future__ import annotations

import torch

FEATURE_BLOCK = 256  # the store grows by at least this many positions


class FeatureStore:
    """Rows [capacity, width] by position; valid from ``start`` up to the runner's length."""

    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None  # [capacity, len(feature_layers) * hidden]
        self.start = 0  # positions before this were fed while not recording

    def restart(self, start: int) -> None:
        """Drop every row (the recorded layers changed); rows are valid from ``start`` on."""
        self._rows = None
        self.start = start

    def clamp(self, length: int) -> None:
        """The runner now holds ``length`` positions: none past it stay valid."""
        self.start = min(self.start, length)

    def read(self, start: int, end: int, length: int) -> torch.Tensor:
        """Rows [end - start, width] of positions start..end-1, of the ``length`` cached."""
        if self._rows is None or not self.start <= start <= end <= length:
            raise ValueError(f"no recorded features for positions {start}..{end - 1} (recorded "
                             f"from {self.start} to {length - 1})")
        return self._rows[start:end]

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Write ``rows`` [n, width] at positions start..; the store grows by doubling."""
        end = start + rows.shape[0]
        store = self._rows
        if store is None or store.shape[0] < end:
            capacity = max(end, FEATURE_BLOCK, 2 * store.shape[0] if store is not None else 0)
            grown = rows.new_empty((capacity, rows.shape[1]))
            if store is not None:
                grown[: store.shape[0]] = store
            self._rows = store = grown
        store[start:end] = rows.to(store.dtype)

    def move(self, target: torch.Tensor, source: torch.Tensor, start: int) -> None:
        """Copy the rows at ``source`` to ``target`` (a tree's kept path), where positions from
        ``start`` on were recorded."""
        if self._rows is not None and self.start <= start:
            self._rows[target] = self._rows[source]
