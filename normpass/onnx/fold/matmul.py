"""Turn a flattened `Reshape → Gemm → Reshape` next to a folded norm into `MatMul → Add`.

HF's `Conv1D` (GPT-2 and its kin) exports as `Reshape(x, [-1, K]) → Gemm(W, b) → Reshape(x.shape[:-1] + [N])`.
ONNX Runtime's transformers optimizer (model type gpt2) turns that into `MatMul(x, W) → Add(b)` after
fusing, but only where the first Reshape reads a `LayerNormalization`, `SkipLayerNormalization` or
`FastGelu`, and then fuses the bias `Add` into the `SkipLayerNormalization` it feeds (not into a
`SkipSimplifiedLayerNormalization`). After a fold, the projections that read an RMS op would keep
their Gemm, both Reshapes and the shape arithmetic that feeds the second one (a 3-layer GPT-2: 268 →
417 nodes), and the MLP's output bias would stay an `Add`. So the fold makes that conversion itself,
before it fuses residual Adds, for the Gemms that read an RMS op it emitted and for those whose
result is a residual operand of a folded norm (the fused op then takes their bias, as ORT's own
fusion does for a LayerNorm).

The algebra: with x of shape [d₀, …, dₖ, K], Reshape(x, [-1, K]) is the matrix X of shape [d₀⋯dₖ, K];
Gemm gives X·W + b (transA = 0, transB = 0, α = β = 1, b of shape [N] or [1, N]), and the second
Reshape restores [d₀, …, dₖ, N]; MatMul broadcasts over the leading axes, so MatMul(x, W) + b is
the same tensor, element for element, computed by the same products and sums. The conversion is
made only where that is proven: the first Reshape's target is [-1, K] (or [d₀⋯dₖ, K] for a static
x), and the second's target is x's leading dims and N, read from constants, from `Shape` of a
tensor and from the shape inference's dims (two dims are equal when both are the same int or the
same symbolic name). Nothing else may read the flattened tensor or the Gemm's output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..graph.constants import constant_values, is_constant, unit_slice
from ..graph.values import attr, input_at, name_of, shape_axes, take_over

# The RMS ops the fold emits for ONNX Runtime: a Gemm reading one, or feeding the residual Add before one, converts.
RMS_OPS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"}
MAX_SHAPE_NODES = 32  # a shape computation larger than this is not followed


def gemms_to_matmuls(model: ir.Model, shapes: dict[str, tuple | None]) -> int:
    """Convert, in place, each provable `Reshape → Gemm → Reshape` next to an RMS op (reading its first output,
    or feeding an `Add` that it reads); returns how many. `shapes` are the shape inference's dims by tensor
    name (ints, symbolic names or None); the tensors added are recorded there."""
    graph = model.graph
    count = 0
    for gemm in list(graph):
        match = _flattened_gemm(gemm, graph, shapes)
        if match is None:
            continue
        flatten, unflatten = match
        x, weight, bias = flatten.inputs[0], gemm.inputs[1], input_at(gemm, 2)
        assert x is not None and weight is not None
        product = ir.Value(name=f"{name_of(gemm)}.matmul", type=unflatten.outputs[0].type)
        # The MatMul keeps the Gemm's name and story (its centring, its migrated γ/β), and says what changed.
        story = (gemm.doc_string + "\n" if gemm.doc_string else "") + "normpass: Gemm without its flattening Reshapes"
        nodes = [ir.node("MatMul", [x, weight], outputs=[product], name=name_of(gemm), doc_string=story)]
        result = product
        if bias is not None:
            result = ir.Value(name=f"{name_of(gemm)}.bias", type=unflatten.outputs[0].type)
            doc = f"normpass: the bias of {name_of(gemm)}"
            nodes.append(
                ir.node("Add", [product, bias], outputs=[result], name=f"{name_of(gemm)}.bias", doc_string=doc)
            )
        graph.insert_before(unflatten, nodes)
        shapes[name_of(product)] = shapes[name_of(result)] = shapes.get(name_of(unflatten.outputs[0]))
        take_over(unflatten.outputs[0], result)
        dead = [unflatten, gemm, flatten]
        read = [v for node in dead for v in node.inputs if v is not None]  # (removal detaches the inputs)
        graph.remove(dead, safe=True)
        _remove_dead_producers(graph, read)
        count += 1
    return count


def _flattened_gemm(gemm: ir.Node, graph: ir.Graph, shapes: dict) -> tuple[ir.Node, ir.Node] | None:
    """(first Reshape, second Reshape) around `gemm` when the conversion is proven, else None."""
    if gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx") or gemm.graph is not graph:
        return None
    if attr(gemm, "transA", 0) or attr(gemm, "transB", 0) or attr(gemm, "alpha", 1.0) != 1.0:
        return None
    if attr(gemm, "beta", 1.0) != 1.0 or gemm.inputs[1] is None or not is_constant(gemm.inputs[1]):
        return None
    flat, out, bias = gemm.inputs[0], gemm.outputs[0], input_at(gemm, 2)
    flatten = None if flat is None else flat.producer()
    if (
        flat is None
        or flatten is None
        or flatten.op_type != "Reshape"
        or len(flat.uses()) != 1
        or flat.is_graph_output()
    ):
        return None
    x = flatten.inputs[0]
    uses = list(out.uses())
    if x is None or len(uses) != 1 or out.is_graph_output() or uses[0].node.op_type != "Reshape" or uses[0].idx != 0:
        return None
    unflatten = uses[0].node
    if not (_reads_rms(x) or _feeds_rms_residual(unflatten.outputs[0])):
        return None
    x_shape, weight_shape = shapes.get(name_of(x)), _static_dims(gemm.inputs[1], shapes)
    if x_shape is None or len(x_shape) < 2 or weight_shape is None or len(weight_shape) != 2:
        return None
    width, features = weight_shape
    if x_shape[-1] != width or not _bias_fits(bias, features, shapes):
        return None
    if not _is_flattening(flatten, x_shape, width, shapes):  # (the second Reshape's allowzero: no entry is a literal 0)
        return None
    target = _shape_dims(input_at(unflatten, 1), shapes)
    expected = [(name_of(x), axis) for axis in range(len(x_shape) - 1)] + [features]
    if target is None or len(target) != len(expected):
        return None
    if not all(_same_dim(a, b, shapes) for a, b in zip(target, expected, strict=True)):
        return None
    return flatten, unflatten


def _reads_rms(x: ir.Value) -> bool:
    producer = x.producer()
    return producer is not None and producer.op_type in RMS_OPS and producer.outputs[0] is x


def _feeds_rms_residual(y: ir.Value) -> bool:
    """Whether `y` is an operand of an `Add` that an RMS op reads."""
    return any(
        use.node.op_type == "Add" and any(u.node.op_type in RMS_OPS for u in use.node.outputs[0].uses())
        for use in y.uses()
    )


def _static_dims(value: ir.Value | None, shapes: dict) -> tuple[int, ...] | None:
    """The static shape of a constant, read from its tensor's header or the shape inference, never from its
    values (a weight the fold rewrote is computed only when the model is written)."""
    if value is None:
        return None
    if value.const_value is not None:
        return tuple(value.const_value.shape.numpy())
    dims = shapes.get(name_of(value))
    return dims if dims is not None and all(isinstance(d, int) for d in dims) else None


def _bias_fits(bias: ir.Value | None, features: int, shapes: dict) -> bool:
    """No bias, or a constant one that broadcasts along the output features alone ([N] or [1, N])."""
    return bias is None or (is_constant(bias) and _static_dims(bias, shapes) in ((features,), (1, features)))


def _is_flattening(flatten: ir.Node, x_shape: tuple, width: int, shapes: dict) -> bool:
    """Whether `flatten` reshapes x to [d₀⋯dₖ, K]: a target [-1, K], or [d₀⋯dₖ, K] for static dims, its
    entries constant or read from shapes."""
    target = _shape_dims(input_at(flatten, 1), shapes)
    if target is None or len(target) != 2 or not _same_dim(target[1], width, shapes):
        return False
    leading = x_shape[:-1]
    static_rows = all(isinstance(d, int) for d in leading) and target[0] == int(np.prod(leading))
    return target[0] == -1 or static_rows


def _shape_dims(value: ir.Value | None, shapes: dict, budget: list[int] | None = None) -> list | None:
    """The entries of a 1-D int64 shape tensor: ints, or (tensor name, axis) for a `Shape` entry; None where
    the computation uses anything but constants, Shape, Gather/Slice/Concat on axis 0, Unsqueeze, Squeeze, Cast."""
    budget = [MAX_SHAPE_NODES] if budget is None else budget
    if value is None:
        return None
    values = constant_values(value)
    if values is not None:
        return [int(v) for v in np.ravel(values)] if values.ndim <= 1 else None
    node = value.producer()
    budget[0] -= 1
    if node is None or budget[0] < 0 or node.domain not in ("", "ai.onnx"):
        return None
    op, first = node.op_type, node.inputs[0] if node.inputs else None
    if op == "Shape" and first is not None:
        return _shape_of(node, first, shapes)
    if op in ("Cast", "Identity", "Unsqueeze", "Squeeze"):  # a scalar and its 1-element tensor hold one dim
        inner = _shape_dims(first, shapes, budget)
        return inner if inner is not None and (len(inner) == 1 or op in ("Cast", "Identity")) else None
    if op == "Concat" and attr(node, "axis", 0) in (0, -1):
        parts = [_shape_dims(part, shapes, budget) for part in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]  # type: ignore[union-attr]
    if op == "Gather" and attr(node, "axis", 0) == 0:
        inner, index = _shape_dims(first, shapes, budget), constant_values(input_at(node, 1))
        if inner is None or index is None or index.ndim > 1:
            return None
        picked = [int(i) for i in np.ravel(index)]
        return [inner[i] for i in picked] if all(-len(inner) <= i < len(inner) for i in picked) else None
    if op == "Slice":
        inner, bounds = _shape_dims(first, shapes, budget), unit_slice(node)
        return None if inner is None or bounds is None else inner[bounds]
    return None


def _shape_of(node: ir.Node, tensor: ir.Value, shapes: dict) -> list | None:
    """Shape(tensor)[start:end] as (name, axis) dims, where the tensor's rank is known."""
    shape = shapes.get(name_of(tensor))
    return None if shape is None else [(name_of(tensor), axis) for axis in shape_axes(node, len(shape))]


def _same_dim(a, b, shapes: dict) -> bool:
    """Whether two dims are provably equal: the same (tensor, axis), or both resolve (through the shape
    inference) to the same int or the same symbolic name."""
    return a == b or (_resolved(a, shapes) is not None and _resolved(a, shapes) == _resolved(b, shapes))


def _resolved(dim, shapes: dict):
    if isinstance(dim, int):
        return dim
    shape = shapes.get(dim[0])
    return None if shape is None or dim[1] >= len(shape) else shape[dim[1]]


def _remove_dead_producers(graph: ir.Graph, values: list[ir.Value]) -> None:
    """Remove the nodes of `graph` that computed only `values` (now read by nothing), transitively, and the
    initializers among them that nothing reads any more (unless they are graph inputs)."""
    stack = list(values)
    while stack:
        value = stack.pop()
        node = value.producer()
        if (
            node is None
            and value.is_initializer()
            and not (value.uses() or value.is_graph_input() or value.is_graph_output())
        ):
            graph.initializers.pop(str(value.name), None)
        if node is None or node.graph is not graph:
            continue
        if any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        stack.extend(v for v in node.inputs if v is not None)
        graph.remove(node, safe=True)
