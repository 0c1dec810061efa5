"""Constant-like tensors: values computable from initializers and `Constant` nodes alone.

Exporters read weights through small constant subgraphs: the TorchScript exporter reads a
deduplicated γ through `Identity(initializer)`, PaddlePaddle writes weights as `Constant` nodes
(`value`, `value_float(s)`, `value_int(s)`), others `Cast`, `Transpose`, `Reshape` or `Unsqueeze`
a stored tensor. Such a tensor is a constant for the analysis (a weight, γ, β or bias). Its
values are computed on demand, one NumPy op per node, and never written back: a rewrite gives
its reader a new initializer (copy-on-write) and the subgraph stays for any other reader.

A node is evaluated only when every input is constant and its op is one of `EVALUATORS`, with
axes read from the attribute or the input, whichever the model's opset uses. A graph input is
never constant, even with a default initializer (the front end makes those `Variable`s), and
neither is anything computed from shapes (`Shape`, `Size`): those vary with the inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

MAX_CONSTANT_NODES = 256  # a constant subgraph larger than this is not recognised as one
CAST_DTYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BOOL,
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64,
}
CONSTANT_ATTRS = {  # Constant node attribute → NumPy dtype of its value
    "value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64,
}


def _axes(node: gs.Node, inputs: list[np.ndarray], index: int) -> list[int] | None:
    """The `axes` of a Squeeze/Unsqueeze/Slice: the attribute (older opsets) or input `index`."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    return [int(a) for a in np.ravel(inputs[index])] if len(inputs) > index and inputs[index] is not None else None


def _reshape(node, inputs):
    data, shape = inputs
    keep_zero = node.attrs.get("allowzero", 0)
    dims = [data.shape[i] if d == 0 and not keep_zero else int(d) for i, d in enumerate(np.ravel(shape))]
    return data.reshape(dims)


def _flatten(node, inputs):
    data = inputs[0]
    axis = node.attrs.get("axis", 1) % (data.ndim + 1) if data.ndim else 0
    return data.reshape(int(np.prod(data.shape[:axis])), -1)


def _squeeze(node, inputs):
    axes = _axes(node, inputs, 1)
    return np.squeeze(inputs[0]) if axes is None else np.squeeze(inputs[0], axis=tuple(axes))


def _slice(node, inputs):
    data = inputs[0]
    if "starts" in node.attrs:  # opset < 10
        starts, ends, axes, steps = node.attrs["starts"], node.attrs["ends"], node.attrs.get("axes"), None
    else:
        starts, ends = np.ravel(inputs[1]), np.ravel(inputs[2])
        axes = _axes(node, inputs, 3)
        steps = np.ravel(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
    axes = range(len(starts)) if axes is None else axes
    index = [slice(None)] * data.ndim
    for i, axis in enumerate(axes):
        index[axis] = slice(int(starts[i]), int(ends[i]), 1 if steps is None else int(steps[i]))
    return data[tuple(index)]


def _constant(node, inputs):
    value = node.attrs.get("value")
    if isinstance(value, gs.Constant):
        return value.values
    name = next(a for a in CONSTANT_ATTRS if a in node.attrs)
    return np.array(node.attrs[name], dtype=CONSTANT_ATTRS[name])


def _constant_of_shape(node, inputs):
    value = node.attrs.get("value")
    fill = value.values.reshape(-1)[0] if isinstance(value, gs.Constant) else np.float32(0)
    return np.full(tuple(int(d) for d in np.ravel(inputs[0])), fill, dtype=np.asarray(fill).dtype)


EVALUATORS = {  # op → NumPy evaluation of the node's first output from its inputs' values
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Range": lambda node, inputs: np.arange(inputs[0], inputs[1], inputs[2]).astype(np.asarray(inputs[0]).dtype),
    "Identity": lambda node, inputs: inputs[0],
    "Cast": lambda node, inputs: inputs[0].astype(onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"])),
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Squeeze": _squeeze,
    "Unsqueeze": lambda node, inputs: np.expand_dims(inputs[0], tuple(_axes(node, inputs, 1))),
    "Transpose": lambda node, inputs: np.transpose(inputs[0], node.attrs.get("perm")),
    "Concat": lambda node, inputs: np.concatenate(inputs, axis=node.attrs["axis"]),
    "Gather": lambda node, inputs: np.take(inputs[0], inputs[1], axis=node.attrs.get("axis", 0)),
    "Slice": _slice,
    "Expand": lambda node, inputs: np.broadcast_to(inputs[0], np.broadcast_shapes(inputs[0].shape, tuple(inputs[1]))),
    "Neg": lambda node, inputs: np.negative(inputs[0]),
    "Add": lambda node, inputs: np.add(*inputs),
    "Sub": lambda node, inputs: np.subtract(*inputs),
    "Mul": lambda node, inputs: np.multiply(*inputs),
}


def _evaluable(node: gs.Node) -> bool:
    """Whether `node`'s op and attributes are ones `EVALUATORS` computes exactly."""
    if node.op not in EVALUATORS or node.domain not in (None, "", "ai.onnx"):
        return False
    if node.op == "Constant":
        return isinstance(node.attrs.get("value"), gs.Constant) or any(a in node.attrs for a in CONSTANT_ATTRS)
    if node.op == "Cast":
        return node.attrs.get("to") in CAST_DTYPES
    if node.op == "Unsqueeze":
        return "axes" in node.attrs or len(node.inputs) > 1
    return True


def _producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if len(tensor.inputs) == 1 else None


def is_constant(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is an initializer or computed from constants alone, without loading it.

    Iterative and bounded: a subgraph of more than `MAX_CONSTANT_NODES` evaluable nodes is taken
    as not constant (a safe answer: a weight that is not constant only declines a fold), so a
    run-time residual stream of Adds is not walked to its start for every tensor on it.
    """
    stack, seen = [tensor], set()
    while stack:
        current = stack.pop()
        if isinstance(current, gs.Constant) or id(current) in seen:
            continue
        seen.add(id(current))
        node = _producer(current)
        if node is None or not _evaluable(node) or node.outputs[0] is not current or len(seen) > MAX_CONSTANT_NODES:
            return False
        stack.extend(t for t in node.inputs if t.name)
    return True


def constant_values(tensor: gs.Tensor) -> np.ndarray | None:
    """Values of a constant-like tensor (read-only; see `is_constant`), else None."""
    if isinstance(tensor, gs.Constant):
        return _initializer_values(tensor)
    if not is_constant(tensor):
        return None
    node = _producer(tensor)
    inputs = [constant_values(t) if t.name else None for t in node.inputs]
    if any(value is None for value, t in zip(inputs, node.inputs) if t.name):
        return None
    try:
        return np.asarray(EVALUATORS[node.op](node, inputs))
    except (ValueError, IndexError, TypeError, KeyError):  # a malformed node: not a usable constant
        return None


def _initializer_values(tensor: gs.Constant) -> np.ndarray:
    lazy = tensor._values
    if isinstance(lazy, LazyValues) and lazy.tensor.HasField("raw_data") and lazy.tensor.data_location != onnx.TensorProto.EXTERNAL:
        # One copy (protobuf → bytes) instead of graphsurgeon's to_array + np.array.
        proto = lazy.tensor
        dtype = onnx.helper.tensor_dtype_to_np_dtype(proto.data_type)
        if dtype.kind in "fiub" and dtype.itemsize in (1, 2, 4, 8):
            return np.frombuffer(proto.raw_data, dtype=dtype).reshape(tuple(proto.dims))
    return tensor.values
