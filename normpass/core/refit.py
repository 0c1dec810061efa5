"""Least-squares refit of one linear layer (recovery after slicing), front-end neutral: no onnx, no torch.

**Algebra.** A layer y = x·W + b of a sliced model no longer sees the input the original gave it: x̃ (the
sliced model's activations) differs from x·Q_k by what the cut dropped upstream. Given the output y* it
should give (the original's, in the kept basis), the refit weights minimize

    ‖X̃ₐ·Wₐ − Y*‖² + λ·‖Wₐ − Wₐ₀‖²,   X̃ₐ = [X̃, 1],  Wₐ = [W; b],  Wₐ₀ = the cut's [W̃₀; b̃₀]

(no ones column for a layer without a bias). Setting the gradient to zero gives the normal equations

    (X̃ₐᵀX̃ₐ + λ·I)·Wₐ = X̃ₐᵀY* + λ·Wₐ₀,

solved in float64. The ridge pulls towards the cut's own weights, so a direction the calibration tokens
do not excite keeps the cut's value instead of an arbitrary one; λ = `ridge` · trace(X̃ₐᵀX̃ₐ)/columns, a
share of the mean energy per input column, so one `ridge` fits layers of any scale. With λ → 0 and
enough tokens this is `numpy.linalg.lstsq`'s solution; with λ → ∞ it is the cut.

**Choosing λ on the calibration data alone.** A wide layer (fc2 reads 4·d features) fitted on a few
thousand tokens overfits at a small λ: measured on IgLM (2880 tokens, fc2 2048 wide) a fixed 10⁻³ made the
held-out error worse than the cut's. So the rows go to two folds (alternate calibration batches), and
`refit` picks, per layer, the λ of `RIDGES` — or the cut itself — whose two-fold validation error is
least: fitted on fold a, judged on fold b from the sums alone, since for weights W
‖X_b·W − Y_b‖² = tr(WᵀG_b·W) − 2·tr(WᵀH_b) + ‖Y_b‖², the last term the same for every candidate.
The winner is refit on both folds. A layer whose validation error the cut beats keeps the cut.

**Streaming.** Only G = Σ X̃ₐᵀX̃ₐ and H = Σ X̃ₐᵀY* are kept, added one batch at a time: memory
(k + 1)·(k + 1 + outputs) whatever the calibration size. Sums add, so processes that each saw a shard
combine theirs (`combine`: an all-reduce over the default `torch.distributed` group, as `pca.combine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .pca import summed_over_processes

RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # the λ tried, as shares of the mean energy per column


@dataclass
class NormalEquations:
    """G = Σ X̃ₐᵀX̃ₐ and H = Σ X̃ₐᵀY* of one layer (the module docstring), per fold, float64."""

    inputs: int
    outputs: int
    bias: bool  # whether X̃ is augmented with a ones column (the layer has a bias to fit)
    grams: np.ndarray = field(init=False, repr=False)  # [2, columns, columns]: one G per fold
    crosses: np.ndarray = field(init=False, repr=False)  # [2, columns, outputs]
    counts: np.ndarray = field(init=False, repr=False)  # rows per fold

    def __post_init__(self) -> None:
        columns = self.inputs + int(self.bias)
        self.grams = np.zeros((2, columns, columns), dtype=np.float64)
        self.crosses = np.zeros((2, columns, self.outputs), dtype=np.float64)
        self.counts = np.zeros(2, dtype=np.int64)

    @property
    def rows(self) -> int:
        return int(self.counts.sum())

    def add(self, inputs: np.ndarray, targets: np.ndarray, fold: int = 0) -> None:
        """Add rows to `fold` (0 or 1): `inputs` [n, inputs] what the layer receives, `targets` [n, outputs]
        what it should give."""
        x = np.asarray(inputs, dtype=np.float64).reshape(-1, self.inputs)
        y = np.asarray(targets, dtype=np.float64).reshape(-1, self.outputs)
        if self.bias:
            x = np.hstack([x, np.ones((len(x), 1))])
        self.grams[fold] += x.T @ x
        self.crosses[fold] += x.T @ y
        self.counts[fold] += len(x)

    def solve(self, weight: np.ndarray, bias: np.ndarray | None, ridge: float, fold: int | None = None):
        """The refit (weight [inputs, outputs], bias [outputs] or None) at `ridge`, pulled towards `weight`,
        `bias`, on both folds or on `fold` alone."""
        start = self._augmented(weight, bias)
        gram = self.grams.sum(0) if fold is None else self.grams[fold]
        cross = self.crosses.sum(0) if fold is None else self.crosses[fold]
        return self._split(_ridge_solution(gram, cross, start, ridge))

    def refit(self, weight: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, float | None]:
        """(weight, bias, λ) with λ the candidate of `RIDGES` of least two-fold validation error, refit on both
        folds; (`weight`, `bias`, None) where the cut's own weights validate best (the module docstring)."""
        start = self._augmented(weight, bias)
        if not all(self.counts):  # one fold only: nothing to validate on, the cut stays
            return weight, bias, None
        errors: dict[float | None, float] = {None: sum(self._error(start, fold) for fold in (0, 1))}
        for ridge in RIDGES:
            errors[ridge] = sum(
                self._error(_ridge_solution(self.grams[1 - f], self.crosses[1 - f], start, ridge), f) for f in (0, 1)
            )
        best = min(errors, key=lambda r: errors[r])
        if best is None:
            return weight, bias, None
        return (*self.solve(weight, bias, best), best)

    def _error(self, weights: np.ndarray, fold: int) -> float:
        """‖X·W − Y‖² − ‖Y‖² on `fold`, from its sums."""
        return float(np.sum(weights * (self.grams[fold] @ weights)) - 2 * np.sum(weights * self.crosses[fold]))

    def _augmented(self, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        start = np.asarray(weight, dtype=np.float64)
        if self.bias:
            start = np.vstack([start, np.asarray(bias, dtype=np.float64).reshape(1, -1)])
        return start

    def _split(self, solved: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return (solved[:-1], solved[-1]) if self.bias else (solved, None)


def _ridge_solution(gram: np.ndarray, cross: np.ndarray, start: np.ndarray, ridge: float) -> np.ndarray:
    """(G + λI)⁻¹·(H + λ·W₀), λ = `ridge` · trace(G)/columns (1 where G holds no energy: the cut stays)."""
    columns = len(gram)
    strength = ridge * np.trace(gram) / columns
    if strength <= 0:
        strength = 1.0
    return np.linalg.solve(gram + strength * np.eye(columns), cross + strength * start)


def combine(equations: list[NormalEquations]) -> None:
    """Sum each layer's sums and row counts over the processes of the default `torch.distributed` group, in
    place (every process passes the same layers in the same order); nothing without a group."""
    for eq in equations:
        flat = summed_over_processes(np.concatenate([eq.grams.ravel(), eq.crosses.ravel(), eq.counts]))
        eq.grams = flat[: eq.grams.size].reshape(eq.grams.shape).copy()
        eq.crosses = flat[eq.grams.size : -2].reshape(eq.crosses.shape).copy()
        eq.counts = np.round(flat[-2:]).astype(np.int64)
