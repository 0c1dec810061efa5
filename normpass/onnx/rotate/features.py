"""Per-feature statistics of a graph's tensors over calibration inputs, for the calibrated exact transforms.

`rotate --calib` changes constants by what its tensors hold on data: key centring subtracts each
attention's mean key (`keys.py`), smoothing divides each norm output's features by a scale made from
their largest magnitude (`smooth.py`); `slice` sums each stream's covariance (`slice/driver.py`). All
read the same run (`calibrate.captured`): every wanted tensor becomes a graph
output of an in-memory copy, ONNX Runtime runs it on the CPU over the calibration batches, and each
tensor is reduced over every position but its last axis (its features).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..calibrate import CalibData, captured
from ..graph.frontend import OnnxGraph


@dataclass(frozen=True)
class FeatureStats:
    """One tensor's features over the calibration inputs: their mean and their largest magnitude."""

    mean: np.ndarray
    absmax: np.ndarray


def feature_statistics(ctx: OnnxGraph, names: list[str], data, options: CalibData) -> dict[str, FeatureStats]:
    """`FeatureStats` of each tensor in `names` over every position of the calibration inputs `data` (`captured`),
    read and checked even when `names` is empty."""
    sums: dict[str, np.ndarray] = {}
    peaks: dict[str, np.ndarray] = {}
    counts = dict.fromkeys(names, 0)
    for _, outputs in captured(ctx, names, data, options):
        for name, values in outputs.items():
            rows = np.asarray(values, dtype=np.float64).reshape(-1, values.shape[-1])
            sums[name] = sums.get(name, 0) + rows.sum(0)
            peaks[name] = np.maximum(peaks.get(name, 0), np.abs(rows).max(0))
            counts[name] += len(rows)
    return {name: FeatureStats(sums[name] / counts[name], peaks[name]) for name in sorted(set(names))}
