"""Apply a `FoldPlan` to an ONNX graph: centre weights, insert centrings, swap norms for RMS ops.

* Centring (algebra.centre) of the planned layers' constants, along the axis that indexes their
  output features: Gemm B (axis 1, or 0 with transB) and C, MatMul W (last axis), Conv W and bias
  (axis 0), Gather tables (axis 1), an Einsum's constant operand (the axis its letter produces),
  constants added into the stream.
* LayerScale: a per-channel constant Mul s after a linear layer is absorbed into it first,
  W⊙s and b⊙s, and the Mul is removed once the rewrite is done.
* Copy-on-write: a rewritten constant is a new initializer read only by the rewritten input;
  whatever else read the old one (a tied LM head, a deduplicated bias) still reads the original.
* Affine migration (`onnx/fold/targets.py`): when every consumer of a folded norm is a linear layer with
  constant weights that can take a bias, γ and β move into them and the RMS op keeps only ones as
  its scale; otherwise the RMS op keeps γ, and β moves into the consumers' biases and across
  residual Adds where it can, else stays an Add. `stranded_beta` names the folds that would
  keep that Add, so the pass can leave those norms as LayerNorms.
* RMS ops: `SimplifiedLayerNormalization` (ORT, default), opset-23 `RMSNormalization`, or the
  decomposed chain Mul → ReduceMean → Add → Sqrt → Div. A decomposed LayerNorm with ε outside
  the root, d / (√var + ε), always becomes the chain with Sqrt before the Add: x / (√mean(x²) + ε).
  A `SkipLayerNormalization` becomes `SkipSimplifiedLayerNormalization` with the same skip, bias
  and sum output (plain ONNX: the Adds of x + skip + bias, then the RMS op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ...core.algebra import centre
from ...core.analysis import layer_scale
from ...core.graph import NormInfo, ZeroMeanGraph
from ...core.plan import Centring, FoldPlan, Insertion
from ..graph.constants import constant_values, is_constant
from ..graph.frontend import OnnxGraph, einsum_weight_axis, graph_values
from ..graph.patterns import SKIP_BIAS_INPUT
from ..graph.values import attr, input_at, input_dims, is_initializer, name_of, take_over
from .targets import AffinePlan, Namer, affine_plan, derived_initializer, move_affine, new_initializer, set_input

RMS_OPS = ("simplified", "onnx", "decomposed")
# A map of a constant's output features along an axis (None: the constant is constant along it), e.g.
# `algebra.centre`; every layer's output along that axis changes by the same map (seed 003 §3).
AxisMap = Callable[[np.ndarray, "int | None"], np.ndarray]
MS_DOMAIN = "com.microsoft"
DOC_PREFIX = "normpass: "


def _bias_along(along: AxisMap, values: np.ndarray, out_rank: int, out_axis: int) -> np.ndarray:
    """`along` applied to a bias that broadcasts into an output of rank `out_rank`, along its axis `out_axis`."""
    axis = out_axis - (out_rank - values.ndim)
    return along(values, axis if axis >= 0 and values.shape[axis] != 1 else None)


def new_value(unique: Namer, name: str, dtype: np.dtype | None) -> ir.Value:
    """A new run-time tensor named uniquely after `name`, of `dtype` where known."""
    kind = None if dtype is None else ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype)))
    return ir.Value(name=unique(name), type=kind)


def reduce_mean(
    graph: ir.Graph, unique: Namer, opset: int, tensor: ir.Value, axis: int, out: ir.Value, name: str
) -> ir.Node:
    """ReduceMean of `tensor` over `axis`, keeping dims (axes an input from opset 18, an attribute before)."""
    if opset >= 18:
        axes = new_initializer(graph, unique(f"{name}.axes"), np.array([axis], dtype=np.int64))
        return ir.node("ReduceMean", [tensor, axes], {"keepdims": 1}, outputs=[out], name=unique(name))
    return ir.node("ReduceMean", [tensor], {"axes": [axis], "keepdims": 1}, outputs=[out], name=unique(name))


def rms_nodes(
    graph: ir.Graph,
    unique: Namer,
    opset: int,
    rms_op: str,
    name: str,
    x: ir.Value,
    scale: ir.Value | None,
    out: ir.Value,
    axis: int,
    epsilon: float,
    dtype: np.dtype,
    eps_outside_root: bool = False,
) -> list[ir.Node]:
    """The nodes computing out = x / √(mean(x²) + ε) ⊙ scale over `axis` (`rms_op`, see the module docstring).

    `eps_outside_root`: x / (√mean(x²) + ε), which only the decomposed chain computes. `scale`
    None: no scale, for the decomposed chain only (which then ends at the division). New
    constants go into `graph`; `dtype` is x's.
    """
    attrs = {"axis": axis, "epsilon": epsilon}
    if rms_op in ("simplified", "onnx") and not eps_outside_root:
        op = "SimplifiedLayerNormalization" if rms_op == "simplified" else "RMSNormalization"
        return [ir.node(op, [x, scale], {**attrs, "stash_type": 1}, outputs=[out], name=unique(name))]
    square, mean, inner, root = (new_value(unique, f"{name}.{s}", dtype) for s in ("sq", "ms", "inner", "rms"))
    normed = out if scale is None else new_value(unique, f"{name}.xhat", dtype)
    eps = new_initializer(graph, unique(f"{name}.eps"), np.array(epsilon, dtype=dtype))
    if eps_outside_root:  # √mean + ε
        root_nodes = [
            ir.node("Sqrt", [mean], outputs=[inner], name=unique(f"{name}.sqrt")),
            ir.node("Add", [inner, eps], outputs=[root], name=unique(f"{name}.add_eps")),
        ]
    else:  # √(mean + ε)
        root_nodes = [
            ir.node("Add", [mean, eps], outputs=[inner], name=unique(f"{name}.add_eps")),
            ir.node("Sqrt", [inner], outputs=[root], name=unique(f"{name}.sqrt")),
        ]
    nodes = [
        ir.node("Mul", [x, x], outputs=[square], name=unique(f"{name}.square")),
        reduce_mean(graph, unique, opset, square, axis, mean, f"{name}.mean_square"),
        *root_nodes,
        ir.node("Div", [x, root], outputs=[normed], name=unique(f"{name}.normalize")),
    ]
    if scale is not None:
        nodes.append(ir.node("Mul", [normed, scale], outputs=[out], name=unique(f"{name}.scale")))
    return nodes


@dataclass(frozen=True)
class AbsorbedScale:
    """A LayerScale `Mul` whose factor went into `layers` (the linear layer, and its bias `Add` if any);
    its data input is `mul.inputs[data_index]`."""

    mul: ir.Node
    data_index: int
    layers: list[str]


@dataclass
class Rewriter:
    ctx: OnnxGraph
    zmg: ZeroMeanGraph
    rms_op: str = "simplified"
    lazy_weights: ClassVar[bool] = True  # large derived weights computed when written (they keep their shape)

    def __post_init__(self) -> None:
        self.docs: dict[str, str] = {}  # node name → what normpass did to it (→ NodeProto.doc_string)
        self._copies: dict[tuple[str, str], ir.Value] = {}
        self._loaded: dict[str, np.ndarray] = {}
        self._affines: dict[str, AffinePlan] = {}
        self._unique = Namer(self.ctx.graph)
        self._layer_scales: dict[str, AbsorbedScale] = {}  # by the Mul's name

    # --- constants, copy-on-write ---------------------------------------------------------------

    def _replace_input(
        self, node: ir.Node, index: int, transform: str, make, change: str = "rewritten", axis: int | None = None
    ) -> None:
        """Point `node.inputs[index]` at a new constant `make(old values)`, shared per transform (a large one is
        computed when written, slab by slab where `make` acts on each fibre along `axis` alone:
        `targets.derived_initializer`, which refuses values that overflow, naming the old constant and
        `change`, e.g. "centred for ln")."""
        old = node.inputs[index]
        assert old is not None, f"{node.name}: input {index} is absent"  # the plan names present inputs only
        key = (name_of(old), transform)
        if key not in self._copies:
            name = self._unique(f"{old.name}.{transform.split(':')[0]}")
            self._copies[key] = derived_initializer(
                self.ctx.graph, name, old, make, change, lazy=self.lazy_weights, axis=axis
            )
        set_input(node, index, self._copies[key])

    def centre_layer(self, centring: Centring, norms: list[str]) -> None:
        """Centre `centring`'s layer or constant; weighted by its `weight` w where it has one,
        W' = W − w⁻¹ ⊗ mean_k(w ⊙ W) (`algebra.centre`)."""
        change = f"centred for {', '.join(norms)}"
        if centring.weight is None:
            self.map_layer(centring, centre, "centred", change)
            return
        weight = np.ravel(self.zmg.constant(centring.weight))

        def weighted(values: np.ndarray, axis: int | None) -> np.ndarray:
            assert axis is not None  # the proof weights no constant, nor Gemm bias, broadcast along the features
            return centre(values, axis, weight)

        self.map_layer(centring, weighted, f"centred/{centring.weight}", f"{change}, weighted by {centring.weight}")

    def map_layer(self, centring: Centring, along: AxisMap, tag: str, change: str) -> None:
        """Apply `along` to the output features of the layer or constant `centring` names (copy-on-write).

        The copies are shared per (constant, `tag`, axis): give each distinct map its own `tag`. `change`
        says what was done, for the node's note and for a refusal ("centred for ln_1").
        """
        node: ir.Node = self.zmg.nodes[centring.node].ref
        if centring.input_index is not None:  # found by name: a node's model may list a subset of its inputs
            index = next(i for i, t in enumerate(node.inputs) if t is not None and t.name == centring.tensor)
            self._replace_input(
                node, index, f"{tag}:{centring.axis}", lambda v: along(v, centring.axis), change, centring.axis
            )
        elif node.op_type == "Gemm":
            axis = 1 - attr(node, "transB", 0)
            self._replace_input(node, 1, f"{tag}:{axis}", lambda v: along(v, axis), change, axis)
            if input_at(node, 2) is not None:
                self._replace_input(node, 2, f"{tag}:bias", lambda v: _bias_along(along, v, 2, 1), change)
        elif node.op_type == "MatMul":
            self._replace_input(node, 1, f"{tag}:-1", lambda v: along(v, v.ndim - 1), change, -1)
        elif node.op_type == "Conv":
            self._replace_input(node, 1, f"{tag}:0", lambda v: along(v, 0), change, 0)
            if input_at(node, 2) is not None:
                self._replace_input(node, 2, f"{tag}:0", lambda v: along(v, 0), change)
        elif node.op_type == "Gather":
            self._replace_input(node, 0, f"{tag}:1", lambda v: along(v, 1), change, 1)
        elif node.op_type == "Mul":
            self._absorb_layer_scale(centring, along, tag, change)
        elif node.op_type == "Einsum":
            index = 0 if is_constant(node.inputs[0]) else 1
            assert centring.axis is not None  # a layer's centring is along an axis
            axis = einsum_weight_axis(attr(node, "equation"), index, centring.axis)
            self._replace_input(node, index, f"{tag}:{axis}", lambda v: along(v, axis), change, axis)
        else:
            raise TypeError(f"no rule to map the output features of {node.op_type} {node.name}")
        self._note(name_of(node), f"weights {change}")

    def _absorb_layer_scale(self, centring: Centring, along: AxisMap, tag: str, change: str) -> None:
        """(x·W + b)⊙s → x·along(W⊙s) + along(b⊙s), and the Mul's factor becomes ones (`apply` then
        removes the Mul: `remove_layer_scales`)."""
        mul, axis = self.zmg.nodes[centring.node], centring.axis
        found = layer_scale(self.zmg, mul, axis) if axis is not None else None
        assert axis is not None and found is not None  # planned only where `layer_scale` matched
        factor_index, linear, add = found
        node, scale = linear.ref, np.ravel(self._values(mul.ref.inputs[factor_index]))
        out_axis = {"MatMul": -1, "Gemm": 1 - attr(node, "transB", 0), "Conv": 0}[node.op_type]

        def scaled(values, axis):
            shape = [1] * values.ndim
            shape[axis] = -1
            return (values * scale.reshape(shape)).astype(values.dtype)

        scaling, scaled_change = f"scaled:{mul.name}", f"scaled by LayerScale {mul.name}"
        absorbed = bool(np.all(scale == 1))  # by an earlier pass (a fold before a rotation): only `along` is left
        if not absorbed:
            self._replace_input(node, 1, scaling, lambda v: scaled(v, out_axis), scaled_change, out_axis)
        if node.op_type != "MatMul" and input_at(node, 2) is not None and not absorbed:
            self._replace_input(node, 2, scaling, lambda v: (v * scale).astype(v.dtype), scaled_change)
        if add is not None:
            index = next(i for i, t in enumerate(add.inputs) if self.zmg.is_constant(t))
            out_rank = len(self.zmg.shape(add.outputs[0]) or ())  # known: the proof read it
            factor = self._values(mul.ref.inputs[factor_index])
            self._replace_input(
                add.ref,
                index,
                f"{scaling}:{tag}",
                lambda v: _bias_along(along, np.asarray(v * factor, dtype=v.dtype), out_rank, axis),
                f"{scaled_change} and {change}",
            )
        self.map_layer(Centring(linear.name, axis), along, tag, change)
        if not absorbed:
            self._replace_input(mul.ref, factor_index, "absorbed", np.ones_like, "replaced by ones")
        layers = [linear.name] + ([add.name] if add is not None else [])
        self._layer_scales[mul.name] = AbsorbedScale(mul.ref, 1 - factor_index, layers)
        self._note(mul.name, f"LayerScale absorbed into {linear.name} (weights {change})")

    def rewritten_for(self, node: str) -> list[str]:
        """The nodes a centring of `node` rewrote: the layers that took an absorbed LayerScale's factor,
        else `node` itself."""
        absorbed = self._layer_scales.get(node)
        return [node] if absorbed is None else absorbed.layers

    def remove_layer_scales(self) -> None:
        """Drop each absorbed LayerScale's `Mul` (its factor is ones now): its readers read its data input,
        where that keeps every shape (the factor's rank at most the data's, by `layer_scale`'s match and
        inference) and every graph output. The note stays on the layer that took the scale."""
        for absorbed in self._layer_scales.values():
            mul, index = absorbed.mul, absorbed.data_index
            data, out = mul.inputs[index], mul.outputs[0]
            factor = mul.inputs[1 - index]
            rank = len(self.ctx.shapes.get(name_of(data)) or ())
            if data is None or factor is None or not rank or len(factor.shape or ()) > rank:
                continue
            if not out.is_graph_output():
                out.replace_all_uses_with(data)
            elif not (data.is_graph_input() or data.is_graph_output() or is_initializer(data)):
                take_over(out, data)

    # --- inserted centring ----------------------------------------------------------------------

    def insert_centering(self, insertion: Insertion) -> None:
        graph = self.ctx.graph
        tensor = next(t for t in graph_values(graph) if t.name == insertion.tensor)
        uses = list(tensor.uses())  # a reader inside a body too
        dtype = self._dtype(tensor)
        mean = self._new_value(f"{tensor.name}.mean", dtype)
        centred = self._new_value(f"{tensor.name}.centred", dtype)
        centred.shape = tensor.shape
        graph.append(
            reduce_mean(
                graph, self._unique, self.ctx.opset, tensor, insertion.axis, mean, f"{tensor.name}.centring_mean"
            )
        )
        sub = ir.node("Sub", [tensor, mean], outputs=[centred], name=self._unique(f"{tensor.name}.centring"))
        self._note(name_of(sub), "inserted centring x − mean(x)")
        graph.append(sub)
        for use in uses:
            use.node.replace_input_with(use.idx, centred)

    def _new_value(self, name: str, dtype: np.dtype | None, shape: ir.Shape | None = None) -> ir.Value:
        value = new_value(self._unique, name, dtype)
        value.shape = shape
        return value

    def _known_shape(self, value: ir.Value) -> ir.Shape | None:
        """`value`'s shape as the analysis knew it (static sizes and the graph inputs' named dimensions), for a
        tensor that replaces it: the outputs of an RMS op from ONNX Runtime's domain and of a β Add after one,
        whose shapes ONNX's inference cannot find again (ONNX Runtime's may fail on the model), keep it."""
        shape = self.ctx.shape_of(value)
        if shape is None:
            return None
        named = input_dims(self.ctx.graph)
        return ir.Shape([d if isinstance(d, int) or d in named else None for d in shape])

    # --- norms ----------------------------------------------------------------------------------

    def _width(self, norm: NormInfo) -> int | None:
        """The number of features: the input's static last dim (as analysed: an earlier rewrite may have
        given the norm a new input value, e.g. the output of a norm folded before it), else γ's or β's length."""
        for name in (norm.ref.x.name, norm.input):
            width = (self.ctx.shapes.get(name) or (None,))[-1]
            if isinstance(width, int):
                return width
        vectors = [self._values(t) for t in (norm.ref.gamma, norm.ref.beta) if t is not None]
        return next((v.shape[-1] for v in vectors if v.ndim and v.shape[-1] > 1), None)

    def _feature_vector(self, norm: NormInfo, tensor: ir.Value | None) -> np.ndarray | None:
        """γ or β as one value per feature (a decomposed norm may scale by a scalar or a [1, 1, d] tensor)."""
        if tensor is None:
            return None
        values, width = self._values(tensor), self._width(norm)
        return values if width is None else np.broadcast_to(values, values.shape[:-1] + (width,)).reshape(width)

    def _beta(self, norm: NormInfo) -> np.ndarray | None:
        """The norm's β, or None when it has none or it is all zeros."""
        beta = self._feature_vector(norm, norm.ref.beta)
        return beta if beta is not None and np.any(beta != 0) else None

    def affine_plan(self, norm: NormInfo) -> AffinePlan:
        """Where the folded norm's γ/β can go, decided once, on the graph before any rewrite."""
        if norm.name not in self._affines:
            self._affines[norm.name] = affine_plan(
                self.ctx, self.zmg.graph_outputs, norm.ref.y, self._width(norm), self._beta(norm) is not None
            )
        return self._affines[norm.name]

    def stranded_beta(self, plan: FoldPlan) -> dict[str, str]:
        """Folded norms whose non-zero β could go nowhere and would stay a separate Add, with why."""
        stranded = {}
        for decision in plan.folded:
            norm = self.zmg.norm_by_name(decision.name)
            affine = self.affine_plan(norm)
            if self._beta(norm) is not None and affine.full is None and affine.beta is None:
                stranded[decision.name] = (
                    "proven foldable, kept as a LayerNorm: its β has no linear layer or residual bias to move into, "
                    "and RMSNorm plus a separate β Add costs more than the LayerNorm "
                    "(--fold-with-beta-add folds it anyway)"
                )
        return stranded

    def replace_norm(self, norm: NormInfo, affine: AffinePlan | None) -> str:
        """Swap the norm for an RMS op, moving γ/β per `affine` (None: keep both); returns a note."""
        match = norm.ref
        x, y = match.nodes[0].inputs[0], match.y  # x may have been rewired to an inserted centring
        skip = None if match.skip is None else self._skip_operands(match)
        gamma = self._feature_vector(norm, match.gamma)
        beta = self._beta(norm)
        moved_to, moved = [], ""
        if affine is not None and affine.full is not None:
            moved_to, moved = move_affine(self.ctx.graph, affine.full, gamma, beta, self._unique), "γ/β"
            gamma = beta = None
        elif affine is not None and affine.beta is not None and beta is not None:
            moved_to, moved = move_affine(self.ctx.graph, affine.beta, None, beta, self._unique), "β"
            beta = None
        for name in moved_to:
            self._note(name, f"absorbed {moved} of {norm.name}")
        if moved == "γ/β":
            note = "γ/β migrated into " + ", ".join(moved_to)
        else:
            note = "γ kept in the RMS op" + (", β migrated into " + ", ".join(moved_to) if moved_to else "")
            note += ", β kept as an Add" if beta is not None else ""
        original_gamma = self._feature_vector(norm, match.gamma)
        # x may be an inserted centring, or of a type inference does not reach (past a model-local function)
        dtype = original_gamma.dtype if original_gamma is not None else self._dtype(match.x, y)
        scale = gamma
        if scale is None:
            width = self._width(norm)
            assert width is not None  # the proof read the input's shape
            scale = np.ones(width, dtype=dtype)
        out = self._new_value(y.name, self._dtype(y), self._known_shape(y))
        rms_out = out if beta is None else self._new_value(f"{y.name}.rms", self._dtype(y), self._known_shape(y))
        doc = f"LayerNorm {norm.name} folded into an RMSNorm (input proven zero-mean); {note}"
        scale_const = new_initializer(
            self.ctx.graph, self._unique(f"{norm.name}.rms_scale"), np.asarray(scale, dtype=dtype)
        )
        nodes = self._rms_nodes(norm, x, scale_const, rms_out, skip)
        if beta is not None:
            add_name = self._unique(f"{norm.name}.beta")  # the Add is named X.beta, its constant after it
            beta_const = new_initializer(self.ctx.graph, self._unique(f"{norm.name}.beta"), beta)
            nodes.append(ir.node("Add", [rms_out, beta_const], outputs=[out], name=add_name))
        for node in nodes:
            self._note(name_of(node), doc)
        self.ctx.graph.extend(nodes)
        take_over(y, out)
        if skip is not None and skip[1] is not None and skip[2] is not None:
            take_over(skip[1], skip[2])
        self.ctx.graph.remove(match.nodes, safe=True)
        return note

    def _skip_operands(self, match) -> tuple[list[ir.Value], ir.Value | None, ir.Value | None]:
        """A SkipLayerNormalization's (skip, [bias]) as they are now (the bias may be a centred copy), its sum
        output, and a new tensor to take the sum's place."""
        node = match.nodes[0]
        bias = input_at(node, SKIP_BIAS_INPUT[node.op_type])
        total = None if match.skip_sum is None else self._new_value(match.skip_sum.name, self._dtype(match.skip_sum))
        return [node.inputs[1]] + ([bias] if bias is not None else []), match.skip_sum, total

    def _rms_nodes(self, norm: NormInfo, x, scale, out, skip=None) -> list[ir.Node]:
        """RMS op(s) normalizing x (or, for a Skip op, x + skip + bias, written to its new sum tensor)."""
        dtype = self._dtype(x)
        if skip is not None:
            operands, _, total = skip
            if self.rms_op == "simplified":
                outputs = [out] + ([ir.Value(name=""), ir.Value(name=""), total] if total is not None else [])
                return [
                    ir.node(
                        "SkipSimplifiedLayerNormalization",
                        [x, operands[0], scale] + operands[1:],
                        {"epsilon": norm.epsilon},
                        outputs=outputs,
                        domain=MS_DOMAIN,
                        name=self._unique(norm.name),
                    )
                ]
            adds = []
            for index, operand in enumerate(operands):
                last = index == len(operands) - 1
                summed = total if last and total is not None else self._new_value(f"{norm.name}.sum", dtype)
                adds.append(ir.node("Add", [x, operand], outputs=[summed], name=self._unique(f"{norm.name}.add")))
                x = summed
            return adds + self._rms_nodes(norm, x, scale, out)
        # no RMS op computes x / (√mean(x²) + ε): only the chain is exact
        assert norm.axis is not None  # a folded norm normalizes one axis
        return rms_nodes(
            self.ctx.graph,
            self._unique,
            self.ctx.opset,
            self.rms_op,
            norm.name,
            x,
            scale,
            out,
            norm.axis,
            norm.epsilon,
            self._dtype(norm.ref.x),
            norm.ref.eps_outside_root,
        )

    def _values(self, tensor: ir.Value) -> np.ndarray:
        """A constant's values, loaded once per rewrite (read-only); the plan reads constants only."""
        name = name_of(tensor)
        if name not in self._loaded:
            values = constant_values(tensor)
            if values is None:
                raise TypeError(f"{name} is not a constant")
            self._loaded[name] = values
        return self._loaded[name]

    def _dtype(self, *tensors: ir.Value) -> np.dtype:
        """The element type of the first of `tensors` whose type inference or the model knows (one norm's input and
        output share it), float32 where none is known."""
        for tensor in tensors:
            known = self.ctx.dtypes.get(name_of(tensor))
            if known is not None:
                return np.dtype(known)
            if tensor.dtype is not None:
                return np.dtype(tensor.dtype.numpy())
        return np.dtype(np.float32)

    def _note(self, name: str, text: str) -> None:
        previous = self.docs.get(name)
        self.docs[name] = (previous + "; " if previous else DOC_PREFIX) + text

    # --- driver ---------------------------------------------------------------------------------

    def apply(self, plan: FoldPlan, migrate: bool = True) -> dict[str, str]:
        """Rewrite the graph in place; returns, per folded norm, a note on its affine."""
        users: dict[Centring, list[str]] = {}
        for decision in plan.folded:
            for centring in decision.centrings:
                users.setdefault(centring, []).append(decision.name)
        folded = [self.zmg.norm_by_name(d.name) for d in plan.folded]
        # Decide migrations on the original graph, before any consumer is rewritten.
        affines = {n.name: self.affine_plan(n) if migrate else None for n in folded}
        for centring, norms in users.items():
            self.centre_layer(centring, norms)
        for insertion in plan.insertions:
            self.insert_centering(insertion)
        notes = {norm.name: self.replace_norm(norm, affines[norm.name]) for norm in folded}
        self.remove_layer_scales()
        RemoveUnusedNodesPass()(self.ctx.model)
        self.ctx.graph.sort()
        return notes
