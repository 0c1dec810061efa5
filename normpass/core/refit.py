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

**Streaming.** Only G = Σ X̃ₐᵀX̃ₐ and H = Σ X̃ₐᵀY* are kept, added one batch at a time: memory
(k + 1)·(k + 1 + outputs) whatever the calibration size. Sums add, so processes that each saw a shard
combine theirs (`combine`: an all-reduce over the default `torch.distributed` group, as `pca.combine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .pca import summed_over_processes

DEFAULT_RIDGE = 1e-3  # λ as a share of the mean energy per input column (`NormalEquations.solve`)


@dataclass
class NormalEquations:
    """G = Σ X̃ₐᵀX̃ₐ and H = Σ X̃ₐᵀY* of one layer (the module docstring), float64, and the rows added."""

    inputs: int
    outputs: int
    bias: bool  # whether X̃ is augmented with a ones column (the layer has a bias to fit)
    gram: np.ndarray = field(init=False, repr=False)
    cross: np.ndarray = field(init=False, repr=False)
    rows: int = 0

    def __post_init__(self) -> None:
        columns = self.inputs + int(self.bias)
        self.gram = np.zeros((columns, columns), dtype=np.float64)
        self.cross = np.zeros((columns, self.outputs), dtype=np.float64)

    def add(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        """Add rows: `inputs` [n, inputs] what the layer receives, `targets` [n, outputs] what it should give."""
        x = np.asarray(inputs, dtype=np.float64).reshape(-1, self.inputs)
        y = np.asarray(targets, dtype=np.float64).reshape(-1, self.outputs)
        if self.bias:
            x = np.hstack([x, np.ones((len(x), 1))])
        self.gram += x.T @ x
        self.cross += x.T @ y
        self.rows += len(x)

    def solve(self, weight: np.ndarray, bias: np.ndarray | None, ridge: float = DEFAULT_RIDGE):
        """The refit (weight [inputs, outputs], bias [outputs] or None), ridge-pulled towards `weight`, `bias`."""
        start = np.asarray(weight, dtype=np.float64)
        if self.bias:
            start = np.vstack([start, np.asarray(bias, dtype=np.float64).reshape(1, -1)])
        columns = len(self.gram)
        strength = ridge * np.trace(self.gram) / columns
        if strength <= 0:  # no energy: nothing to fit on, the cut stays
            strength = 1.0
        solved = np.linalg.solve(self.gram + strength * np.eye(columns), self.cross + strength * start)
        return (solved[:-1], solved[-1]) if self.bias else (solved, None)


def combine(equations: list[NormalEquations]) -> None:
    """Sum each layer's G, H and rows over the processes of the default `torch.distributed` group, in place
    (every process passes the same layers in the same order); nothing without a group."""
    for eq in equations:
        flat = summed_over_processes(np.concatenate([eq.gram.ravel(), eq.cross.ravel(), [float(eq.rows)]]))
        eq.gram = flat[: eq.gram.size].reshape(eq.gram.shape).copy()
        eq.cross = flat[eq.gram.size : -1].reshape(eq.cross.shape).copy()
        eq.rows = round(flat[-1])
