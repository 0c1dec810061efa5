"""ONNX front end: load a model, infer shapes, and build its zero-mean graph.

The model is held as an onnx-graphsurgeon graph (initializers stay lazy `TensorProto`s, so a
124M-parameter model is not copied into NumPy). Shapes come from ONNX shape inference run on a
light copy of the model whose large initializers are declared as inputs instead.
The op → rule table below is the whole of what this front end knows about ONNX op semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph import (
    Broadcast,
    Centered,
    Concat,
    Linear,
    NodeKind,
    NormRule,
    Opaque,
    Permute,
    Regroup,
    Scale,
    Select,
    ShiftInvariant,
    Sum,
    Take,
    ZeroMeanGraph,
    ZNode,
)
from .onnx_patterns import constant_values, is_constant, match_decomposed, match_single_op, norm_info

LIGHT_INITIALIZER_LIMIT = 1024  # elements; larger initializers are declared, not copied, for inference
FLOAT_CASTS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


@dataclass
class OnnxGraph:
    """A model being analysed or rewritten: the graphsurgeon graph plus inferred shapes."""

    model: onnx.ModelProto
    graph: gs.Graph
    shapes: dict[str, tuple | None] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    name: str = "model"

    @property
    def opset(self) -> int:
        return next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 1)


def infer_shapes(model: onnx.ModelProto) -> tuple[dict[str, tuple | None], dict[str, np.dtype]]:
    """Shapes (int, symbolic str or None dims) and dtypes of every tensor inference can reach."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph = light.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    declared = {i.name for i in model.graph.input}
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) <= LIGHT_INITIALIZER_LIMIT and init.data_location != onnx.TensorProto.EXTERNAL:
            graph.initializer.append(init)
        elif init.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    inferred = _infer_contrib(light)
    if inferred is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
        except Exception:  # inference is best effort; unknown shapes make the analysis decline
            inferred = light
    shapes: dict[str, tuple | None] = {}
    dtypes: dict[str, np.dtype] = {}
    for info in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.elem_type:
            dtypes[info.name] = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if tensor_type.HasField("shape"):
            shapes[info.name] = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
            )
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
        dtypes[init.name] = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    return shapes, dtypes


def _has_contrib_ops(model: onnx.ModelProto) -> bool:
    """Whether some node is no ONNX op at the model's opset (an ONNX Runtime contrib op, say)."""
    versions = {o.domain or "": o.version for o in model.opset_import}
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        try:
            onnx.defs.get_schema(node.op_type, versions.get(domain, 1), domain)
        except onnx.defs.SchemaError:
            return True
    return False


def _infer_contrib(light: onnx.ModelProto) -> onnx.ModelProto | None:
    """ONNX Runtime's symbolic inference, which knows its contrib ops, for models that use them."""
    if not _has_contrib_ops(light):
        return None
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        return SymbolicShapeInference.infer_shapes(light, auto_merge=True, guess_output_rank=True)
    except Exception:  # best effort: fall back to ONNX's own inference
        return None


def load_graph(model: onnx.ModelProto, name: str = "model") -> OnnxGraph:
    """Wrap `model` (not modified) for analysis; unnamed or duplicate node names get unique ones."""
    graph = gs.import_onnx(model)
    seen: set[str] = set()
    for index, node in enumerate(graph.nodes):
        if not node.name or node.name in seen:
            node.name = f"{node.op}_{index}" if not node.name else f"{node.name}_{index}"
        seen.add(node.name)
    shapes, dtypes = infer_shapes(model)
    for node in graph.nodes:
        if node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
            shapes.setdefault(node.outputs[0].name, tuple(node.attrs["value"].shape))
    return OnnxGraph(model, graph, shapes, dtypes, name)


# --- op table ----------------------------------------------------------------------------------


def _rank(ctx: OnnxGraph, tensor: gs.Tensor) -> int | None:
    shape = ctx.shapes.get(tensor.name)
    return None if shape is None else len(shape)


def _axis(value: int, rank: int | None) -> int | None:
    if value >= 0:
        return value
    return None if rank is None else value + rank


def _linear_or(reason: str, ok: bool, axis: int | None):
    if ok and axis is not None:
        return NodeKind.LINEAR, Linear(axis)
    return NodeKind.OTHER, Opaque(reason)


def _matmul(ctx, node):
    weight = node.inputs[1]
    rank = _rank(ctx, node.outputs[0])
    ok = is_constant(weight) and not is_constant(node.inputs[0]) and len(ctx.shapes.get(weight.name) or ()) >= 2
    return _linear_or("multiplies two run-time tensors (or a constant on the left)", ok, None if rank is None else rank - 1)


def _gemm(ctx, node):
    ok = is_constant(node.inputs[1]) and (len(node.inputs) < 3 or is_constant(node.inputs[2]))
    return _linear_or("its weight or bias is computed at run time", ok, 1)


def _conv(ctx, node):
    if node.attrs.get("group", 1) != 1:
        return NodeKind.OTHER, Opaque("a grouped or depthwise convolution cannot be centred (seed 003 §3)")
    ok = all(is_constant(t) for t in node.inputs[1:])
    return _linear_or("its weight is computed at run time", ok, 1)


def _gather(ctx, node):
    data, indices = node.inputs[0], node.inputs[1]
    axis = node.attrs.get("axis", 0)
    if is_constant(data):
        rank = _rank(ctx, node.outputs[0])
        ok = len(ctx.shapes.get(data.name) or ()) == 2 and _axis(axis, 2) == 0
        return _linear_or("gathers from a constant that is not an embedding table", ok, None if rank is None else rank - 1)
    return NodeKind.LAYOUT, Take(_axis(axis, _rank(ctx, data)) or 0, _rank(ctx, indices))


def _slice(ctx, node):
    rank = _rank(ctx, node.inputs[0])
    starts = node.inputs[1]
    if len(node.inputs) > 3 and node.inputs[3].name:
        axes = constant_values(node.inputs[3])
        if axes is None:
            return NodeKind.LAYOUT, Select(None)
        axes = [int(a) for a in np.ravel(axes)]
    else:
        count = (starts.shape or [None])[0] if not is_constant(starts) else constant_values(starts).size
        axes = list(range(count)) if isinstance(count, int) else None
    if axes is None or rank is None and any(a < 0 for a in axes):
        return NodeKind.LAYOUT, Select(None)
    return NodeKind.LAYOUT, Select(tuple(_axis(a, rank) for a in axes))


def _split(ctx, node):
    return NodeKind.LAYOUT, Select((_axis(node.attrs.get("axis", 0), _rank(ctx, node.inputs[0])),))


def _transpose(ctx, node):
    perm = node.attrs.get("perm")
    if perm is None:
        rank = _rank(ctx, node.inputs[0])
        if rank is None:
            return NodeKind.OTHER, Opaque("a Transpose of unknown rank")
        perm = list(reversed(range(rank)))
    return NodeKind.LAYOUT, Permute(tuple(perm))


def _concat(ctx, node):
    axis = _axis(node.attrs["axis"], _rank(ctx, node.outputs[0]))
    if axis is None:
        return NodeKind.OTHER, Opaque("a Concat of unknown rank")
    return NodeKind.LAYOUT, Concat(axis)


def _softmax(ctx, node):
    rank = _rank(ctx, node.inputs[0])
    axis = _axis(node.attrs.get("axis", -1 if ctx.opset >= 13 else 1), rank)
    if axis is None or ctx.opset < 13 and axis != rank - 1:
        return NodeKind.OTHER, Opaque("Softmax over several axes")
    return NodeKind.OTHER, ShiftInvariant(axis)


def _cast(ctx, node):
    if node.attrs.get("to") in FLOAT_CASTS:
        return NodeKind.SCALAR, Scale(0, None)
    return NodeKind.OTHER, Opaque("casts to a non-float type")


def _sub(ctx, node):
    """x − ReduceMean(x, axis) is already centred (an inserted or hand-written centring)."""
    x, mean = node.inputs
    producer = mean.inputs[0] if len(mean.inputs) == 1 else None
    if producer is not None and producer.op == "ReduceMean" and producer.inputs[0] is x and producer.attrs.get("keepdims", 1):
        axes = producer.attrs.get("axes")
        if axes is None and len(producer.inputs) > 1:
            axes = constant_values(producer.inputs[1])
        if axes is not None and np.size(axes) == 1:
            axis = _axis(int(np.ravel(axes)[0]), _rank(ctx, x))
            if axis is not None:
                return NodeKind.CENTERED, Centered(axis)
    return NodeKind.RESIDUAL, Sum()


def _unary(ctx, node):
    return NodeKind.SCALAR, Scale(0, None)


def _mul(ctx, node):
    return NodeKind.SCALAR, Scale(None, None)


OP_TABLE = {
    "MatMul": _matmul,  # x·W with constant W: general linear, output features on the last axis
    "Gemm": _gemm,  # α·A·B + β·C with constant B, C: general linear on axis 1
    "Conv": _conv,  # group == 1 only: output channels on axis 1
    "Gather": _gather,  # embedding lookup from a constant [V, d] table, or layout gather
    "Add": lambda ctx, node: (NodeKind.RESIDUAL, Sum()),  # residual add / bias add
    "Sub": _sub,  # residual difference, or an explicit centring x − mean(x)
    "Mul": _mul,  # scalar multiply: one operand must be constant along the axis
    "Div": lambda ctx, node: (NodeKind.SCALAR, Scale(0, 1)),  # x / s, s constant along the axis
    "Neg": _unary,  # −x
    "Identity": _unary,  # x
    "Dropout": _unary,  # identity at inference
    "Cast": _cast,  # float → float: linear up to rounding
    "Transpose": _transpose,  # moves the axis
    "Reshape": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),  # axis intact iff size and suffix match
    "Flatten": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),
    "Squeeze": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),
    "Unsqueeze": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),
    "Slice": _slice,  # keeps every slice along the other axes whole
    "Split": _split,
    "Expand": lambda ctx, node: (NodeKind.LAYOUT, Broadcast()),  # broadcast over other axes
    "Concat": _concat,  # zero-mean parts concatenate to zero mean
    "Softmax": _softmax,  # not linear, but removes a shift along its axis
}


def classify(ctx: OnnxGraph, node: gs.Node):
    handler = OP_TABLE.get(node.op)
    if handler is None:
        return NodeKind.OTHER, Opaque(f"{node.op} is not linear in its input")
    return handler(ctx, node)


def build_zero_mean_graph(ctx: OnnxGraph) -> ZeroMeanGraph:
    """Classify every node of `ctx` and recognise its normalizations."""
    graph = ctx.graph
    outputs = {t.name for t in graph.outputs}
    zmg = ZeroMeanGraph(model_name=ctx.name, shapes=ctx.shapes)
    zmg.graph_inputs = {t.name for t in graph.inputs}
    zmg.graph_outputs = outputs
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant):
            zmg.constants[tensor.name] = lambda t=tensor: t.values
    in_norm: set[int] = set()
    for node in graph.nodes:
        if id(node) in in_norm:
            continue
        found = match_single_op(node, outputs) or match_decomposed(node, outputs)
        if found is not None:
            norm_type, match = found
            op = node.op if len(match.nodes) == 1 else f"decomposed {norm_type.value}"
            norm = norm_info(node.name, op, norm_type, match, _rank(ctx, match.x))
            zmg.norms.append(norm)
            in_norm.update(id(n) for n in match.nodes)
    norms_by_anchor = {norm.ref.nodes[0].name: norm for norm in zmg.norms}
    for node in graph.nodes:
        if node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
            zmg.constants[node.outputs[0].name] = lambda v=node.attrs["value"]: v.values
        if node.name in norms_by_anchor:
            norm = norms_by_anchor[node.name]
            inputs = [norm.input] + [t for t in (norm.scale, norm.bias) if t]
            if norm.ref.skip is not None:
                _add_skip_sum(ctx, zmg, node, norm)
            zmg.add_node(ZNode(norm.name, norm.op, NodeKind.NORM, NormRule(norm), inputs, [norm.output], norm.ref))
            continue
        if id(node) in in_norm:
            continue
        kind, rule = classify(ctx, node)
        zmg.add_node(ZNode(node.name, node.op, kind, rule, [t.name for t in node.inputs], [t.name for t in node.outputs], node))
    return zmg


def _add_skip_sum(ctx: OnnxGraph, zmg: ZeroMeanGraph, node: gs.Node, norm) -> None:
    """A Skip*LayerNormalization normalizes x + skip (+ bias): model that sum as its own `Sum` node.

    Its output is the op's output 3 where something reads it, else a name of its own; it has x's shape.
    """
    match = norm.ref
    operands = [t.name for t in (match.x, match.skip, match.skip_bias) if t is not None]
    ctx.shapes.setdefault(norm.input, ctx.shapes.get(match.x.name))
    zmg.add_node(ZNode(f"{node.name}.sum", f"{node.op} (sum)", NodeKind.RESIDUAL, Sum(), operands, [norm.input], node))
