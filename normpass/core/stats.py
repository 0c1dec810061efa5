"""Statistics of a norm's input and output over calibration tokens (NumPy only, float64).

A front end runs the model and hands each norm's input rows here (`StatsCollector.add`); the
surrogate fits (`core/surrogates.py`) read the result (`NormStats`):

* **Welford moments** per feature of the input x and of the norm's exact output N(x), batches
  merged with Chan's formula (no two-moment estimator: DaMN App. C shows it cancels).
* **A reservoir** (algorithm R) of input rows for the least-squares fits. Every reservoir is
  seeded alike, so two passes over the same batches sample the same tokens: samples of one norm
  from different passes (the original model and a partly replaced one) are aligned row by row.
* **Masks**: `token_rows` drops the tokens whose attention mask is 0 before anything is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class Welford:
    """Per-feature count, mean and sum of squared deviations (M2), in float64.

    `update(batch)` merges a whole batch at once (Chan et al.): with the batch's own mean and M2,
    δ = mean_B − mean, n' = n + m, mean' = mean + δ·m/n', M2' = M2 + M2_B + δ²·n·m/n'.
    """

    def __init__(self, width: int):
        self.count = 0
        self.mean = np.zeros(width, dtype=np.float64)
        self.m2 = np.zeros(width, dtype=np.float64)

    def update(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.float64)
        if rows.shape[0] == 0:
            return
        batch_mean = rows.mean(axis=0)
        batch_m2 = ((rows - batch_mean) ** 2).sum(axis=0)
        self.merge(rows.shape[0], batch_mean, batch_m2)

    def merge(self, count: int, mean: np.ndarray, m2: np.ndarray) -> None:
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * count / total)
        self.count = total

    @property
    def var(self) -> np.ndarray:
        """Population variance (M2 / n), as DaMN uses."""
        return self.m2 / max(self.count, 1)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)


class Reservoir:
    """A uniform sample of at most `capacity` rows from a stream (algorithm R, seeded)."""

    def __init__(self, capacity: int, width: int, seed: int = 0, dtype=np.float32):
        self.capacity = capacity
        self.rows = np.empty((capacity, width), dtype=dtype)
        self.filled = 0
        self.seen = 0
        self.rng = np.random.default_rng(seed)

    def add(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        take = min(self.capacity - self.filled, rows.shape[0])
        if take:
            self.rows[self.filled : self.filled + take] = rows[:take]
            self.filled += take
        rest = rows[take:]
        if rest.shape[0]:
            seen = self.seen + take + np.arange(rest.shape[0])  # 0-based index of each row in the stream
            slots = (self.rng.random(rest.shape[0]) * (seen + 1)).astype(np.int64)
            keep = slots < self.capacity
            self.rows[slots[keep]] = rest[keep]  # in stream order: later rows win a shared slot
        self.seen += rows.shape[0]

    @property
    def sample(self) -> np.ndarray:
        return self.rows[: self.filled]


def token_rows(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Rows of `values` along its last axis, without the tokens whose mask is 0."""
    values = np.asarray(values)
    width = values.shape[-1] if values.ndim else 1
    rows = values.reshape(-1, width)
    if mask is None:
        return rows
    if values.ndim >= 2 and values.shape[:-1] == mask.shape:
        return values[mask != 0]
    if rows.shape[0] == mask.size:
        return rows[mask.reshape(-1) != 0]
    return rows


@dataclass
class NormStats:
    """What calibration collected for one norm: Welford moments of x and N(x), and a sample of x."""

    x: Welford  # of the norm's input
    y: Welford  # of the norm's exact output N(x)
    sample: np.ndarray  # [rows, width] float32, the inputs x of a uniform sample of tokens
    tokens: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.sample.nbytes) + 4 * 8 * self.sample.shape[1]


class StatsCollector:
    """Accumulates `NormStats` per norm from the input rows a front end observes, batch by batch.

    `norms[key]` is the norm's exact formula N (a `NormSpec`): its output is computed here from x,
    so a front end only has to capture each norm's input.
    """

    def __init__(self, norms: dict[str, Callable[[np.ndarray], np.ndarray]], reservoir: int, seed: int = 0):
        self.norms = norms
        self.reservoir = reservoir
        self.seed = seed
        self._acc: dict[str, tuple[Welford, Welford, Reservoir]] = {}

    def add(self, key: str, rows: np.ndarray) -> None:
        """Rows [tokens, width] of norm `key`'s input (masked tokens already dropped)."""
        rows = np.asarray(rows, dtype=np.float64)
        if key not in self._acc:
            width = rows.shape[1]
            self._acc[key] = (Welford(width), Welford(width), Reservoir(self.reservoir, width, self.seed))
        wx, wy, sample = self._acc[key]
        wx.update(rows)
        wy.update(self.norms[key](rows))
        sample.add(rows.astype(np.float32))

    def result(self) -> dict[str, NormStats]:
        return {key: NormStats(wx, wy, sample.sample.copy(), wx.count) for key, (wx, wy, sample) in self._acc.items()}
