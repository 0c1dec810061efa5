"""The zero-mean graph: the front-end-neutral model of a network that the analysis reasons about.

It also defines the interface every node's rule implements (`Rule`, with the `Shift` record the
safety check passes it); the rules themselves are in `rules.py`, which imports this module and is
never imported by it.

It is a `networkx.MultiDiGraph` (`ZeroMeanGraph.graph`, built from the nodes on first use, so
that the analysis, which needs none of it, does not pay for it). Each operation is a node, keyed by its
name, with attributes `kind` (`NodeKind`, the coarse class shown to users), `rule` (its algebra:
how zero mean and shifts flow through it, see `rules.py`), `op` and `ref` (the front end's own
node object, opaque here). Each tensor read by a node is an edge producer → reader, keyed by the
reader's input index, with attributes `tensor` and `index`; a tensor that no node produces (a
graph input, a constant, a value from an outer scope) is a *source* node `("tensor", name)`, so
that what such a tensor reaches is ordinary graph reachability. `nodes`, `producer` and
`consumers` index the same graph by name, for the analysis' inner loops.

Tensor shapes are tuples of `int` (static), `str` (symbolic) or `None` (unknown), or `None` when
even the rank is unknown.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from .plan import Centring

if TYPE_CHECKING:
    import networkx as nx

    from .plan import FoldPlan

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


ALREADY_RMS = "already an RMSNorm: there is no mean subtraction to remove"  # why an RMSNorm never folds


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


# --- rules: the interface (`rules.py` implements it) ------------------------------------------

Required = list[tuple[int, str, int | None]]  # (input index, input tensor, its axis or None)
Backward = Required | Centring | str  # inputs that must be zero-mean, a centring, or why not
Forward = list[tuple[str, int]] | str  # (output, axis) states that carry the shift on, or why not
Rows = tuple[int, int, int]  # (axis, start, stop): the only slice along another axis that carries a shift


@dataclass(frozen=True, eq=False)
class Shift:
    """A per-sample shift entering input `index` of `node`.

    `axis` is the shifted axis of that input; None when the input is broadcast along the
    normalized axis, which is then `out_axis` of the output. `rows`, where known, is the one slice
    along another axis of the input that carries the shift (the rest of the input carries none).
    `weight`, where set, names the per-feature constant w the shift is c·w⁻¹ of (a weighted
    centring's, `plan.Centring.weight`): not constant along the axis until a multiply by w.
    """

    zmg: ZeroMeanGraph
    node: ZNode
    index: int
    axis: int | None
    out_axis: int | None = None
    rows: Rows | None = None
    weight: str | None = None

    @property
    def out(self) -> str:
        return self.node.outputs[0]

    @property
    def in_shape(self):
        return self.zmg.shape(self.node.inputs[self.index])

    @property
    def out_shape(self):
        return self.zmg.shape(self.out)

    @property
    def lift(self) -> int:
        """How many axes broadcasting prepends to the input."""
        return len(self.out_shape) - len(self.in_shape)


class Rule(Protocol):
    """The algebra of one node: see the module docstring. Every rule is a frozen dataclass."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def removes_shift(self) -> bool:
        """Whether `forward` returns [] because the node removes a shift constant along its axis (which a weighted
        shift is not), not because the shift never reaches its output's values."""
        ...

    def backward(self, zmg: ZeroMeanGraph, node: ZNode, tensor: str, axis: int) -> Backward:
        """What makes output `tensor` of `node` zero-mean along `axis`."""
        ...

    def forward(self, shift: Shift) -> Forward:
        """Where a shift entering `node` goes; a reason completes "{op} {name} …"."""
        ...

    def rows(self, shift: Shift, output: str) -> Rows | None:
        """The slice of `output` that carries a shift `forward` passed on to it (None: all of it)."""
        ...

    def rows_read(self, zmg: ZeroMeanGraph, node: ZNode, tensor: str, rows: Rows | None, index: int) -> Rows | None:
        """The slice of input `index` that the slice `rows` of output `tensor` reads (None: all of it; an
        empty range, stop ≤ start: none of it)."""
        ...

    def weigh(self, zmg: ZeroMeanGraph, node: ZNode, tensor: str, axis: int) -> tuple[Required, str] | str | None:
        """For a multiply by a per-feature constant w along `axis`: the input that must be w-weighted
        zero-mean (w ⊙ x zero-mean) for output `tensor` to be zero-mean, and w's name; or why not; None
        where the node is no such multiply."""
        ...

    def unweighs(self, shift: Shift) -> bool:
        """Whether the node multiplies a shift c·w⁻¹ (`Shift.weight` w) by w, leaving c·1."""
        ...


def describe(rule: Rule) -> str:
    """A rule's name and parameters as one string, e.g. `Linear(axis=2)`, `NormRule(norm=ln_f)` (fields declared
    with `repr=False` left out)."""
    params = ", ".join(f"{f.name}={_short(getattr(rule, f.name))}" for f in fields(rule) if f.repr)
    return f"{type(rule).__name__}({params})"


def _short(value) -> str:
    return value.name if hasattr(value, "name") else repr(value)


@dataclass
class ZNode:
    name: str
    op: str
    kind: NodeKind
    rule: Rule
    inputs: list[str]
    outputs: list[str]
    ref: Any = None


GraphNode = str | tuple[str, str]  # in `ZeroMeanGraph.graph`: a node's name, or `source(tensor)`


def source(tensor: str) -> tuple[str, str]:
    """The graph node of a tensor that no node produces."""
    return ("tensor", tensor)


@dataclass
class ZeroMeanGraph:
    """Nodes, tensors and norms of one model, over a `networkx.MultiDiGraph` (see the module docstring)."""

    nodes: dict[str, ZNode] = field(default_factory=dict)
    norms: list[NormInfo] = field(default_factory=list)
    shapes: dict[str, Shape | None] = field(default_factory=dict)
    graph_inputs: set[str] = field(default_factory=set)
    graph_outputs: set[str] = field(default_factory=set)
    constants: dict[str, Callable[[], np.ndarray] | np.ndarray] = field(default_factory=dict)
    producer: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    model_name: str = "model"
    _graph: nx.MultiDiGraph | None = field(default=None, init=False, repr=False, compare=False)

    def add_node(self, node: ZNode) -> None:
        """Add `node`; nodes may come in any order (a reader before its producer)."""
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        self.nodes[node.name] = node
        self._graph = None
        for tensor in filter(None, node.outputs):
            self.producer[tensor] = node.name
        for index, tensor in enumerate(node.inputs):
            if tensor:
                self.consumers.setdefault(tensor, []).append((node.name, index))

    @property
    def graph(self) -> nx.MultiDiGraph:
        """The graph as networkx (see the module docstring), built on first use after a change."""
        if self._graph is None:
            self._graph = self._build_graph()
        return self._graph

    def _build_graph(self) -> nx.MultiDiGraph:
        import networkx as nx  # for inspect --graph and viz only: the CLI starts faster without it

        g: nx.MultiDiGraph[GraphNode] = nx.MultiDiGraph()
        for node in self.nodes.values():
            g.add_node(node.name, kind=node.kind, rule=node.rule, op=node.op, ref=node.ref)
        for node in self.nodes.values():
            for index, tensor in enumerate(node.inputs):
                if not tensor:
                    continue
                producer: GraphNode | None = self.producer.get(tensor)
                if producer is None:
                    producer = source(tensor)
                    g.add_node(producer, tensor=tensor)
                g.add_edge(producer, node.name, key=index, tensor=tensor, index=index)
        return g

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

    def to_networkx(self, plan: FoldPlan | None = None) -> nx.MultiDiGraph:
        """A copy for other tools: string ids and string, number or bool attributes only.

        Nodes: `kind`, `op`, `rule` (`describe`); source tensors are named after the tensor
        (suffixed with their kind if a node has the same name) and have kind `input` or
        `constant`. With a plan, each norm also has `decision` (fold or keep), `reason`,
        `blocked_by` and `centred_layers` (names joined by spaces); empty strings where none.
        Edges keep their key (the reader's input index) and attributes `tensor`, `index`.
        """
        import networkx as nx

        out: nx.MultiDiGraph[str] = nx.MultiDiGraph(name=self.model_name)
        ids: dict[GraphNode, str] = {}
        for ident, data in self.graph.nodes(data=True):
            if ident in self.nodes:
                ids[ident] = ident
                out.add_node(ident, kind=data["kind"].value, op=data["op"], rule=describe(data["rule"]))
                continue
            tensor = data["tensor"]
            kind = (NodeKind.CONSTANT if self.is_constant(tensor) else NodeKind.INPUT).value
            ids[ident] = tensor if tensor not in self.nodes else f"{tensor} ({kind})"
            out.add_node(ids[ident], kind=kind, op=kind, rule="")
        for u, v, key, data in self.graph.edges(keys=True, data=True):
            out.add_edge(ids[u], ids[v], key=key, tensor=data["tensor"], index=data["index"])
        for decision in plan.decisions if plan is not None else []:
            if decision.name not in out:
                continue
            out.nodes[decision.name].update(
                decision="fold" if decision.foldable else "keep",
                reason=decision.reason or "",
                blocked_by=decision.blocker.node if decision.blocker else "",
                centred_layers=" ".join(decision.centred_layers if decision.foldable else []),
            )
        return out
