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

from ...calibration import DEFAULT_BATCH_SIZE, MIN_SAMPLES, Batch, InputSpec, load_batches, sample_count, source_label
from ...errors import InputError
from ..graph.positions import position_limit
from ..runtime import decode
from ..runtime.verify import check_input_shapes, fixed_dim, index_bounds, make_inputs


@dataclass(frozen=True)
class CalibData:
    """How calibration inputs are read (`calibration.load_batches`); `batch_size` None: `batch_size_for`;
    `config`: the ONNX Runtime GenAI config beside the model (`decode.read_config`), for the sizes of a KV-cache
    graph's empty cache that its graph does not show."""

    batch_size: int | None = None
    tokenizer: str | None = None
    max_length: int = 128
    config: dict | None = None


class DataOptions(Protocol):
    """How calibration inputs are read, and how many synthetic ones are made: `ReplaceOptions`, `SliceOptions`."""

    tokenizer: str | None
    max_length: int
    samples: int  # of synthetic data
    input_shapes: dict  # of synthetic data

    @property
    def batch_size(self) -> int | None: ...  # None: `batch_size_for`


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
    optional = decode.leaves_out(decode.signature(model, sized=False))
    return InputSpec(inputs, index_bounds(model), optional, None if limit is None else limit.rows)


def refuse_scalar_inputs(model: onnx.ModelProto, name: str, verb: str) -> None:
    """Calibration data is split into samples along axis 0 of every input: refuse a model with a scalar input."""
    scalars = [n for n, value in run_time_inputs(model).items() if not value.type.tensor_type.shape.dim]
    if scalars:
        raise InputError(
            f"{name}: input {scalars[0]} is a scalar (rank 0): calibration data is split into samples along "
            f"axis 0 of every input, so {verb} takes models whose inputs all have a batch axis"
        )


def fixed_batch(model: onnx.ModelProto) -> tuple[str, int] | None:
    """(input, size) of the first run-time input whose axis 0, the batch, the model fixes; None where none does."""
    for name, value in run_time_inputs(model).items():
        dims = value.type.tensor_type.shape.dim
        if dims and (size := fixed_dim(dims[0])) is not None:
            return name, size
    return None


def batch_size_for(model: onnx.ModelProto, requested: int | None, name: str = "model") -> tuple[int, str | None]:
    """(the batch size to read calibration data in, a note saying where it came from or None).

    `requested` where given; else the size the model fixes its batch axis to (`fixed_batch`), else
    `DEFAULT_BATCH_SIZE`. A requested size other than the one the model fixes is refused (`InputError`),
    naming the flag and the size that works."""
    fixed = fixed_batch(model)
    if fixed is None:
        return (DEFAULT_BATCH_SIZE if requested is None else requested), None
    given, size = fixed
    if requested is None:
        return size, f"calibration data read in batches of {size}, the batch {name} fixes (input {given}, axis 0)"
    if requested != size:
        raise InputError(
            f"--batch-size {requested}: {name} fixes the batch (axis 0 of input {given}) to {size}; "
            f"pass --batch-size {size}, or leave it out and the model's batch is taken"
        )
    return requested, None


def synthetic_batches(
    model: onnx.ModelProto,
    samples: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    input_shapes: dict | None = None,
    config: dict | None = None,
) -> list[Batch]:
    """Seeded random inputs (randn floats, in-range indices, all-ones masks; a KV-cache graph's prefills,
    `config` as `CalibData.config`). Tests and demos only."""
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
    return decode.calibration_batches(model, [{k: b[k] for k in names} for b in batches], "synthetic", config)


def load(
    source,
    model: onnx.ModelProto,
    options: DataOptions,
    seed: int,
    minimum: int = MIN_SAMPLES,
    config: dict | None = None,
) -> list[Batch]:
    """Calibration batches from `source` (`calibration.load_batches`, at least `minimum` samples, or
    `"synthetic"`), shape-checked; `config` as `CalibData.config`."""
    if isinstance(source, str) and source == "synthetic":
        size, _ = batch_size_for(model, options.batch_size)
        return synthetic_batches(model, options.samples, size, seed, options.input_shapes, config)
    return load_fitting(source, model, options.batch_size, options.tokenizer, options.max_length, minimum, config)


def load_fitting(
    source,
    model: onnx.ModelProto,
    batch_size: int | None,
    tokenizer,
    max_length: int,
    minimum: int = MIN_SAMPLES,
    config: dict | None = None,
) -> list[Batch]:
    """`calibration.load_batches` for `model` in batches of `batch_size` (None: `batch_size_for`), each batch's
    shapes checked against the model's fixed dims; samples left over after the last batch the model's fixed
    batch size fills are refused, saying how many to give; a KV-cache graph's batches completed into prefills
    (`decode.calibration_batches`, `config` as `CalibData.config`)."""
    size, _ = batch_size_for(model, batch_size)
    batches = load_batches(source, input_spec(model), size, tokenizer, max_length, minimum)
    file = f"{source}: " if isinstance(source, (str, os.PathLike)) else ""
    fixed = fixed_batch(model)
    counts = [sample_count([batch]) for batch in batches]
    if fixed is not None and counts[-1] != fixed[1] and all(count == fixed[1] for count in counts[:-1]):
        raise InputError(  # a remainder after the last whole batch
            f"{file or 'calibration data: '}{sample_count(batches)} samples do not fill batches of {fixed[1]}, the "
            f"batch the model fixes (input {fixed[0]}, axis 0): give a multiple of {fixed[1]} samples"
        )
    for index, batch in enumerate(batches):
        check_input_shapes(model, {k: v.shape for k, v in batch.items()}, f"{file}calibration batch {index}, input")
    return decode.calibration_batches(model, batches, source_label(source), config)
