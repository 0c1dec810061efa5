"""Recognise normalizations in an ONNX graph (onnx-ir), in one op or decomposed.

This docstring is the authoritative list of spellings (docs/patterns.md says where each is seen).
Every norm found is listed in `inspect`; those that cannot fold say why.

* LayerNorm, one op — folds into an RMS op:
  * `LayerNormalization` (ONNX, opset ≥ 17, either `stash_type`; below 17 the ONNX Runtime contrib
    op of the same name, in the default or the `com.microsoft` domain): LN over axes [axis, rank).
  * `com.microsoft.SkipLayerNormalization(x, skip, γ, [β], [bias])` → (y, mean, inv_std, [sum]):
    LN of s = x + skip + bias. The zero-mean graph models s as a `Sum` node of its own, so the proof
    walks into x and skip and centres the bias; folded, it becomes
    `com.microsoft.SkipSimplifiedLayerNormalization(x, skip, γ, [bias])`, keeping s as output 3
    where something reads it (plain-ONNX emission: `Add`s, then the RMS op).
* LayerNorm, decomposed, anchored at the ReduceMean of its mean — folds over one last axis:
  d = x − ReduceMean(x); y = d / Sqrt(ReduceMean(d²) + ε) [⊙ γ] [+ β], where
  * `ReduceMean` takes its axes as an attribute (opset < 18), as a constant input (opset ≥ 18) or
    as shape arithmetic (`Range(Size(Shape(x)) + axis, Size(Shape(x)), 1)`), keeping dims;
  * x − mean may be computed more than once: equal `Sub`s (the same inputs) are one value d, one
    feeding the square and another the division (older PyTorch exports, ONNX Runtime's
    SkipLayerNormalization fusion tests);
  * the square is `Pow(d, 2)` or `Mul(d, d)`; the variance may be the moments form E[x²] − E[x]²
    (`ReduceMean(x²) − ReduceMean(x)²`);
  * the division is `Div` or `Mul` by `Reciprocal` or by `Div(1, ·)` (TorchScript's `rsqrt`);
  * `Cast`s between float types and `Identity`s are transparent: they may sit anywhere in the
    chain (the mean subtracted in fp16 before a `Cast` to fp32, x̂ cast back), the mean and the
    subtraction may read x through different ones, and `Cast`s to x's own type may sit before γ
    (`γ * x̂.to(dtype)`);
  * ε may be absent (ε = 0, or one the exporter's optimizer dropped, as torch's does for 1e-12),
    or added outside the root, d / (Sqrt(var) + ε): a distinct algebra that no RMS op computes,
    so its fold is emitted as the exact chain x / (Sqrt(ReduceMean(x²)) + ε);
  * γ and β are `Mul`/`Add` in either operand order, with constant-like operands
    (`constant_values`);
  * ONNX's own function body of `LayerNormalization` (opset 17 and 18, as function inlining or a
    converter that expands functions writes it): x flattened to 2-D at `axis` (`Flatten`), the
    moments variance of its rows, γ and β flattened alike, and the result reshaped back to
    `Shape(x)`: the norm of x over [axis, rank);
  * intermediate tensors are read inside the norm alone, or by nodes whose outputs nothing reads
    (the function body's unused Mean/InvStdDev outputs), which then belong to the norm.
  A decomposed LayerNorm over several axes, or one whose intermediates (its mean, its standard
  deviation) are read elsewhere, is listed and declined with that reason.
* Listed as not recognised, with what was seen and where matching stopped: a ReduceMean whose
  x − mean is divided by a square root, when the rest is not a LayerNorm (axes that differ, a
  variance of something else), or whose x − mean has its standard deviation computed, which then
  scales x (tf2onnx's Keras LayerNorm: x·(γ/σ) + (β − μ·γ/σ)). A standard deviation that scales
  nothing (statistics pooling) and x − mean alone (a centring) are no norms.
* RMSNorm, reported as already RMS: `SimplifiedLayerNormalization` (ORT),
  `com.microsoft.SkipSimplifiedLayerNormalization` (its sum is modelled like SkipLayerNorm's),
  `RMSNormalization` (opset 23), and the decomposed chain without the mean subtraction (Llama;
  ONNX's function body of `RMSNormalization`, axes as a `Range` over the shape).
* Listed with a reason, never folded: `com.microsoft.EmbedLayerNormalization` (normalizes a sum of
  embedding lookups made inside the op, and has no RMS variant), `GroupNormalization`, `com.microsoft.SkipGroupNorm` and
  `com.microsoft.GroupNorm`.

Model-local functions are inlined before matching (`frontend.load_graph`), so a norm inside a
function is matched like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from ...core.algebra import has_zero_mean, is_uniform
from ...core.graph import ALREADY_RMS, NormInfo, NormType
from .constants import EVALUATORS, constant_values
from .values import attr, input_at, name_of, readers

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
SKIP_BIAS_INPUT = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 3}  # com.microsoft: x + skip + bias
UNRECOGNISED = "LayerNorm-like pattern"  # the op shown for a pattern that is not recognised
RUNTIME_AXIS = -(1 << 62)  # ReduceMean axes given at run time: the pattern matches, the norm is declined
SHAPE_DEPTH = 8  # nodes of shape arithmetic evaluated for ReduceMean axes
DEAD_LIMIT = 16  # nodes of an unused branch (statistics nobody reads) that may join a norm


@dataclass
class NormMatch:
    """The graph nodes one normalization occupies, and its operands.

    A norm listed but never rewritten (a pattern not recognised, intermediates read elsewhere)
    occupies its anchor alone: x and y are then that node's input and output.
    """

    nodes: list[ir.Node]
    x: ir.Value
    y: ir.Value
    axis: int  # normalizes axes [axis, rank); possibly negative, as written in the graph
    epsilon: float
    gamma: ir.Value | None = None
    beta: ir.Value | None = None
    extra_outputs_used: bool = False
    eps_outside_root: bool = False  # decomposed x̂ = d / (√var + ε) instead of d / √(var + ε)
    skip: ir.Value | None = None  # Skip*LayerNormalization: normalizes x + skip (+ bias)
    skip_bias: ir.Value | None = None
    skip_sum: ir.Value | None = None  # its output 3, the sum, where something reads it
    unsupported: str | None = None  # why this spelling can never be folded
    axes: tuple[int, ...] | None = None  # decomposed: exactly these axes (instead of [axis, rank))

    @property
    def normalized(self) -> str:
        """Name of the tensor the norm normalizes (for a Skip op, its sum, named even when unused)."""
        if self.skip is None:
            return name_of(self.x)
        return name_of(self.skip_sum) if self.skip_sum is not None else f"{self.nodes[0].name}.sum"


@dataclass
class MatchContext:
    """What the matchers know of the graph beyond its nodes.

    `scope`: ids of the nodes of the graph being matched (None: any). A node inside a
    control-flow body is among the readers of an outer tensor it reads, and is no part of a norm
    of the outer graph. `shapes` and `dtypes` (by tensor name) come from shape inference.
    """

    graph_outputs: set[str]
    scope: set[int] | None = None
    shapes: dict[str, tuple | None] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)

    def rank(self, tensor: ir.Value) -> int | None:
        shape = self.shapes.get(name_of(tensor))
        if shape is None and tensor.shape is not None:
            shape = tuple(tensor.shape)
        return None if shape is None else len(shape)

    def elem_type(self, tensor: ir.Value) -> int | None:
        """The ONNX element type of `tensor` where known (a Cast's `to`, a declared or an inferred dtype)."""
        cast = _producer(tensor, "Cast")
        if cast is not None:
            return int(attr(cast, "to"))
        if tensor.dtype is not None:
            return int(tensor.dtype)
        dtype = self.dtypes.get(name_of(tensor))
        return None if dtype is None else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def readers(self, tensor: ir.Value) -> list[ir.Node]:
        """The nodes in scope reading `tensor`, each once."""
        found = {id(n): n for n in readers(tensor) if self.scope is None or id(n) in self.scope}
        return list(found.values())

    def sole_reader(self, tensor: ir.Value) -> ir.Node | None:
        """The node reading `tensor` if it is the only reader and in scope, and `tensor` is no graph output."""
        uses = tensor.uses()
        node = next(iter(uses)).node if len(uses) == 1 else None
        if node is None or tensor.name in self.graph_outputs or (self.scope is not None and id(node) not in self.scope):
            return None
        return node


class NoMatch(Exception):
    """A pattern stopped matching; the message says where."""


# --- values ------------------------------------------------------------------------------------


def _producer(tensor: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node computing `tensor` if it is an `op_type` node, else None."""
    node = None if tensor is None else tensor.producer()
    return node if node is not None and node.op_type == op_type else None


def _passed_on(node: ir.Node | None) -> ir.Value | None:
    """The input of an `Identity`, or of a `Cast` to a float type: the same value for the matcher (a float
    Cast round trip); None for any other node (and for one whose input is absent)."""
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Identity" or (node.op_type == "Cast" and attr(node, "to") in FLOAT_TYPES):
        return input_at(node, 0)
    return None


def _transparent(node: ir.Node | None) -> bool:
    """Whether `node` passes its input on as the same value for the matcher (`_passed_on`)."""
    return _passed_on(node) is not None


def _chain(tensor: ir.Value) -> list[ir.Value]:
    """`tensor`, then what it is a Cast or Identity of, back to the first value that is not one."""
    chain = [tensor]
    while (source := _passed_on(chain[-1].producer())) is not None:
        chain.append(source)
    return chain


def _root(tensor: ir.Value) -> ir.Value:
    return _chain(tensor)[-1]


def _aliases(values: Iterable[ir.Value], ctx: MatchContext, nodes: list[ir.Node]) -> list[ir.Value]:
    """`values` and every value computed from them by Casts and Identitys (in scope), which join `nodes`."""
    found = list(dict.fromkeys(values))
    for value in found:  # grows while iterating: a breadth-first closure
        for node in ctx.readers(value):
            if _transparent(node) and node.outputs[0] not in found:
                nodes.append(node)
                found.append(node.outputs[0])
    return found


def _between(tensor: ir.Value, source: ir.Value) -> list[ir.Node] | None:
    """The Casts and Identitys from `source` to `tensor`, if `tensor` is `source` through them, else None."""
    nodes: list[ir.Node] = []
    while tensor is not source:
        node = tensor.producer()
        before = _passed_on(node)
        if node is None or before is None:
            return None
        nodes.append(node)
        tensor = before
    return nodes


def _other_input(node: ir.Node, tensor: ir.Value) -> ir.Value | None:
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    if first is tensor:
        return second
    if second is tensor:
        return first
    return None


def _scalar(tensor: ir.Value | None) -> float | None:
    values = None if tensor is None else constant_values(tensor)
    return float(values.reshape(-1)[0]) if values is not None and values.size == 1 else None


def _given_at_run_time(tensor: ir.Value | None) -> bool:
    """A graph input (e.g. an initializer also listed in `graph.input`) where a pattern needs a constant."""
    return tensor is not None and tensor.producer() is None and constant_values(tensor) is None


def _shape_values(tensor: ir.Value | None, ctx: MatchContext, depth: int = 0) -> np.ndarray | None:
    """Values of a constant, or of shape arithmetic over ranks: `Size(Shape(t))` is rank(t)."""
    values = constant_values(tensor)
    node = None if tensor is None else tensor.producer()
    if values is not None or node is None or depth > SHAPE_DEPTH or node.domain not in ("", "ai.onnx"):
        return values
    if node.op_type == "Size" and (shape := _producer(input_at(node, 0), "Shape")) is not None:
        shaped = input_at(shape, 0)
        rank = None if shaped is None else ctx.rank(shaped)
        whole = "start" not in shape.attributes and "end" not in shape.attributes
        return None if rank is None or not whole else np.array(rank, dtype=np.int64)
    if node.op_type not in EVALUATORS or node.op_type == "Constant" or node.outputs[0] is not tensor:
        return None
    inputs = [None if t is None else _shape_values(t, ctx, depth + 1) for t in node.inputs]
    if any(v is None for v, t in zip(inputs, node.inputs, strict=True) if t is not None):
        return None
    try:
        return np.asarray(EVALUATORS[node.op_type](node, inputs))
    except (ValueError, IndexError, TypeError, KeyError):
        return None


def _reduce_axes(node: ir.Node, ctx: MatchContext) -> tuple[int, ...] | None:
    """The axes a keepdims `ReduceMean` reduces (`(RUNTIME_AXIS,)` where a graph input gives them), else None."""
    if node.op_type != "ReduceMean" or attr(node, "keepdims", 1) != 1:
        return None
    if "axes" in node.attributes:
        return tuple(int(a) for a in attr(node, "axes"))
    axes = input_at(node, 1)
    if axes is None:
        return None
    if _given_at_run_time(axes):
        return (RUNTIME_AXIS,)
    values = _shape_values(axes, ctx)
    return None if values is None or values.size == 0 else tuple(int(a) for a in np.ravel(values))


def _same_axes(first: tuple[int, ...], second: tuple[int, ...], rank: int | None) -> bool:
    if rank is None:
        return sorted(first) == sorted(second)
    return sorted(a % rank for a in first) == sorted(a % rank for a in second)


def _is_square(node: ir.Node, of: Callable[[ir.Value], bool]) -> bool:
    """`Pow(t, 2)` or `Mul(t, u)`, t and u values that `of` accepts (equal values)."""
    if len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
        return False
    base, other = node.inputs[0], node.inputs[1]
    if node.op_type == "Pow":
        return of(base) and (_scalar(other) == 2.0 or _given_at_run_time(other))
    return node.op_type == "Mul" and of(base) and of(other)


def _scalar_add(node: ir.Node, tensor: ir.Value) -> float | None:
    """ε if `node` is `tensor + ε` with a scalar ε (NaN where ε is a run-time input), else None."""
    if node.op_type != "Add":
        return None
    other = _other_input(node, tensor)
    if other is None:
        return None
    return math.nan if _given_at_run_time(other) else _scalar(other)


def _is_reciprocal_of(node: ir.Node, tensor: ir.Value) -> bool:
    """`Reciprocal(t)`, or `Div(1, t)` (the reciprocal as the TorchScript exporter spells `torch.rsqrt`)."""
    if node.op_type == "Reciprocal":
        return node.inputs[0] is tensor
    return (
        node.op_type == "Div" and len(node.inputs) == 2 and node.inputs[1] is tensor and _scalar(node.inputs[0]) == 1.0
    )


def _one(found: list[ir.Node], what: str) -> ir.Node:
    found = list({id(n): n for n in found}.values())
    if not found:
        raise NoMatch(f"no {what}")
    if len(found) > 1:
        raise NoMatch(f"{what} is computed more than once ({', '.join(name_of(n) for n in found)})")
    return found[0]


def _mean_of(values: list[ir.Value], ctx: MatchContext, nodes: list[ir.Node]) -> tuple[ir.Node, tuple[int, ...]]:
    """The keepdims ReduceMean reading one of `values`, and its axes."""
    means = {id(n): (n, axes) for v in values for n in ctx.readers(v) if (axes := _reduce_axes(n, ctx)) is not None}
    mean = _one([n for n, _ in means.values()], "ReduceMean of the square")
    nodes.append(mean)
    return mean, means[id(mean)][1]


def _root_divide(
    variance: list[ir.Value], numerator: Callable[[ir.Value], bool], ctx: MatchContext, nodes: list[ir.Node]
) -> tuple[ir.Node, float, bool, list[ir.Value]]:
    """From the variance (and its aliases): `n / Sqrt(var + ε)` or `n / (Sqrt(var) + ε)`, with `Div` or
    `Mul(·, Reciprocal(·))` (`Div(1, ·)` as the reciprocal too), n a value `numerator` accepts.

    Returns (the dividing node, ε, whether ε is outside the root, the aliases of the root). No ε
    at all is ε = 0 inside (or an ε the exporter's optimizer dropped, as torch's does for 1e-12).
    Readers of the root other than the division (the function body's 1/σ output) are left for the
    privacy check.
    """
    eps, outside = 0.0, False
    adds = {id(n): (n, e) for v in variance for n in ctx.readers(v) if (e := _scalar_add(n, v)) is not None}
    if adds:
        add = _one([n for n, _ in adds.values()], "Add ε")
        eps = adds[id(add)][1]
        nodes.append(add)
        variance = _aliases([add.outputs[0]], ctx, nodes)
    sqrt = _one([n for v in variance for n in ctx.readers(v) if n.op_type == "Sqrt"], "Sqrt of the variance")
    nodes.append(sqrt)
    root = _aliases([sqrt.outputs[0]], ctx, nodes)
    divider = _divider(root, numerator, ctx, nodes)
    if divider is None and not adds:
        after = [(n, e) for v in root for n in ctx.readers(v) if (e := _scalar_add(n, v)) is not None]
        if len(after) == 1:
            nodes.append(after[0][0])
            eps, outside = after[0][1], True
            root = _aliases([after[0][0].outputs[0]], ctx, nodes)
            divider = _divider(root, numerator, ctx, nodes)
    if divider is None:
        raise NoMatch("x − mean is not divided by the square root")
    return divider, eps, outside, root


def _divider(
    root: list[ir.Value], numerator: Callable[[ir.Value], bool], ctx: MatchContext, nodes: list[ir.Node]
) -> ir.Node | None:
    """`Div(n, root)`, else `Mul(n, Reciprocal(root))`, with n accepted by `numerator`; joins `nodes`."""
    divs = [
        n
        for r in root
        for n in ctx.readers(r)
        if n.op_type == "Div" and n.inputs[1] is r and n.inputs[0] is not None and numerator(n.inputs[0])
    ]
    if divs:
        nodes.append(_one(divs, "division by the root"))
        return nodes[-1]
    for r in root:
        for inverse in ctx.readers(r):
            if not _is_reciprocal_of(inverse, r):
                continue
            branch = [inverse]
            aliases = _aliases([inverse.outputs[0]], ctx, branch)
            muls = [
                n
                for a in aliases
                for n in ctx.readers(a)
                if n.op_type == "Mul" and (other := _other_input(n, a)) is not None and numerator(other)
            ]
            if muls:
                nodes.extend([*branch, _one(muls, "multiplication by the reciprocal of the root")])
                return nodes[-1]
    return None


def _casts_to(tensor: ir.Value, elem_type: int | None, ctx: MatchContext) -> list[ir.Node]:
    """The chain of sole-reader Casts and Identitys after `tensor`, if each Cast casts to `elem_type` (known)."""
    chain: list[ir.Node] = []
    while (node := ctx.sole_reader(tensor)) is not None and _transparent(node):
        if node.op_type == "Cast" and (elem_type is None or int(attr(node, "to")) != elem_type):
            return []
        chain.append(node)
        tensor = node.outputs[0]
    return chain


def _match_affine(
    x: ir.Value, y: ir.Value, ctx: MatchContext, nodes: list[ir.Node], run_time: bool = False
) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
    """Optional `⊙ γ` then `+ β` after the normalized tensor `y` of input `x`, with constant operands
    (`run_time`: any operand).

    Casts after x̂ belong to the norm only if they cast to x's own (stated) type, so that the norm
    as a whole maps x to a tensor of x's type, as the RMS op that replaces it does (Llama's
    `weight * hidden.to(input_dtype)`, x̂ cast back from the fp32 it was computed in).
    """
    gamma = beta = None
    casts = _casts_to(y, ctx.elem_type(x), ctx)
    if casts:
        nodes.extend(casts)
        y = casts[-1].outputs[0]
    consumer = ctx.sole_reader(y)
    if consumer is not None and consumer.op_type == "Mul":
        other = _other_input(consumer, y)
        if other is not None and (run_time or constant_values(other) is not None):
            gamma, y = other, consumer.outputs[0]
            nodes.append(consumer)
            consumer = ctx.sole_reader(y)
    if consumer is not None and consumer.op_type == "Add":
        other = _other_input(consumer, y)
        if other is not None and (run_time or constant_values(other) is not None):
            beta, y = other, consumer.outputs[0]
            nodes.append(consumer)
    return y, gamma, beta


def _dead_nodes(node: ir.Node, ctx: MatchContext) -> list[ir.Node] | None:
    """`node` and every node reading what it computes, if nothing of it reaches a graph output or a
    node out of scope (nothing reads what it computes), else None. Looks at `DEAD_LIMIT` nodes at most."""
    found = {id(node): node}
    stack = [node]
    while stack:
        for out in stack.pop().outputs:
            if out.name in ctx.graph_outputs:
                return None
            for reader in readers(out):
                if ctx.scope is not None and id(reader) not in ctx.scope:
                    return None
                if id(reader) not in found:
                    if len(found) >= DEAD_LIMIT:
                        return None
                    found[id(reader)] = reader
                    stack.append(reader)
    return list(found.values())


def _outside_readers(nodes: list[ir.Node], y: ir.Value, ctx: MatchContext) -> tuple[ir.Value, str] | None:
    """Where an intermediate tensor of `nodes` is read outside them: (tensor, by what), else None.

    Readers whose outputs nothing reads join `nodes` (they are removed with the norm).
    """
    members = {id(n) for n in nodes}
    for node in list(nodes):
        for out in node.outputs:
            if out is y:
                continue
            if out.name in ctx.graph_outputs:
                return out, "is also a graph output"
            for reader in {id(r): r for r in readers(out)}.values():
                if id(reader) in members:
                    continue
                dead = _dead_nodes(reader, ctx)
                if dead is None:
                    return out, f"is also read by {reader.op_type} {reader.name}, outside the norm"
                nodes.extend(n for n in dead if id(n) not in members)
                members.update(id(n) for n in dead)
    return None


def _meet(values: list[ir.Value]) -> tuple[ir.Value, list[ir.Node]]:
    """The latest value that all `values` (of one root) are through Casts and Identitys, and those nodes."""
    for x in _chain(values[0]):
        paths = [path for t in values if (path := _between(t, x)) is not None]
        if len(paths) == len(values):
            return x, [n for path in paths for n in path]
    raise ValueError("values of different roots never meet")  # the callers pass values of one root, which meet there


def _first_reading(nodes: list[ir.Node], x: ir.Value) -> list[ir.Node]:
    """`nodes` once each, with one that reads x as its first input first (the rewrite reads x there)."""
    unique = list({id(n): n for n in nodes}.values())
    first = next(n for n in unique if n.inputs and n.inputs[0] is x)
    return [first] + [n for n in unique if n is not first]


def _runtime_parts(nodes: list[ir.Node], eps: float, axes: tuple[int, ...]) -> str | None:
    """Why a matched norm's algebra is not fixed: ε, axes or an exponent given at run time."""
    runtime = (
        ["ε"] * math.isnan(eps)
        + ["axes"] * (RUNTIME_AXIS in axes)
        + [f"exponent {name_of(n.inputs[1])}" for n in nodes if n.op_type == "Pow" and _scalar(n.inputs[1]) is None]
    )
    if not runtime:
        return None
    verb = "are" if len(runtime) > 1 else "is"
    return (
        f"its {' and '.join(runtime)} {verb} given at run time (an initializer listed as a graph input), "
        "so its algebra is not fixed"
    )


# --- decomposed LayerNorm -------------------------------------------------------------------------


class _LayerNorm:
    """Match the decomposed LayerNorm whose mean is the ReduceMean `anchor` of `x` over `axes` (see the module
    docstring). `subs`: the Subs x − mean, and `minuends` the x each of them reads (through Casts)."""

    def __init__(self, anchor: ir.Node, ctx: MatchContext, x: ir.Value, axes: tuple[int, ...]):
        self.anchor, self.ctx, self.x, self.axes = anchor, ctx, x, axes
        self.source = _root(x)
        self.nodes: list[ir.Node] = [anchor]
        self.means = _aliases([anchor.outputs[0]], ctx, self.nodes)
        subtractions = [
            (n, n.inputs[0])
            for m in self.means
            for n in ctx.readers(m)
            if n.op_type == "Sub"
            and len(n.inputs) == 2
            and n.inputs[1] is m
            and n.inputs[0] is not None
            and _root(n.inputs[0]) is self.source
        ]
        self.subs = [sub for sub, _ in subtractions]
        self.minuends = [minuend for _, minuend in subtractions]

    @classmethod
    def at(cls, anchor: ir.Node, ctx: MatchContext) -> _LayerNorm | None:
        """The matcher of `anchor` if it is a candidate: a ReduceMean over known axes whose mean is subtracted
        from its own input, x − mean(x)."""
        axes, x = _reduce_axes(anchor, ctx), input_at(anchor, 0)
        if axes is None or x is None:
            return None
        matcher = cls(anchor, ctx, x, axes)
        return matcher if matcher.subs else None

    def match(self) -> NormMatch:
        x, between = _meet([self.x, *self.minuends])
        self.nodes += between + self.subs
        deviations = _aliases([s.outputs[0] for s in self.subs], self.ctx, self.nodes)

        def is_deviation(value: ir.Value) -> bool:
            return value in deviations

        variance = self._centred_variance(deviations, is_deviation) or self._moments_variance(x)
        divider, eps, outside, root = _root_divide(variance, is_deviation, self.ctx, self.nodes)
        core, normalized = list(self.nodes), divider.outputs[0]
        problem = _outside_readers(core, normalized, self.ctx)
        if problem is not None:
            tensor, where = problem
            what = "mean" if tensor in self.means else "standard deviation" if tensor in root else "intermediate"
            raise _Shared(f"its {what} {name_of(tensor)} {where}")
        match = self._extend(x, normalized, core)
        match.epsilon, match.eps_outside_root = eps, outside
        match.unsupported = _runtime_parts(match.nodes, eps, self.axes) or self._type_change(match)
        return match

    def _type_change(self, match: NormMatch) -> str | None:
        """Why a norm whose output type differs from its input's cannot become an RMS op (which keeps it)."""
        before, after = self.ctx.elem_type(match.x), self.ctx.elem_type(match.y)
        if before is None or after is None or before == after:
            return None
        names = [onnx.helper.tensor_dtype_to_string(t).removeprefix("TensorProto.").lower() for t in (before, after)]
        return (
            f"it maps {match.x.name} ({names[0]}) to {match.y.name} ({names[1]}) with no Cast back before its "
            "output, and an RMS op keeps its input's type; not rewritten"
        )

    def _centred_variance(
        self, deviations: list[ir.Value], is_deviation: Callable[[ir.Value], bool]
    ) -> list[ir.Value] | None:
        """ReduceMean(d²) over the mean's axes (Casts between), or None if d is not squared."""
        squares = [n for d in deviations for n in self.ctx.readers(d) if _is_square(n, is_deviation)]
        if not squares:
            return None
        square = _one(squares, "square of x − mean")
        self.nodes.append(square)
        return self._mean_of_square(square)

    def _moments_variance(self, x: ir.Value) -> list[ir.Value]:
        """ReduceMean(x²) − mean² over the mean's axes (Casts between)."""

        def is_x(value: ir.Value) -> bool:
            return _between(value, x) is not None

        def is_mean(value: ir.Value) -> bool:
            return value in self.means

        xs = _aliases([x], self.ctx, [])
        mean_square = _one([n for m in self.means for n in self.ctx.readers(m) if _is_square(n, is_mean)], "mean²")
        square = _one([n for v in xs for n in self.ctx.readers(v) if _is_square(n, is_x)], "square of x or of x − mean")
        paths = [path for t in square.inputs if t is not None and (path := _between(t, x)) is not None]
        self.nodes += [mean_square, square, *(n for path in paths for n in path)]
        means_of_square = self._mean_of_square(square)
        squares_of_mean = _aliases([mean_square.outputs[0]], self.ctx, self.nodes)
        subs = [
            n
            for v in means_of_square
            for n in self.ctx.readers(v)
            if n.op_type == "Sub" and n.inputs[0] is v and n.inputs[1] in squares_of_mean
        ]
        variance = _one(subs, "variance E[x²] − E[x]²")
        self.nodes.append(variance)
        return _aliases([variance.outputs[0]], self.ctx, self.nodes)

    def _mean_of_square(self, square: ir.Node) -> list[ir.Value]:
        """The aliases of ReduceMean(square) over the mean's own axes."""
        mean, axes = _mean_of(_aliases([square.outputs[0]], self.ctx, self.nodes), self.ctx, self.nodes)
        if not _same_axes(axes, self.axes, self.ctx.rank(self.x)):
            raise NoMatch(f"the mean is over axes {list(self.axes)} but the variance over axes {list(axes)}")
        return _aliases([mean.outputs[0]], self.ctx, self.nodes)

    def _extend(self, x: ir.Value, normalized: ir.Value, core: list[ir.Node]) -> NormMatch:
        """The core plus γ and β and, for ONNX's function body, the Flatten before and the Reshape after.

        Each extension is taken only if the tensors it adds stay private to the norm.
        """
        flattened = self._flattened(x)
        if flattened is not None and (view := self._unflattened(normalized, core, *flattened)) is not None:
            return view
        nodes = list(core)
        y, gamma, beta = _match_affine(x, normalized, self.ctx, nodes)
        if _outside_readers(nodes, y, self.ctx) is not None:
            nodes, y, gamma, beta = list(core), normalized, None, None
        axis = self.axes[0] if len(self.axes) == 1 else -1
        return NormMatch(_first_reading(nodes, x), x, y, axis, 0.0, gamma, beta, axes=self.axes)

    def _unflattened(
        self, normalized: ir.Value, core: list[ir.Node], source: ir.Value, flatten: list[ir.Node], axis: int
    ) -> NormMatch | None:
        """The norm of `source` over [axis, rank) that ONNX's function body computes on `Flatten<axis>(source)`:
        x̂, cast back, ⊙ γ, + β (Identity without β), `Reshape` to `Shape(source)`. γ and β there may
        be computed at run time (the norm is then declined for it), else no RMS op could replace it."""
        nodes = [*core, *flatten]
        y, gamma, beta = _match_affine(source, normalized, self.ctx, nodes, run_time=True)
        between = _casts_to(y, self.ctx.elem_type(source), self.ctx)
        back = self.ctx.sole_reader(between[-1].outputs[0] if between else y)
        if back is None or back.op_type != "Reshape" or not _is_shape_of(input_at(back, 1), source):
            return None
        nodes += [*between, back]
        if _outside_readers(nodes, back.outputs[0], self.ctx) is not None:
            return None
        return NormMatch(_first_reading(nodes, source), source, back.outputs[0], axis, 0.0, gamma, beta)

    def _flattened(self, x: ir.Value) -> tuple[ir.Value, list[ir.Node], int] | None:
        """For the rows of `Flatten<axis>(t)` (the mean over axis 1 of the 2-D view): (t, the Flatten and
        the Casts up to x, axis)."""
        root = _root(x)
        flatten, casts = root.producer(), _between(x, root)
        if flatten is None or flatten.op_type != "Flatten" or casts is None or not _same_axes(self.axes, (1,), 2):
            return None
        source = input_at(flatten, 0)
        return None if source is None else (source, [flatten, *casts], int(attr(flatten, "axis", 1)))

    def seen(self) -> str | None:
        """What is there of a LayerNorm if x − mean is divided by a square root or its standard deviation
        is computed (the square root of the mean of its square), else None."""
        start = (
            f"{self.source.name} − ReduceMean {self.anchor.name} over axes {list(self.axes)} "
            f"(Sub {', '.join(name_of(s) for s in self.subs)})"
        )
        deviations = _aliases([s.outputs[0] for s in self.subs], self.ctx, [])
        for d in deviations:
            for node in self.ctx.readers(d):
                divides = node.op_type == "Div" and node.inputs[0] is d
                if (divides or node.op_type == "Mul") and _from_root(_other_input(node, d), not divides):
                    verb = "divided" if divides else "multiplied"
                    return f"{start} is {verb} by a square root ({node.op_type} {node.name})"
        root = self._standard_deviation(deviations)
        if root is None or not self._scales_input(root):
            return None
        return f"{start} has its standard deviation computed (Sqrt {root.name})"

    def _scales_input(self, root: ir.Node) -> bool:
        """Whether x is multiplied or divided by something computed from the square root (its reciprocal
        times γ, say): the root normalizes x, as against statistics pooling, which outputs it."""
        found, stack = {id(root)}, [root]
        while stack and len(found) <= DEAD_LIMIT:
            for reader in self.ctx.readers(stack.pop().outputs[0]):
                if reader.op_type in ("Mul", "Div") and any(
                    t is not None and _root(t) is self.source for t in reader.inputs
                ):
                    return True
                if id(reader) not in found and (
                    reader.op_type in ("Reciprocal", "Mul", "Div", "Add") or _transparent(reader)
                ):
                    found.add(id(reader))
                    stack.append(reader)
        return False

    def _standard_deviation(self, deviations: list[ir.Value]) -> ir.Node | None:
        """The Sqrt of ReduceMean(d²) (+ ε), Casts between, if x − mean is squared and averaged."""
        squares = [n for d in deviations for n in self.ctx.readers(d) if _is_square(n, deviations.__contains__)]
        for square in squares:
            for mean in (n for v in _aliases(square.outputs, self.ctx, []) for n in self.ctx.readers(v)):
                if _reduce_axes(mean, self.ctx) is None:
                    continue
                variance = _aliases(mean.outputs, self.ctx, [])
                plus_eps = [
                    n.outputs[0] for v in variance for n in self.ctx.readers(v) if _scalar_add(n, v) is not None
                ]
                for value in _aliases(variance + plus_eps, self.ctx, []):
                    root = next((n for n in self.ctx.readers(value) if n.op_type == "Sqrt"), None)
                    if root is not None:
                        return root
        return None


def _is_shape_of(shape: ir.Value | None, source: ir.Value) -> bool:
    """Whether `shape` is the whole `Shape(source)`."""
    node = _producer(shape, "Shape")
    return node is not None and input_at(node, 0) is source and not {"start", "end"} & set(node.attributes)


class _Shared(NoMatch):
    """A LayerNorm, matched, whose intermediate tensors are read elsewhere."""


def _from_root(tensor: ir.Value | None, inverted: bool) -> bool:
    """Whether `tensor` is a square root (plus ε), or with `inverted` its reciprocal, through Casts."""
    node = None if tensor is None else _root(tensor).producer()
    if inverted:
        inverse = node.inputs[-1] if node is not None and node.inputs else None
        if node is None or inverse is None or not _is_reciprocal_of(node, inverse):
            return False
        node = _root(inverse).producer()
    if node is not None and node.op_type == "Add":
        roots = [_producer(_root(t), "Sqrt") for t in node.inputs if t is not None]
        node = next((root for root in roots if root is not None), node)
    return node is not None and node.op_type == "Sqrt"


def _listed(anchor: ir.Node, x: ir.Value, reason: str) -> NormMatch:
    """A norm listed but not rewritten: it occupies its anchor alone, which reads x."""
    return NormMatch([anchor], x, anchor.outputs[0], -1, 0.0, unsupported=reason)


def match_layer_norm(node: ir.Node, ctx: MatchContext) -> tuple[NormType, NormMatch, str] | None:
    """A decomposed LayerNorm anchored at its mean (a ReduceMean), as (type, match, op shown)."""
    if node.op_type != "ReduceMean":
        return None
    matcher = _LayerNorm.at(node, ctx)
    if matcher is None:
        return None
    try:
        return NormType.LAYER, matcher.match(), "decomposed LayerNorm"
    except _Shared as e:
        return NormType.LAYER, _listed(node, matcher.x, f"not rewritten: {e}"), "decomposed LayerNorm"
    except NoMatch as e:
        seen = matcher.seen()
        if seen is None:
            return None
        return NormType.LAYER, _listed(node, matcher.x, f"not recognised as a LayerNorm: {seen}; {e}"), UNRECOGNISED


# --- decomposed RMSNorm ---------------------------------------------------------------------------


def _is_deviation(tensor: ir.Value, ctx: MatchContext) -> bool:
    """Whether `tensor` is x − ReduceMean(x) (through Casts and Identitys): the d of a LayerNorm."""
    node = _producer(_root(tensor), "Sub")
    if node is None or len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
        return False
    mean = _root(node.inputs[1]).producer()
    averaged = None if mean is None else input_at(mean, 0)
    return (
        mean is not None
        and averaged is not None
        and _reduce_axes(mean, ctx) is not None
        and _root(averaged) is _root(node.inputs[0])
    )


def match_rms_norm(node: ir.Node, ctx: MatchContext) -> tuple[NormType, NormMatch, str] | None:
    """A decomposed RMSNorm `x / Sqrt(ReduceMean(x²) + ε)` anchored at its square."""
    if node.op_type not in ("Pow", "Mul") or not node.inputs or node.inputs[0] is None:
        return None
    squared = [t for t in node.inputs[: 2 if node.op_type == "Mul" else 1] if t is not None]  # x, or x and x
    source = _root(squared[0])

    def is_x(value: ir.Value) -> bool:
        return _root(value) is source

    if not _is_square(node, is_x) or _is_deviation(source, ctx):
        return None
    nodes = [node]
    try:
        mean, axes = _mean_of(_aliases([node.outputs[0]], ctx, nodes), ctx, nodes)
        if any(n.op_type == "Sub" for v in _aliases([mean.outputs[0]], ctx, []) for n in ctx.readers(v)):
            return None  # E[x²] of a LayerNorm's moments variance E[x²] − E[x]² (x may be read by other norms too)
        divider, eps, outside, _ = _root_divide(_aliases([mean.outputs[0]], ctx, nodes), is_x, ctx, nodes)
    except NoMatch:
        return None
    numerator = next(t for t in divider.inputs[: 1 if divider.op_type == "Div" else 2] if t is not None and is_x(t))
    x, between = _meet([*squared, numerator])
    nodes += between
    core = list(nodes)
    y, gamma, beta = _match_affine(x, divider.outputs[0], ctx, nodes)
    if _outside_readers(nodes, y, ctx) is not None:
        nodes, y, gamma, beta = core, divider.outputs[0], None, None
        problem = _outside_readers(nodes, y, ctx)
        if problem is not None:
            reason = f"{ALREADY_RMS}; not rewritten: its intermediate {problem[0].name} {problem[1]}"
            return NormType.RMS, _listed(node, squared[0], reason), "decomposed RMSNorm"
    match = NormMatch(
        _first_reading(nodes, x),
        x,
        y,
        axes[0] if len(axes) == 1 else -1,
        eps,
        gamma,
        beta,
        eps_outside_root=outside,
        unsupported=_runtime_parts(nodes, eps, axes),
        axes=axes,
    )
    return NormType.RMS, match, "decomposed RMSNorm"


def match_decomposed(node: ir.Node, ctx: MatchContext) -> tuple[NormType, NormMatch, str] | None:
    """A decomposed LayerNorm anchored at its first ReduceMean, or an RMSNorm at its square."""
    return match_layer_norm(node, ctx) or match_rms_norm(node, ctx)


# --- one op ----------------------------------------------------------------------------------------


def _used(tensor: ir.Value, graph_outputs: set[str]) -> bool:
    return bool(tensor.name) and (bool(tensor.uses()) or tensor.name in graph_outputs)


def _single(
    node: ir.Node, x: ir.Value, gamma: int | None, beta: int | None, eps: float, axis: int = -1, **extra
) -> NormMatch:
    return NormMatch(
        [node],
        x,
        node.outputs[0],
        int(attr(node, "axis", axis)),
        float(attr(node, "epsilon", eps)),
        None if gamma is None else input_at(node, gamma),
        None if beta is None else input_at(node, beta),
        **extra,
    )


def _skip_parts(node: ir.Node, graph_outputs: set[str]) -> dict:
    """The residual operands of a Skip*LayerNormalization: (x, skip, γ, [β], [bias]) → (y, -, -, [sum])."""
    total = node.outputs[3] if len(node.outputs) > 3 and _used(node.outputs[3], graph_outputs) else None
    return dict(skip=node.inputs[1], skip_bias=input_at(node, SKIP_BIAS_INPUT[node.op_type]), skip_sum=total)


def match_single_op(node: ir.Node, graph_outputs: set[str]) -> tuple[NormType, NormMatch] | None:
    """Norms that are one op (see the module docstring for the list)."""
    x = input_at(node, 0)
    if x is None:  # nothing to normalize: no norm (an op without its input is invalid, ONNX Runtime refuses it)
        return None
    stats_used = any(_used(o, graph_outputs) for o in node.outputs[1:3])
    if node.op_type == "LayerNormalization":  # ONNX (opset ≥ 17) and com.microsoft: same inputs and outputs
        return NormType.LAYER, _single(node, x, 1, 2, 1e-5, extra_outputs_used=stats_used)
    if node.op_type == "SkipLayerNormalization":
        return NormType.LAYER, _single(
            node, x, 2, 3, 1e-12, extra_outputs_used=stats_used, **_skip_parts(node, graph_outputs)
        )
    if node.op_type == "SkipSimplifiedLayerNormalization":
        return NormType.RMS, _single(node, x, 2, None, 1e-12, **_skip_parts(node, graph_outputs))
    if node.op_type in ("SimplifiedLayerNormalization", "RMSNormalization"):
        return NormType.RMS, _single(node, x, 1, None, 1e-5)
    if node.op_type == "EmbedLayerNormalization":
        return NormType.LAYER, _single(
            node,
            x,
            5,
            6,
            1e-12,
            unsupported=(
                "EmbedLayerNormalization normalizes a sum of embedding lookups made inside the op, and "
                "ONNX Runtime has no RMS variant of it; not rewritten"
            ),
        )
    if node.op_type == "GroupNormalization":
        return NormType.GROUP, _single(node, x, 1, 2, 1e-5, axis=1)
    if node.op_type in ("SkipGroupNorm", "GroupNorm"):  # com.microsoft, channels-last
        return NormType.GROUP, _single(node, x, 1, 2, 1e-5)
    return None


# --- what the analysis sees -------------------------------------------------------------------------


def _normalized_axes(match: NormMatch, rank: int) -> list[int]:
    """The axes the norm normalizes, non-negative and sorted."""
    if match.axes is not None:
        return sorted({a % rank for a in match.axes})
    start = match.axis + rank if match.axis < 0 else match.axis
    return list(range(start, rank))


def _axes_reason(axes: list[int], rank: int) -> str:
    if len(axes) > 1 and axes == list(range(axes[0], rank)):
        return (
            f"normalizes over axes {axes[0]}..{rank - 1}: zero mean along one axis does not make a "
            "multi-axis LayerNorm an RMSNorm"
        )
    if len(axes) == 1:
        return f"normalizes over axis {axes[0]}, not the last one: the RMS ops normalize over the last axes"
    return f"normalizes over axes {axes}: zero mean along one axis does not make a multi-axis LayerNorm an RMSNorm"


def norm_info(name: str, op: str, norm_type: NormType, match: NormMatch, rank: int | None) -> NormInfo:
    """Describe a match for the analysis: the normalized axis, and whether it can ever fold."""
    unsupported = None
    axes = None if rank is None else _normalized_axes(match, rank)
    last = None if rank is None else rank - 1
    single = last is not None and axes == [last]
    if norm_type is NormType.GROUP:
        unsupported = (
            "GroupNorm: centring leaves a shift that varies over spatial positions, which GroupNorm "
            "does not remove, and ONNX Runtime has no grouped RMS op; not rewritten"
        )
    elif norm_type is NormType.RMS:
        unsupported = ALREADY_RMS
    elif axes is None or rank is None:
        unsupported = f"the rank of {match.x.name} is unknown, so the normalized axis cannot be tracked"
    elif not single:
        unsupported = _axes_reason(axes, rank)
    elif match.extra_outputs_used:
        unsupported = "its Mean/InvStdDev outputs are used"
    unsupported = match.unsupported or unsupported
    gamma = None if match.gamma is None else constant_values(match.gamma)
    beta = None if match.beta is None else constant_values(match.beta)
    output_centred = (
        norm_type is NormType.LAYER
        and (match.gamma is None or (gamma is not None and is_uniform(gamma)))
        and (match.beta is None or (beta is not None and has_zero_mean(beta)))
    )
    if norm_type is NormType.LAYER and (
        (match.gamma is not None and gamma is None) or (match.beta is not None and beta is None)
    ):
        unsupported = unsupported or "its γ or β is computed at run time, not a constant"
    return NormInfo(
        name=name,
        op=op,
        norm_type=norm_type,
        input=match.normalized,
        output=name_of(match.y),
        axis=last if single and match.unsupported is None else None,
        epsilon=match.epsilon,
        scale=None if match.gamma is None else match.gamma.name,
        bias=None if match.beta is None else match.beta.name,
        output_centred=output_centred,
        unsupported=unsupported,
        ref=match,
    )
