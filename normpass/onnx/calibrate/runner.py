"""Running an ONNX model over calibration batches: the `Runner` every calibrated pass feeds, the original
model's reference runner, the check that the original takes the data, and the capture of chosen tensors.

A `Runner` is an ONNX Runtime session (CPU, optimizations off) of a model whose large weights may be fed
as inputs (`replace/surrogates.light_model`), so a session per trial model costs milliseconds. The original
model runs from its file where it has one (`reference_runner`): ONNX Runtime reads its weights there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from ...calibration import Batch, longest_batch, source_label
from ...core.progress import progress
from ...errors import InputError, UnsupportedModelError
from ...io import checked_model, load_ir, skeleton
from ..graph.frontend import OnnxGraph, graph_values
from ..graph.values import name_of
from ..runtime import verify
from ..runtime.verify import session
from .data import CalibData, load_fitting


class Runner:
    """An ONNX Runtime session (CPU, optimizations off) for a model whose large weights are inputs."""

    def __init__(self, model: onnx.ModelProto, weights: dict[str, np.ndarray] | None = None):
        try:
            self.session = session(model)  # models over 2 GB, duplicate node names
        except UnsupportedModelError as e:
            raise InputError(f"the model being calibrated: {e}") from e
        self.weights = weights or {}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, batch: Batch, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        names = outputs or self.outputs
        return dict(zip(names, self.session.run(names, {**batch, **self.weights}), strict=True))


def check_runs(runner: Runner | verify.Runner, batches: list[Batch], source) -> None:
    """The original model on the calibration batch holding the sample longest along axis 1: a sequence it cannot
    take (a bound the graph does not show as a table, such as OPT's positions counted from a mask) is refused as
    bad data, before the pass, instead of failing in its middle."""
    longest = longest_batch(batches)
    if longest is None:
        return
    batch, width = longest
    try:
        runner.run(batch)
    except Exception as e:  # ONNX Runtime's InvalidArgument, Fail ... derive from Exception only
        raise InputError(
            f"{source_label(source)}: the model does not run on the batch holding its longest sample ({width} along "
            f"axis 1): {str(e).splitlines()[0]}; shorten the sequences (text: --max-length) or give data that fits"
        ) from e


def opened(model: onnx.ModelProto | str | os.PathLike, name: str) -> tuple[onnx.ModelProto | Path, onnx.ModelProto]:
    """(the original to fold and run, its structure for the checks): a path and its skeleton (`io.skeleton` of
    `io.load_ir`: no large weight read), or the checked ModelProto twice."""
    if isinstance(model, (str, os.PathLike)):
        return Path(model), skeleton(load_ir(model))
    model = checked_model(model, name)
    return model, model


@contextlib.contextmanager
def reference_runner(model: onnx.ModelProto | Path, structure: onnx.ModelProto) -> Iterator[Runner | verify.Runner]:
    """A runner of the original model, from its file where it has one (ONNX Runtime reads its weights there:
    nothing else holds them), released when the block ends."""
    if isinstance(model, onnx.ModelProto):
        yield Runner(model)
        return
    with verify.Runner(model, structure) as runner:
        yield runner


def captured(
    ctx: OnnxGraph, names: list[str], data, options: CalibData
) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
    """Each calibration batch of `data` (an .npz, a directory of .npy, text with a tokenizer, or batches:
    `calibration.load_batches`) with the values the graph gives it for each tensor of `names`, one batch
    at a time: ONNX Runtime on the CPU runs `ctx`'s model with those tensors as outputs, as `verify.Runner`
    runs a rewritten model (a large one from a temporary file whose weights are external data, which ONNX
    Runtime maps: a weight computed when written is computed there slab by slab, and held by nothing else).
    The model is left as it was: the outputs are added while its session is made, then removed."""
    batches = load_fitting(
        data, skeleton(ctx.model), options.batch_size, options.tokenizer, options.max_length, 1, options.config
    )
    if not names:  # the data is read and checked all the same: a file the user names must be one
        return
    wanted = sorted(set(names))
    values = {value.name: value for value in graph_values(ctx.graph)}
    with contextlib.ExitStack() as stack:
        with _as_outputs(ctx, [values[name] for name in wanted]):
            try:
                runner = stack.enter_context(verify.Runner(ctx.model, skeleton(ctx.model)))
            except UnsupportedModelError as e:
                raise InputError(f"the model being calibrated: {e}") from e
        check_runs(runner, batches, data)
        for batch in progress(batches, "calibration statistics", enabled=False):
            outputs = runner.run(batch)
            yield batch, {name: outputs[name] for name in wanted}


@contextlib.contextmanager
def _as_outputs(ctx: OnnxGraph, values: list[ir.Value]) -> Iterator[None]:
    """`values` are outputs of `ctx`'s graph (typed from `ctx.dtypes` where untyped) while the block runs."""
    added = [value for value in values if not value.is_graph_output()]
    untyped = [value for value in added if value.type is None]
    for value in untyped:
        value.type = ir.TensorType(ir.DataType.from_numpy(np.dtype(ctx.dtypes[name_of(value)])))
    ctx.graph.outputs.extend(added)
    try:
        yield
    finally:
        for value in added:
            ctx.graph.outputs.remove(value)
        for value in untyped:
            value.type = None
