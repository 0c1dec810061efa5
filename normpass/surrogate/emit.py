"""Emit surrogate norms into an ONNX graph (onnx-graphsurgeon IR), moving constants where exact.

A surrogate (`surrogates.Surrogate`) computes y = γ ⊙ core(x − c) + β. The norm's nodes are
removed and the cheapest exact form of that formula is emitted:

* **shift c** — when every consumer of x is the norm and x is a sum (Adds whose intermediate
  results feed only the next Add) with a constant summand that broadcasts along the feature axis
  (a bias), that constant becomes b − c (copy-on-write) and no op is needed: the producing layer
  then outputs x − c, exactly. Otherwise an explicit `Sub(x, c)`.
* **core** — rms: `SimplifiedLayerNormalization` (ORT), opset-23 `RMSNormalization`, or the
  decomposed chain, as for the exact fold; affine: nothing; dyt: `Mul(α)` → `Tanh`; derf:
  `Mul(α)` → `Erf` (Derf's s is part of the shift: erf(α u + s) = erf(α (u + s/α))).
* **γ and β** — when every path from y reaches a linear layer that contracts over the features
  (through feature-preserving reshapes; `onnx/targets.py` `migration_targets`), both migrate into it:
  W' = diag(γ)·W, b' = b + β·W. Otherwise γ stays (the RMS op's scale, else a `Mul`), and β
  still migrates if every consumer is such a linear layer or a residual `Add` whose other
  summand carries a private bias: Add(y, s) = Add(y − β, s + β). Else an `Add(β)`.

**Input centring (exact preconditioning).** A LayerNorm removes any per-token shift of its
input: LN(x − m·1) = LN(x). When x is consumed only by the norm, the linear layers and biases
summed into x through private Adds can be centred along the features (W' = W − mean_out(W),
b' = b − mean(b), seed 003 §3) without changing the model. Their per-token mean, which the
surrogates cannot remove, is then gone; what is left comes from the other summands (in a post-LN
model, the previous norm's output). `centre_inputs` does this for every remaining LayerNorm.

`light_model` turns a working graph into a model whose large constants are graph inputs (fed at
run time), so that an ONNX Runtime session per trial costs milliseconds instead of serialising
every weight; `export_model` writes the final model with every weight in it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..core.algebra import centre
from ..core.graph import NormInfo, NormType
from .fit import NormSpec, Surrogate
from ..onnx.frontend import OnnxGraph, body_holders, norm_matches
from ..onnx.export import export_model as write_model
from ..onnx.constants import constant_values
from ..onnx.patterns import norm_info
from ..onnx.targets import (
    Namer, affine_plan, is_feature_vector, is_private, move_affine, private_bias, producer, value_readers,
)

LIGHT_LIMIT = 4096  # elements; larger constants become graph inputs of a light model
DOC_PREFIX = "normpass: "
# Estimated cost of each op a surrogate may emit, relative to one LayerNormalization over the
# same tensor (ONNX Runtime 1.31, CPU, 8192×384 fp32, one thread, 10th percentile of 300 runs
# each, interleaved: LN 5.5 ms, SimplifiedLayerNormalization 3.0, Add/Sub/Mul 2.4–2.7,
# Tanh 3.1, Erf 7.3). Memory-bound elementwise ops cost about half a LayerNorm each, so an
# affine that keeps both a Mul and an Add saves nothing. Ops on reduced tensors cost ~0.
OP_COST = {
    "LayerNormalization": 1.0,
    "SimplifiedLayerNormalization": 0.55,
    "RMSNormalization": 0.55,
    "Add": 0.5,
    "Sub": 0.5,
    "Mul": 0.5,
    "Div": 0.5,
    "Tanh": 0.6,
    "Erf": 1.3,
    "ReduceMean": 0.5,
    "Sqrt": 0.05,
    "Add(ε)": 0.05,
}


def op_cost(ops: dict[str, int]) -> float:
    return float(sum(OP_COST.get(op, 0.5) * count for op, count in ops.items()))


def norm_cost(norm: NormInfo) -> float:
    """Estimated cost of the original norm (its ops), in LayerNorm units.

    In a decomposed norm the ops right after a ReduceMean up to the reciprocal of the root
    (Add(ε), Sqrt, Reciprocal, Casts) work on reduced tensors and cost ~0.
    """
    nodes = norm.ref.nodes
    if len(nodes) == 1:
        return OP_COST.get(nodes[0].op, 1.0)
    total, reduced = 0.0, False
    for node in nodes:
        if node.op == "ReduceMean":
            total, reduced = total + OP_COST["ReduceMean"], True
        elif reduced and node.op in ("Add", "Sqrt", "Reciprocal", "Cast"):
            total += OP_COST["Sqrt"]
        elif node.op != "Cast":
            total, reduced = total + OP_COST.get(node.op, 0.5), False
    return total


# --- working graphs -----------------------------------------------------------------------------


def open_graph(model: onnx.ModelProto, shapes: dict, name: str = "model") -> OnnxGraph:
    """A disposable working graph of `model` (node names must already be unique), with known shapes."""
    graph = gs.import_onnx(model)
    return OnnxGraph(model, graph, shapes, name=name, holders=body_holders(graph))


def find_norms(ctx: OnnxGraph) -> dict[str, NormInfo]:
    """The norms of `ctx`, by name (the name of their first node), as the front end matches them."""
    outputs = {t.name for t in ctx.graph.outputs}
    norms: dict[str, NormInfo] = {}
    for node, op, (norm_type, match) in norm_matches(ctx.graph.nodes, outputs):
        shape = ctx.shapes.get(match.x.name)
        norms[node.name] = norm_info(node.name, op, norm_type, match, None if shape is None else len(shape))
    return norms


def norm_spec(norm: NormInfo) -> NormSpec:
    """The norm's exact formula, for computing its output from its input in NumPy."""
    match = norm.ref
    gamma = None if match.gamma is None else constant_values(match.gamma)
    beta = None if match.beta is None else constant_values(match.beta)
    return NormSpec(norm.norm_type is NormType.LAYER, norm.epsilon,
                    None if gamma is None else np.asarray(gamma).reshape(-1),
                    None if beta is None else np.asarray(beta).reshape(-1))


def width_of(ctx: OnnxGraph, norm: NormInfo) -> int | None:
    shape = ctx.shapes.get(norm.input)
    gamma = None if norm.ref.gamma is None else constant_values(norm.ref.gamma)
    if gamma is not None:
        return int(np.asarray(gamma).shape[-1])
    return shape[-1] if shape and isinstance(shape[-1], int) else None


def dtype_of(norm: NormInfo) -> np.dtype:
    x = norm.ref.x
    if isinstance(x, gs.Variable) and x.dtype is not None:
        return np.dtype(x.dtype)
    gamma = None if norm.ref.gamma is None else constant_values(norm.ref.gamma)
    return np.dtype(gamma.dtype) if gamma is not None else np.dtype(np.float32)


# --- where constants can go --------------------------------------------------------------------


def _only_read_by(tensor: gs.Tensor, nodes: list[gs.Node], graph_outputs: set[str]) -> bool:
    """Whether only `nodes` read the values of `tensor` (its `Shape` readers see no change of them)."""
    members = {id(n) for n in nodes}
    return tensor.name not in graph_outputs and all(id(c) in members for c in value_readers(tensor))


def shift_target(norm: NormInfo, width: int, graph_outputs: set[str]) -> tuple[gs.Node, int] | None:
    """Where the shift c of a surrogate can go exactly: a private bias of x, if x feeds only the norm."""
    match = norm.ref
    if not _only_read_by(match.x, match.nodes, graph_outputs):
        return None
    return private_bias(match.x, width, graph_outputs)


# --- input centring -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """A constant or linear layer summed into a norm's input, to be centred along the features."""

    node: gs.Node
    index: int  # the constant input (bias or weight) of `node` to centre
    axis: int | None  # the constant's axis indexing output features; None: a bias vector (last axis)


def centrable_leaves(ctx: OnnxGraph, norm: NormInfo, width: int, graph_outputs: set[str]) -> list[Leaf]:
    """Linear layers and biases summed into the input of a LayerNorm that only the norm reads."""
    match = norm.ref
    if norm.norm_type is not NormType.LAYER or norm.axis is None or not _only_read_by(match.x, match.nodes, graph_outputs):
        return []
    leaves: list[Leaf] = []

    def last_dim(tensor):
        shape = ctx.shapes.get(tensor.name)
        return shape[-1] if shape else None

    def walk(tensor: gs.Tensor) -> None:
        node = producer(tensor)
        if node is None:
            return
        if node.op == "Add" and len(node.inputs) == 2 and node.inputs[0] is not node.inputs[1]:
            for index, operand in enumerate(node.inputs):
                values = constant_values(operand)
                if values is not None:
                    if is_feature_vector(values, width):
                        leaves.append(Leaf(node, index, None))
                elif is_private(operand, graph_outputs) and last_dim(operand) == width:
                    walk(operand)
        elif node.op == "MatMul" and len(node.inputs) == 2:
            weight = constant_values(node.inputs[1])
            if weight is not None and weight.ndim == 2 and weight.shape[1] == width and constant_values(node.inputs[0]) is None:
                leaves.append(Leaf(node, 1, 1))
        elif node.op == "Gemm" and not node.attrs.get("transA", 0):
            weight = constant_values(node.inputs[1])
            out_axis = 0 if node.attrs.get("transB", 0) else 1
            if weight is not None and weight.ndim == 2 and weight.shape[out_axis] == width:
                if len(node.inputs) > 2 and node.inputs[2].name:
                    bias = constant_values(node.inputs[2])
                    if bias is None or not (is_feature_vector(bias, width) or bias.size == 1):
                        return
                    leaves.append(Leaf(node, 2, None))
                leaves.append(Leaf(node, 1, out_axis))

    walk(match.x)
    return leaves


# --- emission -----------------------------------------------------------------------------------


@dataclass
class Emission:
    """What emitting one surrogate did."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    shift: str = "none"  # "none" | "migrated into <node>" | "Sub"
    gamma: str = ""
    beta: str = ""
    changed: list[str] = field(default_factory=list)  # nodes whose constants were rewritten

    @property
    def cost(self) -> float:
        return op_cost(self.ops)

    def to_json(self) -> dict:
        return {"ops": dict(self.ops), "cost": self.cost, "shift": self.shift, "gamma": self.gamma, "beta": self.beta,
                "rewritten_layers": sorted(set(self.changed))}


class Emitter:
    """Rewrites one working graph; `docs` collects per-node notes for the final model."""

    def __init__(self, ctx: OnnxGraph, rms_op: str = "simplified"):
        self.ctx = ctx
        self.graph = ctx.graph
        self.rms_op = rms_op
        self.graph_outputs = {t.name for t in self.graph.outputs}
        self.unique = Namer(self.graph)
        self.docs: dict[str, str] = {}

    def note(self, name: str, text: str) -> None:
        previous = self.docs.get(name)
        self.docs[name] = (previous + "; " if previous else DOC_PREFIX) + text

    def _set_constant(self, node: gs.Node, index: int, values: np.ndarray, tag: str) -> None:
        """Point input `index` of `node` at a new constant (whatever else read the old one still does)."""
        old = node.inputs[index]
        node.inputs[index] = gs.Constant(self.unique(f"{old.name}.{tag}"), np.ascontiguousarray(values))

    def _const(self, base: str, values) -> gs.Constant:
        return gs.Constant(self.unique(base), np.ascontiguousarray(values))

    # exact preconditioning

    def centre_inputs(self, norm: NormInfo) -> list[str]:
        """Centre what is summed into the norm's input (exact for a LayerNorm); returns node names."""
        width = width_of(self.ctx, norm)
        if width is None:
            return []
        done = []
        for leaf in centrable_leaves(self.ctx, norm, width, self.graph_outputs):
            values = constant_values(leaf.node.inputs[leaf.index])
            axis = values.ndim - 1 if leaf.axis is None else leaf.axis
            self._set_constant(leaf.node, leaf.index, centre(values, axis), "centred")
            self.note(leaf.node.name, f"centred along the features for {norm.name} (exact: the LayerNorm removes the shift)")
            done.append(leaf.node.name)
        return done

    # surrogates

    def emit(self, norm: NormInfo, surrogate: Surrogate) -> Emission:
        """Replace `norm` by `surrogate` in the graph (see the module docstring)."""
        match = norm.ref
        width = width_of(self.ctx, norm)
        dtype = dtype_of(norm)
        emission = Emission()
        x, y = match.x, match.y
        # decide on the original wiring, before the norm's nodes go
        target = shift_target(norm, width, self.graph_outputs) if surrogate.has_shift else None
        output = affine_plan(self.ctx, self.graph_outputs, y, width, needs_bias=True)
        for node in match.nodes:
            node.inputs.clear()
            node.outputs.clear()
        doc = f"{surrogate.kind} surrogate for {norm.name} ({norm.op})"
        nodes: list[gs.Node] = []
        current = x

        def add(op: str, inputs: list, attrs: dict | None = None, label: str = "", key: str | None = None) -> gs.Variable:
            out = gs.Variable(self.unique(f"{norm.name}.{label or op.lower()}"), dtype=dtype)
            nodes.append(gs.Node(op, self.unique(f"{norm.name}.{label or op.lower()}"), attrs=attrs or {}, inputs=inputs, outputs=[out]))
            emission.ops[key or op] += 1  # ops on reduced tensors are counted apart (they cost ~0)
            return out

        shift = np.asarray(surrogate.shift, dtype=np.float64)
        if surrogate.has_shift:
            if target is not None:
                holder, index = target
                bias = constant_values(holder.inputs[index])
                self._set_constant(holder, index, (bias.astype(np.float64) - shift).reshape(bias.shape).astype(bias.dtype), "shifted")
                self.note(holder.name, f"absorbed the calibrated shift of {norm.name}")
                emission.shift = f"migrated into {holder.name}"
                emission.changed.append(holder.name)
            else:
                current = add("Sub", [current, self._const(f"{norm.name}.shift", shift.astype(dtype))], label="shift")
                emission.shift = "Sub"

        gamma = np.asarray(surrogate.gamma, dtype=np.float64)
        beta = np.asarray(surrogate.beta, dtype=np.float64)
        keep_gamma = output.full is None and not np.all(gamma == 1)
        keep_beta = output.full is None and output.beta is None and np.any(beta != 0)
        if surrogate.kind == "rms":
            scale = gamma if keep_gamma else np.ones(width)
            current = self._rms(norm, current, scale.astype(dtype), dtype, add)
            keep_gamma = False  # γ is the RMS op's scale
        elif surrogate.kind in ("dyt", "derf"):
            current = add("Mul", [current, self._const(f"{norm.name}.alpha", np.array(surrogate.alpha, dtype=dtype))], label="alpha")
            current = add("Tanh" if surrogate.kind == "dyt" else "Erf", [current])
        if keep_gamma:
            current = add("Mul", [current, self._const(f"{norm.name}.gamma", gamma.astype(dtype))], label="gamma")
        if keep_beta:
            current = add("Add", [current, self._const(f"{norm.name}.beta", beta.astype(dtype))], label="beta")

        moved_to = []
        if output.full is not None:
            moved_to = move_affine(output.full, None if np.all(gamma == 1) else gamma, beta if np.any(beta != 0) else None, self.unique)
            emission.gamma = emission.beta = "migrated into " + ", ".join(moved_to)
            emission.changed += moved_to
        else:
            emission.gamma = ("in the RMS op's scale" if surrogate.kind == "rms" else "Mul") if not np.all(gamma == 1) else "none"
            if output.beta is not None and np.any(beta != 0):
                moved_to = move_affine(output.beta, None, beta, self.unique)
                emission.beta = "migrated into " + ", ".join(moved_to)
                emission.changed += moved_to
            else:
                emission.beta = "Add" if keep_beta else "none"
        for name in moved_to:
            self.note(name, f"absorbed {'γ/β' if output.full is not None else 'β'} of the {norm.name} surrogate")

        # the last emitted op writes y; with nothing emitted, y's readers read x (or the Sub) instead
        if not nodes and y.name in self.graph_outputs:
            add("Identity", [current])  # an identity surrogate on a graph output
        if nodes:
            nodes[-1].outputs[0] = y
        else:
            for consumer in list(y.outputs):
                _rewire(consumer, y, current)
        for node in nodes:
            self.note(node.name, doc)
        self.graph.nodes.extend(nodes)
        return emission

    def _rms(self, norm: NormInfo, x, scale: np.ndarray, dtype, add) -> gs.Tensor:
        attrs = {"axis": -1, "epsilon": float(norm.epsilon)}
        if self.rms_op in ("simplified", "onnx"):
            op = "SimplifiedLayerNormalization" if self.rms_op == "simplified" else "RMSNormalization"
            return add(op, [x, self._const(f"{norm.name}.rms_scale", scale)], {**attrs, "stash_type": 1}, label="rms")
        square = add("Mul", [x, x], label="square")
        if self.ctx.opset >= 18:
            axes = self._const(f"{norm.name}.axes", np.array([-1], dtype=np.int64))
            mean = add("ReduceMean", [square, axes], {"keepdims": 1}, label="mean_square")
        else:
            mean = add("ReduceMean", [square], {"axes": [-1], "keepdims": 1}, label="mean_square")
        eps = self._const(f"{norm.name}.eps", np.array(norm.epsilon, dtype=dtype))
        root = add("Sqrt", [add("Add", [mean, eps], label="add_eps", key="Add(ε)")], key="Sqrt")
        normed = add("Div", [x, root], label="normalize")
        if np.all(scale == 1):
            return normed
        return add("Mul", [normed, self._const(f"{norm.name}.rms_scale", scale)], label="scale")


# --- models -------------------------------------------------------------------------------------


def _rewire(node: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    for index, tensor in enumerate(list(node.inputs)):
        if tensor is old:
            node.inputs[index] = new


def light_model(ctx: OnnxGraph, source: onnx.ModelProto, extra_outputs: dict[str, np.dtype] | None = None,
                cache: dict[str, np.ndarray] | None = None, limit: int = LIGHT_LIMIT) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The working graph as a model whose large constants are inputs; returns (model, their values).

    Consumes the working graph. `extra_outputs` (tensor name → dtype) become graph outputs;
    `cache` holds the values of untouched source initializers so they are converted once.
    """
    graph = ctx.graph
    graph.cleanup(remove_unused_graph_inputs=False)
    feeds: dict[str, np.ndarray] = {}
    tensors = graph.tensors()
    for name, tensor in tensors.items():
        if not isinstance(tensor, gs.Constant):
            continue
        raw = tensor._values
        shape = tuple(raw.shape)
        if int(np.prod(shape)) <= limit:
            continue
        if cache is not None and not isinstance(raw, np.ndarray) and name in cache:
            values = cache[name]
        else:
            values = np.ascontiguousarray(tensor.values)
            if cache is not None and not isinstance(raw, np.ndarray):
                cache[name] = values
        feeds[name] = values
        variable = gs.Variable(name, dtype=values.dtype, shape=list(shape))
        for consumer in list(tensor.outputs):
            _rewire(consumer, tensor, variable)
        graph.inputs.append(variable)
    for name, dtype in (extra_outputs or {}).items():
        tensor = tensors[name]
        if tensor.dtype is None:
            tensor.dtype = dtype
        if tensor not in graph.outputs:
            graph.outputs.append(tensor)
    model = gs.export_onnx(graph, do_type_check=False)
    model.ir_version = source.ir_version
    del model.opset_import[:]
    model.opset_import.extend(source.opset_import)
    return model, feeds


def export_model(ctx: OnnxGraph, source: onnx.ModelProto, docs: dict[str, str], properties: dict[str, str]) -> onnx.ModelProto:
    """The final model: every weight inside (untouched ones copied once), `source`'s opsets and
    metadata plus `properties`."""
    ctx.graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return write_model(ctx.graph, source, docs, properties)
