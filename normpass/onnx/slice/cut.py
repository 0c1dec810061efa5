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

from ...core.graph import NodeKind, NormInfo, ZeroMeanGraph
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
        self._narrow_followers(stream, narrowed, width, kept)
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

    def _narrow_followers(self, stream: Stream, narrowed: list[tuple[ir.Value, int]], width: int, kept: int) -> None:
        """What the cut of `stream` narrows beyond its own tensors: the outputs of elementwise ops (not the
        stream's residual sums) and of its RMS ops (a decomposed RMSNorm's Pow and Mul, a fused op's output and
        sum) computed from a narrowed value, where their declared shape says `width` at its axis (counted from
        the end, as broadcasting aligns). Left at d, such a declaration contradicts what the node computes:
        ONNX Runtime warns and strict shape inference (normpass's own loader) refuses the model. A fused RMS op
        of another piece (a Skip op sums this piece's tensor, through a shortcut, into the next) is that
        piece's: its own cut says its width, which may still be d (the end `head="full"` leaves whole)."""
        own = {id(node) for name in stream.norms for node in self.zmg.norm_by_name(name).ref.nodes}
        pending = list(narrowed)
        while pending:
            value, axis = pending.pop()
            for use in value.uses():
                node = use.node
                outputs = FOLLOWING.get(node.op_type)
                if outputs is None or (node.domain not in ("", "ai.onnx") and node.op_type not in SINGLE_OPS):
                    continue
                if node.op_type in SINGLE_OPS and id(node) not in own:
                    continue
                known = self.zmg.nodes.get(name_of(node))
                if known is not None and known.kind is NodeKind.RESIDUAL:  # a sum of the stream: its piece's own
                    continue  # cut says its width (in a sequential fit's model that piece may still be whole)
                for index in outputs or range(len(node.outputs)):
                    out = node.outputs[index] if index < len(node.outputs) else None
                    if out is not None and self._narrow(out, axis, width, kept):
                        pending.append((out, axis))

    def pin_widths(self, pieces: list[Stream], widths: dict[str, int]) -> None:
        """Name its own width on the stream's axis of each target shape of a piece (`widths`: piece → columns)
        that a `Reshape` or `Expand` computes at run time from the `Shape` of a tensor of a piece of another
        width. OPT's TorchScript export restores [batch, seq, d] after its MLP from the shape taken before the
        residual sum, in the piece before: where that piece is cut to k and this one is not (the end left
        whole by `head="full"`, or the later pieces of a sequential fit's models,
        `driver.sequential_covariances`), that shape says k. A target whose entry on the axis is a constant, or
        reads the shapes of tensors of pieces of this piece's width only, is left as it is: a pin would hide
        the target from ONNX Runtime's constant folding. The pin (`_pin`): the entry of a `Concat` of pieces
        becomes the constant width, which shape inference follows; any other target a Mul by a mask and an
        Add of the width."""
        owner = {tensor: piece.name for piece in pieces for tensor in self._piece_tensors(piece)}
        for piece in pieces:
            width, axes = widths[piece.name], dict(piece.states)
            for node in list(self.ctx.graph):
                position = RESHAPING.get(node.op_type)
                out = node.outputs[0].name if node.outputs else None
                if position is None or out not in axes or position >= len(node.inputs):
                    continue
                target, rank = node.inputs[position], len(self.ctx.shapes.get(out) or ())
                if target is None or not rank:
                    continue
                read = self._shapes_read(target, axes[out] - rank, owner)
                if read is not None and all(widths[other] == width for other in read):
                    continue
                self._pin(node, position, axes[out] - rank, rank, width, piece.name)

    def _piece_tensors(self, piece: Stream) -> list[str]:
        """The tensors of `piece` whose shape says its width: its states and its norms' outputs."""
        norms = [node for name in piece.norms for node in self.zmg.norm_by_name(name).ref.nodes]
        return [tensor for tensor, _ in piece.states] + [name_of(v) for node in norms for v in node.outputs if v]

    def _shapes_read(self, target: ir.Value, at: int, owner: dict[str, str]) -> set[str] | None:
        """The pieces (by name, `owner`: tensor → piece) of the tensors whose `Shape` entry `at` of `target` is
        computed from; None where it reads a tensor of a piece other than through its `Shape` (its values:
        unknown). Of a `Concat` of pieces, only the piece holding the entry is followed."""
        found = _concat_entry(self.ctx, target, at)
        pending = [target] if found is None else [found[0].inputs[found[1]]]
        seen: set[int] = set()
        read: set[str] = set()
        while pending:
            value = pending.pop()
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if name_of(value) in owner:
                return None
            producer = value.producer()
            if producer is None:
                continue
            if producer.op_type == "Shape":
                source = name_of(producer.inputs[0])
                read |= {owner[source]} if source in owner else set()
                continue
            pending += list(producer.inputs)
        return read

    def _pin(self, node: ir.Node, position: int, at: int, rank: int, width: int, label: str) -> None:
        """The target shape of `node` (its input `position`) names `width` at `at` (counted from the end): in a
        `Concat` whose piece there is one entry long, that piece becomes the constant; else Mul by a mask,
        Add `width` there."""
        target, graph = node.inputs[position], self.ctx.graph
        assert target is not None
        note = f"target shape names {width} features on the stream's axis ({label})"
        found = _concat_entry(self.ctx, target, at)
        if found is not None and found[2] == 1:
            self._replace_in_concat(node, position, found[0], found[1], np.array([width], np.int64))
            self._note(name_of(node), note)
            return
        keep = np.ones(rank, np.int64)
        keep[at] = 0
        masked = self._new_value(f"{name_of(target)}.masked", np.dtype(np.int64))
        pinned = self._new_value(f"{name_of(target)}.pinned", np.dtype(np.int64))
        name = self._unique(f"{name_of(node)}.pinned")
        inputs = [new_initializer(graph, self._unique(f"{name}.mask"), keep)]
        mask = ir.node("Mul", [target, *inputs], outputs=[masked], name=self._unique(f"{name}.mask"))
        inputs = [new_initializer(graph, self._unique(f"{name}.width"), (1 - keep) * width)]
        add = ir.node("Add", [masked, *inputs], outputs=[pinned], name=name)
        graph.insert_before(node, [mask, add])
        node.replace_input_with(position, pinned)
        self._note(name_of(node), note)

    def _retarget(self, node: ir.Node, position: int, at: int, width: int, kept: int, label: str) -> None:
        """Where the target shape of `node` (its input `position`) names `width` at `at` (counted from the end),
        name `kept`: a constant is copied; a `Concat` of pieces (ONNX exports build shapes from `Shape` and
        constants) gets a copy of its own with the constant piece changed. A piece computed at run time is
        left: it is computed from the sliced tensors themselves (or pinned, `pin_widths`)."""
        target = node.inputs[position]
        if target is None:
            return
        note = f"target shape names {kept} features of the sliced stream, not {width}"
        values = constant_values(target)
        if values is not None:
            if -values.size <= at and values.ravel()[at] == width:
                self._replace_input(node, position, f"sliced_shape:{label}:{at}", _named(at, kept), f"sliced to {kept}")
                self._note(name_of(node), note)
            return
        found = _concat_entry(self.ctx, target, at)
        if found is None:
            return
        concat, index, _, end = found
        piece = constant_values(concat.inputs[index])
        if piece is None or piece.ravel()[at - end] != width:
            return
        self._replace_in_concat(node, position, concat, index, _named(at - end, kept)(piece))
        self._note(name_of(node), note)

    def _replace_in_concat(self, node: ir.Node, position: int, concat: ir.Node, index: int, piece: np.ndarray) -> None:
        """`node` reads, as its input `position`, a copy of `concat` whose input `index` is the constant `piece`."""
        inputs = list(concat.inputs)
        inputs[index] = new_initializer(self.ctx.graph, self._unique(f"{concat.name}.sliced"), piece)
        shape = self._new_value(f"{name_of(concat.outputs[0])}.sliced", np.dtype(np.int64))
        copy = ir.node("Concat", inputs, {"axis": 0}, outputs=[shape], name=self._unique(f"{concat.name}.sliced"))
        self.ctx.graph.insert_before(node, copy)
        node.replace_input_with(position, shape)


def _concat_entry(ctx: OnnxGraph, target: ir.Value, at: int) -> tuple[ir.Node, int, int, int] | None:
    """Where entry `at` (counted from the end) of `target`, a `Concat` of 1-D pieces, lies: (the Concat, the
    input holding it, that input's length, the position from the end just past it); None where `target` is
    no such Concat or a length from the entry to the end is unknown."""
    concat = target.producer()
    if concat is None or concat.op_type != "Concat":
        return None
    end = 0
    for index in range(len(concat.inputs) - 1, -1, -1):
        piece = concat.inputs[index]
        values = constant_values(piece)
        length = _length(ctx, piece) if values is None else values.size
        if not length:
            return None
        if end - length <= at < end:
            return concat, index, length, end
        end -= length
    return None


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
