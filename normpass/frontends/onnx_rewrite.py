"""Apply a `FoldPlan` to an ONNX graph: centre weights, insert centrings, swap norms for RMS ops.

* Centring (algebra.centre) of the planned layers' constants, along the axis that indexes their
  output features: Gemm B (axis 1, or 0 with transB) and C, MatMul W (last axis), Conv W and bias
  (axis 0), Gather tables (axis 1), constants added into the stream.
* Copy-on-write: a rewritten constant is a new initializer read only by the rewritten input;
  whatever else read the old one (a tied LM head, a deduplicated bias) still reads the original.
* Affine migration (algebra.migrate_affine): when every consumer of a folded norm is a linear
  layer with constant weights that can take a bias, γ and β move into them and the RMS op keeps
  only ones as its scale; otherwise the RMS op keeps γ, and β stays an Add.
* RMS ops: `SimplifiedLayerNormalization` (ORT, default), opset-23 `RMSNormalization`, or the
  decomposed chain Mul → ReduceMean → Add → Sqrt → Div.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..algebra import centre, migrate_affine
from ..analysis import regroup_axis
from ..graph import NormInfo, ZeroMeanGraph
from ..plan import Centring, FoldPlan, Insertion
from .onnx import OnnxGraph
from .onnx_patterns import constant_values, is_constant

RMS_OPS = ("simplified", "onnx", "decomposed")
REGROUP_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
DOC_PREFIX = "normpass: "


def _bias_centred(values: np.ndarray, out_rank: int, out_axis: int) -> np.ndarray:
    """Centre a bias that broadcasts into an output of rank `out_rank` along `out_axis`."""
    axis = out_axis - (out_rank - values.ndim)
    return centre(values, axis if axis >= 0 and values.shape[axis] != 1 else None)


class Namer:
    """Unique node and tensor names within one graph."""

    def __init__(self, graph: gs.Graph):
        self.names = set(graph.tensors()) | {node.name for node in graph.nodes}

    def __call__(self, base: str) -> str:
        name, index = base, 1
        while name in self.names:
            index += 1
            name = f"{base}_{index}"
        self.names.add(name)
        return name


@dataclass
class Rewriter:
    ctx: OnnxGraph
    zmg: ZeroMeanGraph
    rms_op: str = "simplified"

    def __post_init__(self):
        self.docs: dict[str, str] = {}  # node name → what normpass did to it (→ NodeProto.doc_string)
        self._copies: dict[tuple[str, str], gs.Constant] = {}
        self._loaded: dict[str, np.ndarray | None] = {}
        self._unique = Namer(self.ctx.graph)

    # --- constants, copy-on-write ---------------------------------------------------------------

    def _replace_input(self, node: gs.Node, index: int, transform: str, make) -> None:
        """Point `node.inputs[index]` at a new constant `make(old values)`, shared per transform."""
        old = node.inputs[index]
        key = (old.name, transform)
        if key not in self._copies:
            values = make(self._values(old))
            self._copies[key] = gs.Constant(self._unique(f"{old.name}.{transform.split(':')[0]}"), np.ascontiguousarray(values))
        node.inputs[index] = self._copies[key]

    def centre_layer(self, centring: Centring, norms: list[str]) -> None:
        node: gs.Node = self.zmg.nodes[centring.node].ref
        doc = f"weights centred for {', '.join(norms)}"
        if centring.input_index is not None:
            self._replace_input(node, centring.input_index, f"centred:{centring.axis}", lambda v: centre(v, centring.axis))
        elif node.op == "Gemm":
            self._replace_input(node, 1, f"centred:{1 - node.attrs.get('transB', 0)}",
                                lambda v: centre(v, 1 - node.attrs.get("transB", 0)))
            if len(node.inputs) > 2 and node.inputs[2].name:
                self._replace_input(node, 2, "centred:bias", lambda v: _bias_centred(v, 2, 1))
        elif node.op == "MatMul":
            self._replace_input(node, 1, "centred:-1", lambda v: centre(v, v.ndim - 1))
        elif node.op == "Conv":
            self._replace_input(node, 1, "centred:0", lambda v: centre(v, 0))
            if len(node.inputs) > 2 and node.inputs[2].name:
                self._replace_input(node, 2, "centred:0", lambda v: centre(v, 0))
        elif node.op == "Gather":
            self._replace_input(node, 0, "centred:1", lambda v: centre(v, 1))
        else:
            raise TypeError(f"no centring rule for {node.op} {node.name}")
        self._note(node, doc)

    # --- inserted centring ----------------------------------------------------------------------

    def insert_centering(self, insertion: Insertion) -> None:
        graph = self.ctx.graph
        tensor = graph.tensors()[insertion.tensor]
        consumers = list(tensor.outputs)
        mean = gs.Variable(self._unique(f"{tensor.name}.mean"), dtype=tensor.dtype)
        centred = gs.Variable(self._unique(f"{tensor.name}.centred"), dtype=tensor.dtype, shape=tensor.shape)
        graph.nodes.append(self._reduce_mean(tensor, insertion.axis, mean, f"{tensor.name}.centring_mean"))
        sub = gs.Node("Sub", self._unique(f"{tensor.name}.centring"), inputs=[tensor, mean], outputs=[centred])
        self._note(sub, "inserted centring x − mean(x)")
        graph.nodes.append(sub)
        for consumer in consumers:
            for index, source in enumerate(consumer.inputs):
                if source is tensor:
                    consumer.inputs[index] = centred

    def _reduce_mean(self, tensor, axis, out, name) -> gs.Node:
        if self.ctx.opset >= 18:
            axes = gs.Constant(self._unique(f"{name}.axes"), np.array([axis], dtype=np.int64))
            return gs.Node("ReduceMean", self._unique(name), attrs={"keepdims": 1}, inputs=[tensor, axes], outputs=[out])
        return gs.Node("ReduceMean", self._unique(name), attrs={"axes": [axis], "keepdims": 1}, inputs=[tensor], outputs=[out])

    # --- norms ----------------------------------------------------------------------------------

    def _migration_targets(self, norm: NormInfo) -> list[tuple[gs.Node, int, gs.Node | None, int]] | None:
        """Where γ/β can go: (linear node, input-feature axis of its weight, bias node, bias index).

        None unless every path from the norm's output reaches, through reshapes that keep the
        feature axis, the input of a linear layer that contracts over it (and can take β).
        """
        match = norm.ref
        beta = None if match.beta is None else self._values(match.beta)
        needs_bias = beta is not None and bool(np.any(beta != 0))
        return migration_targets(self.ctx, self.zmg.graph_outputs, match.y, needs_bias)

    def _migrate(self, norm: NormInfo, targets) -> None:
        match = norm.ref
        gamma = None if match.gamma is None else self._values(match.gamma)
        beta = None if match.beta is None else self._values(match.beta)
        for linear, in_axis, bias_node, bias_index in targets:
            weight = self._values(linear.inputs[1])
            bias = None
            if bias_node is not None and bias_index < len(bias_node.inputs) and bias_node.inputs[bias_index].name:
                bias = self._values(bias_node.inputs[bias_index])
            # Gemm: y = α·A·B + β_g·C, so β·W enters C scaled by α/β_g.
            shift_scale = linear.attrs.get("alpha", 1.0) / linear.attrs.get("beta", 1.0) if linear.op == "Gemm" else 1.0
            new_weight, new_bias = migrate_affine(weight, bias, gamma, beta, in_axis, shift_scale)
            linear.inputs[1] = gs.Constant(self._unique(f"{linear.inputs[1].name}.affine"), new_weight)
            if new_bias is not None and bias_node is not None:
                const = gs.Constant(self._unique(f"{linear.name}.bias_affine"), new_bias)
                if bias_index < len(bias_node.inputs):
                    bias_node.inputs[bias_index] = const
                else:
                    bias_node.inputs.append(const)
            self._note(linear, f"absorbed γ/β of {norm.name}")

    def replace_norm(self, norm: NormInfo, targets) -> str:
        """Swap the norm for an RMS op, γ/β going to `targets` if any; returns a note on where they went."""
        match = norm.ref
        graph = self.ctx.graph
        x, y = match.nodes[0].inputs[0], match.y  # x may have been rewired to an inserted centring
        for node in match.nodes:
            node.inputs.clear()
            node.outputs.clear()
        if targets is not None:
            self._migrate(norm, targets)
            gamma = beta = None
            note = "γ/β migrated into " + ", ".join(t[0].name for t in targets)
        else:
            gamma = None if match.gamma is None else self._values(match.gamma)
            beta = None if match.beta is None else self._values(match.beta)
            note = "γ kept in the RMS op" + (", β kept as an Add" if beta is not None else "")
        original_gamma = None if match.gamma is None else self._values(match.gamma)
        dtype = original_gamma.dtype if original_gamma is not None else self._dtype(x)
        width = original_gamma.shape[-1] if original_gamma is not None else self.ctx.shapes[x.name][-1]
        scale = gamma if gamma is not None else np.ones(width, dtype=dtype)
        rms_out = y if beta is None else gs.Variable(self._unique(f"{y.name}.rms"), dtype=y.dtype)
        doc = f"LayerNorm {norm.name} folded into an RMSNorm (input proven zero-mean); {note}"
        scale_const = gs.Constant(self._unique(f"{norm.name}.rms_scale"), np.asarray(scale, dtype=dtype))
        nodes = self._rms_nodes(norm, x, scale_const, rms_out)
        if beta is not None:
            nodes.append(gs.Node("Add", self._unique(f"{norm.name}.beta"), inputs=[rms_out, gs.Constant(self._unique(f"{norm.name}.beta"), beta)],
                                 outputs=[y]))
        for node in nodes:
            self._note(node, doc)
        graph.nodes.extend(nodes)
        return note

    def _rms_nodes(self, norm: NormInfo, x, scale, out) -> list[gs.Node]:
        attrs = {"axis": norm.axis, "epsilon": norm.epsilon}
        if self.rms_op == "simplified":
            return [gs.Node("SimplifiedLayerNormalization", self._unique(norm.name), attrs={**attrs, "stash_type": 1},
                            inputs=[x, scale], outputs=[out])]
        if self.rms_op == "onnx":
            return [gs.Node("RMSNormalization", self._unique(norm.name), attrs={**attrs, "stash_type": 1},
                            inputs=[x, scale], outputs=[out])]
        name = norm.name
        square, mean, shifted, root, normed = (gs.Variable(self._unique(f"{name}.{s}"), dtype=x.dtype) for s in ("sq", "ms", "mse", "rms", "xhat"))
        eps = gs.Constant(self._unique(f"{name}.eps"), np.array(norm.epsilon, dtype=self._dtype(x)))
        return [
            gs.Node("Mul", self._unique(f"{name}.square"), inputs=[x, x], outputs=[square]),
            self._reduce_mean(square, norm.axis, mean, f"{name}.mean_square"),
            gs.Node("Add", self._unique(f"{name}.add_eps"), inputs=[mean, eps], outputs=[shifted]),
            gs.Node("Sqrt", self._unique(f"{name}.sqrt"), inputs=[shifted], outputs=[root]),
            gs.Node("Div", self._unique(f"{name}.normalize"), inputs=[x, root], outputs=[normed]),
            gs.Node("Mul", self._unique(f"{name}.scale"), inputs=[normed, scale], outputs=[out]),
        ]

    def _values(self, tensor: gs.Tensor) -> np.ndarray | None:
        """A constant's values, loaded once per rewrite (read-only)."""
        if tensor.name not in self._loaded:
            self._loaded[tensor.name] = constant_values(tensor)
        return self._loaded[tensor.name]

    def _dtype(self, tensor: gs.Tensor) -> np.dtype:
        return np.dtype(self.ctx.dtypes.get(tensor.name) or tensor.dtype or np.float32)

    def _note(self, node: gs.Node, text: str) -> None:
        previous = self.docs.get(node.name)
        self.docs[node.name] = (previous + "; " if previous else DOC_PREFIX) + text

    # --- driver ---------------------------------------------------------------------------------

    def apply(self, plan: FoldPlan, migrate: bool = True) -> dict[str, str]:
        """Rewrite the graph in place; returns, per folded norm, a note on its affine."""
        users: dict[Centring, list[str]] = {}
        for decision in plan.folded:
            for centring in decision.centrings:
                users.setdefault(centring, []).append(decision.name)
        folded = [self.zmg.norm_by_name(d.name) for d in plan.folded]
        # Decide migrations on the original graph, before any consumer is rewritten.
        targets = {n.name: self._migration_targets(n) if migrate else None for n in folded}
        for centring, norms in users.items():
            self.centre_layer(centring, norms)
        for insertion in plan.insertions:
            self.insert_centering(insertion)
        notes = {norm.name: self.replace_norm(norm, targets[norm.name]) for norm in folded}
        self.ctx.graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return notes


def migration_targets(ctx: OnnxGraph, graph_outputs: set[str], tensor: gs.Tensor, needs_bias: bool,
                      other=None) -> list | None:
    """Where a per-feature affine on `tensor` (its last axis) can go, or None.

    Every path from `tensor` must reach, through reshapes that keep the feature axis, the input of
    a linear layer that contracts over it (and can take a bias when `needs_bias`); each such layer
    is a target (linear node, input-feature axis of its weight, bias node, bias index).
    `other(consumer, tensor, axis)` may claim a consumer that is not such a layer by returning a
    target of its own (anything not None); by default nothing else is accepted.
    """
    targets = []
    shape = ctx.shapes.get(tensor.name)
    frontier = [(tensor, shape and len(shape) - 1)]
    while frontier:
        current, axis = frontier.pop()
        if current.name in graph_outputs or not current.outputs or axis is None:
            return None
        for consumer in current.outputs:
            if other is not None and (claimed := other(consumer, current, axis)) is not None:
                targets.append(claimed)
                continue
            if consumer.inputs[0] is not current or current in consumer.inputs[1:]:
                return None
            if consumer.op in REGROUP_OPS:
                out = consumer.outputs[0]
                frontier.append((out, regroup_axis(ctx.shapes.get(current.name), ctx.shapes.get(out.name), axis)))
                continue
            target = linear_target(ctx, graph_outputs, consumer, axis, needs_bias)
            if target is None:
                return None
            targets.append(target)
    return targets


def linear_target(ctx: OnnxGraph, graph_outputs: set[str], consumer: gs.Node, axis: int, needs_bias: bool):
    """(node, weight input axis, bias node, bias index) if `consumer` contracts over `axis`."""
    rank = len(ctx.shapes.get(consumer.inputs[0].name) or ())
    weight = consumer.inputs[1] if len(consumer.inputs) > 1 else None
    weight_shape = None if weight is None else ctx.shapes.get(weight.name)
    if weight is None or not is_constant(weight) or weight_shape is None or len(weight_shape) != 2 or axis != rank - 1:
        return None
    if consumer.op == "Gemm" and not consumer.attrs.get("transA", 0):
        if len(consumer.inputs) > 2 and not is_constant(consumer.inputs[2]) or needs_bias and consumer.attrs.get("beta", 1.0) == 0:
            return None
        return consumer, consumer.attrs.get("transB", 0), consumer, 2
    if consumer.op != "MatMul":
        return None
    product = consumer.outputs[0]
    add = product.outputs[0] if len(product.outputs) == 1 and product.name not in graph_outputs else None
    if add is not None and add.op == "Add":
        other = 1 if add.inputs[0] is product else 0
        bias = constant_values(add.inputs[other])
        if bias is not None and bias.shape[-1:] == (weight_shape[1],) and bias.size == weight_shape[1]:
            return consumer, 0, add, other
    return None if needs_bias else (consumer, 0, None, None)
