"""Per-feature statistics of a graph's tensors over calibration inputs, for the calibrated exact transforms.

`rotate --calib` changes constants by what its tensors hold on data: key centring subtracts each
attention's mean key (`keys.py`), smoothing divides each norm output's features by a scale made from
their largest magnitude (`smooth.py`); `slice` sums each stream's covariance (`slice/driver.py`). All
read the same run (`captured`): every wanted tensor becomes a graph
output of an in-memory copy, ONNX Runtime runs it on the CPU over the calibration batches, and each
tensor is reduced over every position but its last axis (its features).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx

from ...calibration import Batch
from ...core.progress import progress
from ...io import in_memory_proto
from ..graph.frontend import OnnxGraph
from ..replace.driver import Runner, check_runs, load_fitting


@dataclass(frozen=True)
class CalibData:
    """How calibration inputs are read (`calibration.load_batches`)."""

    batch_size: int = 16
    tokenizer: str | None = None
    max_length: int = 128


@dataclass(frozen=True)
class FeatureStats:
    """One tensor's features over the calibration inputs: their mean and their largest magnitude."""

    mean: np.ndarray
    absmax: np.ndarray


def captured(
    ctx: OnnxGraph, names: list[str], data, options: CalibData
) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
    """Each calibration batch of `data` (an .npz, a directory of .npy, text with a tokenizer, or batches:
    `calibration.load_batches`) with the values the graph gives it for each tensor of `names`, one batch
    at a time (ONNX Runtime on the CPU, an in-memory copy with those tensors as outputs)."""
    proto = in_memory_proto(ctx.model)
    batches = load_fitting(data, proto, options.batch_size, options.tokenizer, options.max_length, minimum=1)
    if not names:  # the data is read and checked all the same: a file the user names must be one
        return
    wanted = sorted(set(names))
    outputs = {output.name for output in proto.graph.output}
    for name in (n for n in wanted if n not in outputs):  # a graph pruned to what is wanted has them already
        dtype = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(ctx.dtypes[name]))
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, dtype, None))
    runner = Runner(proto)
    check_runs(runner, batches, data)
    for batch in progress(batches, "calibration statistics", enabled=False):
        yield batch, runner.run(batch, wanted)


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
