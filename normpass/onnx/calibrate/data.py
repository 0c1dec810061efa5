"""Calibration inputs for an ONNX model: what its graph inputs are, batches read for it and checked against
its fixed dims (`calibration.load_batches`), and seeded synthetic batches for tests and demos.

Every calibrated pass (`replace`, `rotate --calib`, `slice`) splits its data into samples along axis 0 of
every input: a model with a scalar input is refused (`refuse_scalar_inputs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir

from ...calibration import MIN_SAMPLES, Batch, InputSpec, load_batches, source_label
from ...errors import InputError
from ..graph.positions import position_limit
from ..runtime import decode
from ..runtime.verify import check_input_shapes, fixed_dim, index_bounds, make_inputs


@dataclass(frozen=True)
class CalibData:
    """How calibration inputs are read (`calibration.load_batches`)."""

    batch_size: int = 16
    tokenizer: str | None = None
    max_length: int = 128


class DataOptions(Protocol):
    """How calibration inputs are read, and how many synthetic ones are made: `ReplaceOptions`, `SliceOptions`."""

    batch_size: int
    tokenizer: str | None
    max_length: int
    samples: int  # of synthetic data
    input_shapes: dict  # of synthetic data


def run_time_inputs(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """The graph inputs that are not initializers, by name."""
    initializers = {i.name for i in model.graph.initializer}
    return {value.name: value for value in model.graph.input if value.name not in initializers}


def input_spec(model: onnx.ModelProto) -> InputSpec:
    """Graph inputs that are not initializers (dtype, rank), and the tables integer inputs index; a KV-cache
    graph's cache, mask and positions may be left out (`decode.calibration_batches` fills them in)."""
    inputs: dict[str, tuple[np.dtype | None, int | None]] = {
        name: (
            np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)),
            len(value.type.tensor_type.shape.dim),
        )
        for name, value in run_time_inputs(model).items()
    }
    limit = position_limit(ir.from_proto(model))
    optional = decode.leaves_out(decode.signature(model))
    return InputSpec(inputs, index_bounds(model), optional, None if limit is None else limit.rows)


def refuse_scalar_inputs(model: onnx.ModelProto, name: str, verb: str) -> None:
    """Calibration data is split into samples along axis 0 of every input: refuse a model with a scalar input."""
    scalars = [n for n, value in run_time_inputs(model).items() if not value.type.tensor_type.shape.dim]
    if scalars:
        raise InputError(
            f"{name}: input {scalars[0]} is a scalar (rank 0): calibration data is split into samples along "
            f"axis 0 of every input, so {verb} takes models whose inputs all have a batch axis"
        )


def synthetic_batches(
    model: onnx.ModelProto, samples: int = 64, batch_size: int = 16, seed: int = 0, input_shapes: dict | None = None
) -> list[Batch]:
    """Seeded random inputs (randn floats, in-range indices, all-ones masks). Tests and demos only."""
    batches = []
    spec = input_spec(model)
    names = [name for name in spec.names if name not in spec.optional]
    for index, start in enumerate(range(0, samples, batch_size)):
        size = min(batch_size, samples - start)
        shapes = dict(input_shapes or {})
        for name in names:
            if name not in shapes:
                value = next(v for v in model.graph.input if v.name == name)
                dims = value.type.tensor_type.shape.dim
                shapes[name] = tuple(fixed_dim(d) or (size if axis == 0 else 16) for axis, d in enumerate(dims))
            shapes[name] = (size,) + tuple(shapes[name][1:])
        batches.append(make_inputs(model, shapes, seed=seed * 100003 + index))
    return decode.calibration_batches(model, [{k: b[k] for k in names} for b in batches], "synthetic")


def load(source, model: onnx.ModelProto, options: DataOptions, seed: int, minimum: int = MIN_SAMPLES) -> list[Batch]:
    """Calibration batches from `source` (`calibration.load_batches`, at least `minimum` samples, or
    `"synthetic"`), shape-checked."""
    if isinstance(source, str) and source == "synthetic":
        return synthetic_batches(model, options.samples, options.batch_size, seed, options.input_shapes)
    return load_fitting(source, model, options.batch_size, options.tokenizer, options.max_length, minimum)


def load_fitting(
    source, model: onnx.ModelProto, batch_size: int, tokenizer, max_length: int, minimum: int = MIN_SAMPLES
) -> list[Batch]:
    """`calibration.load_batches` for `model`, each batch's shapes checked against the model's fixed dims."""
    batches = load_batches(source, input_spec(model), batch_size, tokenizer, max_length, minimum)
    file = f"{source}: " if isinstance(source, (str, os.PathLike)) else ""
    for index, batch in enumerate(batches):
        check_input_shapes(model, {k: v.shape for k, v in batch.items()}, f"{file}calibration batch {index}, input")
    return decode.calibration_batches(model, batches, source_label(source))
