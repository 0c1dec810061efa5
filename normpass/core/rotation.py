"""Which residual streams rotate exactly, and what rotating one changes (pure; never mutates).

**Algebra (DESIGN §2b).** For an orthogonal Q (QᵀQ = I) and an RMSNorm without affine over the whole
hidden axis, RMSNorm(xQ) = xQ / rms(xQ) = RMSNorm(x)·Q, since ‖xQ‖ = ‖x‖. So if every tensor of a
residual stream is replaced by its rotation xQ, and every norm reading it by its rotated output, the
model is unchanged provided that

* every *writer* of the stream produces xQ: a linear layer's weight and bias are multiplied by Q on the
  output features (`W → W·Q`, `b → b·Q`), an embedding table row-wise, and a constant added into the
  stream (a position table, a class token, a bias) along its hidden axis;
* every *reader* undoes it: a linear layer contracting over the hidden axis takes `W → Qᵀ·W`;
* everything in between commutes with a rotation of the hidden axis: residual sums of rotated tensors,
  scaling by a factor constant along the axis, layout ops that keep the axis whole (reshapes, transposes,
  slices, gathers and concatenations along other axes, rows picked by `Where`), and RMSNorms whose γ is
  uniform (a scalar commutes with Q).

A norm that keeps a non-uniform γ does not commute (RMSNorm(xQ)⊙γ ≠ (RMSNorm(x)⊙γ)·Q), but its γ can
move: what the norm writes, y = u⊙γ (u = RMSNorm(x)), reaches the readers through ops that commute
with diag(γ), so the norm writes u instead and every reader of y absorbs γ, `W → Qᵀ·diag(γ)·W`. A
constant c added on the way (the β a fold keeps as an `Add`: u⊙γ + β = (u + β⊘γ)⊙γ) becomes (c⊘γ)·Q,
which needs γ ≠ 0. The states reached from such a norm's output carry its name (a *scale tag*); a tag
must not meet an untagged tensor (a sum of u⊙γ and something else has no common factor to move).

**The proof.** A stream is the closure of a seed state (the input of an RMSNorm, along its axis) under
both directions of every edge: backward to the producer (its inputs join the stream through the same
`Rule.backward` the fold's proof uses, with the axis each input maps to; a `Linear` producer is a writer)
and forward to every consumer (through `Rule.forward`, which maps the axis as it maps a shift; a linear
layer contracting over the axis is a reader, as the front end decides). Anything else refuses the
stream, with the node and the path from the seed norm: a graph input or output, a nonlinearity, a
LayerNorm (it subtracts the mean, which a rotation does not keep), a centring, a Softmax, a slice along
the hidden axis or along axes known only at run time, a concatenation along it, a norm that keeps β.
Every norm the closure reaches belongs to that stream (`Stream.norms`, refused ones too), so each norm
is in one stream at most.

Two refusals are named by what the model does, not by where the closure first fails: a norm after a
block that adds γ ⊙ RMSNorm(x) to the stream (Gemma-2's sandwich norms: no rotation commutes with that
γ), and a norm over each head of a projection's features (Qwen-3's query and key norms, `_per_head`),
which is on no residual stream at all and is refused the same way whichever exporter wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .algebra import is_uniform
from .graph import NormInfo, NormType, Shift, ZeroMeanGraph, ZNode
from .plan import Blocker, Centring
from .rules import Centered, Concat, NormRule, Reduce, Regroup, Select, ShapeOnly, ShiftInvariant, regroup_axis

State = tuple[str, int]  # (tensor, axis)
Reads = Callable[[ZNode, int, int], bool]  # (node, input index, axis): a linear layer contracting over it?


@dataclass(frozen=True)
class Reader:
    """A linear layer contracting input `index` of `node` along `axis`: its weight takes Qᵀ (and γ of `scale`)."""

    node: str
    index: int
    axis: int
    scale: str | None = None  # the norm whose γ the layer absorbs


@dataclass
class Stream:
    """One residual stream: every tensor rotated by the same Q, or why it cannot be.

    `writers` maps each writer to the norm whose γ divides it (constants added after a norm that keeps
    γ) or None. A writer is a `Centring`: a layer whose output features along `axis` take Q (LayerScale
    `Mul`s after one included), or a constant input of a node, rotated along its own axis.
    """

    name: str  # the seed norm
    width: int | None
    norms: list[str] = field(default_factory=list)
    writers: dict[Centring, str | None] = field(default_factory=dict)
    readers: list[Reader] = field(default_factory=list)
    moved_gamma: list[str] = field(default_factory=list)  # norms whose γ moves into the readers
    tensors: int = 0
    states: list[State] = field(default_factory=list, repr=False)  # every (tensor, axis) of the stream
    blocker: Blocker | None = None

    @property
    def rotatable(self) -> bool:
        return self.blocker is None

    @property
    def reason(self) -> str | None:
        return None if self.blocker is None else self.blocker.reason

    def to_json(self) -> dict:
        return {
            "stream": self.name,
            "rotatable": self.rotatable,
            "reason": self.reason,
            "hidden_size": self.width,
            "norms": list(self.norms),
            "writers": sorted({w.label for w in self.writers}),
            "readers": sorted({r.node for r in self.readers}),
            "gamma_moved_from": list(self.moved_gamma),
            "tensors": self.tensors,
            "blocked_by": None if self.blocker is None else self.blocker.node,
            "blocking_path": [] if self.blocker is None else list(self.blocker.path),
        }


@dataclass
class RotationPlan:
    streams: list[Stream]

    @property
    def rotatable(self) -> list[Stream]:
        return [s for s in self.streams if s.rotatable]

    def to_json(self) -> dict:
        return {
            "streams": [s.to_json() for s in self.streams],
            "total": len(self.streams),
            "rotatable": len(self.rotatable),
        }


def gamma_of(zmg: ZeroMeanGraph, norm: NormInfo) -> np.ndarray:
    """The norm's γ, one value per feature (its constant, raveled); ones where it has none."""
    return np.ravel(zmg.constant(norm.scale)) if norm.scale is not None else np.ones(1)


def gamma_tag(zmg: ZeroMeanGraph, norm: NormInfo) -> str | None:
    """The norm's name if its γ is not uniform (it must move into the readers), else None."""
    if norm.scale is None or not zmg.is_constant(norm.scale):
        return None
    return None if is_uniform(zmg.constant(norm.scale)) else norm.name


def _norm_refusal(zmg: ZeroMeanGraph, norm: NormInfo, axis: int) -> str | None:
    """Why `norm` does not commute with a rotation along `axis` (its γ aside), or None."""
    if norm.norm_type is not NormType.RMS:
        return f"{norm.op} {norm.name} subtracts the mean (not an RMSNorm), which a rotation does not keep"
    if norm.axis != axis:
        return f"{norm.op} {norm.name} does not normalize over the whole hidden axis alone"
    if norm.scale is not None and not zmg.is_constant(norm.scale):
        return f"{norm.op} {norm.name} takes γ at run time"
    if norm.bias is not None and (not zmg.is_constant(norm.bias) or np.any(zmg.constant(norm.bias) != 0)):
        return f"{norm.op} {norm.name} keeps a β inside the norm"
    return None


class _Closure:
    """The closure of one seed state (see the module docstring), filling one `Stream`."""

    def __init__(self, zmg: ZeroMeanGraph, reads: Reads, seed: NormInfo, axis: int):
        self.zmg, self.reads = zmg, reads
        self.tags: dict[State, str | None] = {}
        self.via: dict[State, tuple[str, State | None]] = {}  # how a state was reached: (node, from state)
        self.stack: list[State] = []
        width = _dim(zmg, (seed.input, axis))
        self.stream = Stream(seed.name, width if isinstance(width, int) else None)
        self.seed, self.axis = seed, axis

    def run(self) -> Stream:
        seed = (self.seed.input, self.axis)
        self._add(seed, None, self.seed.name, None)
        if self.stream.width is None:
            self._block(seed, self.seed.name, f"the hidden size of {self.seed.input} is not static")
        while self.stack:
            state = self.stack.pop()
            self._backward(state)
            self._forward(state)
        self.stream.tensors = len(self.tags)
        self.stream.states = list(self.tags)
        return self.stream

    # --- bookkeeping ----------------------------------------------------------------------------

    def _add(self, state: State, tag: str | None, node: str, parent: State | None) -> None:
        if state in self.tags:
            if self.tags[state] != tag:
                tags = sorted(f"the γ of {t}" if t else "no γ" for t in (self.tags[state], tag))
                self._block(state, node, f"{state[0]} is reached with {tags[0]} and with {tags[1]}")
            return
        self.tags[state] = tag
        self.via[state] = (node, parent)
        self.stack.append(state)
        dim = _dim(self.zmg, state)
        if isinstance(dim, int) and self.stream.width is not None and dim != self.stream.width:
            self._block(state, node, f"{state[0]} has {dim} features along the stream's axis, not {self.stream.width}")

    def _block(self, state: State, node: str, reason: str) -> None:
        if self.stream.blocker is not None:
            return
        path = [node]
        current: State | None = state
        while current is not None:
            step, current = self.via[current]
            if step != path[-1]:
                path.append(step)
        self.stream.blocker = Blocker(node, reason, tuple(reversed(path)), state[0], state[1])

    def _norm(self, norm: NormInfo, state: State) -> str | None:
        """Enter a norm reading or writing `state`; returns why it refuses the stream, or None."""
        if norm.name not in self.stream.norms:
            self.stream.norms.append(norm.name)
        why = _norm_refusal(self.zmg, norm, state[1])
        tag = gamma_tag(self.zmg, norm)
        if why is None and tag is not None and tag not in self.stream.moved_gamma:
            self.stream.moved_gamma.append(tag)
        return why

    # --- the two directions ---------------------------------------------------------------------

    def _backward(self, state: State) -> None:
        tensor, axis = state
        tag = self.tags[state]
        node = self.zmg.producer_of(tensor)
        if node is None:
            self._block(state, tensor, f"graph input {tensor} is in the stream: rotating it would change the input")
            return
        if isinstance(node.rule, NormRule):
            norm = node.rule.norm
            why = self._norm(norm, state)
            if why is None and gamma_tag(self.zmg, norm) != tag:
                why = _gamma_writer(norm, tensor, tag)
            if why is not None:
                self._block(state, node.name, why)
                return
            self._add((norm.input, axis), None, node.name, state)
            return
        why = _breaks(node, axis)
        result = why or node.rule.backward(self.zmg, node, tensor, axis)
        if isinstance(result, str):
            self._block(state, node.name, result)
            return
        if isinstance(result, Centring):  # a linear layer (or a LayerScale after one) writes the stream
            if tag is not None:
                self._block(state, node.name, f"{node.op} {node.name} adds to the output of {tag}, which keeps γ")
                return
            self.stream.writers[result] = None
            return
        for index, source, in_axis in result:
            if not self.zmg.is_constant(source):
                if in_axis is None:  # rules refuse this themselves; a rotation could not reach it either
                    self._block(state, node.name, f"{node.op} {node.name} broadcasts {source} along the hidden axis")
                else:
                    self._add((source, in_axis), tag, node.name, state)
                continue
            why = self._constant_refusal(source, in_axis, tag)
            if why is not None:
                self._block(state, node.name, f"{node.op} {node.name}: {why}")
                continue
            self.stream.writers[Centring(node.name, in_axis, index, source, stream_axis=axis)] = tag

    def _constant_refusal(self, tensor: str, axis: int | None, tag: str | None) -> str | None:
        values = self.zmg.constant(tensor)
        if axis is None and np.any(values != 0):
            return f"adds {tensor}, constant along the hidden axis, which a rotation would make vary"
        if tag is not None and np.any(gamma_of(self.zmg, self.zmg.norm_by_name(tag)) == 0):
            return f"adds {tensor} after {tag}, whose γ has zeros, so it cannot be divided by γ"
        return None

    def _forward(self, state: State) -> None:
        tensor, axis = state
        tag = self.tags[state]
        if tensor in self.zmg.graph_outputs:
            self._block(state, tensor, f"the stream is graph output {tensor}: rotating it would change the output")
            return
        for node, index in self.zmg.consumers_of(tensor):
            if isinstance(node.rule, ShapeOnly):  # reads no values
                continue
            if isinstance(node.rule, NormRule):
                norm = node.rule.norm
                why = self._norm(norm, state) if index == 0 else f"{node.op} {node.name} reads the stream as γ or β"
                if why is None and tag is not None:
                    why = f"{node.op} {node.name} normalizes the output of {tag}, which keeps γ"
                if why is not None:
                    self._block(state, node.name, why)
                    continue
                self._add((norm.output, axis), gamma_tag(self.zmg, norm), node.name, state)
                continue
            if self.reads(node, index, axis):
                reader = Reader(node.name, index, axis, tag)
                if reader not in self.stream.readers:
                    self.stream.readers.append(reader)
                continue
            why = _breaks(node, axis) or _not_commuting(node)
            result = why or node.rule.forward(Shift(self.zmg, node, index, axis))
            if isinstance(result, str):
                self._block(state, node.name, result if why else f"{node.op} {node.name} {result}")
                continue
            for out, out_axis in result:
                self._add((out, out_axis), tag, node.name, state)


def _gamma_writer(norm: NormInfo, tensor: str, tag: str | None) -> str:
    """Why `norm`, whose γ is not uniform, cannot write `tensor` of a stream that carries `tag` (another norm's γ,
    or none)."""
    if tag is None:
        return (
            f"{norm.op} {norm.name} writes the stream ({tensor}) with its own γ: a norm after a block (Gemma-2's "
            "sandwich norms) adds γ ⊙ RMSNorm(x) to the residual stream, and no rotation commutes with a per-feature "
            "γ there, so this stream cannot be rotated or sliced: the model is left as it is"
        )
    return f"{tensor} is reached with a γ other than that of {norm.name}"


def _per_head(zmg: ZeroMeanGraph, norm: NormInfo) -> Blocker | None:
    """The refusal of a norm over each head of a wider feature axis, or None.

    Qwen-3's and OLMo-2's query and key norms normalize each head alone: the projection's d features are
    reshaped into d/h groups of h and each group is normalized. The reshape next to the norm (producing its
    input, through float casts) does not keep the normalized axis, so no residual stream reaches the norm,
    and a rotation of a head would meet the rotary embedding and the attention scores, which do not commute
    with it. Refused here by what it is, whichever exporter wrote the graph.
    """
    node = zmg.producer_of(norm.input)
    while node is not None and node.op in ("Cast", "Identity"):
        node = zmg.producer_of(node.inputs[0])
    if node is None or not isinstance(node.rule, Regroup) or norm.axis is None:
        return None
    width = _dim(zmg, (norm.input, norm.axis))
    features = (zmg.shape(node.inputs[0]) or (None,))[-1]
    if not isinstance(width, int) or not isinstance(features, int) or features <= width or features % width:
        return None
    if regroup_axis(zmg.shape(node.inputs[0]), zmg.shape(node.outputs[0]), len(zmg.shape(node.inputs[0]) or ()) - 1):
        return None
    reason = (
        f"{norm.op} {norm.name} normalizes each head on its own ({node.op} {node.name} splits {features} features "
        f"into {features // width} groups of {width}: per-head query/key norms, as in Qwen-3): it is on no residual "
        "stream, and a rotation of a head would not commute with the rotary embedding and attention that read it; "
        "nothing to do: it is left as it is, and the residual stream rotates and slices without it"
    )
    return Blocker(node.name, reason, (norm.name, node.name), norm.input, norm.axis)


def _dim(zmg: ZeroMeanGraph, state: State):
    shape = zmg.shape(state[0])
    return None if shape is None or state[1] >= len(shape) else shape[state[1]]


def _breaks(node: ZNode, axis: int) -> str | None:
    """Why an op the fold's proof passes through does not commute with a rotation along `axis`, or None."""
    rule = node.rule
    if isinstance(rule, Concat) and rule.axis == axis:
        return f"{node.op} {node.name} concatenates along the hidden axis"
    if isinstance(rule, Select) and (rule.axes is None or axis in rule.axes):
        return f"{node.op} {node.name} slices along the hidden axis, or along axes known only at run time"
    if isinstance(rule, Centered) or (isinstance(rule, Reduce) and rule.axes is not None and axis in rule.axes):
        return (
            f"{node.op} {node.name} {'subtracts' if isinstance(rule, Centered) else 'takes'} the mean of the stream "
            "over its hidden axis (as the centring x − mean(x) does that the fold inserts where the stream is not "
            "zero-mean: a norm writes γ ⊙ x̂ + β into it, as BLOOM's embedding norm does), and a rotation does not "
            "keep the mean; nothing to do: the stream is left as it is"
        )
    return None


def _not_commuting(node: ZNode) -> str | None:
    """Why a consumer whose `forward` would pass a shift on still does not commute with Q: it removes
    the shift (Softmax) without being linear. (A `Linear` that is not a reader, or an `Opaque` node,
    is refused by its own `forward`, with the reason.)"""
    if isinstance(node.rule, ShiftInvariant):
        return f"{node.op} {node.name} is not linear in the stream"
    return None


def plan_rotation(zmg: ZeroMeanGraph, reads: Reads) -> RotationPlan:
    """Every stream of `zmg`, seeded at its norms over one axis: rotatable (with what to rotate) or refused (why).

    A stream seeded at a LayerNorm (one the fold could not make an RMSNorm) is refused at once, by that norm.

    `reads(node, index, axis)` is the front end's answer to: does `node` contract input `index` along
    `axis` with constant weights (a linear layer that can take Qᵀ)?
    """
    streams: list[Stream] = []
    seen: set[str] = set()
    for norm in zmg.norms:
        if norm.name in seen or norm.axis is None:
            continue
        head = _per_head(zmg, norm)
        if head is not None:
            streams.append(Stream(norm.name, None, [norm.name], blocker=head))
            seen.add(norm.name)
            continue
        stream = _Closure(zmg, reads, norm, norm.axis).run()
        seen.update(stream.norms)
        streams.append(stream)
    return RotationPlan(streams)
