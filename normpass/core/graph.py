"""The zero-mean graph: the front-end-neutral model of a network that the analysis reasons about.

Nodes are operations, edges are tensors. Each node carries a *rule* describing how zero mean along
one axis of a tensor flows through it (seed 003 §4.2):

* `Linear(axis)`      y = x·W + b. Centring W and b along the output features makes y zero-mean
                      along `axis` of y for every input (column-centred constraint).
* `Scale(factor)`     y = x ⊙ s. If s is constant along the axis, mean(y) = s·mean(x): zero stays zero.
* `Sum()`             y = Σ ±xᵢ (residual add/sub). Zero-mean iff every branch is.
* `Permute(perm)`     y = transpose(x): the axis moves, its elements do not.
* `Regroup()`         y = reshape(x): the axis is intact iff the same size and the same suffix
                      product (number of elements after it) exist on both sides.
* `Select(axes)`      slice/split along `axes`: each slice along other axes is kept whole.
* `Take(axis, index_rank)`  gather along `axis` of data from an index tensor.
* `Broadcast()`       expand over other axes.
* `Concat(axis)`      zero-mean parts concatenated (along any axis) are zero-mean.
* `Mix(kept)`         y = a linear map over the other axes, the same for every slice along an axis
                      in `kept` (Resize, average pooling, Pad with zeros, Tile with repeat 1 on
                      the axis): zero-mean slices stay zero-mean, a shift constant along it stays so.
* `Choose()`          Where(c, a, b) with c constant along the axis: whole rows come from a or b.
* `Centered(axis)`    the output is already zero-mean along `axis` (x − mean(x)).
* `NormRule(norm)`    a normalization node. It removes a per-sample shift that is constant along
                      its single normalized axis if it subtracts the mean (LayerNorm).
* `ShiftInvariant(axis)`  e.g. Softmax: f(x + c·1) = f(x) along `axis`.
* `ShapeOnly()`       reads only its input's shape or dtype (Shape, Size, EyeLike): a shift never
                      reaches its output, and its output carries no zero-mean stream.
* `Opaque(reason)`    anything else: zero mean does not flow through it, and a shift reaching it
                      changes the model.

Kinds (`NodeKind`) are the coarse classification shown to users; rules carry the algebra.
Tensor shapes are tuples of `int` (static), `str` (symbolic) or `None` (unknown), or `None` when
even the rank is unknown.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx
import numpy as np

Shape = tuple  # tuple[int | str | None, ...]


class NodeKind(enum.Enum):
    LINEAR = "linear"
    SCALAR = "scalar"
    RESIDUAL = "residual"
    LAYOUT = "layout"
    CENTERED = "centered"
    NORM = "norm"
    INPUT = "input"
    CONSTANT = "constant"
    OTHER = "other"


class NormType(enum.Enum):
    LAYER = "LayerNorm"
    RMS = "RMSNorm"
    GROUP = "GroupNorm"


# --- rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """Output zero-mean along `axis` once the layer's weights are centred (the stream input is free)."""

    axis: int


@dataclass(frozen=True)
class Scale:
    """Output = input[stream] times input[factor]; `factor=None` for unary ops (Neg, Cast, Dropout)."""

    stream: int = 0
    factor: int | None = None


@dataclass(frozen=True)
class Sum:
    """Output = ± every input (Add, Sub)."""


@dataclass(frozen=True)
class Permute:
    perm: tuple[int, ...]


@dataclass(frozen=True)
class Regroup:
    """Reshape-like: Reshape, Flatten, Squeeze, Unsqueeze."""


@dataclass(frozen=True)
class Select:
    """Slice or split along `axes` of input 0 (None: the axes are not known statically)."""

    axes: tuple[int, ...] | None


@dataclass(frozen=True)
class Take:
    """Gather along `axis` of input 0 with an index tensor of rank `index_rank`."""

    axis: int
    index_rank: int | None


@dataclass(frozen=True)
class Broadcast:
    """Expand input 0 to a larger shape."""


@dataclass(frozen=True)
class Concat:
    axis: int


@dataclass(frozen=True)
class Mix:
    """Input 0 mapped over other axes by one linear map; `kept`: the axes it leaves alone."""

    kept: tuple[int, ...]


@dataclass(frozen=True)
class Choose:
    """Where(condition, a, b): each element from a or b, per the condition (input 0)."""


@dataclass(frozen=True)
class Centered:
    axis: int


@dataclass(frozen=True)
class ShiftInvariant:
    axis: int


@dataclass(frozen=True)
class ShapeOnly:
    """Output independent of the input's values (Shape, Size, EyeLike, Random*Like)."""


@dataclass(frozen=True)
class Opaque:
    reason: str


@dataclass(frozen=True)
class NormRule:
    norm: "NormInfo"


Rule = Any  # one of the dataclasses above


# --- records -----------------------------------------------------------------------------------


@dataclass
class NormInfo:
    """A recognised normalization, whatever its form in the source graph (one op or a pattern).

    `axis` is the single normalized axis (non-negative) when the norm normalizes over one axis,
    else None. `output_centred` says the output γ⊙x̂+β is itself zero-mean (uniform γ, mean β = 0).
    """

    name: str
    op: str  # what the user sees: "LayerNormalization", "decomposed LayerNorm", ...
    norm_type: NormType
    input: str
    output: str
    axis: int | None
    epsilon: float
    scale: str | None = None
    bias: str | None = None
    output_centred: bool = False
    unsupported: str | None = None  # why this norm can never be folded, found by the front end
    ref: Any = None  # front-end handle (matched nodes)

    @property
    def removes_mean(self) -> bool:
        return self.norm_type is NormType.LAYER and self.axis is not None


@dataclass
class ZNode:
    name: str
    op: str
    kind: NodeKind
    rule: Rule
    inputs: list[str]
    outputs: list[str]
    ref: Any = None


@dataclass
class ZeroMeanGraph:
    """Nodes, tensors and norms of one model, over a `networkx.MultiDiGraph` (edges = tensors)."""

    nodes: dict[str, ZNode] = field(default_factory=dict)
    norms: list[NormInfo] = field(default_factory=list)
    shapes: dict[str, Shape | None] = field(default_factory=dict)
    graph_inputs: set[str] = field(default_factory=set)
    graph_outputs: set[str] = field(default_factory=set)
    constants: dict[str, Callable[[], np.ndarray] | np.ndarray] = field(default_factory=dict)
    producer: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    model_name: str = "model"

    def add_node(self, node: ZNode) -> None:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        self.nodes[node.name] = node
        for tensor in node.outputs:
            if tensor:
                self.producer[tensor] = node.name
        for index, tensor in enumerate(node.inputs):
            if tensor:
                self.consumers.setdefault(tensor, []).append((node.name, index))

    # tensors
    def shape(self, tensor: str) -> Shape | None:
        return self.shapes.get(tensor)

    def rank(self, tensor: str) -> int | None:
        shape = self.shape(tensor)
        return None if shape is None else len(shape)

    def is_constant(self, tensor: str) -> bool:
        return tensor in self.constants

    def constant(self, tensor: str) -> np.ndarray:
        value = self.constants[tensor]
        if callable(value):
            value = value()
            self.constants[tensor] = value
        return value

    def producer_of(self, tensor: str) -> ZNode | None:
        name = self.producer.get(tensor)
        return None if name is None else self.nodes[name]

    def consumers_of(self, tensor: str) -> list[tuple[ZNode, int]]:
        return [(self.nodes[name], index) for name, index in self.consumers.get(tensor, [])]

    def norm_by_name(self, name: str) -> NormInfo:
        for norm in self.norms:
            if norm.name == name:
                return norm
        raise KeyError(name)

    def to_networkx(self) -> nx.MultiDiGraph:
        """The graph as networkx: node attributes `op`, `kind`; edge attribute `tensor`."""
        g = nx.MultiDiGraph()
        for node in self.nodes.values():
            g.add_node(node.name, op=node.op, kind=node.kind.value)
        for node in self.nodes.values():
            for tensor in node.inputs:
                source = self.producer.get(tensor)
                if source is not None:
                    g.add_edge(source, node.name, tensor=tensor)
        return g
