"""Numerical verification of a rewritten ONNX model against its original, in ONNX Runtime.

Both models run with graph optimizations off on the same seeded inputs generated from the graph's
input types and shapes. Per output we report max |a − b| and the relative error
max |a − b| / max |ref| (normalised by the output's scale, so near-zero elements do not blow it
up), and the tolerance of its dtype. Integer and boolean outputs must match exactly.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from .errors import InputError, UnsupportedModelError
from .io import may_exceed_proto_limit, save_external
from .precision import bf16_as_fp32

# Relative tolerance per output dtype: a fold may only change rounding.
REL_TOLERANCE = {
    np.dtype(np.float64): 1e-10,
    np.dtype(np.float32): 1e-4,
    np.dtype(np.float16): 1e-2,
}
BFLOAT16_TOLERANCE = 5e-2
BFLOAT16 = onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16)
DEFAULT_BATCH, DEFAULT_DIM = 2, 16
MAX_INPUT_ELEMENTS = 2**27  # verification inputs, all together


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
class Comparison:
    outputs: tuple[OutputComparison, ...]
    input_shapes: dict

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


def session(model: onnx.ModelProto, optimize: bool = False, providers=("CPUExecutionProvider",)) -> ort.InferenceSession:
    """An ORT session for an in-memory model (never serialized whole when it may exceed 2 GB).

    Duplicate node names, which ORT rejects, are renamed in a copy; a model ORT cannot load
    raises `UnsupportedModelError` with ORT's reason.
    """
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    model = _uniquely_named(model)
    if not may_exceed_proto_limit(model):
        return _open(model.SerializeToString(), options, providers)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        save_external(model, path)
        return _open(str(path), options, providers)


def _open(source: bytes | str, options: ort.SessionOptions, providers) -> ort.InferenceSession:
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
            raise InputError(f"--input-shape {spec!r}: expected NAME:DxDx..., e.g. input_ids:1x128") from None
        if not name:
            raise InputError(f"--input-shape {spec!r}: missing the input name, e.g. input_ids:1x128")
    return shapes


def check_input_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], where: str = "input shape") -> None:
    """Refuse shapes for inputs the model lacks, or that disagree with its declared rank or fixed dims."""
    declared = {i.name: i.type.tensor_type for i in model.graph.input}
    total = 0
    for name, shape in shapes.items():
        if name not in declared:
            raise InputError(f"{where} {name}: the model has no input {name!r} (its inputs: {', '.join(declared)})")
        if any(d < 1 for d in shape):
            raise InputError(f"{where} {name}: {list(shape)} has a dimension < 1; every dimension must be positive")
        tensor_type = declared[name]
        if tensor_type.HasField("shape"):
            dims = tensor_type.shape.dim
            if len(dims) != len(shape):
                raise InputError(f"{where} {name}: {list(shape)} has rank {len(shape)}, the model declares rank {len(dims)}")
            for axis, (dim, size) in enumerate(zip(dims, shape)):
                if dim.HasField("dim_value") and dim.dim_value != size:
                    raise InputError(f"{where} {name}: dimension {axis} is {size}, the model fixes it to {dim.dim_value}")
        total += int(np.prod(shape, dtype=object))
    if total > MAX_INPUT_ELEMENTS:
        raise InputError(f"{where}: {total} elements in all, more than {MAX_INPUT_ELEMENTS}; choose smaller shapes")


def _index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For integer inputs used (through shape-only ops) as Gather indices: the table size."""
    tables = {i.name: list(i.dims) for i in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    bounds = {}
    for graph_input in model.graph.input:
        frontier, seen = [graph_input.name], set()
        while frontier:
            name = frontier.pop()
            for node in consumers.get(name, []):
                if node.op_type == "Gather" and node.input[1] == name and node.input[0] in tables:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    size = tables[node.input[0]][axis]
                    bounds[graph_input.name] = min(bounds.get(graph_input.name, size), size)
                elif node.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand") and node.input[0] == name:
                    if node.output[0] not in seen:
                        seen.add(node.output[0])
                        frontier.append(node.output[0])
    return bounds


def make_inputs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input: randn floats, in-range indices, all-ones masks."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    initializers = {i.name for i in model.graph.initializer}
    bounds = _index_bounds(model)
    unknown = set(shapes) - {i.name for i in model.graph.input}
    if unknown:
        raise InputError(f"--input-shape names no graph input: {', '.join(sorted(unknown))}")
    feeds = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        tensor_type = graph_input.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if graph_input.name in shapes:
            shape = shapes[graph_input.name]
        else:
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (DEFAULT_BATCH if axis == 0 else DEFAULT_DIM)
                for axis, d in enumerate(tensor_type.shape.dim)
            )
        if dtype.kind == "f":
            feeds[graph_input.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b" or "mask" in graph_input.name.lower():
            feeds[graph_input.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[graph_input.name] = rng.integers(0, bounds.get(graph_input.name, 2), size=shape).astype(dtype)
    return feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `model` on `feeds`; a bfloat16 model runs as its fp32 copy, outputs rounded back."""
    wide = bf16_as_fp32(model)
    if wide is not None:
        declared = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
        feeds = {k: v.astype(np.float32) if v.dtype == BFLOAT16 else v for k, v in feeds.items()}
        outputs = run(wide, feeds)
        return {k: v.astype(BFLOAT16) if declared.get(k) == onnx.TensorProto.BFLOAT16 else v for k, v in outputs.items()}
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def compare_outputs(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], input_shapes=None) -> Comparison:
    results = []
    for name, ref in reference.items():
        got = candidate[name]
        if ref.dtype.kind in "iub":
            abs_err = float(np.max(ref != got)) if ref.size else 0.0
            rel_err = abs_err
        else:
            wide_ref = ref.astype(np.float64)
            diff = np.abs(wide_ref - got.astype(np.float64))
            abs_err = float(diff.max()) if diff.size else 0.0
            scale = float(np.abs(wide_ref).max()) if diff.size else 0.0
            rel_err = abs_err / scale if scale > 0 else abs_err
            if not np.isfinite(diff).all():
                rel_err = abs_err = float("inf") if np.isfinite(wide_ref).all() else abs_err
        results.append(OutputComparison(name, str(ref.dtype), abs_err, rel_err, tolerance_for(ref.dtype)))
    return Comparison(tuple(results), dict(input_shapes or {}))


def verify(original: onnx.ModelProto, rewritten: onnx.ModelProto, shapes=None, seed: int = 0) -> Comparison:
    """Run both models on the same seeded inputs and compare every output."""
    feeds = make_inputs(original, shapes, seed)
    return compare_outputs(run(original, feeds), run(rewritten, feeds), {k: list(v.shape) for k, v in feeds.items()})
