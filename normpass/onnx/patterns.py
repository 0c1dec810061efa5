"""Recognise normalizations in an ONNX graph (onnx-ir), in one op or decomposed.

Recognised spellings (every one is listed in `inspect`; those that cannot fold say why):

* LayerNorm, one op — folds into an RMS op:
  * `LayerNormalization` (ONNX, opset ≥ 17, either `stash_type`; below 17 the ONNX Runtime contrib
    op of the same name, in the default or the `com.microsoft` domain): LN over axes [axis, rank).
  * `com.microsoft.SkipLayerNormalization(x, skip, γ, [β], [bias])` → (y, mean, inv_std, [sum]):
    LN of s = x + skip + bias. The zero-mean graph models s as a `Sum` node of its own, so the proof
    walks into x and skip and centres the bias; folded, it becomes
    `com.microsoft.SkipSimplifiedLayerNormalization(x, skip, γ, [bias])`, keeping s as output 3
    where something reads it (plain-ONNX emission: `Add`s, then the RMS op).
* LayerNorm, decomposed, as exporters emit it — folds:
  d = x − ReduceMean(x); y = d / Sqrt(ReduceMean(d²) + ε) [⊙ γ] [+ β], where
  * the square is `Pow(d, 2)` or `Mul(d, d)`; `ReduceMean` takes its axes as an attribute
    (opset < 18) or as a constant input (opset ≥ 18);
  * the division is `Div` or `Mul` by `Reciprocal` or by `Div(1, ·)` (TorchScript's `rsqrt`);
    `Cast`s may sit between the steps, x may itself be a `Cast`'s output, and `Cast`s to x's own
    type may sit before γ (`γ * x̂.to(dtype)`);
  * the variance may be the moments form E[x²] − E[x]² (`ReduceMean(x²) − ReduceMean(x)²`);
  * ε may be absent (ε = 0, or one the exporter's optimizer dropped, as torch's does for 1e-12),
    or added outside the root, d / (Sqrt(var) + ε): a distinct algebra that no RMS op computes,
    so its fold is emitted as the exact chain x / (Sqrt(ReduceMean(x²)) + ε);
  * γ and β are `Mul`/`Add` in either operand order, with constant-like operands
    (`constant_values`).
* RMSNorm, reported as already RMS: `SimplifiedLayerNormalization` (ORT),
  `com.microsoft.SkipSimplifiedLayerNormalization` (its sum is modelled like SkipLayerNorm's),
  `RMSNormalization` (opset 23), and the decomposed chain without the mean subtraction (Llama).
* Listed with a reason, never folded: `com.microsoft.EmbedLayerNormalization` (normalizes a sum of
  embedding lookups made inside the op, and has no RMS variant), `GroupNormalization`, `com.microsoft.SkipGroupNorm` and
  `com.microsoft.GroupNorm`.

A decomposed pattern matches only if its intermediate tensors are used inside it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from ..core.algebra import has_zero_mean, is_uniform
from ..core.graph import ALREADY_RMS, NormInfo, NormType
from .constants import constant_values
from .values import attr, input_at, readers

TRANSPARENT_CASTS = {"Cast"}
SKIP_BIAS_INPUT = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 3}  # com.microsoft: x + skip + bias


@dataclass
class NormMatch:
    """The graph nodes one normalization occupies, and its operands."""

    nodes: list[ir.Node]
    x: ir.Value
    y: ir.Value
    axis: int  # possibly negative, as written in the graph
    epsilon: float
    gamma: ir.Value | None = None
    beta: ir.Value | None = None
    extra_outputs_used: bool = False
    internal: list[ir.Value] = field(default_factory=list)
    eps_outside_root: bool = False  # decomposed x̂ = d / (√var + ε) instead of d / √(var + ε)
    skip: ir.Value | None = None  # Skip*LayerNormalization: normalizes x + skip (+ bias)
    skip_bias: ir.Value | None = None
    skip_sum: ir.Value | None = None  # its output 3, the sum, where something reads it
    unsupported: str | None = None  # why this spelling can never be folded

    @property
    def normalized(self) -> str:
        """Name of the tensor the norm normalizes (for a Skip op, its sum, named even when unused)."""
        if self.skip is None:
            return self.x.name
        return self.skip_sum.name if self.skip_sum is not None else f"{self.nodes[0].name}.sum"


def _unique_nodes(nodes) -> list[ir.Node]:
    """Consumers once each (`readers` lists a node once per input it reads the tensor on)."""
    return list({id(n): n for n in nodes}.values())


def _sole_consumer(tensor: ir.Value) -> ir.Node | None:
    uses = tensor.uses()
    return next(iter(uses)).node if len(uses) == 1 else None


def _producer_op(tensor: ir.Value | None) -> str | None:
    node = None if tensor is None else tensor.producer()
    return None if node is None else node.op_type


def _skip_casts_forward(tensor: ir.Value, chain: list[ir.Node]) -> ir.Value:
    while (node := _sole_consumer(tensor)) is not None and node.op_type in TRANSPARENT_CASTS:
        chain.append(node)
        tensor = node.outputs[0]
    return tensor


def _cast_of(tensor: ir.Value, source: ir.Value) -> bool:
    """Whether `tensor` is `source`, or `source` through Casts (`source` may itself be a Cast's output)."""
    while tensor is not None and tensor is not source and _producer_op(tensor) in TRANSPARENT_CASTS:
        tensor = tensor.producer().inputs[0]
    return tensor is source


RUNTIME_AXIS = -(1 << 62)  # ReduceMean axes given at run time: the pattern matches, the norm is declined


def _reduce_axes(node: ir.Node) -> list[int] | None:
    if "axes" in node.attributes:
        return list(attr(node, "axes"))
    if input_at(node, 1) is not None and _given_at_run_time(node.inputs[1]):
        return [RUNTIME_AXIS]
    if input_at(node, 1) is not None:
        axes = constant_values(node.inputs[1])
        return None if axes is None else [int(a) for a in np.ravel(axes)]
    return None


def _single_reduce_axis(node: ir.Node) -> int | None:
    if node.op_type != "ReduceMean" or attr(node, "keepdims", 1) != 1:
        return None
    axes = _reduce_axes(node)
    return axes[0] if axes is not None and len(axes) == 1 else None


def _scalar(tensor: ir.Value | None) -> float | None:
    values = None if tensor is None else constant_values(tensor)
    return float(values.reshape(-1)[0]) if values is not None and values.size == 1 else None


def _given_at_run_time(tensor: ir.Value | None) -> bool:
    """A graph input (e.g. an initializer also listed in `graph.input`) where a pattern needs a constant."""
    return tensor is not None and tensor.producer() is None and constant_values(tensor) is None


def _other_input(node: ir.Node, tensor: ir.Value) -> ir.Value | None:
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    if first is tensor:
        return second
    if second is tensor:
        return first
    return None


def _is_square_of(node: ir.Node, t: ir.Value) -> bool:
    """`Pow(t, 2)` or `Mul(t, t)`."""
    if node.op_type == "Pow":
        return node.inputs[0] is t and (_scalar(node.inputs[1]) == 2.0 or _given_at_run_time(node.inputs[1]))
    return node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is t and node.inputs[1] is t


def _mean_of_square(t: ir.Value, square: ir.Node, nodes: list[ir.Node]) -> tuple[ir.Value, int] | None:
    """From `square` = t²: `ReduceMean(t²)` over one axis (Casts between). Returns (its output, axis)."""
    nodes.append(square)
    mean_in = _skip_casts_forward(square.outputs[0], nodes)
    mean = _sole_consumer(mean_in)
    if mean is None or (axis := _single_reduce_axis(mean)) is None:
        return None
    nodes.append(mean)
    return _skip_casts_forward(mean.outputs[0], nodes), axis


def _scalar_add(t: ir.Value) -> tuple[ir.Node, float] | None:
    """The sole consumer of `t` if it is `t + ε` with a scalar ε, and ε (NaN where ε is a run-time input)."""
    add = _sole_consumer(t)
    if add is None or add.op_type != "Add":
        return None
    other = _other_input(add, t)
    eps = math.nan if _given_at_run_time(other) else _scalar(other)
    return None if eps is None else (add, eps)


def _is_reciprocal_div(node: ir.Node, t: ir.Value) -> bool:
    """`Div(1, t)`: the reciprocal as the TorchScript exporter spells `torch.rsqrt`."""
    return node.op_type == "Div" and len(node.inputs) == 2 and node.inputs[1] is t and _scalar(node.inputs[0]) == 1.0


def _match_root_divide(var: ir.Value, d: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float, bool] | None:
    """From the variance: `d / Sqrt(var + ε)`, or `d / (Sqrt(var) + ε)`, with `Div` or `Mul(·, Reciprocal(·))`
    (`Div(1, ·)` as the reciprocal too).

    Returns (normalized tensor, ε, whether ε is outside the root). No ε at all is ε = 0 inside (or
    an ε the exporter's optimizer dropped, as torch's does for 1e-12).
    """
    eps, outside = 0.0, False
    if (inside := _scalar_add(var)) is not None:
        nodes.append(inside[0])
        eps, var = inside[1], inside[0].outputs[0]
    sqrt = _sole_consumer(var)
    if sqrt is None or sqrt.op_type != "Sqrt":
        return None
    nodes.append(sqrt)
    root = _skip_casts_forward(sqrt.outputs[0], nodes)
    if inside is None and (after := _scalar_add(root)) is not None:
        nodes.append(after[0])
        eps, outside = after[1], True
        root = _skip_casts_forward(after[0].outputs[0], nodes)
    divider = _sole_consumer(root)
    if divider is None:
        return None
    if divider.op_type == "Reciprocal" or _is_reciprocal_div(divider, root):
        nodes.append(divider)
        inverse = _skip_casts_forward(divider.outputs[0], nodes)
        divider = _sole_consumer(inverse)
        if divider is None or divider.op_type != "Mul" or not _cast_of(_other_input(divider, inverse) or inverse, d):
            return None
    elif divider.op_type != "Div" or divider.inputs[1] is not root or not _cast_of(divider.inputs[0], d):
        return None
    nodes.append(divider)
    return divider.outputs[0], eps, outside


def _match_rms_core(
    d: ir.Value, square_users: list[ir.Node]
) -> tuple[list[ir.Node], ir.Value, float, int, bool] | None:
    """From d: `d / Sqrt(ReduceMean(d²) + ε)`. Returns (nodes, normalized tensor, ε, axis, ε outside the root)."""
    squares = [n for n in square_users if _is_square_of(n, d)]
    if len(squares) != 1:
        return None
    nodes: list[ir.Node] = []
    head = _mean_of_square(d, squares[0], nodes)
    tail = None if head is None else _match_root_divide(head[0], d, nodes)
    return None if tail is None else (nodes, tail[0], tail[1], head[1], tail[2])


def _match_variance_core(mean: ir.Node, x: ir.Value, d: ir.Value, axis: int):
    """The variance form: `(x − E[x]) / Sqrt(E[x²] − E[x]² + ε)`, anchored at `mean` = ReduceMean(x).

    Returns what `_match_rms_core` returns, or None.
    """
    mean_users = _unique_nodes(readers(mean.outputs[0]))
    mean_squares = [n for n in mean_users if _is_square_of(n, mean.outputs[0])]
    x_squares = [n for n in _unique_nodes(readers(x)) if _is_square_of(n, x)]
    if len(mean_users) != 2 or len(mean_squares) != 1 or len(x_squares) != 1:
        return None
    nodes = [mean_squares[0]]
    mean_sq = _skip_casts_forward(mean_squares[0].outputs[0], nodes)
    head = _mean_of_square(x, x_squares[0], nodes)
    if head is None or head[1] != axis:
        return None
    var = _sole_consumer(head[0])
    if var is None or var.op_type != "Sub" or var.inputs[0] is not head[0] or var.inputs[1] is not mean_sq:
        return None
    nodes.append(var)
    tail = _match_root_divide(var.outputs[0], d, nodes)
    return None if tail is None else (nodes, tail[0], tail[1], axis, tail[2])


def _elem_type(tensor: ir.Value) -> int | None:
    """The ONNX element type of `tensor` where the graph states it (a Cast's `to`, or a declared dtype)."""
    if _producer_op(tensor) in TRANSPARENT_CASTS:
        return int(attr(tensor.producer(), "to"))
    return None if tensor.dtype is None else int(tensor.dtype)


def _casts_to(tensor: ir.Value, elem_type: int | None) -> list[ir.Node]:
    """The chain of sole-consumer Casts after `tensor`, if each casts to `elem_type` (a known type)."""
    chain: list[ir.Node] = []
    while (node := _sole_consumer(tensor)) is not None and node.op_type in TRANSPARENT_CASTS:
        if elem_type is None or int(attr(node, "to")) != elem_type:
            return []
        chain.append(node)
        tensor = node.outputs[0]
    return chain


def _match_affine(
    x: ir.Value, y: ir.Value, nodes: list[ir.Node], scope: set[int] | None
) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
    """Optional `⊙ γ` then `+ β` with constant operands after the normalized tensor `y` of input `x`.

    Casts before γ belong to the norm only if they cast to x's own (stated) type, so that the norm
    as a whole maps x to a tensor of x's type, as the RMS op that replaces it does (Llama's
    `weight * hidden.to(input_dtype)`). Only nodes in `scope` (ids; None: any) qualify as γ or β:
    a node inside a control-flow body is among the readers of an outer tensor it reads, and that
    node is no part of the norm.
    """
    gamma = beta = None

    def next_consumer(tensor):
        node = _sole_consumer(tensor)
        return node if node is None or scope is None or id(node) in scope else None

    casts = _casts_to(y, _elem_type(x))
    cast = casts[-1].outputs[0] if casts else y
    consumer = next_consumer(cast)
    if consumer is not None and consumer.op_type == "Mul":
        other = _other_input(consumer, cast)
        if other is not None and constant_values(other) is not None:
            gamma, y = other, consumer.outputs[0]
            nodes.extend([*casts, consumer])
            consumer = next_consumer(y)
    if consumer is not None and consumer.op_type == "Add":
        other = _other_input(consumer, y)
        if other is not None and constant_values(other) is not None:
            beta, y = other, consumer.outputs[0]
            nodes.append(consumer)
    return y, gamma, beta


def _internal_tensors_private(nodes: list[ir.Node], y: ir.Value, graph_outputs: set[str]) -> bool:
    members = {id(n) for n in nodes}
    for node in nodes:
        for out in node.outputs:
            if out is y:
                continue
            if out.name in graph_outputs or any(id(c) not in members for c in readers(out)):
                return False
    return True


def match_decomposed(
    node: ir.Node, graph_outputs: set[str], scope: set[int] | None = None
) -> tuple[NormType, NormMatch] | None:
    """Match a decomposed LayerNorm anchored at its first ReduceMean, or an RMSNorm at its square.

    `scope`: ids of the nodes of the graph being matched (see `_match_affine`).
    """
    if node.op_type == "ReduceMean":
        axis = _single_reduce_axis(node)
        x = node.inputs[0]
        subs = [n for n in _unique_nodes(readers(node.outputs[0])) if n.op_type == "Sub"]
        sub = subs[0] if len(subs) == 1 else None
        if axis is None or sub is None or sub.inputs[0] is not x or sub.inputs[1] is not node.outputs[0]:
            return None
        d = sub.outputs[0]
        core = _match_rms_core(d, _unique_nodes(readers(d))) if len(_unique_nodes(readers(d))) == 2 else None
        core = core or _match_variance_core(node, x, d, axis)
        if core is None or core[3] != axis:
            return None
        nodes = [node, sub] + core[0]
        norm_type = NormType.LAYER
    elif node.op_type in ("Pow", "Mul"):
        x = node.inputs[0]
        if any(
            c.op_type == "Sub" and c.inputs[0] is x and _producer_op(input_at(c, 1)) == "ReduceMean" for c in readers(x)
        ):
            return None
        core = _match_rms_core(x, [node])
        if core is None:
            return None
        nodes = core[0]
        norm_type = NormType.RMS
    else:
        return None
    core_nodes = list(nodes)
    y, gamma, beta = _match_affine(x, core[1], nodes, scope)
    if not _internal_tensors_private(nodes, y, graph_outputs):  # e.g. x̂ is also a graph output: the norm ends at x̂
        nodes, y, gamma, beta = core_nodes, core[1], None, None
        if not _internal_tensors_private(nodes, y, graph_outputs):
            return None
    runtime = (
        ["ε"] * math.isnan(core[2])
        + ["axes"] * (core[3] == RUNTIME_AXIS)
        + [f"exponent {n.inputs[1].name}" for n in nodes if n.op_type == "Pow" and _scalar(n.inputs[1]) is None]
    )
    unsupported = (
        None
        if not runtime
        else (
            f"its {' and '.join(runtime)} {'are' if len(runtime) > 1 else 'is'} given at run time (an initializer listed as a graph input), so its algebra is not fixed"
        )
    )
    axis = -1 if core[3] == RUNTIME_AXIS else core[3]
    return norm_type, NormMatch(
        nodes, x, y, axis, core[2], gamma, beta, eps_outside_root=core[4], unsupported=unsupported
    )


def _used(tensor: ir.Value, graph_outputs: set[str]) -> bool:
    return bool(tensor.name) and (bool(tensor.uses()) or tensor.name in graph_outputs)


def _single(node: ir.Node, gamma: int | None, beta: int | None, eps: float, axis: int = -1, **extra) -> NormMatch:
    return NormMatch(
        [node],
        node.inputs[0],
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
    stats_used = any(_used(o, graph_outputs) for o in node.outputs[1:3])
    if node.op_type == "LayerNormalization":  # ONNX (opset ≥ 17) and com.microsoft: same inputs and outputs
        return NormType.LAYER, _single(node, 1, 2, 1e-5, extra_outputs_used=stats_used)
    if node.op_type == "SkipLayerNormalization":
        return NormType.LAYER, _single(
            node, 2, 3, 1e-12, extra_outputs_used=stats_used, **_skip_parts(node, graph_outputs)
        )
    if node.op_type == "SkipSimplifiedLayerNormalization":
        return NormType.RMS, _single(node, 2, None, 1e-12, **_skip_parts(node, graph_outputs))
    if node.op_type in ("SimplifiedLayerNormalization", "RMSNormalization"):
        return NormType.RMS, _single(node, 1, None, 1e-5)
    if node.op_type == "EmbedLayerNormalization":
        return NormType.LAYER, _single(
            node,
            5,
            6,
            1e-12,
            unsupported=(
                "EmbedLayerNormalization normalizes a sum of embedding lookups made inside the op, and "
                "ONNX Runtime has no RMS variant of it; not rewritten"
            ),
        )
    if node.op_type == "GroupNormalization":
        return NormType.GROUP, _single(node, 1, 2, 1e-5, axis=1)
    if node.op_type in ("SkipGroupNorm", "GroupNorm"):  # com.microsoft, channels-last
        return NormType.GROUP, _single(node, 1, 2, 1e-5)
    return None


def norm_info(name: str, op: str, norm_type: NormType, match: NormMatch, rank: int | None) -> NormInfo:
    """Describe a match for the analysis: the normalized axis, and whether it can ever fold."""
    unsupported = None
    axis = match.axis
    if rank is not None and axis < 0:
        axis += rank
    if norm_type is NormType.GROUP:
        unsupported = (
            "GroupNorm: centring leaves a shift that varies over spatial positions, which GroupNorm "
            "does not remove, and ONNX Runtime has no grouped RMS op; not rewritten"
        )
    elif norm_type is NormType.RMS:
        unsupported = ALREADY_RMS
    elif rank is None:
        unsupported = f"the rank of {match.x.name} is unknown, so the normalized axis cannot be tracked"
    elif axis != rank - 1:
        unsupported = (
            f"normalizes over axes {axis}..{rank - 1}: zero mean along one axis does not make a "
            "multi-axis LayerNorm an RMSNorm"
        )
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
        output=match.y.name,
        axis=axis if rank is not None and axis == rank - 1 and match.unsupported is None else None,
        epsilon=match.epsilon,
        scale=None if match.gamma is None else match.gamma.name,
        bias=None if match.beta is None else match.beta.name,
        output_centred=output_centred,
        unsupported=unsupported,
        ref=match,
    )
