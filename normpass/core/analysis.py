"""Which LayerNorms fold into RMSNorms exactly, and what must be centred for it (pure; never mutates).

Notation: a norm N normalizes tensor x along one axis k. LN(x) = RMSNorm(x) whenever
mean_k(x) = 0 for every input, so N folds if we can make its input zero-mean along k by
centring the weights of the linear layers that produce it.

**Proof (backward, seed 003 Algorithm 1).** From (x, k), walk producers: a `Linear` layer whose
output axis is k is centred (W' = W − mean_out(W), b' = b − mean(b)) and the walk stops, and so
is one followed by a per-channel constant Mul (LayerScale: W' = centre(W⊙s), b' = centre(b⊙s)); a
constant on a branch is centred; `Sum`, `Concat`, `Scale` (factor constant along k) and layout
ops that keep the axis intact continue the walk on their inputs; an already-centred output stops
it; anything else blocks the proof.

**Safety (forward, seed 003 App. D.2).** Centring a layer changes its output y into
y − m(x)·1ₖ, a per-sample shift constant along k. The model is unchanged iff every path from y
carries that shift (through sums, scalings constant along k and axis-preserving layout ops) into
an op that removes it: a LayerNorm over k (folded or not: LN(x + c·1) = LN(x)), a centring
x − mean_k(x), or a Softmax over k; a reader of shapes only (Shape, Size) never sees it. A shift
reaching a graph output, a linear layer, a nonlinearity or an RMSNorm makes the centring unsafe,
and the norms that need it are refused.

**Inserted centring.** Where a proof is blocked at a tensor t whose shifts are all removed
downstream (the safety condition), inserting t' = t − mean_k(t) makes t zero-mean at the cost of
one ReduceMean and one Sub. It is planned only where it enables at least `MIN_FOLDS_PER_INSERTION`
folds, since one insertion costs about what one fold saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .graph import (
    Broadcast,
    Centered,
    Choose,
    Concat,
    Linear,
    Mix,
    NormInfo,
    NormRule,
    Opaque,
    Permute,
    Regroup,
    Scale,
    Select,
    ShapeOnly,
    ShiftInvariant,
    Sum,
    Take,
    ZeroMeanGraph,
    ZNode,
)
from .plan import Blocker, Centring, FoldPlan, Insertion, NormDecision

MIN_FOLDS_PER_INSERTION = 2


# --- axis algebra ------------------------------------------------------------------------------


def _broadcast_axis(out_shape, in_shape, axis: int) -> tuple[int | None, str | None]:
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
    (`_solve_unknown_dim`).
    """
    if from_shape is None or to_shape is None:
        return None
    from_shape, to_shape = _solve_unknown_dim(tuple(from_shape), tuple(to_shape))
    tail = from_shape[axis:]
    if not all(isinstance(d, int) for d in tail):
        return None
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


def _scale_roles(zmg: ZeroMeanGraph, node: ZNode, axis: int) -> tuple[int, int | None] | str:
    """(stream input, factor input) of a `Scale` node for output axis `axis`, or why there is none.

    The factor must be constant along the axis; for Mul either operand may be the factor.
    """
    rule = node.rule
    if rule.factor is None and rule.stream is not None:
        return rule.stream, None
    out_shape = zmg.shape(node.outputs[0])
    for stream in [rule.stream] if rule.stream is not None else [0, 1]:
        factor = rule.factor if rule.factor is not None else 1 - stream
        factor_axis, why = _broadcast_axis(out_shape, zmg.shape(node.inputs[factor]), axis)
        if why is None and factor_axis is None:
            return stream, factor
    return f"{node.op} {node.name} multiplies by a factor that is not constant along the normalized axis"


def _along_rows(zmg: ZeroMeanGraph, node: ZNode, axis: int) -> bool:
    """Whether a Where's condition is constant along output axis `axis` (it picks whole rows)."""
    cond_axis, why = _broadcast_axis(zmg.shape(node.outputs[0]), zmg.shape(node.inputs[0]), axis)
    return cond_axis is None and why is None


def layer_scale(zmg: ZeroMeanGraph, node: ZNode, axis: int) -> tuple[int, ZNode, ZNode | None] | None:
    """(factor index, linear layer, bias Add or None) if `node` is a LayerScale, else None.

    A LayerScale multiplies the output of a linear layer (with or without a bias Add) by a
    per-channel constant s: (x·W + b)⊙s = x·(W⊙s) + b⊙s, so s is absorbed into the layer, which
    is then centred. The layer's output and the bias sum must be read by nothing else.
    """
    if not isinstance(node.rule, Scale) or node.op != "Mul" or len(node.inputs) != 2:
        return None
    factors = [i for i, t in enumerate(node.inputs) if zmg.is_constant(t)]
    out_shape = zmg.shape(node.outputs[0])
    if len(factors) != 1 or out_shape is None or not _per_channel(zmg.shape(node.inputs[factors[0]]), len(out_shape), axis):
        return None
    stream = node.inputs[1 - factors[0]]
    add = None
    producer = _private_producer(zmg, stream)
    if producer is not None and producer.op == "Add" and isinstance(producer.rule, Sum) and len(producer.inputs) == 2:
        biases = [t for t in producer.inputs if zmg.is_constant(t)]
        linear = [t for t in producer.inputs if not zmg.is_constant(t)]
        if len(biases) != 1 or len(linear) != 1:
            return None
        add, producer = producer, _private_producer(zmg, linear[0])
    if producer is None or not isinstance(producer.rule, Linear) or producer.rule.axis != axis or producer.op not in ABSORBING_OPS:
        return None
    return factors[0], producer, add


def _per_channel(shape, rank: int, axis: int) -> bool:
    """Whether a factor of `shape` broadcast to rank `rank` varies along `axis` alone."""
    if shape is None or len(shape) > rank:
        return False
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    return all(d == 1 for j, d in enumerate(padded) if j != axis)


ABSORBING_OPS = ("MatMul", "Gemm", "Conv")  # linear layers a LayerScale can be absorbed into


def _private_producer(zmg: ZeroMeanGraph, tensor: str) -> ZNode | None:
    """The producer of `tensor` if `tensor` has one reader and is not a graph output."""
    if tensor in zmg.graph_outputs or len(zmg.consumers.get(tensor, [])) != 1:
        return None
    return zmg.producer_of(tensor)


# --- proof (backward) --------------------------------------------------------------------------


@dataclass
class Proof:
    centrings: list[Centring] = field(default_factory=list)
    blockers: list[Blocker] = field(default_factory=list)


def _backward(zmg: ZeroMeanGraph, node: ZNode, tensor: str, axis: int):
    """Inputs of `node` that must be zero-mean for `tensor` to be, or a reason string."""
    rule = node.rule
    out_shape = zmg.shape(tensor)
    if out_shape is None:
        return f"{node.op} {node.name}: the shape of {tensor} is unknown"
    if isinstance(rule, (Sum, Concat, Scale, Broadcast, Choose)):
        if isinstance(rule, Scale):
            roles = _scale_roles(zmg, node, axis)
            if isinstance(roles, str):
                return roles
            indices = [roles[0]]
        elif isinstance(rule, Choose):
            if not _along_rows(zmg, node, axis):
                return f"{node.op} {node.name} selects elements within a row, not whole rows (its condition varies along the axis)"
            indices = [1, 2]
        else:
            indices = [0] if isinstance(rule, Broadcast) else range(len(node.inputs))
        required = []
        for index in indices:
            source = node.inputs[index]
            in_axis, why = _broadcast_axis(out_shape, zmg.shape(source), axis)
            if why:
                return f"{node.op} {node.name}: cannot map the normalized axis onto {source}: {why}"
            if in_axis is None and not zmg.is_constant(source):
                return f"{node.op} {node.name} broadcasts {source} along the normalized axis"
            required.append((index, source, in_axis))
        return required
    if isinstance(rule, Mix):
        if axis not in rule.kept:
            return f"{node.op} {node.name} mixes or pads along the normalized axis (or its parameters are not constant)"
        return [(0, node.inputs[0], axis)]
    if isinstance(rule, Permute):
        if axis >= len(rule.perm):
            return f"{node.op} {node.name}: its perm does not match the rank of {tensor}"
        return [(0, node.inputs[0], rule.perm[axis])]
    if isinstance(rule, Regroup):
        in_axis = regroup_axis(out_shape, zmg.shape(node.inputs[0]), axis)
        if in_axis is None:
            return f"{node.op} {node.name} does not keep the normalized axis intact (or its shapes are unknown)"
        return [(0, node.inputs[0], in_axis)]
    if isinstance(rule, Select):
        if rule.axes is None:
            return f"{node.op} {node.name}: its slicing axes are not constant"
        if axis in rule.axes:
            return f"{node.op} {node.name} slices the normalized axis"
        return [(0, node.inputs[0], axis)]
    if isinstance(rule, Take):
        if rule.index_rank is None:
            return f"{node.op} {node.name}: the rank of its indices is unknown"
        if axis < rule.axis:
            return [(0, node.inputs[0], axis)]
        if axis >= rule.axis + rule.index_rank:
            return [(0, node.inputs[0], axis - rule.index_rank + 1)]
        return f"{node.op} {node.name} gathers along the normalized axis"
    if isinstance(rule, Centered):
        return [] if rule.axis == axis else f"{node.op} {node.name} is centred along axis {rule.axis}, not {axis}"
    if isinstance(rule, NormRule):
        norm = rule.norm
        if norm.output_centred and norm.axis == axis:
            return []
        return (
            f"the output of {norm.op} {norm.name} is γ⊙x̂+β, which is not zero-mean "
            "(γ not uniform or mean(β) ≠ 0): a post-LN stream"
        )
    if isinstance(rule, Opaque):
        return f"{node.op} {node.name}: {rule.reason}"
    if isinstance(rule, ShapeOnly):
        return f"{node.op} {node.name} computes a value from a shape, which is not zero-mean"
    if isinstance(rule, ShiftInvariant):
        return f"{node.op} {node.name} is not linear in its input"
    raise TypeError(f"unhandled rule {rule!r}")


def prove(zmg: ZeroMeanGraph, norm: NormInfo) -> Proof:
    """Walk back from the norm's input; collect the centrings that make it zero-mean, or blockers."""
    proof = Proof()
    start = (norm.input, norm.axis)
    parent: dict[tuple[str, int], tuple[tuple[str, int] | None, str]] = {start: (None, norm.name)}
    stack = [start]

    def path_to(state) -> tuple[str, ...]:
        names = []
        while state is not None:
            state, name = parent[state]
            names.append(name)
        return tuple(reversed(names))

    def block(state, node_name, reason, tensor, axis):
        proof.blockers.append(Blocker(node_name, reason, path_to(state) + (node_name,), tensor, axis))

    while stack:
        state = stack.pop()
        tensor, axis = state
        node = zmg.producer_of(tensor)
        if zmg.is_constant(tensor):  # only the norm's own input: constants on branches are centred below
            block(state, tensor, f"the norm's input {tensor} is a constant", None, None)
            continue
        if node is None:
            block(state, tensor, f"graph input {tensor} carries arbitrary data", tensor, axis)
            continue
        if isinstance(node.rule, Linear):
            if node.rule.axis == axis:
                proof.centrings.append(Centring(node.name, axis))
            else:
                block(state, node.name, f"{node.op} {node.name} centres axis {node.rule.axis}, the norm needs {axis}", tensor, axis)
            continue
        required = _backward(zmg, node, tensor, axis)
        if isinstance(required, str) and layer_scale(zmg, node, axis) is not None:
            proof.centrings.append(Centring(node.name, axis))  # absorbed into its layer, which is centred
            continue
        if isinstance(required, str):
            block(state, node.name, required, tensor, axis)
            continue
        for index, source, in_axis in required:
            if zmg.is_constant(source):
                proof.centrings.append(Centring(node.name, in_axis, index, source, stream_axis=axis))
                continue
            child = (source, in_axis)
            if child not in parent:
                parent[child] = (state, node.name)
                stack.append(child)
    return proof


# --- safety (forward) --------------------------------------------------------------------------


class ShiftChecker:
    """Decides whether a per-sample shift constant along an axis is removed downstream.

    `removed(tensor, axis)` is memoised over (tensor, axis), so checking every centring of a deep
    residual stream is linear in graph size.
    """

    def __init__(self, zmg: ZeroMeanGraph):
        self.zmg = zmg
        self.memo: dict[tuple[str, int], Blocker | None] = {}

    def _through(self, node: ZNode, index: int, axis: int | None, out_axis: int | None = None):
        """Forward rule: successor states of a shift entering `node` at input `index`, or a Blocker.

        `axis` is the shifted axis of that input; None when the input is broadcast along the
        normalized axis (then `out_axis` names it in the output).
        """
        rule = node.rule

        def unsafe(reason):
            return Blocker(node.name, f"{node.op} {node.name} {reason}")

        if isinstance(rule, ShapeOnly):
            return []
        out = node.outputs[0]
        out_shape, in_shape = self.zmg.shape(out), self.zmg.shape(node.inputs[index])
        if isinstance(rule, NormRule):
            norm = rule.norm
            if index == 0 and norm.removes_mean and norm.axis == axis:
                return []
            return unsafe("does not remove a shift along the normalized axis")
        if isinstance(rule, (Centered, ShiftInvariant)):
            return [] if index == 0 and rule.axis == axis else unsafe("does not remove a shift along this axis")
        if out_shape is None or in_shape is None:
            return unsafe("has an unknown shape")
        lift = len(out_shape) - len(in_shape)
        if isinstance(rule, Choose) and (index == 0 or not _along_rows(self.zmg, node, out_axis if axis is None else axis + lift)):
            return unsafe("selects elements within a row, or takes the shifted tensor as its condition")
        if axis is None:
            passes = isinstance(rule, (Sum, Broadcast, Choose)) or isinstance(rule, Scale) and self._is_stream(node, index, out_axis)
            if passes:
                return [(out, out_axis)]
            return unsafe("receives a shift it may not pass on")
        if isinstance(rule, Mix):
            return [(out, axis)] if index == 0 and axis in rule.kept else unsafe("mixes or pads along the shifted axis")
        if isinstance(rule, (Sum, Broadcast, Choose)):
            if isinstance(rule, Broadcast) and index != 0:
                return unsafe("takes the shifted tensor as its shape")
            return [(out, axis + lift)]
        if isinstance(rule, Scale):
            if not self._is_stream(node, index, axis + lift):
                return unsafe("scales the shifted tensor by a factor that varies along its axis, or scales by it")
            return [(out, axis + lift)]
        if isinstance(rule, Permute):
            return [(out, rule.perm.index(axis))] if axis in rule.perm else unsafe("has a perm that does not match its input")
        if isinstance(rule, Regroup):
            regrouped = regroup_axis(in_shape, out_shape, axis)
            return unsafe("does not keep the shifted axis intact") if regrouped is None else [(out, regrouped)]
        if isinstance(rule, Select):
            return [(o, axis) for o in node.outputs if o]
        if isinstance(rule, Take):
            if index != 0 or rule.index_rank is None or axis == rule.axis:
                return unsafe("gathers along the shifted axis")
            return [(out, axis if axis < rule.axis else axis + rule.index_rank - 1)]
        if isinstance(rule, Concat):
            return unsafe("concatenates along the shifted axis") if rule.axis == axis else [(out, axis)]
        detail = f": {rule.reason}" if isinstance(rule, Opaque) else ""
        return unsafe(f"would change its output (it is not shift-invariant){detail}")

    def _is_stream(self, node: ZNode, index: int, out_axis: int) -> bool:
        roles = _scale_roles(self.zmg, node, out_axis)
        return not isinstance(roles, str) and roles[0] == index

    def entering(self, node: ZNode, index: int, axis: int | None, out_axis: int) -> Blocker | None:
        """Is a shift entering `node` at input `index` (along `axis` of that input) removed downstream?"""
        successors = self._through(node, index, axis, out_axis)
        if isinstance(successors, Blocker):
            return successors
        return next((b for s in successors if (b := self.removed(*s)) is not None), None)

    def removed(self, tensor: str, axis: int) -> Blocker | None:
        """None if a shift along `axis` of `tensor` is removed on every path, else where it is not."""
        stack = [((tensor, axis), False)]
        while stack:
            state, expanded = stack.pop()
            if state in self.memo:
                continue
            successors = self._expand(*state)
            if isinstance(successors, Blocker):
                self.memo[state] = successors
                continue
            if not expanded:
                stack.append((state, True))
                stack.extend((s, False) for s in successors if s not in self.memo)
            else:
                self.memo[state] = next((self.memo[s] for s in successors if self.memo[s] is not None), None)
        return self.memo[(tensor, axis)]

    def _expand(self, tensor: str, axis: int):
        if tensor in self.zmg.graph_outputs:
            return Blocker(tensor, f"the shift reaches graph output {tensor}")
        states = []
        for node, index in self.zmg.consumers_of(tensor):
            result = self._through(node, index, axis)
            if isinstance(result, Blocker):
                return result
            states.extend(result)
        return states


# --- plan --------------------------------------------------------------------------------------


def plan(zmg: ZeroMeanGraph, insert_centering: bool = True, keep: dict[str, str] | None = None) -> FoldPlan:
    """Decide every norm of `zmg`: fold (with the centrings it needs) or decline (with the reason).

    `keep` names norms to leave as they are even where they fold, with the reason (a rewrite
    that would not pay); their centrings and insertions are not planned for them.
    """
    keep = keep or {}
    checker = ShiftChecker(zmg)
    decisions: list[NormDecision] = []
    pending: dict[str, tuple[NormInfo, Proof]] = {}
    for norm in zmg.norms:
        decision = NormDecision(norm.name, norm.op, False, None)
        decisions.append(decision)
        if norm.unsupported:
            decision.reason = norm.unsupported
            continue
        proof = prove(zmg, norm)
        decision.centrings = proof.centrings
        unsafe = _first_unsafe(zmg, checker, proof.centrings)
        if unsafe is not None:
            decision.blocker = unsafe
            decision.reason = f"centring {unsafe.path[0]} is unsafe: {unsafe.reason}"
            continue
        if norm.name in keep:
            decision.kept, decision.reason, decision.centrings = True, keep[norm.name], []
            continue
        if proof.blockers:
            decision.blocker = proof.blockers[0]
            decision.reason = f"input not provably zero-mean: {proof.blockers[0].reason}"
            pending[norm.name] = (norm, proof)
            continue
        decision.foldable = True
    if insert_centering:
        _plan_insertions(checker, decisions, pending)
    return FoldPlan(decisions)


def _first_unsafe(zmg: ZeroMeanGraph, checker: ShiftChecker, centrings: list[Centring]) -> Blocker | None:
    for centring in centrings:
        node = zmg.nodes[centring.node]
        if centring.input_index is None:
            blocker = checker.removed(node.outputs[0], centring.axis)
        else:
            blocker = checker.entering(node, centring.input_index, centring.axis, centring.stream_axis)
        if blocker is not None:
            return Blocker(blocker.node, blocker.reason, (centring.label, blocker.node))
    return None


def safe_centrings(zmg: ZeroMeanGraph, norm: NormInfo, checker: ShiftChecker | None = None) -> list[Centring]:
    """The centrings `prove` finds for `norm` whose shift is removed downstream, proven or not.

    Each centring shifts its own output by a per-sample constant along the axis; where every such
    shift is removed (the safety condition), centring any subset leaves the model unchanged. For a
    LayerNorm whose input is not provably zero-mean (a post-LN stream), these centrings still take
    the per-sample mean of the linear layers they reach out of its input.
    """
    checker = checker or ShiftChecker(zmg)
    return [c for c in prove(zmg, norm).centrings if _first_unsafe(zmg, checker, [c]) is None]


def _plan_insertions(checker: ShiftChecker, decisions: list[NormDecision], pending) -> None:
    """Insert x − mean(x) at blocked tensors whose shift is removed downstream, where it pays."""
    candidates: dict[Insertion, set[str]] = {}
    for name, (norm, proof) in pending.items():
        insertions = set()
        for blocker in proof.blockers:
            if blocker.tensor is None or blocker.axis is None or checker.removed(blocker.tensor, blocker.axis):
                break
            insertions.add(Insertion(blocker.tensor, blocker.axis))
        else:
            for insertion in insertions:
                candidates.setdefault(insertion, set()).add(name)
    chosen = set(candidates)
    while True:
        enabled = {
            name
            for name, (_, proof) in pending.items()
            if all(Insertion(b.tensor, b.axis) in chosen for b in proof.blockers)
        }
        weak = {i for i in chosen if len(candidates[i] & enabled) < MIN_FOLDS_PER_INSERTION}
        if not weak:
            break
        chosen -= weak
    by_name = {d.name: d for d in decisions}
    for name in enabled:
        _, proof = pending[name]
        decision = by_name[name]
        decision.insertions = sorted({Insertion(b.tensor, b.axis) for b in proof.blockers}, key=lambda i: i.tensor)
        decision.foldable = True
        decision.reason = None
        decision.blocker = None
