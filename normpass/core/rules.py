"""Rules: how zero mean along one axis, and a shift constant along it, flow through one operation.

Every node of the zero-mean graph carries a rule (the `Rule` interface of `graph.py`, which this module
implements and `graph.py` never imports), and each rule owns both directions of its algebra:

* `backward` (the proof, seed 003 §4.2): for the node's output to be zero-mean along axis k, which
  inputs must be zero-mean, and along which of their axes; or a `Centring` of the node itself; or
  the reason it cannot be.
* `forward` (the safety check, seed 003 App. D.2): a per-sample shift c·1 constant along axis k of
  one input; the outputs (and axes) that carry it on, none when the node removes it, or why it
  would change the model.

The rules (the inputs of an op that the front end classifies; `x` is the stream input):

* `Linear(axis)`      y = x·W + b. Centring W and b along the output features makes y zero-mean
                      along `axis` of y for every input (column-centred constraint); a shift of x
                      changes y.
* `Scale(stream, factor)`  y = x ⊙ s. If s is constant along the axis, mean(y) = s·mean(x): zero
                      stays zero and a shift stays constant along the axis.
* `Sum()`             y = Σ ±xᵢ (residual add/sub). Zero-mean iff every branch is; shifts add up.
* `Permute(perm)`     y = transpose(x): the axis moves, its elements do not.
* `Regroup()`         y = reshape(x): the axis is intact iff the same size and the same suffix
                      product (number of elements after it) exist on both sides, or, the
                      element count being kept, the same prefix product (symbolic sizes by name).
* `Select(axes)`      slice/split along `axes`: each slice along other axes is kept whole.
* `Take(axis, index_rank)`  gather along `axis` of data from an index tensor.
* `Broadcast()`       expand over other axes.
* `Concat(axis)`      zero-mean parts concatenated (along any axis) are zero-mean.
* `Mix(kept)`         y = a linear map over the other axes, the same for every slice along an axis
                      in `kept` (Resize, average pooling, Pad with zeros, Tile with repeat 1 on
                      the axis): zero-mean slices stay zero-mean, a shift constant along it stays so.
* `Reduce(axes, keepdims)`  y = mean (or sum) of x over `axes`, not the normalized axis k (a mean-pooled
                      head: tokens or spatial positions averaged). Each row of y along k is an
                      average Σⱼ wⱼ·xⱼ of rows of x along k: mean_k(y) = Σⱼ wⱼ·mean_k(xⱼ) = 0 when every
                      row is zero-mean, and a shift cⱼ·1 (constant along k, any value per row) becomes
                      (Σⱼ wⱼ·cⱼ)·1, still constant along k. Reducing over k itself mixes along it.
* `Choose()`          Where(c, a, b) with c constant along the axis: whole rows come from a or b.
* `Centered(axis)`    the output is already zero-mean along `axis` (x − mean(x)); removes a shift.
* `NormRule(norm)`    a normalization node. Its output γ⊙x̂+β is zero-mean only when the front end
                      found γ uniform and mean(β) = 0; it removes a shift constant along its single
                      normalized axis if it subtracts the mean (LayerNorm: LN(x + c·1) = LN(x)).
* `ShiftInvariant(axis)`  e.g. Softmax: f(x + c·1) = f(x) along `axis`; not linear.
* `ShapeOnly()`       reads only its input's shape or dtype (Shape, Size, EyeLike): a shift never
                      reaches its output, and its output carries no zero-mean stream.
* `Opaque(reason)`    anything else: zero mean does not flow through it, and a shift reaching it
                      changes the model.

**Rows that carry a shift.** A shift entering part i of a `Concat` along another axis a lives in
that part's rows of a alone; a `Slice` along a that keeps none of those rows passes no shift on
(`Rule.rows`). So a row taken from a concatenation whose other rows were normalized again reads
no shift (XCiT's class attention: `cat([norm2(x[:, :1]), x[:, 1:]])[:, :1]` feeds the MLP).
Elementwise ops keep the rows where the input spans their axis. Every other rule forgets where the
shift is (all rows), which is always sound. Backwards, `Rule.rows_read` is the same map the other
way: the rows of an input that a slice of the output reads (a `Slice`'s bounds, a `Concat` part's
own rows, none for a part outside them); every other rule needs all rows, which is always sound.

**Weights.** `Scale.weigh`: y = x ⊙ w with w a constant that varies along the axis alone (a
LayerScale over a concatenation, which no one layer absorbs) is zero-mean iff x is w-weighted
zero-mean, mean_k(w ⊙ x) = 0. Every rule that returns inputs keeps each element's feature index
along the axis and acts on rows linearly, so a weighted need passes through it unchanged, except a
`Concat` along the axis; a layer is then centred weighted (`plan.Centring.weight`). Forwards, the
shift c·w⁻¹ such a centring leaves passes the same rules and becomes c·1 at a multiply by w
(`Scale.unweighs`); a rule that removes shifts (`removes_shift`) does not remove it before that.

**Values nobody reads.** A shift entering the data input (input 0) of a modelled op (any rule but
`Opaque`) whose outputs only shape readers read, and no graph output is, changes nothing: those ops'
output shapes follow their inputs' shapes and constant parameters, never input 0's values (ops
whose shapes do depend on values, NonZero and kin, are `Opaque`). So a `Gather` along the shifted
axis whose output is read only by `Shape` (BART's TorchScript encoder takes `inputs_embeds[..., -1]`
for its shape) lets the shift through, as does one whose output nothing reads.

Axes map through broadcasting right-aligned (`broadcast_axis`) and through reshapes by their
suffix products, or their prefix products where the suffixes are symbolic (`regroup_axis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .graph import Backward, Forward, NormInfo, Required, Rows, Shift, ZeroMeanGraph, ZNode
from .plan import Centring

# --- axis algebra ------------------------------------------------------------------------------


def broadcast_axis(out_shape, in_shape, axis: int) -> tuple[int | None, str | None]:
    """Map output axis to the same axis of a broadcast input.

    Returns (input axis, None) when the input spans the axis, (None, None) when the input is
    constant along it (missing or size 1), and (None, reason) when that cannot be decided.
    """
    if in_shape is None or out_shape is None:
        return None, "its rank is unknown"
    in_axis = axis - (len(out_shape) - len(in_shape))
    if in_axis < 0:
        return None, None
    in_dim, out_dim = in_shape[in_axis], out_shape[axis]
    if in_dim == 1 and out_dim != 1:
        return None, None
    if in_dim == out_dim or (in_dim is not None and in_dim != 1):
        return in_axis, None
    return None, f"its size along axis {in_axis} is unknown"


def regroup_axis(from_shape, to_shape, axis: int) -> int | None:
    """Where axis `axis` of `from_shape` lives in `to_shape` after a row-major reshape, if intact.

    The axis survives iff `to_shape` has an axis of the same size with the same number of
    elements after it: then every slice along it holds the same elements in the same order.
    One unknown dimension in either shape is first solved from the element count a reshape keeps
    (`_solve_unknown_dim`). Where the elements after it are not static, the same number of elements
    *before* it says the same (`_by_prefix`).
    """
    if from_shape is None or to_shape is None:
        return None
    from_shape, to_shape = _solve_unknown_dim(tuple(from_shape), tuple(to_shape))
    tail = from_shape[axis:]
    if not all(isinstance(d, int) for d in tail):
        return _by_prefix(from_shape, to_shape, axis)
    size, suffix = tail[0], math.prod(tail[1:])
    product = 1
    for j in range(len(to_shape) - 1, -1, -1):
        dim = to_shape[j]
        if product == suffix and dim == size:
            return j
        if not isinstance(dim, int) or product > suffix:
            return None
        product *= dim
    return None


def _by_prefix(from_shape: tuple, to_shape: tuple, axis: int) -> int | None:
    """`regroup_axis` by the elements before the axis: a reshape keeps the element count T, so an axis of
    `to_shape` of the axis's size s with P elements before it, as many as before the axis (P·s·S = T =
    P·s·S'), has as many after it too, S = S' (where P·s = 0 the tensor is empty: no grouping to keep).
    Two products of dimensions are known equal where their static parts multiply alike and their symbolic
    parts are the same names (one name, one value), e.g. a patch grid's reshape [B, d, H·W] →
    [B, d, H, W] with H and W symbolic: the stream's axis d is intact whatever the image size."""
    size = from_shape[axis]
    before = _product(from_shape[:axis])
    if size is None or before is None:
        return None
    for j, dim in enumerate(to_shape):
        if dim == size and _product(to_shape[:j]) == before:
            return j
    return None


def _product(dims: tuple) -> tuple[int, tuple[str, ...]] | None:
    """A product of dimensions as (its static part, its symbolic names sorted); None where one is unknown."""
    if any(d is None for d in dims):
        return None
    names = tuple(sorted(str(d) for d in dims if not isinstance(d, int)))
    return math.prod(d for d in dims if isinstance(d, int)), names


def _solve_unknown_dim(from_shape: tuple, to_shape: tuple) -> tuple[tuple, tuple]:
    """The two shapes of a reshape with their one unknown dimension solved, where that is possible.

    A reshape keeps the element count: prod(from_shape) = prod(to_shape). A symbolic dimension
    named alike in both shapes is one value (ONNX's `dim_param` meaning, which shape inference
    propagates through `Shape` arithmetic, e.g. a batch dimension), so it cancels. If what remains
    is all static but one dimension u, named nowhere else, then u = (static product of the other
    side) / (static product of its own side), exactly (an empty tensor, where a cancelled
    dimension is 0, has no elements whose grouping could matter). Otherwise the shapes are
    returned unchanged.
    """
    sides = [dict(enumerate(from_shape)), dict(enumerate(to_shape))]
    for j, dim in enumerate(to_shape):
        match = next((i for i, d in sides[0].items() if isinstance(dim, str) and d == dim), None)
        if match is not None:
            del sides[0][match], sides[1][j]
    unknown = [(side, i) for side in (0, 1) for i, d in sides[side].items() if not isinstance(d, int)]
    if len(unknown) != 1 or [*from_shape, *to_shape].count(sides[unknown[0][0]][unknown[0][1]]) != 1:
        return from_shape, to_shape
    side, index = unknown[0]
    known = math.prod(d for i, d in sides[side].items() if i != index)
    total = math.prod(sides[1 - side].values())
    if known == 0 or total % known:
        return from_shape, to_shape
    shapes = [list(from_shape), list(to_shape)]
    shapes[side][index] = total // known
    return tuple(shapes[0]), tuple(shapes[1])


def _broadcast_inputs(zmg: ZeroMeanGraph, node: ZNode, tensor: str, axis: int, indices) -> Required | str:
    """Inputs `indices` of an elementwise node, each with the axis that `axis` of its output maps to.

    An input broadcast along the axis is allowed only if it is a constant (it is then centred,
    to zero).
    """
    out_shape = zmg.shape(tensor)
    required = []
    for index in indices:
        source = node.inputs[index]
        in_axis, why = broadcast_axis(out_shape, zmg.shape(source), axis)
        if why:
            return f"{node.op} {node.name}: cannot map the normalized axis onto {source}: {why}"
        if in_axis is None and not zmg.is_constant(source):
            return f"{node.op} {node.name} broadcasts {source} along the normalized axis"
        required.append((index, source, in_axis))
    return required


def _along_rows(zmg: ZeroMeanGraph, node: ZNode, axis: int) -> bool:
    """Whether a Where's condition is constant along output axis `axis` (it picks whole rows)."""
    cond_axis, why = broadcast_axis(zmg.shape(node.outputs[0]), zmg.shape(node.inputs[0]), axis)
    return cond_axis is None and why is None


def _values_unread(zmg: ZeroMeanGraph, node: ZNode) -> bool:
    """Whether no value of `node`'s outputs is read: none is a graph output, and only shape readers read them."""
    return all(
        output not in zmg.graph_outputs and all(isinstance(c.rule, ShapeOnly) for c, _ in zmg.consumers_of(output))
        for output in node.outputs
        if output
    )


def _rows_of_input(zmg: ZeroMeanGraph, node: ZNode, tensor: str, rows: Rows | None, index: int) -> Rows | None:
    """The rows of broadcast input `index` that rows `rows` of elementwise output `tensor` read: the same rows
    where the input spans their axis, all of it where it is broadcast along it."""
    if rows is None:
        return None
    axis, start, stop = rows
    in_axis, why = broadcast_axis(zmg.shape(tensor), zmg.shape(node.inputs[index]), axis)
    return None if in_axis is None or why else (in_axis, start, stop)


def _rows_of_output(shift: Shift) -> Rows | None:
    """The rows of an elementwise output that a shift in rows `shift.rows` of its input reaches: the same rows
    where the input spans their axis, all of it where it is broadcast along it."""
    if shift.rows is None or shift.in_shape is None or shift.out_shape is None:
        return None
    axis, start, stop = shift.rows
    out_axis = axis + shift.lift
    return (out_axis, start, stop) if shift.in_shape[axis] == shift.out_shape[out_axis] else None


# --- the rules ---------------------------------------------------------------------------------


class _Flow:
    """Shared checks: a proof needs the output's shape; a shift needs both shapes.

    Subclasses implement `pull` (backward, shape known), `push` (forward along `axis` of the
    input) and, if they pass on a broadcast shift, `push_broadcast` (forward along `out_axis` of
    the output).
    """

    def backward(self, zmg, node, tensor, axis) -> Backward:
        if zmg.shape(tensor) is None:
            return f"{node.op} {node.name}: the shape of {tensor} is unknown"
        return self.pull(zmg, node, tensor, axis)

    def pull(self, zmg, node, tensor, axis) -> Backward:
        raise NotImplementedError

    shapes_follow_shapes: ClassVar[bool] = True  # output shapes never depend on input 0's values

    def forward(self, shift: Shift) -> Forward:
        if shift.index == 0 and self.shapes_follow_shapes and _values_unread(shift.zmg, shift.node):
            return []
        if shift.out_shape is None or shift.in_shape is None:
            return "has an unknown shape"
        if shift.axis is not None:
            return self.push(shift, shift.axis)
        if shift.out_axis is None:
            return "receives a broadcast shift along an unknown axis"
        return self.push_broadcast(shift, shift.out_axis)

    def push_broadcast(self, shift: Shift, out_axis: int) -> Forward:
        return "receives a shift it may not pass on"

    def rows(self, shift: Shift, output: str) -> Rows | None:
        return None  # all of it: forgetting where a shift is never makes the check unsound

    def rows_read(self, zmg, node, tensor, rows, index) -> Rows | None:
        return None  # all of it: requiring every row of an input to be zero-mean is never unsound

    def weigh(self, zmg, node, tensor, axis) -> tuple[Required, str] | str | None:
        return None

    def unweighs(self, shift: Shift) -> bool:
        return False

    # `forward` returns [] because the node removes a shift constant along its axis (not because the shift
    # never reaches its output's values): a weighted shift, not constant along the axis, is not removed there
    removes_shift: ClassVar[bool] = False

    def push(self, shift: Shift, axis: int) -> Forward:
        return "would change its output (it is not shift-invariant)"


@dataclass(frozen=True)
class Linear(_Flow):
    """Output zero-mean along `axis` once the layer's weights are centred (the stream input is free).

    `bias_per_feature` False: a bias that is one number for every feature (a Gemm's C of one element),
    which a weighted centring cannot keep in its shape (`plan.Centring.weight`).
    """

    axis: int
    bias_per_feature: bool = field(default=True, repr=False)

    def backward(self, zmg, node, tensor, axis) -> Backward:
        if axis != self.axis:
            return f"{node.op} {node.name} centres axis {self.axis}, the norm needs {axis}"
        return Centring(node.name, axis)


@dataclass(frozen=True)
class Scale(_Flow):
    """Output = input[stream] times input[factor]; `factor=None` for unary ops (Neg, Cast, Dropout)."""

    stream: int | None = 0
    factor: int | None = None

    def backward(self, zmg, node, tensor, axis) -> Backward:
        result = super().backward(zmg, node, tensor, axis)
        if isinstance(result, str) and layer_scale(zmg, node, axis) is not None:
            return Centring(node.name, axis)  # absorbed into its layer, which is centred
        return result

    def pull(self, zmg, node, tensor, axis) -> Backward:
        roles = self.roles(zmg, node, axis)
        if isinstance(roles, str):
            return roles
        return _broadcast_inputs(zmg, node, tensor, axis, [roles[0]])

    def roles(self, zmg, node, axis: int) -> tuple[int, int | None] | str:
        """(stream input, factor input) for output axis `axis`, or why there is none.

        The factor must be constant along the axis; for Mul either operand may be the factor.
        """
        if self.factor is None and self.stream is not None:
            return self.stream, None
        out_shape = zmg.shape(node.outputs[0])
        for stream in [self.stream] if self.stream is not None else [0, 1]:
            factor = self.factor if self.factor is not None else 1 - stream
            factor_axis, why = broadcast_axis(out_shape, zmg.shape(node.inputs[factor]), axis)
            if why is None and factor_axis is None:
                return stream, factor
        return f"{node.op} {node.name} multiplies by a factor that is not constant along the normalized axis"

    def _is_stream(self, shift: Shift, out_axis: int) -> bool:
        roles = self.roles(shift.zmg, shift.node, out_axis)
        return not isinstance(roles, str) and roles[0] == shift.index

    def push_broadcast(self, shift: Shift, out_axis: int) -> Forward:
        if self._is_stream(shift, out_axis):
            return [(shift.out, out_axis)]
        return super().push_broadcast(shift, out_axis)

    def push(self, shift: Shift, axis: int) -> Forward:
        out_axis = axis + shift.lift
        if not self._is_stream(shift, out_axis) and not self.unweighs(shift):
            return "scales the shifted tensor by a factor that varies along its axis, or scales by it"
        return [(shift.out, out_axis)]

    def rows(self, shift: Shift, output: str) -> Rows | None:
        return _rows_of_output(shift)

    def rows_read(self, zmg, node, tensor, rows, index) -> Rows | None:
        return _rows_of_input(zmg, node, tensor, rows, index)

    def weigh(self, zmg, node, tensor, axis) -> tuple[Required, str] | str | None:
        """y = x ⊙ w with w constant and per-feature along `axis`: mean_k(y) = 0 iff x is w-weighted zero-mean.

        Where w has a zero (or non-finite) entry no weighted centring exists: a shift c·w⁻¹ is undefined.
        """
        found = per_channel_factor(zmg, node, axis)
        if found is None:
            return None
        stream, factor = found
        values = zmg.constant(factor)
        if not np.all(np.isfinite(values)) or np.any(values == 0):
            return f"{node.op} {node.name} multiplies by a per-feature factor {factor} with a zero or non-finite entry"
        required = _broadcast_inputs(zmg, node, tensor, axis, [stream])
        return required if isinstance(required, str) else (required, factor)

    def unweighs(self, shift: Shift) -> bool:
        if shift.weight is None or shift.axis is None or shift.out_shape is None or shift.in_shape is None:
            return False
        found = per_channel_factor(shift.zmg, shift.node, shift.axis + shift.lift)
        return found is not None and found == (shift.index, shift.weight)


class _Elementwise(_Flow):
    """Broadcasting ops whose output carries a shift of any data input on (Sum, Broadcast, Choose)."""

    def push_broadcast(self, shift: Shift, out_axis: int) -> Forward:
        return [(shift.out, out_axis)]

    def push(self, shift: Shift, axis: int) -> Forward:
        return [(shift.out, axis + shift.lift)]

    def rows(self, shift: Shift, output: str) -> Rows | None:
        return _rows_of_output(shift)

    def rows_read(self, zmg, node, tensor, rows, index) -> Rows | None:
        return _rows_of_input(zmg, node, tensor, rows, index)


@dataclass(frozen=True)
class Sum(_Elementwise):
    """Output = ± every input (Add, Sub)."""

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return _broadcast_inputs(zmg, node, tensor, axis, range(len(node.inputs)))


@dataclass(frozen=True)
class Broadcast(_Elementwise):
    """Expand input 0 to a larger shape."""

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return _broadcast_inputs(zmg, node, tensor, axis, [0])

    def push(self, shift: Shift, axis: int) -> Forward:
        if shift.index != 0:
            return "takes the shifted tensor as its shape"
        return super().push(shift, axis)


@dataclass(frozen=True)
class Choose(_Elementwise):
    """Where(condition, a, b): each element from a or b, per the condition (input 0)."""

    def pull(self, zmg, node, tensor, axis) -> Backward:
        if not _along_rows(zmg, node, axis):
            return (
                f"{node.op} {node.name} selects elements within a row, not whole rows "
                "(its condition varies along the axis)"
            )
        return _broadcast_inputs(zmg, node, tensor, axis, [1, 2])

    def forward(self, shift: Shift) -> Forward:
        if shift.out_shape is None or shift.in_shape is None:
            return "has an unknown shape"
        out_axis = shift.out_axis if shift.axis is None else shift.axis + shift.lift
        if shift.index == 0 or out_axis is None or not _along_rows(shift.zmg, shift.node, out_axis):
            return "selects elements within a row, or takes the shifted tensor as its condition"
        return super().forward(shift)


@dataclass(frozen=True)
class Concat(_Flow):
    axis: int

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return _broadcast_inputs(zmg, node, tensor, axis, range(len(node.inputs)))

    def push(self, shift: Shift, axis: int) -> Forward:
        if axis == self.axis:
            return "concatenates along the shifted axis"
        return [(shift.out, axis)]

    def rows(self, shift: Shift, output: str) -> Rows | None:
        """The rows of the shifted part (where the parts' sizes along the axis are static)."""
        sizes = [(shift.zmg.shape(t) or ())[self.axis : self.axis + 1] for t in shift.node.inputs]
        if not all(len(size) == 1 and isinstance(size[0], int) for size in sizes):
            return shift.rows
        offset = sum(size[0] for size in sizes[: shift.index])
        if shift.rows is None:
            return (self.axis, offset, offset + sizes[shift.index][0])
        axis, start, stop = shift.rows
        return (axis, offset + start, offset + stop) if axis == self.axis else shift.rows

    def rows_read(self, zmg, node, tensor, rows, index) -> Rows | None:
        """The part's own rows within `rows` (an empty range where the part lies outside them)."""
        if rows is None or rows[0] != self.axis:
            return rows
        sizes = [(zmg.shape(t) or ())[self.axis : self.axis + 1] for t in node.inputs]
        if not all(len(size) == 1 and isinstance(size[0], int) for size in sizes):
            return None
        offset, size = sum(size[0] for size in sizes[:index]), sizes[index][0]
        _, start, stop = rows
        return (self.axis, max(start - offset, 0), min(stop - offset, size))


@dataclass(frozen=True)
class Mix(_Flow):
    """Input 0 mapped over other axes by one linear map; `kept`: the axes it leaves alone."""

    kept: tuple[int, ...]

    def pull(self, zmg, node, tensor, axis) -> Backward:
        if axis not in self.kept:
            return f"{node.op} {node.name} mixes or pads along the normalized axis (or its parameters are not constant)"
        return [(0, node.inputs[0], axis)]

    def push(self, shift: Shift, axis: int) -> Forward:
        if shift.index != 0 or axis not in self.kept:
            return "mixes or pads along the shifted axis"
        return [(shift.out, axis)]


@dataclass(frozen=True)
class Reduce(_Flow):
    """Mean or sum of input 0 over `axes` (of the input; None: not known statically), see the module docstring.

    With `keepdims` every axis keeps its place; without, the reduced axes are dropped.
    """

    axes: tuple[int, ...] | None
    keepdims: bool

    def pull(self, zmg, node, tensor, axis) -> Backward:
        in_axis = self._in_axis(zmg.rank(node.inputs[0]), axis)
        if in_axis is None:
            return f"{node.op} {node.name} reduces over the normalized axis (or its axes are not known)"
        return [(0, node.inputs[0], in_axis)]

    def push(self, shift: Shift, axis: int) -> Forward:
        if shift.index != 0 or self.axes is None or axis in self.axes:
            return "reduces over the shifted axis (or its axes are not known)"
        return [(shift.out, axis if self.keepdims else axis - sum(a < axis for a in self.axes))]

    def _in_axis(self, rank: int | None, out_axis: int) -> int | None:
        """The input axis that output axis `out_axis` is, if it is not reduced."""
        if self.axes is None or rank is None:
            return None
        kept = list(range(rank)) if self.keepdims else [a for a in range(rank) if a not in self.axes]
        if out_axis >= len(kept) or kept[out_axis] in self.axes:
            return None
        return kept[out_axis]


@dataclass(frozen=True)
class Permute(_Flow):
    perm: tuple[int, ...]

    def pull(self, zmg, node, tensor, axis) -> Backward:
        if axis >= len(self.perm):
            return f"{node.op} {node.name}: its perm does not match the rank of {tensor}"
        return [(0, node.inputs[0], self.perm[axis])]

    def push(self, shift: Shift, axis: int) -> Forward:
        if axis not in self.perm:
            return "has a perm that does not match its input"
        return [(shift.out, self.perm.index(axis))]

    def rows_read(self, zmg, node, tensor, rows, index) -> Rows | None:
        return None if rows is None or rows[0] >= len(self.perm) else (self.perm[rows[0]], *rows[1:])


@dataclass(frozen=True)
class Regroup(_Flow):
    """Reshape-like: Reshape, Flatten, Squeeze, Unsqueeze."""

    def pull(self, zmg, node, tensor, axis) -> Backward:
        in_axis = regroup_axis(zmg.shape(tensor), zmg.shape(node.inputs[0]), axis)
        if in_axis is None:
            return f"{node.op} {node.name} does not keep the normalized axis intact (or its shapes are unknown)"
        return [(0, node.inputs[0], in_axis)]

    def push(self, shift: Shift, axis: int) -> Forward:
        out_axis = regroup_axis(shift.in_shape, shift.out_shape, axis)
        if out_axis is None:
            return "does not keep the shifted axis intact"
        return [(shift.out, out_axis)]


@dataclass(frozen=True)
class Select(_Flow):
    """Slice or split along `axes` of input 0 (None: the axes are not known statically).

    `bounds`: (axis, start, stop) of each axis a unit-step slice keeps, where all are static.
    """

    axes: tuple[int, ...] | None
    bounds: tuple[Rows, ...] | None = None

    def pull(self, zmg, node, tensor, axis) -> Backward:
        if self.axes is None:
            return f"{node.op} {node.name}: its slicing axes are not constant"
        if axis in self.axes:
            return f"{node.op} {node.name} slices the normalized axis"
        return [(0, node.inputs[0], axis)]

    def push(self, shift: Shift, axis: int) -> Forward:
        return [(output, axis) for output in shift.node.outputs if output]

    def rows(self, shift: Shift, output: str) -> Rows | None:
        """The shifted rows that the slice keeps, renumbered (none: an empty slice, stop ≤ start)."""
        if shift.rows is None or self.axes is None:
            return None
        axis, start, stop = shift.rows
        if axis not in self.axes:
            return shift.rows
        kept = next((b for b in self.bounds or () if b[0] == axis), None)
        if kept is None:
            return None
        return (axis, max(start, kept[1]) - kept[1], min(stop, kept[2]) - kept[1])

    def rows_read(self, zmg, node, tensor, rows, index) -> Rows | None:
        """The input rows a slice reads: its own bounds (along an axis other than the normalized one, which
        `pull` refuses to slice), or the slice `rows` of its output moved to where it starts."""
        bounds = {bound[0]: bound for bound in self.bounds or ()}
        if rows is None:
            return next(iter(bounds.values()), None)
        axis, start, stop = rows
        if self.axes is not None and axis not in self.axes:
            return rows
        bound = bounds.get(axis)
        return None if bound is None else (axis, bound[1] + start, bound[1] + min(stop, bound[2] - bound[1]))


@dataclass(frozen=True)
class Take(_Flow):
    """Gather along `axis` of input 0 with an index tensor of rank `index_rank`."""

    axis: int
    index_rank: int | None

    def pull(self, zmg, node, tensor, axis) -> Backward:
        if self.index_rank is None:
            return f"{node.op} {node.name}: the rank of its indices is unknown"
        if axis < self.axis:
            return [(0, node.inputs[0], axis)]
        if axis >= self.axis + self.index_rank:
            return [(0, node.inputs[0], axis - self.index_rank + 1)]
        return f"{node.op} {node.name} gathers along the normalized axis"

    def push(self, shift: Shift, axis: int) -> Forward:
        if shift.index != 0 or self.index_rank is None or axis == self.axis:
            return "gathers along the shifted axis"
        return [(shift.out, axis if axis < self.axis else axis + self.index_rank - 1)]


@dataclass(frozen=True)
class Centered(_Flow):
    axis: int

    removes_shift: ClassVar[bool] = True

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return [] if self.axis == axis else f"{node.op} {node.name} is centred along axis {self.axis}, not {axis}"

    def forward(self, shift: Shift) -> Forward:
        return [] if shift.index == 0 and self.axis == shift.axis else "does not remove a shift along this axis"


@dataclass(frozen=True)
class ShiftInvariant(_Flow):
    axis: int

    removes_shift: ClassVar[bool] = True

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return f"{node.op} {node.name} is not linear in its input"

    def forward(self, shift: Shift) -> Forward:
        return [] if shift.index == 0 and self.axis == shift.axis else "does not remove a shift along this axis"


@dataclass(frozen=True)
class ShapeOnly(_Flow):
    """Output independent of the input's values (Shape, Size, EyeLike, Random*Like)."""

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return f"{node.op} {node.name} computes a value from a shape, which is not zero-mean"

    def forward(self, shift: Shift) -> Forward:
        return []


@dataclass(frozen=True)
class Opaque(_Flow):
    reason: str

    shapes_follow_shapes: ClassVar[bool] = False  # an unknown op: its output shape may depend on values

    def pull(self, zmg, node, tensor, axis) -> Backward:
        return f"{node.op} {node.name}: {self.reason}"

    def push(self, shift: Shift, axis: int) -> Forward:
        return f"{super().push(shift, axis)}: {self.reason}"


@dataclass(frozen=True)
class NormRule(_Flow):
    norm: NormInfo

    removes_shift: ClassVar[bool] = True

    def pull(self, zmg, node, tensor, axis) -> Backward:
        if self.norm.output_centred and self.norm.axis == axis:
            return []
        return (
            f"the output of {self.norm.op} {self.norm.name} is γ⊙x̂+β, which is not zero-mean "
            "(γ not uniform or mean(β) ≠ 0): a post-LN stream"
        )

    def forward(self, shift: Shift) -> Forward:
        if shift.index == 0 and self.norm.removes_mean and self.norm.axis == shift.axis:
            return []
        return "does not remove a shift along the normalized axis"


# --- LayerScale ----------------------------------------------------------------------------------


# Linear layers a LayerScale can be absorbed into, and its multiply, as the ONNX and PyTorch front ends name them.
ABSORBING_OPS = (
    *("MatMul", "Gemm", "Conv"),
    *("aten.linear", "aten.addmm", "aten.matmul", "aten.mm", "aten.convolution", "aten.conv1d", "aten.conv2d"),
)
SCALING_OPS = ("Mul", "aten.mul")


def layer_scale(zmg: ZeroMeanGraph, node: ZNode, axis: int) -> tuple[int, ZNode, ZNode | None] | None:
    """(factor index, linear layer, bias Add or None) if `node` is a LayerScale, else None.

    A LayerScale multiplies the output of a linear layer (with or without a bias Add) by a
    per-channel constant s: (x·W + b)⊙s = x·(W⊙s) + b⊙s, so s is absorbed into the layer, which
    is then centred. The layer's output and the bias sum must be read by nothing else.
    """
    found = per_channel_factor(zmg, node, axis)
    if found is None:
        return None
    stream_index, _ = found
    stream = node.inputs[stream_index]
    add = None
    producer = _private_producer(zmg, stream)
    if producer is not None and producer.op == "Add" and isinstance(producer.rule, Sum) and len(producer.inputs) == 2:
        biases = [t for t in producer.inputs if zmg.is_constant(t)]
        linear = [t for t in producer.inputs if not zmg.is_constant(t)]
        if len(biases) != 1 or len(linear) != 1:
            return None
        add, producer = producer, _private_producer(zmg, linear[0])
    if (
        producer is None
        or not isinstance(producer.rule, Linear)
        or producer.rule.axis != axis
        or producer.op not in ABSORBING_OPS
    ):
        return None
    return 1 - stream_index, producer, add


def per_channel_factor(zmg: ZeroMeanGraph, node: ZNode, axis: int) -> tuple[int, str] | None:
    """(stream input, factor) of a `Mul` by a constant that varies along output axis `axis` alone, y = x ⊙ w, else
    None: a LayerScale over anything, which a centring weighted by w makes exact (`plan.Centring.weight`)."""
    if not isinstance(node.rule, Scale) or node.op not in SCALING_OPS or len(node.inputs) != 2:
        return None
    factors = [i for i, t in enumerate(node.inputs) if zmg.is_constant(t)]
    out_shape = zmg.shape(node.outputs[0])
    if len(factors) != 1 or out_shape is None:
        return None
    factor = node.inputs[factors[0]]
    return (1 - factors[0], factor) if _per_channel(zmg.shape(factor), len(out_shape), axis) else None


def _per_channel(shape, rank: int, axis: int) -> bool:
    """Whether a factor of `shape` broadcast to rank `rank` varies along `axis` alone."""
    if shape is None or len(shape) > rank:
        return False
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    return all(d == 1 for j, d in enumerate(padded) if j != axis)


def _private_producer(zmg: ZeroMeanGraph, tensor: str) -> ZNode | None:
    """The producer of `tensor` if `tensor` has one reader and is not a graph output."""
    if tensor in zmg.graph_outputs or len(zmg.consumers_of(tensor)) != 1:
        return None
    return zmg.producer_of(tensor)
