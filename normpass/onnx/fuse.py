"""Fuse `Add` + `SimplifiedLayerNormalization` into ORT's `SkipSimplifiedLayerNormalization`.

ONNX Runtime's session optimizer fuses `Add + LayerNormalization` into `SkipLayerNormalization`
but not `Add + SimplifiedLayerNormalization`, so a folded model would lose that fusion. Here
s = a + b; y = RMSNorm(s)·γ becomes one `com.microsoft.SkipSimplifiedLayerNormalization(a, b, γ)`
whose outputs are (y, -, -, s); s is kept only where the residual stream goes on. The fused node
takes the Add's place in the node order, so everything that read s still comes after it.
Only same-shape, run-time operands in float or float16 qualify (ORT registers the op for those
alone: a double model keeps the pair), the dtype read from γ's initializer. When one of them is itself t + c, with c a constant
1-D bias and t + c read by nothing else (a linear layer's bias `Add`), that Add goes into the
op's bias input too: s = a + t + c = Skip(a, t, γ, c), as ORT's own BiasSkipLayerNorm fusion does.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

MS_DOMAIN = "com.microsoft"
SKIP_DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)  # ORT's kernels for SkipSimplifiedLayerNormalization


def ort_fuses_into_skip_layer_norm(x: gs.Tensor, shapes: dict[str, tuple | None], graph_outputs: set[str]) -> bool:
    """Whether ORT's session optimizer will fuse the `Add` writing a LayerNorm's input `x` with it.

    Its SkipLayerNormFusion takes `Add(a, b) → LayerNormalization` when a and b are same-shape
    run-time tensors and nothing else reads the sum (as at the last norm of a pre-LN stack).
    """
    add = x.inputs[0] if len(x.inputs) == 1 else None
    if add is None or add.op != "Add" or len(add.inputs) != 2 or len(x.outputs) != 1 or x.name in graph_outputs:
        return False
    first, second = add.inputs
    shape = shapes.get(first.name)
    return (not isinstance(first, gs.Constant) and not isinstance(second, gs.Constant) and shape is not None
            and shapes.get(second.name) == shape and len(shape) in (2, 3))


def fuse_skip_rms(model: onnx.ModelProto, shapes: dict[str, tuple | None]) -> int:
    """Rewrite `model` in place; returns the number of fused pairs."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in list(node.input) + _body_reads(node):
            consumers[name] = consumers.get(name, 0) + 1
    constants = {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    outputs = {o.name for o in graph.output}
    vectors = {i.name: tuple(i.dims) for i in graph.initializer if len(i.dims) == 1}
    dtypes = {i.name: i.data_type for i in graph.initializer}
    fused: dict[int, onnx.NodeProto] = {}  # id(Add) → the fused node, which takes the Add's place
    removed: set[int] = set()  # ids of the fused norms and bias Adds
    for norm in graph.node:
        add = producers.get(norm.input[0]) if norm.op_type == "SimplifiedLayerNormalization" and norm.domain in ("", "ai.onnx") else None
        if add is None or add.op_type != "Add" or id(add) in fused or len(add.input) != 2:
            continue
        if len(norm.input) < 2 or dtypes.get(norm.input[1]) not in SKIP_DTYPES:
            continue
        first, second = add.input
        shape = shapes.get(first)
        if first in constants or second in constants or shape is None or shapes.get(second) != shape or len(shape) not in (2, 3):
            continue
        axis = next((a.i for a in norm.attribute if a.name == "axis"), -1)
        if axis not in (-1, len(shape) - 1):
            continue
        total = add.output[0]
        keep_sum = consumers.get(total, 0) > 1 or total in outputs
        inputs, note = [first, second, norm.input[1]], f"normpass: fused with residual Add {add.name}"
        for index in (1, 0):
            bias_add = producers.get(inputs[index])
            split = None if bias_add is None or id(bias_add) in fused else _bias_split(bias_add, shape, vectors, shapes)
            if split is not None and consumers.get(inputs[index]) == 1 and inputs[index] not in outputs:
                inputs[index] = split[0]
                inputs.append(split[1])
                removed.add(id(bias_add))
                note += f" and bias Add {bias_add.name}"
                break
        skip = onnx.helper.make_node(
            "SkipSimplifiedLayerNormalization",
            inputs,
            [norm.output[0], "", "", total] if keep_sum else [norm.output[0]],
            name=norm.name,
            domain=MS_DOMAIN,
            epsilon=next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5),
        )
        skip.doc_string = (norm.doc_string + "\n" if norm.doc_string else "") + note
        fused[id(add)] = skip
        removed.add(id(norm))
    if not fused:
        return 0
    nodes = [fused.get(id(node), node) for node in graph.node if id(node) not in removed]
    del graph.node[:]
    graph.node.extend(nodes)
    if all(o.domain != MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return len(fused)


def _body_reads(node: onnx.NodeProto) -> list[str]:
    """Tensor names read inside the bodies of a control-flow node, at any depth.

    Names local to a body are counted too: an extra reader only prevents a fusion.
    """
    bodies = [body for attr in node.attribute for body in ([attr.g] if attr.HasField("g") else attr.graphs)]
    return [name for body in bodies for inner in body.node for name in list(inner.input) + _body_reads(inner)]


def _bias_split(node: onnx.NodeProto, shape: tuple, vectors: dict[str, tuple], shapes: dict) -> tuple[str, str] | None:
    """(t, c) if `node` is t + c with c a 1-D constant over the last axis and t shaped like the sum."""
    if node.op_type != "Add" or len(node.input) != 2:
        return None
    for t, c in (node.input, node.input[::-1]):
        if c in vectors and vectors[c] == (shape[-1],) and t not in vectors and shapes.get(t) == shape:
            return t, c
    return None
