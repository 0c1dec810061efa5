"""Where a norm's per-feature affine can go in an ONNX graph, and moving it there.

A norm's output is y = u⊙γ + β, per feature (the last axis). Both rewrites (the exact fold and
the surrogates) remove the affine where that is exact:

* **γ and β into linear layers.** When every path from y reaches, through reshapes that keep the
  feature axis, a linear layer that contracts over the features (MatMul with a constant weight,
  Gemm, the packed QKV projection of `com.microsoft.Attention`), then (u⊙γ + β)·W + b = u·W' + b'
  with W' = diag(γ)·W and b' = b + β·W (`algebra.migrate_affine`; a Gemm's β·W is scaled by α/β_g).
* **β alone across a residual Add.** When each consumer is such a layer or an `Add(y, s)` whose
  other summand s carries a bias c through Adds nothing else reads, then
  Add(y, s) = Add(y − β, s + β): c' = c + β, and the other readers take β·W as above. γ stays
  in the norm (the residual stream needs u⊙γ).

Every rewritten constant is a new initializer read only by the rewritten node (copy-on-write):
whatever else read the old one (a tied LM head, a deduplicated bias) keeps reading it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx_ir as ir

from ...core.algebra import migrate_affine, scale_along
from ...core.analysis import regroup_axis
from ...errors import WeightOverflowError
from ...io import drop_pages
from ..graph.constants import constant_values, is_constant
from ..graph.frontend import SHAPE_READERS, OnnxGraph
from ..graph.patterns import SKIP_BIAS_INPUT
from ..graph.values import attr, input_at, is_initializer, name_of, readers
from .derived import DerivedTensor, compatible

LAZY_MIN_BYTES = 2**20  # derived weights at least this large are computed when written

REGROUP_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
BIASED_ACTIVATIONS = ("BiasGelu", "FastGelu")  # com.microsoft f(x + bias): the bias input takes β·W like an Add


def is_feature_vector(values: np.ndarray | None, width: int) -> bool:
    return values is not None and values.size == width and values.shape[-1:] == (width,)


def is_private(tensor: ir.Value, graph_outputs: set[str]) -> bool:
    """Whether one node reads the values of `tensor` (readers of its shape alone do not count)."""
    return len(value_readers(tensor)) == 1 and tensor.name not in graph_outputs


def value_readers(tensor: ir.Value) -> list[ir.Node]:
    """The nodes reading `tensor`'s values: a `Shape` or `Size` reader sees no change of them."""
    return [node for node in readers(tensor) if node.op_type not in SHAPE_READERS]


def private_bias(tensor: ir.Value, width: int, graph_outputs: set[str]) -> tuple[ir.Node, int] | None:
    """(Add node, input index) of a bias summed into `tensor` through private Adds, else None.

    The bias broadcasts along the feature axis only, so adding a d-vector (or a scalar) to it adds
    the same to `tensor` and to nothing else.
    """
    node = tensor.producer()
    if node is None or node.op_type != "Add" or len(node.inputs) != 2 or node.inputs[0] is node.inputs[1]:
        return None
    for index, operand in enumerate(node.inputs):
        if is_feature_vector(constant_values(operand), width):
            return node, index
    for operand in node.inputs:
        if operand is not None and constant_values(operand) is None and is_private(operand, graph_outputs):
            found = private_bias(operand, width, graph_outputs)
            if found is not None:
                return found
    return None


@dataclass(frozen=True)
class LinearTarget:
    """A linear layer contracting over the features: its weight's input axis and where its bias is."""

    node: ir.Node
    in_axis: int
    bias_node: ir.Node | None  # the node whose input `bias_index` is (or would be) the bias
    bias_index: int | None


@dataclass(frozen=True)
class SumTarget:
    """β moves from y into the bias of the other summand of a residual Add: (y − β) + (s + β)."""

    add: ir.Node
    holder: ir.Node
    index: int


@dataclass
class AffinePlan:
    """Where a norm's γ and β can go: into linear layers (both), β alone, or nowhere."""

    full: list[LinearTarget] | None  # targets taking γ and β
    beta: list[LinearTarget | SumTarget] | None  # targets taking β alone (γ stays in the norm)


def affine_plan(
    ctx: OnnxGraph, graph_outputs: set[str], y: ir.Value, width: int | None, needs_bias: bool
) -> AffinePlan:
    """Where the affine of a norm writing `y` (`width` features) can go; β-only only if `needs_bias`."""
    full = migration_targets(ctx, graph_outputs, y, needs_bias)
    if full is not None or not needs_bias or width is None:
        return AffinePlan(full, None)
    return AffinePlan(None, migration_targets(ctx, graph_outputs, y, True, _sum_claim(ctx, width, graph_outputs)))


def migration_targets(
    ctx: OnnxGraph, graph_outputs: set[str], tensor: ir.Value, needs_bias: bool, other=None
) -> list | None:
    """Where a per-feature affine on `tensor` (its last axis) can go, or None.

    Every path from `tensor` must reach, through reshapes that keep the feature axis, the input of
    a reader of shapes only (`Shape`, `Size`: it does not see the affine) or of a linear layer that
    contracts over it (and can take a bias when `needs_bias`). `other(consumer, tensor, axis)` may
    claim a consumer that is not such a layer by returning a target of its own (anything not None);
    by default nothing else is accepted.
    """
    targets = []
    shape = ctx.shapes.get(name_of(tensor))
    frontier = [(tensor, len(shape) - 1 if shape else None)]
    while frontier:
        current, axis = frontier.pop()
        if current.name in graph_outputs or not current.uses() or axis is None:
            return None
        for consumer in ctx.readers(current):  # a reader inside a control-flow body is its control-flow node
            if consumer.op_type in SHAPE_READERS:  # reads no values: the affine does not matter to it
                continue
            if other is not None and (claimed := other(consumer, current, axis)) is not None:
                targets.append(claimed)
                continue
            if consumer.inputs[0] is not current or current in consumer.inputs[1:]:
                return None
            if consumer.op_type in REGROUP_OPS:
                out = consumer.outputs[0]
                frontier.append(
                    (out, regroup_axis(ctx.shapes.get(name_of(current)), ctx.shapes.get(name_of(out)), axis))
                )
                continue
            target = linear_target(ctx, graph_outputs, consumer, axis, needs_bias)
            if target is None:
                return None
            targets.append(target)
    return targets


def linear_target(
    ctx: OnnxGraph, graph_outputs: set[str], consumer: ir.Node, axis: int, needs_bias: bool
) -> LinearTarget | None:
    """The target if `consumer` is a linear layer contracting over `axis` (and can take a bias if needed)."""
    rank = len(ctx.shapes.get(name_of(consumer.inputs[0])) or ())
    weight = input_at(consumer, 1)
    weight_shape = None if weight is None else ctx.shapes.get(name_of(weight))
    if weight is None or not is_constant(weight) or weight_shape is None or len(weight_shape) != 2 or axis != rank - 1:
        return None
    if consumer.op_type == "Gemm" and not attr(consumer, "transA", 0):
        if (input_at(consumer, 2) is not None and not is_constant(consumer.inputs[2])) or (
            needs_bias and attr(consumer, "beta", 1.0) == 0
        ):
            return None
        return LinearTarget(consumer, attr(consumer, "transB", 0), consumer, 2)
    if consumer.op_type == "Attention" and consumer.domain == "com.microsoft":  # QKV = x·W + b, W packed [d, 3d]
        if is_constant(input_at(consumer, 2)):
            return LinearTarget(consumer, 0, consumer, 2)
        return None if needs_bias else LinearTarget(consumer, 0, None, None)
    if consumer.op_type != "MatMul":
        return None
    product = consumer.outputs[0]
    readers = ctx.readers(product)
    add = readers[0] if len(readers) == 1 and product.name not in graph_outputs else None
    if add is not None and (
        add.op_type == "Add" or (add.op_type in BIASED_ACTIVATIONS and len(add.inputs) > 1 and add.inputs[0] is product)
    ):
        other = 1 if add.inputs[0] is product else 0
        bias = constant_values(add.inputs[other])
        if bias is not None and bias.shape[-1:] == (weight_shape[1],) and bias.size == weight_shape[1]:
            return LinearTarget(consumer, 0, add, other)
    return None if needs_bias else LinearTarget(consumer, 0, None, None)


def other_summand(node: ir.Node, tensor: ir.Value) -> int | None:
    """The input index of the other operand, if `node` is an `Add` of `tensor` and a different tensor."""
    if node.op_type != "Add" or len(node.inputs) != 2 or node.inputs[0] is node.inputs[1]:
        return None
    if tensor not in node.inputs:
        return None
    return 1 if node.inputs[0] is tensor else 0


def _sum_claim(ctx: OnnxGraph, width: int, graph_outputs: set[str]):
    """Claims a residual `Add(tensor, s)` whose other summand s carries a private bias."""

    def claim(consumer: ir.Node, tensor: ir.Value, axis: int) -> SumTarget | None:
        if consumer.op_type in SKIP_BIAS_INPUT:
            return _skip_claim(consumer, tensor, width)
        other_index = other_summand(consumer, tensor)
        if other_index is None:
            return None
        in_shape, out_shape = ctx.shapes.get(name_of(tensor)), ctx.shapes.get(name_of(consumer.outputs[0]))
        if (
            not in_shape
            or not out_shape
            or in_shape[-1] != width
            or out_shape[-1] != width
            or axis != len(in_shape) - 1
        ):
            return None
        other = consumer.inputs[other_index]
        values = constant_values(other)
        if is_feature_vector(values, width):
            return SumTarget(consumer, consumer, other_index)
        if other is not None and values is None and is_private(other, graph_outputs):
            found = private_bias(other, width, graph_outputs)
            if found is not None:
                return SumTarget(consumer, found[0], found[1])
        return None

    return claim


def _skip_claim(node: ir.Node, tensor: ir.Value, width: int) -> SumTarget | None:
    """A Skip op summing `tensor` with another run-time operand and a bias: β moves into that bias."""
    index = SKIP_BIAS_INPUT[node.op_type]
    reads = [i for i, t in enumerate(node.inputs) if t is tensor]
    if reads not in ([0], [1]) or len(node.inputs) <= index:
        return None
    return SumTarget(node, node, index) if is_feature_vector(constant_values(node.inputs[index]), width) else None


class Namer:
    """Unique node and tensor names within one graph."""

    def __init__(self, graph: ir.Graph):
        nodes = list(graph.all_nodes())
        values = [
            *graph.inputs,
            *graph.initializers.values(),
            *(t for node in nodes for t in (*node.inputs, *node.outputs)),
        ]
        self.names = {t.name for t in values if t is not None} | {node.name for node in nodes}

    def __call__(self, base: str) -> str:
        name, index = base, 1
        while name in self.names:
            index += 1
            name = f"{base}_{index}"
        self.names.add(name)
        return name


def new_initializer(graph: ir.Graph, name: str, values: np.ndarray) -> ir.Value:
    """A new initializer of `graph` holding `values` (an in-memory `ir.Tensor`)."""
    values = np.ascontiguousarray(values)
    tensor = ir.Tensor(values, name=name)
    value = ir.Value(name=name, shape=ir.Shape(values.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _all_finite(values: np.ndarray | None) -> bool:
    """Whether no value is ±inf or NaN (None: no values), without a temporary the size of `values`: finite
    values of at most 32 bits cannot sum to ±inf in float64, so the sum is finite exactly when they all
    are (wider values: their extremes)."""
    if values is None or values.size == 0:
        return True
    if values.dtype.itemsize <= 4:
        return bool(np.isfinite(values.sum(dtype=np.float64)))
    return bool(np.isfinite(values.min()) and np.isfinite(values.max()))


def refuse_overflow(
    values: np.ndarray, sources: Iterable[np.ndarray | None], what: str, migrated: bool = False
) -> np.ndarray:
    """`values`, unless they overflow their dtype: every source finite, some value ±inf or NaN. Then no
    model of that dtype computes the rewrite exactly, verified or not: `WeightOverflowError`, naming
    `what` ("initializer W centred for ln"). `migrated`: `what` is an affine migration, which the
    fold can do without."""
    if _all_finite(values) or not all(_all_finite(s) for s in sources):
        return values
    dtype = values.dtype.name
    remedy = "fold without affine migration (γ and β then stay in the norm), or " if migrated else ""
    raise WeightOverflowError(
        f"{what} overflows {dtype} (finite weights become ±inf), so no {dtype} model computes this rewrite "
        f"exactly: {remedy}convert the model to float32; nothing written"
    )


def derived_initializer(
    graph: ir.Graph,
    name: str,
    source: ir.Value,
    make,
    change: str,
    migrated: bool = False,
    lazy: bool = True,
    axis: int | None = None,
) -> ir.Value:
    """A new initializer of `graph` holding `make(values of source)`: the source after `change` (e.g.
    "centred for ln"), refused where that overflows (`refuse_overflow`).

    A source initializer of at least `LAZY_MIN_BYTES` is not computed now: with `axis` (`make` acts on each
    fibre along it alone, and may change its size there: a cut) it gives a `derived.DerivedTensor`, computed
    and written slab by slab from the source's slabs whenever it is written; without, where `lazy` (the
    shape and dtype kept), an `ir.LazyTensor` computed whole each time it is written. Neither is held in
    between, so a large model's changed weights are never all in memory (an overflow is then refused when
    the model is written: the atomic write leaves nothing). Others are computed now.
    """
    what = f"initializer {name_of(source)} {change}"
    tensor = source.const_value if is_initializer(source) else None
    if tensor is not None and tensor.nbytes >= LAZY_MIN_BYTES and axis is not None and compatible(tensor, axis):
        check = partial(_checked_slab, what=what, migrated=migrated)
        derived = DerivedTensor(tensor, make, axis, name, check)
        return _register(graph, name, derived)
    if tensor is None or tensor.nbytes < LAZY_MIN_BYTES or not lazy:
        values = constant_values(source)
        return new_initializer(graph, name, refuse_overflow(make(values), [values], what, migrated))

    def compute() -> ir.Tensor:
        source_values = tensor.numpy()
        values = np.ascontiguousarray(make(source_values))
        drop_pages(tensor)
        refuse_overflow(values, [source_values], what, migrated)
        if values.shape != tuple(tensor.shape.numpy()) or ir.DataType.from_numpy(values.dtype) != tensor.dtype:
            raise AssertionError(f"{name}: a derived weight changed its shape or dtype")
        return ir.Tensor(values, name=name)

    deferred = ir.LazyTensor(compute, dtype=tensor.dtype, shape=ir.Shape(tensor.shape.numpy()), name=name)
    return _register(graph, name, deferred)


def _checked_slab(values: np.ndarray, source: np.ndarray, what: str, migrated: bool) -> np.ndarray:
    return refuse_overflow(values, [source], what, migrated)


def _register(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    """A new initializer of `graph` holding `tensor` (computed when read)."""
    value = ir.Value(
        name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def set_input(node: ir.Node, index: int, value: ir.Value) -> None:
    """Point input `index` of `node` at `value` (the inputs grow when `index` is past the end)."""
    if index >= len(node.inputs):
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)


def move_affine(
    graph: ir.Graph, targets: list, gamma: np.ndarray | None, beta: np.ndarray | None, unique: Namer
) -> list[str]:
    """Move γ/β into linear targets and β into sum targets (new initializers of `graph`); returns the
    names of the nodes changed.

    Pass None for a γ of ones or a β of zeros: nothing is computed for it.
    """

    def name_for(node: ir.Node, index: int, tag: str) -> str:
        old = input_at(node, index)
        return unique(f"{old.name if old is not None else f'{node.name}.bias'}.{tag}")

    def renew(node: ir.Node, index: int, values: np.ndarray, tag: str) -> None:
        set_input(node, index, new_initializer(graph, name_for(node, index, tag), values))

    changed = []
    for target in targets:
        if isinstance(target, SumTarget):
            old = target.holder.inputs[target.index]
            bias = constant_values(old)
            assert bias is not None  # a sum target's bias is a constant (`_sum_claim`)
            moved = (bias.astype(np.float64) + np.asarray(beta, dtype=np.float64).reshape(-1)).reshape(bias.shape)
            what = f"initializer {name_of(old)} plus a folded norm's β"
            moved = refuse_overflow(moved.astype(bias.dtype), [bias, beta], what, migrated=True)
            renew(target.holder, target.index, moved, "beta")
            changed.append(name_of(target.holder))
            continue
        linear = target.node
        bias = None
        if target.bias_node is not None and input_at(target.bias_node, target.bias_index) is not None:
            bias = constant_values(target.bias_node.inputs[target.bias_index])
        # Gemm: y = α·A·B + β_g·C, so β·W enters C scaled by α/β_g.
        shift_scale = attr(linear, "alpha", 1.0) / attr(linear, "beta", 1.0) if linear.op_type == "Gemm" else 1.0
        weight = linear.inputs[1]
        if gamma is not None:  # diag(γ)·W, computed when written where W is large
            scaled = derived_initializer(
                graph,
                name_for(linear, 1, "affine"),
                weight,
                # bound now: a large weight is computed when written, after this loop has moved on
                lambda w, axis=target.in_axis: migrate_affine(w, None, gamma, None, axis)[0],
                "multiplied by a folded norm's γ",
                migrated=True,
                axis=target.in_axis,
            )
            set_input(linear, 1, scaled)
        new_bias = bias
        if beta is not None:
            weights = constant_values(weight)
            assert weights is not None  # a linear target's weight is a constant (`linear_target`)
            shifted = migrate_affine(weights, bias, None, beta, target.in_axis, shift_scale)[1]
            assert shifted is not None  # β is given
            what = f"the bias of {name_of(linear)} plus a folded norm's β·W"
            new_bias = refuse_overflow(shifted, [weights, bias, beta], what, migrated=True)
        drop_pages(weight.const_value)
        if new_bias is not None and target.bias_node is not None:
            renew(target.bias_node, target.bias_index, new_bias, "affine")
        changed.append(name_of(linear))
    return changed


@dataclass
class StreamPlan:
    """Where a surrogate's γ goes along the residual stream (`core/stream.py`): the linear layers
    reading the stream (their input rows take D), those writing into it through a residual Add (their
    output rows and bias take 1/D), and the stream values read by linear surrogates (they take D)."""

    readers: list[LinearTarget]
    writers: list[LinearTarget]
    absorbed: list[ir.Value]


def _writer(ctx: OnnxGraph, graph_outputs: set[str], value: ir.Value, width: int) -> LinearTarget | None:
    """The linear layer whose private output is `value` (`linear_target`: a MatMul, with the private bias
    Add that writes `value` if there is one, or a Gemm) with a constant weight of `width` outputs and a
    bias, if any, of one value per output."""
    node = value.producer()
    if node is None or not is_private(value, graph_outputs):
        return None
    add = node if node.op_type == "Add" else None
    if add is not None:  # the bias Add of a MatMul: `linear_target` finds it from the MatMul
        node = next((t.producer() for t in add.inputs if t is not None and constant_values(t) is None), None)
        if node is None or node.op_type != "MatMul":
            return None
    if node.op_type not in ("MatMul", "Gemm"):
        return None
    rank = len(ctx.shapes.get(name_of(node.inputs[0])) or ())
    target = linear_target(ctx, graph_outputs, node, rank - 1, needs_bias=False)
    if target is None or (node.op_type == "MatMul" and target.bias_node is not add):
        return None  # a MatMul's bias Add, if any, is the one writing `value`
    outputs = (ctx.shapes.get(name_of(target.node.inputs[1])) or (None, None))[1 - target.in_axis]
    bias = None
    if target.bias_node is not None and target.bias_index is not None:
        bias = input_at(target.bias_node, target.bias_index)
    if outputs != width or (bias is not None and not is_feature_vector(constant_values(bias), width)):
        return None
    return target


def stream_plan(
    ctx: OnnxGraph, graph_outputs: set[str], y: ir.Value, width: int, absorbs, writers: bool = True
) -> StreamPlan | None:
    """The stream `y` starts, if every reader of it is a linear layer contracting over the features,
    a residual Add whose other summand is a private linear writer (`_writer`), a shape reader, or a
    node `absorbs(node, value)` accepts (a linear surrogate's norm reading `value`); None otherwise.
    With `writers` False a residual Add's other summand may be anything (an offset of the stream
    passes any Add; a scale needs a writer that takes 1/D), and `StreamPlan.writers` stays empty."""
    plan = StreamPlan([], [], [])
    frontier, seen = [y], {id(y)}
    while frontier:
        current = frontier.pop()
        shape = ctx.shapes.get(name_of(current))
        if current.name in graph_outputs or not shape or shape[-1] != width:
            return None
        absorbed = False
        for consumer in ctx.readers(current):
            if consumer.op_type in SHAPE_READERS:
                continue
            if absorbs(consumer, current):
                absorbed = True
                continue
            other_index = other_summand(consumer, current)
            if other_index is not None:
                out, other = consumer.outputs[0], consumer.inputs[other_index]
                if (ctx.shapes.get(name_of(out)) or ())[-1:] != (width,) or other is None or id(other) in seen:
                    return None
                if writers:
                    writer = _writer(ctx, graph_outputs, other, width)
                    if writer is None:
                        return None
                    plan.writers.append(writer)
                if id(out) not in seen:
                    seen.add(id(out))
                    frontier.append(out)
                continue
            if consumer.inputs[0] is not current or current in consumer.inputs[1:]:
                return None
            target = linear_target(ctx, graph_outputs, consumer, len(shape) - 1, needs_bias=False)
            if target is None:
                return None
            plan.readers.append(target)
        if absorbed:
            plan.absorbed.append(current)
    nodes = [id(t.node) for t in plan.readers + plan.writers]
    return plan if len(set(nodes)) == len(nodes) else None


def scale_writers(graph: ir.Graph, writers: list[LinearTarget], factors: np.ndarray, unique: Namer) -> list[str]:
    """Each writer's output features times `factors`: its weight along the output axis, its bias."""
    changed = []
    for target in writers:
        node = target.node
        out_axis = 1 - target.in_axis
        weight = input_at(node, 1)
        assert weight is not None  # `_writer` checked: a constant weight
        scaled = derived_initializer(
            graph,
            unique(f"{weight.name}.stream"),
            weight,
            lambda w, axis=out_axis: scale_along(w.astype(np.float64), axis, factors).astype(w.dtype),
            "scaled along the residual stream",
            migrated=True,
            axis=out_axis,
        )
        set_input(node, 1, scaled)
        if target.bias_node is not None and target.bias_index is not None:
            bias = input_at(target.bias_node, target.bias_index)
            values = None if bias is None else constant_values(bias)
            assert bias is not None and values is not None  # `_writer` checked: a constant feature vector
            moved = (values.astype(np.float64) * factors).astype(values.dtype).reshape(values.shape)
            what = f"initializer {name_of(bias)} scaled along the residual stream"
            moved = refuse_overflow(moved, [values], what, migrated=True)
            set_input(target.bias_node, target.bias_index, new_initializer(graph, unique(f"{bias.name}.stream"), moved))
        changed.append(name_of(node))
    return changed
