"""Constant-like tensors: values computable from initializers and `Constant` nodes alone.

Exporters read weights through small constant subgraphs: the TorchScript exporter reads a
deduplicated γ through `Identity(initializer)`, PaddlePaddle writes weights as `Constant` nodes
(`value`, `value_float(s)`, `value_int(s)`), others `Cast`, `Transpose`, `Reshape` or `Unsqueeze`
a stored tensor. Such a tensor is a constant for the analysis (a weight, γ, β or bias). Its
values are computed on demand, one NumPy op per node, and never written back: a rewrite gives
its reader a new initializer (copy-on-write) and the subgraph stays for any other reader.

A node is evaluated only when every input is constant and its op is one of `EVALUATORS`, with
axes read from the attribute or the input, whichever the model's opset uses. A graph input is
never constant, even with a default initializer, and neither is anything computed from shapes
(`Shape`, `Size`): those vary with the inputs. An initializer's values are read from its
`ir.Tensor` (memory-mapped where the model keeps its weights in external data), not copied.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from .values import attr, input_at, is_initializer

MAX_CONSTANT_NODES = 256  # a constant subgraph larger than this is not recognised as one
CAST_DTYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BOOL,
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
}
CONSTANT_ATTRS = {  # Constant node attribute → NumPy dtype of its value
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _axes(node: ir.Node, inputs: list[np.ndarray], index: int) -> list[int] | None:
    """The `axes` of a Squeeze/Unsqueeze/Slice: the attribute (older opsets) or input `index`."""
    if "axes" in node.attributes:
        return [int(a) for a in attr(node, "axes")]
    return [int(a) for a in np.ravel(inputs[index])] if len(inputs) > index and inputs[index] is not None else None


def _unsqueeze(node, inputs):
    axes = _axes(node, inputs, 1)
    if axes is None:  # a malformed node
        raise ValueError(f"Unsqueeze {node.name} has no axes")
    return np.expand_dims(inputs[0], tuple(axes))


def _reshape(node, inputs):
    data, shape = inputs
    keep_zero = attr(node, "allowzero", 0)
    dims = [data.shape[i] if d == 0 and not keep_zero else int(d) for i, d in enumerate(np.ravel(shape))]
    return data.reshape(dims)


def _flatten(node, inputs):
    data = inputs[0]
    axis = attr(node, "axis", 1) % (data.ndim + 1) if data.ndim else 0
    return data.reshape(int(np.prod(data.shape[:axis])), -1)


def _squeeze(node, inputs):
    axes = _axes(node, inputs, 1)
    return np.squeeze(inputs[0]) if axes is None else np.squeeze(inputs[0], axis=tuple(axes))


def _slice(node, inputs):
    data = inputs[0]
    if "starts" in node.attributes:  # opset < 10
        starts, ends, axes, steps = attr(node, "starts"), attr(node, "ends"), attr(node, "axes"), None
    else:
        starts, ends = np.ravel(inputs[1]), np.ravel(inputs[2])
        axes = _axes(node, inputs, 3)
        steps = np.ravel(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
    axes = range(len(starts)) if axes is None else axes
    index = [slice(None)] * data.ndim
    for i, axis in enumerate(axes):
        index[axis] = slice(int(starts[i]), int(ends[i]), 1 if steps is None else int(steps[i]))
    return data[tuple(index)]


def _tensor_attr(node: ir.Node) -> ir.TensorProtocol | None:
    value = attr(node, "value")
    return value if isinstance(value, ir.TensorProtocol) else None


def _constant(node, inputs):
    value = _tensor_attr(node)
    if value is not None:
        return value.numpy()
    name = next(a for a in CONSTANT_ATTRS if a in node.attributes)
    return np.array(attr(node, name), dtype=CONSTANT_ATTRS[name])


def _constant_of_shape(node, inputs):
    value = _tensor_attr(node)
    fill = value.numpy().reshape(-1)[0] if value is not None else np.float32(0)
    return np.full(tuple(int(d) for d in np.ravel(inputs[0])), fill, dtype=np.asarray(fill).dtype)


EVALUATORS = {  # op → NumPy evaluation of the node's first output from its inputs' values
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Range": lambda node, inputs: np.arange(inputs[0], inputs[1], inputs[2]).astype(np.asarray(inputs[0]).dtype),
    "Identity": lambda node, inputs: inputs[0],
    "Cast": lambda node, inputs: inputs[0].astype(onnx.helper.tensor_dtype_to_np_dtype(attr(node, "to"))),
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Transpose": lambda node, inputs: np.transpose(inputs[0], attr(node, "perm")),
    "Concat": lambda node, inputs: np.concatenate(inputs, axis=attr(node, "axis")),
    "Gather": lambda node, inputs: np.take(inputs[0], inputs[1], axis=attr(node, "axis", 0)),
    "Slice": _slice,
    "Expand": lambda node, inputs: np.broadcast_to(inputs[0], np.broadcast_shapes(inputs[0].shape, tuple(inputs[1]))),
    "Neg": lambda node, inputs: np.negative(inputs[0]),
    "Add": lambda node, inputs: np.add(*inputs),
    "Sub": lambda node, inputs: np.subtract(*inputs),
    "Mul": lambda node, inputs: np.multiply(*inputs),
}


def _evaluable(node: ir.Node) -> bool:
    """Whether `node`'s op and attributes are ones `EVALUATORS` computes exactly."""
    if node.op_type not in EVALUATORS or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Constant":
        return _tensor_attr(node) is not None or any(a in node.attributes for a in CONSTANT_ATTRS)
    if node.op_type == "Cast":
        return attr(node, "to") in CAST_DTYPES
    if node.op_type == "Unsqueeze":
        return "axes" in node.attributes or input_at(node, 1) is not None
    return True


def is_constant(tensor: ir.Value | None) -> bool:
    """Whether `tensor` is an initializer or computed from constants alone, without loading it.

    Iterative and bounded: a subgraph of more than `MAX_CONSTANT_NODES` evaluable nodes is taken
    as not constant (a safe answer: a weight that is not constant only declines a fold), so a
    run-time residual stream of Adds is not walked to its start for every tensor on it.
    """
    if tensor is None:
        return False
    stack, seen = [tensor], set()
    while stack:
        current = stack.pop()
        if is_initializer(current) or id(current) in seen:
            continue
        seen.add(id(current))
        node = current.producer()
        if node is None or not _evaluable(node) or node.outputs[0] is not current or len(seen) > MAX_CONSTANT_NODES:
            return False
        stack.extend(t for t in node.inputs if t is not None)
    return True


def constant_values(tensor: ir.Value | None) -> np.ndarray | None:
    """Values of a constant-like tensor (read-only; see `is_constant`), else None."""
    if tensor is None:
        return None
    if is_initializer(tensor) and tensor.const_value is not None:
        return tensor.const_value.numpy()
    node = tensor.producer()
    if node is None or not is_constant(tensor):
        return None
    inputs = [None if t is None else constant_values(t) for t in node.inputs]
    if any(value is None for value, t in zip(inputs, node.inputs, strict=False) if t is not None):
        return None
    try:
        return np.asarray(EVALUATORS[node.op_type](node, inputs))
    except (ValueError, IndexError, TypeError, KeyError):  # a malformed node: not a usable constant
        return None


def unit_slice(node: ir.Node) -> slice | None:
    """The bounds of a `Slice` of a 1-D tensor with constant one-element starts and ends, on axis 0 (or -1)
    and with step 1 where those inputs are given (as exporters slice a `Shape`), else None."""
    if node.op_type != "Slice" or len(node.inputs) < 3:
        return None
    starts, ends = constant_values(node.inputs[1]), constant_values(node.inputs[2])
    axes, steps = constant_values(input_at(node, 3)), constant_values(input_at(node, 4))
    if starts is None or ends is None or np.size(starts) != 1 or np.size(ends) != 1:
        return None
    if input_at(node, 3) is not None and (axes is None or np.ravel(axes).tolist() not in ([0], [-1])):
        return None
    if input_at(node, 4) is not None and (steps is None or np.ravel(steps).tolist() != [1]):
        return None
    return slice(int(np.ravel(starts)[0]), int(np.ravel(ends)[0]))
