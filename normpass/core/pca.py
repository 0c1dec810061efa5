"""The principal basis of a residual stream, for slicing it (SliceGPT; NumPy only, front-end neutral).

**Algebra (DESIGN §2c).** Once a stream is read only by RMSNorms without affine and by linear layers
(`core/rotation.py`), any orthogonal Q may rotate it exactly. With C = Σ uᵀu, summed over the
calibration tokens u where the stream's RMS ops read it, and C = Q·Λ·Qᵀ (eigenvalues descending), the
rotated stream x·Q holds most of its energy in its first columns, and keeping only the first k
(Q_k, d×k) cuts every writer's output and every reader's input from d to k. What is dropped is the
energy of the last d − k directions: not zero, so slicing is judged on held-out data, never called exact.

* **Tokens.** Each token is divided by its length before it is summed (u = x / ‖x‖): the RMS ops see
  only the direction, and DESIGN §2c measured on DINOv2-S that a basis of the raw stream is dominated
  by the last blocks (~100× the energy of the first) and fits the early blocks worse than this one.
  Zero tokens (padding, masked out before) carry no direction and are skipped. SliceGPT sums the raw
  inputs of each norm (`rotate.py`, `pca_calc`); the eigenvectors of a sum do not change with its
  damping, so none is added here.
* **Streaming, in float64.** The sum is kept, not the tokens: memory d² whatever the calibration size.
* **Across processes.** Sums add: `combine` all-reduces the accumulators with `torch.distributed` when
  a process group is initialized (torch is never imported here: a process that made a group has it).
* **Width.** k = (1 − R)·d rounded to a multiple of `round_to` (at least one multiple, at most d);
  R = 0 keeps k = d, a full rotation.
* **The RMS scale.** Over k columns an RMS op computes x_k / √(‖x_k‖²/k + ε), the dense model
  x / √(‖x‖²/d + ε) ≈ x_k / √(‖x_k‖²/d + ε) = √(d/k) · x_k / √(‖x_k‖²/k + ε·d/k): the sliced op takes
  γ·√(d/k) and ε·d/k (`rms_rescale`); a chain computing x / (√mean(x²) + ε) takes ε·√(d/k).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

DEFAULT_ROUND_TO = 16  # fp16 tensor cores want multiples of 8, INT8 GEMMs 16 or more; not measured here


@dataclass
class Covariance:
    """Σ uᵀu over the unit-length tokens u added so far (float64), and how many."""

    width: int
    sum: np.ndarray = field(init=False, repr=False)
    tokens: int = 0
    basis: Basis | None = field(default=None, init=False, repr=False, compare=False)  # `eigenbasis`'s, of this sum

    def __post_init__(self) -> None:
        self.sum = np.zeros((self.width, self.width), dtype=np.float64)

    def add(self, rows: np.ndarray) -> None:
        """Add tokens (`rows`, [n, width], any float dtype), each divided by its length; zero rows are skipped."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, self.width)
        lengths = np.linalg.norm(rows, axis=1)
        keep = lengths > 0
        units = rows[keep] / lengths[keep, None]
        self.sum += units.T @ units
        self.tokens += len(units)
        self.basis = None


@dataclass(frozen=True)
class Basis:
    """The principal directions of one stream: `vectors[:, i]` has eigenvalue `values[i]`, descending."""

    values: np.ndarray
    vectors: np.ndarray

    def energy_kept(self, k: int) -> float:
        """The share of the calibration tokens' energy in the first k directions."""
        total = float(np.clip(self.values, 0, None).sum())
        return 1.0 if total == 0 else float(np.clip(self.values[:k], 0, None).sum()) / total


def eigenbasis(covariance: Covariance) -> Basis:
    """The eigendecomposition of the sum (float64, symmetric), eigenvalues descending; each eigenvector's
    largest entry positive, so that equal sums give equal bases wherever they were computed. Computed once
    per sum: it is kept on the accumulator until `add` or `combine` changes the sum (at width 4096 one
    decomposition takes seconds, and the sequential fit and the cut both ask for each piece's)."""
    if covariance.basis is None:
        covariance.basis = _decomposed(covariance.sum)
    return covariance.basis


def _decomposed(total: np.ndarray) -> Basis:
    symmetric = (total + total.T) / 2
    values, vectors = np.linalg.eigh(symmetric)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    peaks = vectors[np.argmax(np.abs(vectors), axis=0), np.arange(vectors.shape[1])]
    return Basis(values, vectors * np.where(peaks < 0, -1.0, 1.0))


def combine(covariances: list[Covariance]) -> None:
    """Sum each accumulator over the processes of the default `torch.distributed` group, in place (every
    process must pass accumulators of the same widths, in the same order); nothing without a group."""
    for covariance in covariances:
        summed = summed_over_processes(np.append(covariance.sum.ravel(), float(covariance.tokens)))
        covariance.sum = summed[:-1].reshape(covariance.width, covariance.width).copy()
        covariance.tokens = round(summed[-1])
        covariance.basis = None


def summed_over_processes(values: np.ndarray) -> np.ndarray:
    """`values` (float64) summed over the processes of the default `torch.distributed` group (an
    all-reduce; every process passes an array of the same size); `values` itself without a group."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return values
    import torch

    flat = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
    distributed.all_reduce(flat)
    return flat.numpy()


def sliced_width(width: int, ratio: float, round_to: int = DEFAULT_ROUND_TO) -> int:
    """k for slicing a share `ratio` of `width` columns (module docstring); `width` itself at ratio 0."""
    if ratio == 0:
        return width
    step = min(round_to, width)
    return int(min(width, max(step, round((1 - ratio) * width / step) * step)))


def rms_rescale(width: int, kept: int) -> tuple[float, float]:
    """(factor of γ, factor of ε) that keep an RMS op over `kept` of `width` columns at the dense scale."""
    return math.sqrt(width / kept), width / kept
