"""Numerical verification of a rewritten ONNX model against its original, in ONNX Runtime.

A rewrite must keep the model's signature: the same inputs and outputs, in the same order, with
the same names, element types and ranks. That is checked first; then both models run with graph
optimizations off on the same seeded inputs generated from the graph's input types and shapes,
in up to three runs (`verification_runs`), so that a rewrite that is exact for one input only is caught:

1. the given (or default) shapes, boolean inputs all true;
2. the same shapes, boolean inputs all false (only for models with boolean inputs), so both
   branches of control flow that a boolean input selects run;
3. small other sizes for the dynamic dims, boolean inputs random (skipped, and said so, where
   the original model rejects those sizes, or where it would repeat run 1).

Per output we report the worst over the runs of max |a − b| and of the relative error
max |a − b| / max |ref| (normalised by the output's scale, so near-zero elements do not blow it
up), and the tolerance of its dtype. Integer and boolean outputs must match exactly; non-finite
values must agree in place and value.

A model to verify is a `ModelProto`, the path of a file, or an `ir.Model`; only one ONNX Runtime
session and one copy of the weights exist at a time: the original's session runs every input set
and is released (its outputs kept) before the rewritten model's session opens. A file is run
from its path (its external data read by ONNX Runtime), an `ir.Model` from bytes when small, else
from a temporary directory holding it with external data (also where the model came without: ONNX Runtime
maps external data rather than copying it); signatures and inputs are read from `io.skeleton`s, which hold
no weights.

`runs_optimized` runs a written model once more at ONNX Runtime's default graph optimizations
(ORT_ENABLE_ALL), as a user's session runs it: a rewrite exact with them off may still stop one of them
(a shape it cannot fold through, an op it then rewrites into one its kernel refuses).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir

from ...errors import InputError, InputsRejectedError, UnsupportedModelError, VerificationError, WeightOverflowError
from ...io import (
    in_memory_proto,
    interface,
    ir_weight_bytes,
    keeps_external_data,
    maps_weights,
    may_exceed_proto_limit,
    release_weights,
    save_external,
    save_ir,
    skeleton,
    to_proto,
)
from . import decode
from .precision import bf16_as_fp32, uses_bf16

if TYPE_CHECKING:
    import onnxruntime as ort

# Relative tolerance per output dtype: a fold may only change rounding.
REL_TOLERANCE = {
    np.dtype(np.float64): 1e-10,
    np.dtype(np.float32): 1e-4,
    np.dtype(np.float16): 1e-2,
}
BFLOAT16_TOLERANCE = 5e-2
# An `ir.Model` with fewer bytes of weights than this runs from serialized bytes; a larger one from a temporary
# file whose weights are external data, which ONNX Runtime maps instead of copying: a model serialized whole
# would be held three times while its session opens (the proto, its bytes, the session's own copy).
IN_MEMORY_WEIGHT_BYTES = 2**26
BFLOAT16 = onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16)
DEFAULT_BATCH, DEFAULT_DIM = 2, 16
MAX_INPUT_ELEMENTS = 2**27  # verification inputs, all together
OTHER_BATCH, OTHER_DIM = 3, 5  # the extra run's dynamic dims: small, and neither 1 nor a default


def tolerance_for(dtype: np.dtype) -> float:
    if dtype.kind in "iub":
        return 0.0
    return REL_TOLERANCE.get(np.dtype(dtype), BFLOAT16_TOLERANCE)


@dataclass(frozen=True)
class OutputComparison:
    name: str
    dtype: str
    max_abs_error: float
    max_rel_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_rel_error <= self.tolerance)


@dataclass(frozen=True)
class Run:
    """One verification run: the input shapes and how boolean inputs were filled (None: there are none)."""

    shapes: dict
    bools: str | None
    skipped: str | None = None  # why this run did not happen
    step: str | None = None  # a KV-cache graph's step, e.g. "decode step: batch 2, 1 new token after 16"

    def sizes(self) -> str:
        if self.step is not None:
            return self.step
        return ", ".join(f"{name} {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in self.shapes.items())


@dataclass(frozen=True)
class Comparison:
    outputs: tuple[OutputComparison, ...]
    input_shapes: dict
    runs: tuple[Run, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def max_abs_error(self) -> float:
        return max((o.max_abs_error for o in self.outputs), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((o.max_rel_error for o in self.outputs), default=0.0)

    def failures(self) -> str:
        return "; ".join(
            f"{o.name}: relative error {o.max_rel_error:.3g} > {o.tolerance:.0e} ({o.dtype})"
            for o in self.outputs
            if not o.passed
        )

    def exercised(self) -> str:
        """What ran, e.g. "3 runs: x 2x8, cond scalar with booleans true, false; x 3x5, cond scalar with booleans
        random"."""
        done = [run for run in self.runs if run.skipped is None]
        fills: dict[str, list] = {}
        for run in done:
            fills.setdefault(run.sizes(), []).append(run.bools)
        parts = [
            sizes + ("" if None in bools else f" with booleans {', '.join(bools)}") for sizes, bools in fills.items()
        ]
        parts += [f"{run.sizes()} not run ({run.skipped})" for run in self.runs if run.skipped is not None]
        return f"{len(done)} run{'s' if len(done) != 1 else ''}: " + "; ".join(parts)

    def describe(self) -> str:
        text = f"max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}"
        return f"{text} over {self.exercised()}" if self.runs else text


def session(
    model: onnx.ModelProto, optimize: bool = False, providers=("CPUExecutionProvider",)
) -> ort.InferenceSession:
    """An ORT session for an in-memory model (never serialized whole when it may exceed 2 GB).

    Duplicate node names, which ORT rejects, are renamed in a copy; a model ORT cannot load
    raises `UnsupportedModelError` with ORT's reason.
    """
    options = _options(optimize)
    model = _uniquely_named(model)
    if not may_exceed_proto_limit(model):
        return ort_session(model.SerializeToString(), options, providers)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        save_external(model, path)
        return ort_session(str(path), options, providers)


def _options(optimize: bool = False) -> ort.SessionOptions:
    import onnxruntime as ort  # imported when a model is run: folding without verification never loads it

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.add_session_config_entry("session.disable_prepacking", "1")  # no second, packed copy of the weights
    options.log_severity_level = 4  # fatal only: what a failure says is in the exception it raises, not a log line
    return options


def ort_session(source: bytes | str, options: ort.SessionOptions, providers) -> ort.InferenceSession:
    """`ort.InferenceSession`, with what ORT refuses as a one-line `UnsupportedModelError`."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(source, options, providers=list(providers))
    except Exception as e:  # ORT's Fail, InvalidGraph, NotImplemented ... derive from Exception only
        raise UnsupportedModelError(f"ONNX Runtime cannot run it: {str(e).splitlines()[0]}") from e


def _uniquely_named(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy whose nodes are renamed if any two share a name."""
    names = [node.name for node in model.graph.node if node.name]
    if len(names) == len(set(names)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for index, node in enumerate(copy.graph.node):
        node.name = f"{node.name}#{index}"
    return copy


def parse_input_shapes(specs: list[str]) -> dict[str, tuple[int, ...]]:
    """`["ids:1x128"]` → {"ids": (1, 128)}."""
    shapes = {}
    for spec in specs or []:
        name, _, dims = spec.rpartition(":")
        try:
            shapes[name] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise InputError(f"input shape {spec!r}: expected NAME:DxDx..., e.g. input_ids:1x128") from None
        if not name:
            raise InputError(f"input shape {spec!r}: missing the input name, e.g. input_ids:1x128")
    return shapes


def fixed_dim(dim: onnx.TensorShapeProto.Dimension) -> int | None:
    """A dimension's static size, or None where it is dynamic (some exporters write -1 or 0 for that)."""
    return dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None


def check_input_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], where: str = "input shape") -> None:
    """Refuse shapes for inputs the model lacks, or that disagree with its declared rank or fixed dims; a size
    below 1 except a KV-cache graph's past length (0: an empty cache)."""
    declared = {i.name: i.type.tensor_type for i in model.graph.input}
    empty_caches = decode.zero_allowed(model) if any(0 in shape for shape in shapes.values()) else {}
    total = 0
    for name, shape in shapes.items():
        if name not in declared:
            raise InputError(f"{where} {name}: the model has no input {name!r} (its inputs: {', '.join(declared)})")
        if any(d < 1 for axis, d in enumerate(shape) if axis != empty_caches.get(name)):
            raise InputError(f"{where} {name}: {list(shape)} has a dimension < 1; every dimension must be positive")
        tensor_type = declared[name]
        if tensor_type.HasField("shape"):
            dims = tensor_type.shape.dim
            if len(dims) != len(shape):
                raise InputError(
                    f"{where} {name}: {list(shape)} has rank {len(shape)}, the model declares rank {len(dims)}"
                )
            for axis, (dim, size) in enumerate(zip(dims, shape, strict=False)):
                if fixed_dim(dim) not in (None, size):
                    raise InputError(
                        f"{where} {name}: dimension {axis} is {size}, the model fixes it to {dim.dim_value}"
                    )
        total += int(np.prod(shape, dtype=object))
    if total > MAX_INPUT_ELEMENTS:
        raise InputError(f"{where}: {total} elements in all, more than {MAX_INPUT_ELEMENTS}; choose smaller shapes")


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For integer inputs used (through shape-only ops) as Gather indices: the table size."""
    tables = {i.name: list(i.dims) for i in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    bounds: dict[str, int] = {}
    for graph_input in model.graph.input:
        frontier, seen = [graph_input.name], set()
        while frontier:
            name = frontier.pop()
            for node in consumers.get(name, []):
                if node.op_type == "Gather" and node.input[1] == name and node.input[0] in tables:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    size = tables[node.input[0]][axis]
                    bounds[graph_input.name] = min(bounds.get(graph_input.name, size), size)
                elif (
                    node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand")
                    and node.input[0] == name
                ) and node.output[0] not in seen:
                    seen.add(node.output[0])
                    frontier.append(node.output[0])
    return bounds


def _input_shape(graph_input: onnx.ValueInfoProto, dims: tuple[int, int], named: dict[str, int]) -> tuple[int, ...]:
    """Static dims as they are; a dynamic dim is dims[0] on axis 0, else dims[1], the same for every use of its name."""
    shape = []
    for axis, d in enumerate(graph_input.type.tensor_type.shape.dim):
        if (size := fixed_dim(d)) is not None:
            shape.append(size)
            continue
        value = dims[0] if axis == 0 else dims[1]
        shape.append(named.setdefault(d.dim_param, value) if d.dim_param else value)
    return tuple(shape)


def make_inputs(
    model: onnx.ModelProto,
    shapes: dict[str, tuple[int, ...]] | None = None,
    seed: int = 0,
    bools: str = "true",
    dims: tuple[int, int] = (DEFAULT_BATCH, DEFAULT_DIM),
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input: randn floats, in-range indices, all-ones integer masks.

    Boolean inputs are all true, all false or random (`bools`). A named dynamic dim takes its size
    from an input in `shapes` that has it; other dynamic dims are `dims` (batch, other) as
    `_input_shape` assigns them.
    """
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    initializers = {i.name for i in model.graph.initializer}
    bounds = index_bounds(model)
    unknown = set(shapes) - {i.name for i in model.graph.input}
    if unknown:
        raise InputError(f"input shapes given for no graph input: {', '.join(sorted(unknown))}")
    named = {
        d.dim_param: value
        for i in model.graph.input
        if i.name in shapes
        for d, value in zip(i.type.tensor_type.shape.dim, shapes[i.name], strict=False)
        if d.dim_param
    }
    feeds = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type)
        shape = shapes.get(graph_input.name) or _input_shape(graph_input, dims, named)
        if dtype.kind == "f":
            feeds[graph_input.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[graph_input.name] = (
                rng.integers(0, 2, size=shape).astype(bool) if bools == "random" else np.full(shape, bools == "true")
            )
        elif "mask" in graph_input.name.lower():
            feeds[graph_input.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[graph_input.name] = rng.integers(0, bounds.get(graph_input.name, 2), size=shape).astype(dtype)
    return feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimize: bool = False) -> dict[str, np.ndarray]:
    """Every output of `model` on `feeds` (graph optimizations off, or ORT's default with `optimize`); a
    bfloat16 model runs as its fp32 copy, outputs rounded back."""
    wide = bf16_as_fp32(model)
    if wide is not None:
        declared = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
        feeds = {k: v.astype(np.float32) if v.dtype == BFLOAT16 else v for k, v in feeds.items()}
        outputs = run(wide, feeds, optimize)
        return {
            k: v.astype(BFLOAT16) if declared.get(k) == onnx.TensorProto.BFLOAT16 else v for k, v in outputs.items()
        }
    sess = session(model, optimize)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=False))


def _errors(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(max abs error, relative error) of one output; inf where shapes or non-finite values disagree."""
    if ref.shape != got.shape:
        return float("inf"), float("inf")
    if ref.dtype.kind in "iub":
        error = float(np.max(ref != got)) if ref.size else 0.0
        return error, error
    wide_ref, wide_got = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(wide_ref)
    same_specials = np.array_equal(wide_ref[~finite], wide_got[~finite], equal_nan=True)
    if not same_specials or not np.isfinite(wide_got[finite]).all():
        return float("inf"), float("inf")
    diff = np.abs(wide_ref[finite] - wide_got[finite])
    abs_err = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(wide_ref[finite]).max()) if diff.size else 0.0
    return abs_err, abs_err / scale if scale > 0 else abs_err


def compare_outputs(
    reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], input_shapes=None
) -> Comparison:
    """Every output of `reference` against the same-named output of `candidate` (missing: infinite error)."""
    results = []
    for name, ref in reference.items():
        got = candidate.get(name)
        abs_err, rel_err = (float("inf"), float("inf")) if got is None else _errors(ref, got)
        results.append(OutputComparison(name, str(ref.dtype), abs_err, rel_err, tolerance_for(ref.dtype)))
    return Comparison(tuple(results), dict(input_shapes or {}))


def _signature(values) -> list[tuple[str, str, int | None]]:
    """(name, element type, rank or None where unknown) of each input or output, in order."""

    def rank(info):
        tensor_type = info.type.tensor_type
        return len(tensor_type.shape.dim) if tensor_type.HasField("shape") else None

    return [(info.name, onnx.TensorProto.DataType.Name(info.type.tensor_type.elem_type), rank(info)) for info in values]


def _same(a: tuple, b: tuple) -> bool:
    return a[:2] == b[:2] and (a[2] is None or b[2] is None or a[2] == b[2])


def check_signature(original: onnx.ModelProto, rewritten: onnx.ModelProto, name: str = "model") -> None:
    """Refuse a rewrite whose inputs or outputs differ from the original's (names, order, element types, ranks)."""
    for kind, before, after in (
        ("inputs", original.graph.input, rewritten.graph.input),
        ("outputs", original.graph.output, rewritten.graph.output),
    ):
        old, new = _signature(before), _signature(after)
        if len(old) != len(new) or not all(map(_same, old, new)):
            changed = next(
                (f"{a} became {b}" for a, b in zip(old, new, strict=False) if not _same(a, b)),
                f"{len(old)} became {len(new)}",
            )
            raise VerificationError(
                f"{name}: the rewrite changed the model's {kind} (name, element type, rank): "
                f"{changed}; the rewritten model is refused"
            )


def verification_runs(model: onnx.ModelProto) -> list[tuple[str | None, tuple[int, int] | None]]:
    """(boolean fill or None, dynamic dims or None for the given shapes) of each run (see the module docstring)."""
    has_bools = any(i.type.tensor_type.elem_type == onnx.TensorProto.BOOL for i in model.graph.input)
    if not has_bools:
        return [(None, None), (None, (OTHER_BATCH, OTHER_DIM))]
    return [("true", None), ("false", None), ("random", (OTHER_BATCH, OTHER_DIM))]


Model = onnx.ModelProto | ir.Model | Path


def run_inputs(
    model: onnx.ModelProto, shapes: dict | None, seed: int, source: Model | None = None
) -> list[tuple[dict[str, np.ndarray], str | None, bool, str | None]]:
    """(feeds, boolean fill, whether the original must run on them, the decode step they are) of each
    verification run.

    Without given shapes, a KV-cache graph (`decode.signature`) runs a prefill, a decode step (both required)
    and several new tokens after a past; any other model the runs of `verification_runs`, the first required.
    """
    sig = decode.signature(model, decode.read_config(source)) if not shapes else None
    if sig is not None:
        return [
            (
                decode.set_values(sig, make_inputs(model, decode.input_shapes(model, sig, *step), seed + i), step[2]),
                None,
                i < 2,
                decode.describe(*step),
            )
            for i, step in enumerate(sig.steps(DEFAULT_DIM))
        ]
    return [
        (
            make_inputs(
                model, None if dims else shapes, seed + i, bools or "true", dims or (DEFAULT_BATCH, DEFAULT_DIM)
            ),
            bools,
            not dims,
            None,
        )
        for i, (bools, dims) in enumerate(verification_runs(model))
    ]


def structure(model: Model) -> onnx.ModelProto:
    """What verification reads of `model` besides running it: a proto of its graph, without large weights."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, ir.Model):
        return skeleton(model)
    return onnx.load(str(model), load_external_data=False)


def _in_memory(model: Model, shape: onnx.ModelProto) -> onnx.ModelProto | None:
    """`model` as a whole ModelProto where it must run as one (bfloat16 copies, duplicate node names), else None."""
    if isinstance(model, onnx.ModelProto):
        return model
    names = [node.name for node in shape.graph.node if node.name]
    if not uses_bf16(shape) and len(names) == len(set(names)):
        return None
    return in_memory_proto(model) if isinstance(model, ir.Model) else onnx.load(str(model))


class Runner:
    """One ORT session on `model` (graph optimizations off, or ORT's default with `optimize`), opened on entry
    and released on exit."""

    def __init__(self, model: Model, shape: onnx.ModelProto, optimize: bool = False):
        self.model, self.shape, self.optimize = model, shape, optimize
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self):
        whole = _in_memory(self.model, self.shape)
        if whole is not None:
            self.run = lambda feeds: run(whole, feeds, self.optimize)
            return self
        source = self.model
        if isinstance(source, ir.Model):
            small = not keeps_external_data(source) and ir_weight_bytes(source) < IN_MEMORY_WEIGHT_BYTES
            if small and not maps_weights(source):
                source = to_proto(source).SerializeToString()
            else:
                self._tmp = tempfile.TemporaryDirectory()
                source = Path(self._tmp.name) / "model.onnx"
                save_ir(source, self.model, external=True)
        options = _options(self.optimize)
        sess = ort_session(source if isinstance(source, bytes) else str(source), options, ("CPUExecutionProvider",))
        names = [o.name for o in sess.get_outputs()]
        self.run = lambda feeds: dict(zip(names, sess.run(names, feeds), strict=False))
        return self

    def __exit__(self, *exc):
        self.run = None  # the session goes with its closure
        if self._tmp is not None:
            self._tmp.cleanup()


def verify(
    original: Model,
    rewritten: Model,
    shapes=None,
    seed: int = 0,
    name: str = "model",
    original_structure: onnx.ModelProto | None = None,
) -> Comparison:
    """Check the signature, then run both models on the same seeded inputs (see the module docstring) and compare.

    `original_structure`: `structure(original)` where the caller has it.
    """
    before, after = original_structure or structure(original), structure(rewritten)
    if isinstance(rewritten, ir.Model):
        release_weights(rewritten)  # what the rewrite read of the original's file is not held while the sessions run
    check_signature(before, after, name)
    done: list[tuple[dict, dict, dict]] = []
    runs: list[Run] = []
    with Runner(original, before) as reference_runner:
        for feeds, bools, required, step in run_inputs(before, shapes, seed, original):
            run_shapes = {k: list(v.shape) for k, v in feeds.items()}
            if not required and bools is None and runs and run_shapes == runs[0].shapes:
                runs.append(Run(run_shapes, bools, "the model has no dynamic dims"))
                continue
            try:
                reference = reference_runner.run(feeds)
            except Exception as e:  # the original need not accept other sizes than the given ones; say so instead
                if required:
                    sizes = ", ".join(f"{k} {'x'.join(map(str, v)) or 'scalar'}" for k, v in run_shapes.items())
                    raise InputsRejectedError(
                        f"{name}: the original model does not run on the verification inputs ({sizes}): "
                        f"{str(e).splitlines()[0][:200]}; give the input shapes the model expects"
                    ) from e
                refused = f"the original model rejects these sizes: {str(e).splitlines()[0][:120]}"
                runs.append(Run(run_shapes, bools, refused, step))
                continue
            done.append((feeds, reference, run_shapes))
            runs.append(Run(run_shapes, bools, step=step))
    with Runner(rewritten, after) as candidate_runner:
        comparisons = [
            compare_outputs(reference, candidate_runner.run(feeds), run_shapes) for feeds, reference, run_shapes in done
        ]
    worst = [
        max(results, key=lambda o: (o.max_rel_error, o.max_abs_error))
        for results in zip(*(c.outputs for c in comparisons), strict=False)
    ]
    return Comparison(tuple(worst), comparisons[0].input_shapes, tuple(runs))


def runs_optimized(model: Model, feeds: dict[str, np.ndarray], name: str, verb: tuple) -> float:
    """Run `model` once on `feeds` in ONNX Runtime (CPU) at its default graph optimizations, as a user's
    session would (the module docstring); `verb` names the rewrite ("slice", "sliced"). Returns the seconds
    it took (the session's optimizations included). Raises `VerificationError` where it cannot: what
    normpass wrote must run where the original ran."""
    start = time.perf_counter()
    try:
        with Runner(model, structure(model), optimize=True) as runner:
            runner.run(feeds)
    except WeightOverflowError:
        raise
    except Exception as e:  # ORT's Fail, InvalidArgument ... derive from Exception only; a load: UnsupportedModelError
        cause = e.__cause__ if isinstance(e, UnsupportedModelError) and e.__cause__ is not None else e
        raise VerificationError(
            f"{name}: the {verb[1]} model runs with graph optimizations off but not at ONNX Runtime's default "
            f"level (ORT_ENABLE_ALL: {str(cause).splitlines()[0][:300]}); nothing written; a bug in normpass "
            f"(report it with the model); {verb[0]} with --no-verify to write it for sessions with optimizations off"
        ) from e
    return time.perf_counter() - start


def checked(
    original,
    rewritten: ir.Model,
    before: onnx.ModelProto,
    options,
    name: str,
    done: str,
    verb: tuple,
    seconds: dict,
    modified: bool = True,
) -> Comparison | None:
    """`rewritten`'s signature checked against `before` (the original's structure) and, with `options.verify`,
    its outputs against `original`'s (`verify.verify`, with `options.input_shapes` and `options.seed`).

    `done` says what the rewrite did ("3 of 5 norms folded"), `verb` names it ("fold", "folded"). Raises
    `VerificationError` on a mismatch, `UnsupportedModelError` where the result cannot run; records
    `seconds["verify"]`. A model left as it was (`modified` false) that does not take the verification
    inputs has nothing to verify: None.
    """
    if not options.verify:
        check_signature(before, interface(rewritten), name)  # verify() checks it first
        return None
    start = time.perf_counter()
    try:
        comparison = verify(original, rewritten, options.input_shapes, options.seed, name, before)
    except WeightOverflowError:  # a large weight, computed as verification writes the model: not a run failure
        raise
    except UnsupportedModelError as e:
        if isinstance(e, InputsRejectedError) and not modified:
            return None
        wrapper = InputsRejectedError if isinstance(e, InputsRejectedError) else UnsupportedModelError
        raise wrapper(
            f"{name}: {done}, but the result could not be verified ({e}); nothing written; "
            f"{verb[0]} without verification to write it unverified"
        ) from e
    seconds["verify"] = time.perf_counter() - start
    if not comparison.passed:
        raise VerificationError(
            f"{name}: {verb[1]} model does not match the original: {comparison.failures()}; nothing written"
        )
    return comparison
