"""Cut a proven residual stream of a folded ONNX graph to its first k principal directions (in place).

A stream the rotation proof accepts (`core/rotation.py`) is rotated by the rotation's own rewriter
(`rotate/rotator.Rotator.rotate_stream`) with a d×k matrix Q_k instead of a square Q: every writer's
output features `W → W·Q_k` (biases `b·Q_k`, embedding and position tables and class tokens row-wise,
LayerScales absorbed first), every reader's input features `W → Q_kᵀ·diag(γ)·W`. What is left for this
module (DESIGN §2c, `core/pca.py`):

* **The RMS ops** of the stream normalize k columns: γ (uniform on a proven stream, or ones where the
  rotation moved it into the readers) becomes its first k entries times √(d/k), ε becomes ε·d/k (ε·√(d/k)
  in a chain computing x / (√mean(x²) + ε)), so that each keeps the dense model's scale.
* **Shapes.** Every tensor of the stream has k features along its axis: its recorded shape says so, and a
  `Reshape` or `Expand` inside the stream whose constant target shape names d there names k instead.
* **A β after a norm** (the fold keeps it as an `Add` when no reader can take it as a bias, e.g. before a
  bias-less LM head) is not part of what the basis was fitted on: its part outside the kept columns,
  r = (β⊘γ)·(I − Q_k·Q_kᵀ), would be lost. Each reader it reaches through layout ops alone takes it as a
  bias instead, r·diag(γ)·W (SliceGPT gives such a head a bias too): into a `Gemm`'s C, the constant of a
  `MatMul`'s bias `Add`, or one inserted `Add` after a `MatMul` that has none (the only op slicing adds).

Every changed constant is a new initializer (copy-on-write, computed now: its shape changes), shared by the
uses that take the same map, so weights tied before stay tied where their uses are cut alike.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ...core.graph import NormInfo, ZeroMeanGraph
from ...core.layers import Shortcut
from ...core.pca import rms_rescale
from ...core.rotation import Stream, gamma_of
from ..fold.targets import new_initializer, set_input
from ..graph.constants import constant_values
from ..graph.frontend import OnnxGraph, graph_values
from ..graph.values import input_at, name_of, take_over
from ..rotate.rotator import Rotator, reader_weight

LAYOUT_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Slice", "Gather", "Expand")
SINGLE_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")
RESHAPING = {"Reshape": 1, "Expand": 1}  # op → the input holding its target shape
# op → the outputs whose shape follows a narrowed input's (empty: all): elementwise ops, and the RMS ops'
# normalized output (and a Skip op's sum, output 3); their statistics (outputs 1, 2) keep 1 on the axis
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Abs", "Cast", "CastLike", "Identity")
FOLLOWING: dict[str, tuple[int, ...]] = {op: () for op in ELEMENTWISE} | {
    "SimplifiedLayerNormalization": (0,),
    "RMSNormalization": (0,),
    "SkipSimplifiedLayerNormalization": (0, 3),
}


def slice_refusal(zmg: ZeroMeanGraph, stream: Stream) -> str | None:
    """Why a stream the rotation accepts cannot be cut here (its RMS ops must carry the rescale), or None."""
    for name in stream.norms:
        norm = zmg.norm_by_name(name)
        if norm.scale is None or not zmg.is_constant(norm.scale):
            return f"{norm.op} {norm.name} has no constant γ to carry the rescale √(d/k) of a sliced RMS op"
        if norm.epsilon and _epsilon_site(norm) is None:
            return (
                f"{norm.op} {norm.name}: its ε is not an attribute or a constant of one Add, so it cannot be rescaled"
            )
    return None


def _epsilon_site(norm: NormInfo) -> tuple[ir.Node, int | None] | None:
    """Where the norm's ε is: (its op, None) for an attribute, (the Add, input index) in a chain; None: unknown."""
    match = norm.ref
    if len(match.nodes) == 1 and match.nodes[0].op_type in SINGLE_OPS:
        return match.nodes[0], None
    for node in match.nodes:
        if node.op_type != "Add":
            continue
        for index, value in enumerate(node.inputs):
            values = constant_values(value)
            if values is not None and values.size == 1 and np.isclose(float(values.ravel()[0]), norm.epsilon):
                return node, index
    return None


class Slicer(Rotator):
    """The rotation's rewriter, cutting streams instead of rotating them (the module docstring)."""

    lazy_weights = False  # a cut weight changes its shape: computed now, not when written

    def cut_stream(self, stream: Stream, basis: np.ndarray, label: str) -> None:
        """Cut `stream` (accepted by the proof and by `slice_refusal`) to the columns of `basis` (d×k, orthonormal)."""
        assert stream.width is not None  # a stream without a static width is refused
        width, kept = stream.width, basis.shape[1]
        gamma_factor, eps_factor = rms_rescale(width, kept)
        carried = self._carried_constants(stream, basis) if kept < width else {}
        for name in stream.norms:  # first: the rotation then finds γ replaced and leaves it (see rotate_stream)
            moved = name in stream.moved_gamma
            self._rescale_norm(self.zmg.norm_by_name(name), moved, width, kept, (gamma_factor, eps_factor), label)
        self.rotate_stream(stream, basis, label)
        for reader, bias in carried.values():
            self._add_bias(reader, bias, label)
        if kept < width:
            self._cut_shapes(stream, width, kept, label)

    def _rescale_norm(
        self, norm: NormInfo, moved: bool, width: int, kept: int, factors: tuple[float, float], label: str
    ) -> None:
        """γ → its first k entries·√(d/k) (ones·√(d/k) where the rotation moves γ into the readers), ε → ε·d/k."""
        match = norm.ref
        gamma_factor, eps_factor = factors

        def sliced_gamma(values: np.ndarray) -> np.ndarray:
            flat = np.ones(values.size, values.dtype) if moved else np.ravel(values)
            cut = flat[:kept] if flat.size == width else flat  # a uniform γ: any k of its entries
            shape = tuple(kept if d == width else d for d in values.shape) if flat.size == width else values.shape
            return (cut.astype(np.float64) * gamma_factor).astype(values.dtype).reshape(shape)

        for node in match.nodes:
            for index, value in enumerate(node.inputs):
                if value is match.gamma:
                    tag = f"sliced:{label}:{'unit' if moved else 'uniform'}"
                    self._replace_input(node, index, tag, sliced_gamma, "sliced: γ·√(d/k) over k columns")
        site = _epsilon_site(norm)
        if site is None:  # ε = 0 (`slice_refusal` refuses the stream otherwise): nothing to rescale
            return
        eps_node, eps_index = site
        factor = gamma_factor if match.eps_outside_root else eps_factor
        if eps_index is None:
            eps_node.attributes["epsilon"] = ir.AttrFloat32("epsilon", norm.epsilon * factor)
        else:
            self._replace_input(
                eps_node, eps_index, f"sliced_eps:{label}", lambda v: (v * factor).astype(v.dtype), "sliced: ε·d/k"
            )
        self._note(name_of(eps_node), f"normalizes {kept} of {width} columns: γ·√(d/k), ε·{factor:.4g}")

    def add_shortcut(self, shortcut: Shortcut, matrix: np.ndarray) -> str:
        """Change the basis of the operand of a residual sum that comes from another piece (`core/layers.py`):
        one inserted MatMul by the k_a×k_b `matrix` Q_a,kᵀ·Q_b,k on that edge (k_b = d and Q_b = I where the
        target piece is left whole). Returns the name of the tensor the sum now reads."""
        node = self.zmg.nodes[shortcut.node].ref
        index = next(i for i, v in enumerate(node.inputs) if v is not None and v.name == shortcut.tensor)
        operand = node.inputs[index]
        dtype = self._dtype(operand)
        weight = new_initializer(self.ctx.graph, self._unique(f"{shortcut.tensor}.shortcut"), matrix.astype(dtype))
        changed = self._new_value(f"{shortcut.tensor}.shortcut", dtype)
        if operand.shape is not None:  # the shortcut acts on the last axis (`driver._pieces`)
            changed.shape = ir.Shape([*list(operand.shape)[:-1], matrix.shape[1]])
        self.ctx.dtypes[name_of(changed)] = dtype
        name = self._unique(f"{shortcut.node}.shortcut")
        self.ctx.graph.insert_before(node, ir.node("MatMul", [operand, weight], outputs=[changed], name=name))
        node.replace_input_with(index, changed)
        self._note(name, f"shortcut from the basis of {shortcut.source} to that of {shortcut.target}")
        return name_of(changed)

    def _carried_constants(self, stream: Stream, basis: np.ndarray) -> dict[str, tuple[ir.Node, np.ndarray]]:
        """Per reader (by name): the bias that carries what the cut drops of the constants added after a norm
        that keeps γ (the module docstring), computed from the weights before the cut."""
        carried: dict[str, tuple[ir.Node, np.ndarray]] = {}
        for centring, tag in stream.writers.items():
            adder = self.zmg.nodes[centring.node].ref
            if tag is None or adder.op_type != "Add" or centring.tensor is None:
                continue
            constant = constant_values(next(v for v in adder.inputs if v is not None and v.name == centring.tensor))
            if constant is None or constant.size != basis.shape[0]:  # not one vector along the stream's axis
                continue
            gamma = gamma_of(self.zmg, self.zmg.norm_by_name(tag)).astype(np.float64)
            scaled = np.ravel(constant).astype(np.float64) / gamma
            dropped = (scaled - (scaled @ basis) @ basis.T) * gamma
            for reader in stream.readers:
                node = self.zmg.nodes[reader.node].ref
                found = reader_weight(self.ctx, node, reader.index, reader.axis)
                if reader.scale != tag or found is None or not _reads(node.inputs[reader.index], adder.outputs[0]):
                    continue
                weight = constant_values(node.inputs[found[0]])
                if weight is None or weight.ndim != 2:
                    continue
                bias = np.moveaxis(weight.astype(np.float64), found[1], 0).T @ dropped
                previous = carried.get(reader.node, (node, 0.0))[1]
                carried[reader.node] = (node, previous + bias)
        return carried

    def _add_bias(self, node: ir.Node, bias: np.ndarray, label: str) -> None:
        """Add `bias` (one value per output feature) to the output of the linear layer `node`."""
        out = node.outputs[0]
        dtype = self._dtype(out)
        note = f"bias carries the β the cut drops from its input ({label})"
        if node.op_type == "Gemm":
            if input_at(node, 2) is None:
                set_input(
                    node, 2, new_initializer(self.ctx.graph, self._unique(f"{name_of(node)}.bias"), bias.astype(dtype))
                )
            else:
                self._replace_input(node, 2, f"carried:{label}", lambda v: (v + bias).astype(v.dtype), note)
            self._note(name_of(node), note)
            return
        users = list(out.uses())
        if len(users) == 1 and not out.is_graph_output() and users[0].node.op_type == "Add":
            add = users[0].node
            other = 1 - users[0].idx
            values = constant_values(add.inputs[other])
            if values is not None and np.broadcast_shapes(values.shape, bias.shape)[-1:] == bias.shape:
                self._replace_input(add, other, f"carried:{label}", lambda v: (v + bias).astype(v.dtype), note)
                self._note(name_of(add), note)
                return
        biased = self._new_value(name_of(out), dtype)
        take_over(out, biased)
        out.name = self._unique(f"{biased.name}.unbiased")
        constant = new_initializer(self.ctx.graph, self._unique(f"{name_of(node)}.bias"), bias.astype(dtype))
        add = ir.node("Add", [out, constant], outputs=[biased], name=self._unique(f"{name_of(node)}.bias"))
        self.ctx.graph.insert_after(node, add)
        self._note(name_of(add), note)

    def _cut_shapes(self, stream: Stream, width: int, kept: int, label: str) -> None:
        """Every value the cut narrows says k: the stream's tensors, and what is computed from them elementwise
        (`_narrow_followers`); every target shape inside the stream that names d names k."""
        axes = dict(stream.states)
        values = {value.name: value for value in graph_values(self.ctx.graph)}
        narrowed = []
        for tensor, axis in stream.states:
            value = values.get(tensor)
            shape = None if value is None else value.shape or self.ctx.shapes.get(tensor)
            if value is not None and shape is not None and self._narrow(value, axis - len(shape), width, kept):
                narrowed.append((value, axis - len(shape)))
        self._narrow_followers(narrowed, width, kept)
        for node in list(self.ctx.graph):
            position = RESHAPING.get(node.op_type)
            out = node.outputs[0].name if node.outputs else None
            if position is not None and out in axes and position < len(node.inputs):
                rank = len(self.ctx.shapes.get(out) or ())
                self._retarget(node, position, axes[out] - rank, width, kept, label)

    def _narrow(self, value: ir.Value, axis: int, width: int, kept: int) -> bool:
        """Declared (value_info) and inferred shape of `value` say `kept` at `axis` (negative: from the end) where
        they said `width`; whether either did."""
        known, shape = self.ctx.shapes.get(name_of(value)), value.shape
        changed = False
        if known is not None and -len(known) <= axis < 0 and known[axis] == width:
            self.ctx.shapes[name_of(value)] = _with(known, axis, kept)
            changed = True
        if shape is not None and -len(shape) <= axis < 0 and shape[axis] == width:
            value.shape = ir.Shape(_with(tuple(shape), axis, kept))
            changed = True
        return changed

    def _narrow_followers(self, narrowed: list[tuple[ir.Value, int]], width: int, kept: int) -> None:
        """What the cut narrows beyond the stream's own tensors: the outputs of elementwise ops and of RMS ops
        (a decomposed RMSNorm's Pow and Mul, a fused op's output and sum) computed from a narrowed value, where
        their declared shape says `width` at its axis (counted from the end, as broadcasting aligns). Left at d,
        such a declaration contradicts what the node computes: ONNX Runtime warns and strict shape inference
        (normpass's own loader) refuses the model."""
        pending = list(narrowed)
        while pending:
            value, axis = pending.pop()
            for use in value.uses():
                node = use.node
                outputs = FOLLOWING.get(node.op_type)
                if outputs is None or (node.domain not in ("", "ai.onnx") and node.op_type not in SINGLE_OPS):
                    continue
                for index in outputs or range(len(node.outputs)):
                    out = node.outputs[index] if index < len(node.outputs) else None
                    if out is not None and self._narrow(out, axis, width, kept):
                        pending.append((out, axis))

    def pin_width(self, piece: Stream, width: int, label: str) -> None:
        """Name `width` on the stream's axis of every target shape of `piece` computed at run time (a `Reshape`
        or `Expand` whose target is no constant): Mul by a mask, Add `width` there. Such a target reads the
        `Shape` of another tensor of the stream — OPT's TorchScript export restores [batch, seq, d] after its
        MLP from the shape taken before it flattened the stream, in another piece. Once every piece has the
        same width that shape is right; in the sequential fit's models (`driver.sequential_covariances`),
        where the earlier pieces are cut to k and the later ones whole, it is not."""
        axes = dict(piece.states)
        for node in list(self.ctx.graph):
            position = RESHAPING.get(node.op_type)
            out = node.outputs[0].name if node.outputs else None
            if position is None or out not in axes or position >= len(node.inputs):
                continue
            target, rank = node.inputs[position], len(self.ctx.shapes.get(out) or ())
            if target is None or not rank or constant_values(target) is not None:
                continue
            keep = np.ones(rank, np.int64)
            keep[axes[out]] = 0
            masked = self._new_value(f"{name_of(target)}.masked", np.dtype(np.int64))
            pinned = self._new_value(f"{name_of(target)}.pinned", np.dtype(np.int64))
            graph, name = self.ctx.graph, self._unique(f"{name_of(node)}.pinned")
            inputs = [new_initializer(graph, self._unique(f"{name}.mask"), keep)]
            mask = ir.node("Mul", [target, *inputs], outputs=[masked], name=self._unique(f"{name}.mask"))
            inputs = [new_initializer(graph, self._unique(f"{name}.width"), (1 - keep) * width)]
            add = ir.node("Add", [masked, *inputs], outputs=[pinned], name=name)
            graph.insert_before(node, [mask, add])
            node.replace_input_with(position, pinned)
            self._note(name_of(node), f"target shape names {width} features on the stream's axis ({label})")

    def _retarget(self, node: ir.Node, position: int, at: int, width: int, kept: int, label: str) -> None:
        """Where the target shape of `node` (its input `position`) names `width` at `at` (counted from the end),
        name `kept`: a constant is copied; a `Concat` of pieces (ONNX exports build shapes from `Shape` and
        constants) gets a copy of its own with the constant piece changed. A piece computed at run time is
        left: it is computed from the sliced tensors themselves."""
        target = node.inputs[position]
        if target is None:
            return
        values = constant_values(target)
        if values is not None:
            if -values.size <= at and values.ravel()[at] == width:
                self._replace_input(node, position, f"sliced_shape:{label}:{at}", _named(at, kept), f"sliced to {kept}")
                self._note(name_of(node), f"target shape names {kept} features of the sliced stream, not {width}")
            return
        concat = target.producer()
        if concat is None or concat.op_type != "Concat":
            return
        pieces = [constant_values(piece) for piece in concat.inputs]
        lengths = [_length(self.ctx, p) if v is None else v.size for p, v in zip(concat.inputs, pieces, strict=True)]
        end = 0
        for index in range(len(pieces) - 1, -1, -1):
            length = lengths[index]
            if not length:
                return
            if end - length <= at < end:
                piece = pieces[index]
                offset = at - end
                if piece is None or piece.ravel()[offset] != width:
                    return
                changed = new_initializer(
                    self.ctx.graph, self._unique(f"{concat.name}.sliced"), _named(offset, kept)(piece)
                )
                inputs = list(concat.inputs)
                inputs[index] = changed
                shape = self._new_value(f"{name_of(target)}.sliced", np.dtype(np.int64))
                copy = ir.node(
                    "Concat", inputs, {"axis": 0}, outputs=[shape], name=self._unique(f"{concat.name}.sliced")
                )
                self.ctx.graph.insert_before(node, copy)
                node.replace_input_with(position, shape)
                self._note(name_of(node), f"target shape names {kept} features of the sliced stream, not {width}")
                return
            end -= length


def _reads(value: ir.Value | None, source: ir.Value) -> bool:
    """Whether `value` is `source` or made from it by layout ops alone (no other operand, no arithmetic)."""
    while value is not None and value is not source:
        producer = value.producer()
        if producer is None or producer.op_type not in LAYOUT_OPS:
            return False
        value = producer.inputs[0]
    return value is source


def _length(ctx: OnnxGraph, value: ir.Value | None) -> int | None:
    """The static length of a 1-D tensor, or None."""
    shape = None if value is None else ctx.shapes.get(name_of(value))
    return shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None


def _with(shape: tuple, axis: int, size) -> tuple:
    """`shape` with entry `axis` (negative: from the end) replaced by `size`."""
    dims = list(shape)
    dims[axis] = size
    return tuple(dims)


def _named(at: int, kept: int):
    """A map of a shape constant: entry `at` (negative: from the end) becomes `kept`."""

    def change(values: np.ndarray) -> np.ndarray:
        copy = np.array(values)
        copy.reshape(-1)[at] = kept
        return copy

    return change
