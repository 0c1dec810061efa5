"""Per-feature statistics of a graph's tensors over calibration inputs, for the calibrated exact transforms.

`rotate --calib` changes constants by what its tensors hold on data: key centring subtracts each
attention's mean key (`keys.py`), smoothing divides each norm output's features by a scale made from
their largest magnitude (`smooth.py`). Both read the same run: every wanted tensor becomes a graph
output of an in-memory copy, ONNX Runtime runs it on the CPU over the calibration batches, and each
tensor is reduced over every position but its last axis (its features).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ...calibration import load_batches
from ...core.progress import progress
from ...io import in_memory_proto
from ..graph.frontend import OnnxGraph
from ..replace.driver import input_spec
from ..runtime.verify import check_input_shapes, session


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


def feature_statistics(ctx: OnnxGraph, names: list[str], data, options: CalibData) -> dict[str, FeatureStats]:
    """`FeatureStats` of each tensor in `names` over every position of the calibration inputs `data` (an .npz,
    a directory of .npy, text with a tokenizer, or batches: `calibration.load_batches`)."""
    proto = in_memory_proto(ctx.model)
    batches = load_batches(
        data, input_spec(proto), options.batch_size, options.tokenizer, options.max_length, minimum=1
    )
    for index, batch in enumerate(batches):
        check_input_shapes(proto, {k: v.shape for k, v in batch.items()}, f"calibration batch {index}, input")
    wanted = sorted(set(names))
    for name in wanted:
        dtype = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(ctx.dtypes[name]))
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, dtype, None))
    run = session(proto)
    sums: dict[str, np.ndarray] = {}
    peaks: dict[str, np.ndarray] = {}
    counts = dict.fromkeys(wanted, 0)
    for batch in progress(batches, "calibration statistics", enabled=False):
        for name, values in zip(wanted, run.run(wanted, batch), strict=True):
            rows = np.asarray(values, dtype=np.float64).reshape(-1, values.shape[-1])
            sums[name] = sums.get(name, 0) + rows.sum(0)
            peaks[name] = np.maximum(peaks.get(name, 0), np.abs(rows).max(0))
            counts[name] += len(rows)
    return {name: FeatureStats(sums[name] / counts[name], peaks[name]) for name in wanted}
