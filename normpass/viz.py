"""Pictures of the zero-mean graph around every norm: what folds, what was centred, what blocks.

**What is drawn.** The graph of operations (plus the graph inputs, outputs and centred
constants as small nodes), coloured by `NodeKind`. Each norm is marked folded or refused; the
layers centred for folded norms have a green outline; a refused norm's blocker has a red one and
the path from the norm back to it is drawn in red. By default only what explains a decision is
shown: for every norm, its *proof region* (the nodes on axis-transparent paths — residual,
scalar, layout — between the norm and the layers it centres or the node that blocks it), the
blocking path, and one hop of context around them. Paths through hidden nodes become dashed
edges. `full=True` shows everything; `norm=NAME` focuses on one norm.

**Layout** (a small Sugiyama layout, no Graphviz needed): longest-path layering top to bottom,
sources pulled down next to their first consumer, dummy nodes on edges that span layers,
barycentre ordering sweeps, then x positions relaxed towards the mean of each node's neighbours
without overlaps.

**Writers.** DOT (for Graphviz), SVG (drawn here, presentation attributes only, so any viewer
renders it) and HTML: one self-contained file with the SVG, the decisions as JSON and a small
script for pan, zoom, search and a details panel. Nothing is fetched at view time.
"""

from __future__ import annotations

import html
import itertools
import json
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from statistics import fmean
from typing import cast

import networkx as nx

from .core.graph import NodeKind, ZeroMeanGraph
from .core.plan import Centring, FoldPlan, NormDecision
from .core.rules import Concat, NormRule
from .errors import InputError

TRANSPARENT = {NodeKind.RESIDUAL.value, NodeKind.SCALAR.value, NodeKind.LAYOUT.value}

# kind → (fill, stroke, legend label)
KIND_STYLE = {
    "linear": ("#dbeafe", "#2563eb", "linear"),
    "scalar": ("#fef3c7", "#d97706", "scalar"),
    "residual": ("#ede9fe", "#7c3aed", "residual"),
    "layout": ("#f1f5f9", "#94a3b8", "layout"),
    "centered": ("#ccfbf1", "#0d9488", "centred (zero-mean op)"),
    "other": ("#e5e7eb", "#4b5563", "other"),
    "input": ("#ffffff", "#6b7280", "input / output / constant"),
    "output": ("#ffffff", "#6b7280", None),
    "constant": ("#ffffff", "#6b7280", None),
}
NORM_STYLE = {"folded": ("#bbf7d0", "#15803d", "norm folded"), "refused": ("#fecaca", "#b91c1c", "norm refused")}
CENTRED_STROKE, BLOCKER_STROKE = "#16a34a", "#dc2626"
# edge style → (colour, width, dash, legend label)
EDGE_STYLE = {
    "": ("#9ca3af", 1.2, None, None),
    "proof": ("#16a34a", 2.2, None, "proof path"),
    "block": ("#dc2626", 3.0, None, "blocking path"),
    "collapsed": ("#9ca3af", 1.2, "5,4", "through hidden nodes"),
}

CHAR_W, NODE_H, NORM_H, ROW_H, GAP, DUMMY_W, MARGIN, HEADER_H = 6.4, 38, 52, 84, 22, 10, 30, 100
MAX_LABEL, MIN_WIDTH = 30, 900.0


@dataclass
class VNode:
    id: str
    op: str
    kind: str
    label: str
    roles: list[str] = field(default_factory=list)  # folded, refused, centred, inserted, blocker, context
    info: dict = field(default_factory=dict)  # everything the details panel shows
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0
    h: float = NODE_H


@dataclass
class VEdge:
    source: str
    target: str
    style: str  # a key of EDGE_STYLE
    tensors: list[str]
    hidden: int = 0  # for collapsed edges: how many hidden nodes the edge stands for
    points: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class View:
    title: str
    subtitle: str
    nodes: dict[str, VNode]
    edges: list[VEdge]
    norms: list[dict]
    width: float = 0.0
    height: float = 0.0


# --- what to draw ------------------------------------------------------------------------------


class _Graph:
    """The zero-mean graph as a networkx DiGraph with pseudo-nodes for inputs, outputs, constants."""

    def __init__(self, zmg: ZeroMeanGraph, plan: FoldPlan):
        self.zmg = zmg
        self.g: nx.DiGraph[str] = nx.DiGraph()
        self.alias: dict[str, str] = {}  # tensor → pseudo-node id
        for node in zmg.nodes.values():
            self.g.add_node(
                node.name,
                op=node.op,
                kind=node.kind.value,
                inputs=node.inputs,
                outputs=node.outputs,
                rule=_describe(node.rule),
            )
        constants = {c.tensor for c in _centrings(plan) if c.tensor and c.tensor not in zmg.producer}
        for tensor in sorted(zmg.graph_inputs):
            self._pseudo(tensor, "input", outputs=[tensor])
        for tensor in sorted(constants):
            self._pseudo(tensor, "constant", outputs=[tensor])
        for node in zmg.nodes.values():
            for tensor in node.inputs:
                source = zmg.producer.get(tensor) or self.alias.get(tensor)
                if source is not None:
                    self._edge(source, node.name, tensor)
        for tensor in sorted(zmg.graph_outputs):
            sink = self._pseudo(tensor, "output", inputs=[tensor])
            source = zmg.producer.get(tensor) or self.alias.get(tensor)
            if source is not None:
                self._edge(source, sink, tensor)

    def _pseudo(self, tensor: str, kind: str, inputs=(), outputs=()) -> str:
        ident = tensor if tensor not in self.g else f"{tensor} ({kind})"
        self.alias.setdefault(tensor, ident)
        self.g.add_node(ident, op=kind, kind=kind, inputs=list(inputs), outputs=list(outputs), rule=None)
        return ident

    def _edge(self, source: str, target: str, tensor: str) -> None:
        if self.g.has_edge(source, target):
            self.g.edges[source, target]["tensors"].append(tensor)
        else:
            self.g.add_edge(source, target, tensors=[tensor])

    def resolve(self, name: str) -> str | None:
        """The drawn node for a name in a plan: a node, or a tensor (its pseudo-node, else its producer)."""
        return name if name in self.zmg.nodes else self.alias.get(name) or self.zmg.producer.get(name)

    def connect(self, a: str, b: str) -> list[str]:
        """The nodes of a shortest path between a and b, in edge direction (either way round)."""
        for source, target in ((b, a), (a, b)):
            try:
                return nx.shortest_path(self.g, source, target)
            except (nx.NetworkXNoPath, nx.NodeNotFound):
                pass
        return []

    def data_sources(self, ident: str) -> list[str]:
        """Producers of the inputs that carry data: a layout op's shape or index inputs do not."""
        node = self.zmg.nodes.get(ident)
        if node is None:
            return list(self.g.predecessors(ident))
        inputs = node.inputs[:1] if node.kind is NodeKind.LAYOUT and not isinstance(node.rule, Concat) else node.inputs
        sources = (self.zmg.producer.get(t) or self.alias.get(t) for t in inputs if t)
        return [s for s in sources if s is not None]

    def blocking_path(self, decision: NormDecision) -> list[tuple[str, str]]:
        """Edges from the norm back to its blocker (safety blockers: from the centred layer forward)."""
        if decision.blocker is None:
            return []
        names = [n for n in (self.resolve(name) for name in decision.blocker.path) if n is not None]
        edges: list[tuple[str, str]] = []
        for a, b in itertools.pairwise(names):
            path = self.connect(a, b)
            edges.extend(itertools.pairwise(path))
        return edges

    def proof_regions(self, ends: dict[str, set[str]]) -> dict[str, int]:
        """For each node, the norms whose proof region holds it, as the bits of an int (bit i: the i-th norm
        of `ends`, which maps each norm to its ends). A norm's proof region is the norm, its ends that reach
        it, and the nodes on the paths from those ends to it among what reaches it through transparent nodes.

        Two passes over the graph instead of a walk per norm (a residual stream makes the regions of
        successive norms overlap, their sizes summing to O(nodes · norms)): bottom-up, the norms each node
        reaches through transparent nodes; top-down, the norms one of whose ends lies above it among those.
        Time O(edges · norms / 64)."""
        bit = {norm: 1 << i for i, norm in enumerate(ends)}
        end_of: dict[str, int] = {}
        for norm, nodes in ends.items():
            for ident in nodes:
                end_of[ident] = end_of.get(ident, 0) | bit[norm]
        order = list(nx.topological_sort(self.g))
        passes: dict[str, int] = {}  # the norms reached through v: v's own bit; if v is transparent, all it reaches
        reaches: dict[str, int] = {}
        for v in reversed(order):
            reaches[v] = bit.get(v, 0)
            for w in self.g.successors(v):
                reaches[v] |= passes[w]
            passes[v] = bit.get(v, 0) | (reaches[v] if self.g.nodes[v]["kind"] in TRANSPARENT else 0)
        region: dict[str, int] = {}
        for v in order:
            from_ends = end_of.get(v, 0)
            for u in self.g.predecessors(v):
                from_ends |= region[u]
            region[v] = bit.get(v, 0) | (reaches[v] & from_ends)
        return region


def build_view(zmg: ZeroMeanGraph, plan: FoldPlan, full: bool = False, norm: str | None = None) -> View:
    """Choose, label and lay out the nodes to draw for `plan` (see the module docstring)."""
    graph = _Graph(zmg, plan)
    g = graph.g
    decisions = plan.decisions
    if norm is not None:
        decisions = [d for d in decisions if d.name == norm]
        if not decisions:
            names = ", ".join(d.name for d in plan.decisions) or "none"
            raise InputError(f"norm {norm!r}: no such norm in {zmg.model_name}; its norms are: {names}")
    focus = {d.name for d in decisions}
    by_name = {d.name: d for d in plan.decisions}
    norms_json = [d.to_json() for d in plan.decisions]  # each once: a folded norm's lists its centred layers
    decisions_json = {d.name: j for d, j in zip(plan.decisions, norms_json, strict=True)}
    roles: dict[str, list[str]] = {n: [] for n in g}
    notes: dict[str, dict[str, list[str]]] = {n: {} for n in g}
    relevant: set[str] = set()
    block_edges: set[tuple[str, str]] = set()

    def mark(ident, role, note, norm_name):
        if ident is not None:
            if role not in roles[ident]:
                roles[ident].append(role)
            notes[ident].setdefault(note, []).append(norm_name)

    # Each centring is resolved once (a residual stream's norms list O(norms²) centrings in all, the same
    # objects: keyed by identity, looked up at C speed).
    drawn = {id(c): graph.resolve(c.label) for c in _centrings(plan)}
    ends: dict[str, set[str]] = {}
    for decision in plan.decisions:
        roles[decision.name].append("folded" if decision.foldable else "refused")
        centred = cast(set[str], set(map(drawn.__getitem__, map(id, decision.centrings))) - {None})
        inserted = {
            r for i in decision.insertions if (r := graph.resolve(zmg.producer.get(i.tensor, i.tensor))) is not None
        }
        if decision.foldable:
            for ident in centred:  # `mark`, inlined: this runs once per centring of every norm
                if "centred" not in roles[ident]:
                    roles[ident].append("centred")
                notes[ident].setdefault("centred for", []).append(decision.name)
            for ident in inserted:
                mark(ident, "inserted", "x − mean(x) inserted after it for", decision.name)
        path_edges = []
        if decision.blocker is not None:
            path_edges = graph.blocking_path(decision)
            mark(graph.resolve(decision.blocker.node), "blocker", "blocks", decision.name)
        if decision.name not in focus:
            continue
        on_path = {ident for edge in path_edges for ident in edge}
        ends[decision.name] = centred | inserted | on_path
        relevant |= on_path
        block_edges |= set(path_edges)
    regions = graph.proof_regions(ends)
    folded_bits = sum(1 << i for i, name in enumerate(ends) if by_name[name].foldable)
    relevant |= {ident for ident, bits in regions.items() if bits}
    proof_edges = {(u, w) for u, w in g.edges if regions[u] & regions[w] & folded_bits}
    if full:
        visible = set(g)
    else:
        context = {m for n in relevant for m in (*graph.data_sources(n), *g.successors(n))} - relevant
        for ident in context:
            roles[ident].append("context")
        visible = relevant | context
    nodes = {}
    for ident in g:  # graph order keeps the output deterministic
        if ident not in visible:
            continue
        data = g.nodes[ident]
        info = {
            "name": ident,
            "op": data["op"],
            "kind": data["kind"],
            "rule": data["rule"],
            "inputs": [[t, _shape(zmg, t)] for t in data["inputs"] if t],
            "outputs": [[t, _shape(zmg, t)] for t in data["outputs"] if t],
            "roles": roles[ident],
            "notes": notes[ident],
        }
        if ident in by_name:
            info["decision"] = decisions_json[ident]
        nodes[ident] = VNode(ident, data["op"], data["kind"], ident, roles[ident], info)
    edges = []
    for source, target, data in g.edges(data=True):
        if source in nodes and target in nodes:
            style = "block" if (source, target) in block_edges else "proof" if (source, target) in proof_edges else ""
            edges.append(VEdge(source, target, style, data["tensors"]))
    edges += _collapsed_edges(g, nodes, edges)
    folded = len(plan.folded)
    shown = (
        f"all {len(nodes)} nodes"
        if full
        else f"{len(nodes)} of {len(g)} nodes; the rest is collapsed (a full view shows all)"
    )
    around = f"norm {norm}" if norm else f"{plan.total} norm(s)"
    view = View(
        title=f"{zmg.model_name}: {folded} of {plan.total} norms fold exactly into RMSNorm",
        subtitle=f"zero-mean graph around {around}; showing {shown}",
        nodes=nodes,
        edges=edges,
        norms=norms_json,
    )
    _layout(view)
    return view


def _centrings(plan: FoldPlan) -> list[Centring]:
    """Every centring object of every decision, once (the decisions' lists share the prover's objects, whose
    lists sum to O(norms²) entries: told apart by identity, at C speed, not by their Python-level hash)."""
    every = itertools.chain.from_iterable(d.centrings for d in plan.decisions)
    again = itertools.chain.from_iterable(d.centrings for d in plan.decisions)
    return list(dict(zip(map(id, every), again, strict=True)).values())


def _describe(rule) -> str:
    """A rule as the details panel shows it (a norm's rule without its front-end handle)."""
    if isinstance(rule, NormRule):
        norm = rule.norm
        return (
            f"{norm.norm_type.value} over axis {norm.axis}, ε = {norm.epsilon:.3g}; "
            f"γ = {norm.scale or 'none'}, β = {norm.bias or 'none'}"
        )
    return repr(rule)


def _shape(zmg: ZeroMeanGraph, tensor: str):
    shape = zmg.shape(tensor)
    return None if shape is None else list(shape)


def _collapsed_edges(g: nx.DiGraph, nodes: dict[str, VNode], edges: list[VEdge]) -> list[VEdge]:
    """Dashed edges u → w where w is reached from u only through hidden nodes, transitively reduced: none
    where a longer path of drawn and dashed edges leads from u to w as well.

    Each is labelled with the number of hidden nodes it stands for. Per drawn node u: a walk through the
    hidden nodes below it, and for the reduction one through the drawn nodes up to its farthest dashed
    target in topological order, not through the whole view."""
    hidden = {n for n in g if n not in nodes}
    if not hidden:
        return []
    index = {n: i for i, n in enumerate(nodes)}
    position = {n: i for i, n in enumerate(v for v in nx.topological_sort(g) if v in nodes)}
    found: dict[str, list[str]] = {u: [] for u in nodes}
    for edge in edges:
        found[edge.source].append(edge.target)
    below: dict[str, set[str]] = {}
    dashed: dict[str, list[str]] = {}
    for source in nodes:
        below[source] = _reached(g.successors, g.successors(source), hidden)
        exits = {t for current in below[source] for t in g.successors(current) if t in nodes}
        dashed[source] = sorted(exits - set(found[source]), key=index.__getitem__)  # node order: deterministic
        found[source] += dashed[source]
    collapsed = []
    for u, targets in dashed.items():
        if not targets:
            continue
        limit = max(position[w] for w in targets)
        longer, stack = set(), list(found[u])
        while stack:
            for w in found[stack.pop()]:
                if w not in longer and position[w] <= limit:
                    longer.add(w)
                    stack.append(w)
        for w in targets:
            if w not in longer:
                above = _reached(g.predecessors, g.predecessors(w), below[u])
                collapsed.append(VEdge(u, w, "collapsed", [], hidden=len(above)))
    return collapsed


def _reached(step, starts: Iterable[str], within: Container[str]) -> set[str]:
    """The nodes of `within` among `starts` and what `step` (successors or predecessors) leads to from
    them through nodes of `within`."""
    reached = {n for n in starts if n in within}
    stack = list(reached)
    while stack:
        for n in step(stack.pop()):
            if n in within and n not in reached:
                reached.add(n)
                stack.append(n)
    return reached


# --- layout ------------------------------------------------------------------------------------


def _lines(node: VNode) -> list[str]:
    """The text in a node's box: op, name and, for a norm, its decision."""
    lines = [node.op, _short(node.label)]
    if node.kind == "norm":
        lines.append("folded ✓" if "folded" in node.roles else "refused ✗")
    return lines


def _size(node: VNode) -> None:
    node.w = max(70.0, max(len(line) for line in _lines(node)) * CHAR_W + 20)
    node.h = NORM_H if node.kind == "norm" else NODE_H


def _short(text: str) -> str:
    """Long names keep their start and their more telling end: `model.encoder…output.dense.bias`."""
    if len(text) <= MAX_LABEL:
        return text
    head = (MAX_LABEL - 1) // 3
    return text[:head] + "…" + text[len(text) - (MAX_LABEL - 1 - head) :]


LayoutNode = str | tuple[str, int, int]  # a drawn node's id, or ("dummy", edge, layer) on a long edge


def _layout(view: View) -> None:
    """Set node coordinates and edge points (layers top to bottom)."""
    for node in view.nodes.values():
        _size(node)
    g: nx.DiGraph[str] = nx.DiGraph()
    g.add_nodes_from(view.nodes)
    g.add_edges_from((e.source, e.target) for e in view.edges)
    order = list(nx.topological_sort(g))
    layer: dict = {}
    for v in order:
        layer[v] = max((layer[u] + 1 for u in g.predecessors(v)), default=0)
    for v in reversed(order):  # sources sit just above their first consumer
        if g.in_degree(v) == 0 and g.out_degree(v):
            layer[v] = min(layer[w] for w in g.successors(v)) - 1
    # chains of dummy nodes on long edges
    up: dict = {v: [] for v in g}
    down: dict = {v: [] for v in g}
    chains = []
    for index, edge in enumerate(view.edges):
        chain: list[LayoutNode] = [edge.source]
        for step in range(layer[edge.source] + 1, layer[edge.target]):
            dummy = ("dummy", index, step)
            layer[dummy], up[dummy], down[dummy] = step, [], []
            chain.append(dummy)
        chain.append(edge.target)
        for a, b in itertools.pairwise(chain):
            down[a].append(b)
            up[b].append(a)
        chains.append(chain)
    rows: list[list] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    rank: dict[LayoutNode, float] = {v: float(i) for i, v in enumerate(order)}
    for chain in chains:  # a dummy starts next to its edge's source
        rank.update((dummy, rank[chain[0]] + 0.5) for dummy in chain[1:-1])
    for v in sorted(layer, key=rank.__getitem__):
        rows[layer[v]].append(v)
    _order_rows(rows, up, down)
    width = {v: view.nodes[v].w if v in view.nodes else DUMMY_W for v in layer}
    x = _place_rows(rows, up, down, width)
    left = min((x[v] - width[v] / 2 for v in x), default=0.0)
    right = max((x[v] + width[v] / 2 for v in x), default=0.0)
    left -= max(0.0, (MIN_WIDTH - 2 * MARGIN - (right - left)) / 2)  # centre a narrow graph
    for v, node in view.nodes.items():
        node.x = x[v] - left + MARGIN
        node.y = HEADER_H + MARGIN + layer[v] * ROW_H + NORM_H / 2
    for edge, chain in zip(view.edges, chains, strict=False):
        source, target = view.nodes[edge.source], view.nodes[edge.target]
        middle = [(x[d] - left + MARGIN, HEADER_H + MARGIN + layer[d] * ROW_H + NORM_H / 2) for d in chain[1:-1]]
        edge.points = [(source.x, source.y + source.h / 2), *middle, (target.x, target.y - target.h / 2)]
    view.width = max(MIN_WIDTH, max((n.x + n.w / 2 for n in view.nodes.values()), default=0.0) + MARGIN)
    view.height = HEADER_H + 2 * MARGIN + len(rows) * ROW_H


def _order_rows(rows: list[list], up: dict, down: dict, sweeps: int = 8) -> None:
    """Barycentre heuristic: sort each row by the mean position of its neighbours in the row before."""
    for sweep in range(sweeps):
        downward = sweep % 2 == 0
        indices = range(1, len(rows)) if downward else range(len(rows) - 2, -1, -1)
        for r in indices:
            neighbours = up if downward else down
            position = {v: i for i, v in enumerate(rows[r - 1 if downward else r + 1])}
            keys = {}
            for i, v in enumerate(rows[r]):
                placed = [position[u] for u in neighbours[v] if u in position]
                keys[v] = fmean(placed) if placed else i
            rows[r].sort(key=keys.__getitem__)


def _place_rows(rows: list[list], up: dict, down: dict, width: dict, rounds: int = 6) -> dict:
    """x centres: packed rows, then each node pulled to its neighbours' mean, keeping row order and gaps."""
    x = {}
    for row in rows:
        cursor = 0.0
        for v in row:
            x[v] = cursor + width[v] / 2
            cursor += width[v] + GAP
    for round_ in range(rounds):
        sequence = rows if round_ % 2 == 0 else list(reversed(rows))
        for row in sequence:
            desired = [fmean([x[u] for u in up[v] + down[v]]) if up[v] or down[v] else x[v] for v in row]
            gaps = [(width[a] + width[b]) / 2 + GAP for a, b in itertools.pairwise(row)]
            left = desired[:]
            for i in range(1, len(row)):
                left[i] = max(desired[i], left[i - 1] + gaps[i - 1])
            right = desired[:]
            for i in range(len(row) - 2, -1, -1):
                right[i] = min(desired[i], right[i + 1] - gaps[i])
            for v, a, b in zip(row, left, right, strict=False):
                x[v] = (a + b) / 2
    return x


# --- writers -----------------------------------------------------------------------------------


def _node_style(node: VNode) -> tuple[str, str, float, str | None]:
    """fill, stroke, stroke width, dash."""
    status = next((r for r in node.roles if r in NORM_STYLE), None)
    fill, stroke, _ = NORM_STYLE[status] if status else KIND_STYLE.get(node.kind, KIND_STYLE["other"])
    width, dash = 1.4, ("4,3" if node.kind in ("input", "output", "constant") else None)
    if "centred" in node.roles or "inserted" in node.roles:
        stroke, width = CENTRED_STROKE, 4.0
    if "blocker" in node.roles:
        stroke, width = BLOCKER_STROKE, 4.0
    return fill, stroke, width, dash


def _legend() -> tuple[list, list]:
    """Swatches (label, fill, stroke, stroke width) for the kinds, then for norms and outlines."""
    kinds = [(label, fill, stroke, 1.4) for fill, stroke, label in KIND_STYLE.values() if label]
    marks = [(label, fill, stroke, 1.4) for fill, stroke, label in NORM_STYLE.values()]
    marks += [("centred layer", "#ffffff", CENTRED_STROKE, 3.0), ("blocker", "#ffffff", BLOCKER_STROKE, 3.0)]
    return kinds, marks


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _svg_node(node: VNode) -> str:
    fill, stroke, width, dash = _node_style(node)
    classes = " ".join(["node", f"kind-{node.kind}", *node.roles])
    lines = _lines(node)
    top = -node.h / 2 + 15
    texts = []
    for i, line in enumerate(lines):
        weight = ' font-weight="bold"' if i != 1 else ""
        size = 12 if i == 0 else 10
        colour = "#111827" if i == 0 else "#374151"
        texts.append(f'<text y="{top + i * 13:.1f}" font-size="{size}"{weight} fill="{colour}">{_esc(line)}</text>')
    opacity = ' opacity="0.7"' if "context" in node.roles else ""
    tooltip = f"{node.op} {node.id} ({node.kind}{', ' + ', '.join(node.roles) if node.roles else ''})"
    return (
        f'<g class="{classes}" data-id="{_esc(node.id)}" transform="translate({node.x:.1f},{node.y:.1f})"{opacity}>'
        f"<title>{_esc(tooltip)}</title>"
        f'<rect x="{-node.w / 2:.1f}" y="{-node.h / 2:.1f}" width="{node.w:.1f}" height="{node.h:.1f}" rx="6" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="{width}"{_dash(dash)}/>' + "".join(texts) + "</g>"
    )


def _dash(dash: str | None) -> str:
    return f' stroke-dasharray="{dash}"' if dash else ""


def _svg_edge(edge: VEdge) -> str:
    colour, width, dash, _ = EDGE_STYLE[edge.style]
    (x0, y0), rest = edge.points[0], edge.points[1:]
    path = [f"M{x0:.1f},{y0:.1f}"]
    for x1, y1 in rest:
        mid = (y0 + y1) / 2
        path.append(f"C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}")
        x0, y0 = x1, y1
    title = ", ".join(edge.tensors) or f"through {edge.hidden} hidden node(s)"
    label = ""
    if edge.hidden:
        (xa, ya), (xb, yb) = edge.points[len(edge.points) // 2 - 1 : len(edge.points) // 2 + 1]
        label = (
            f'<text x="{(xa + xb) / 2 + 6:.1f}" y="{(ya + yb) / 2 + 3:.1f}" font-size="9" fill="#6b7280" '
            f'text-anchor="start">{edge.hidden} hidden</text>'
        )
    return (
        f'<path class="edge {edge.style}" data-source="{_esc(edge.source)}" data-target="{_esc(edge.target)}" '
        f'd="{" ".join(path)}" fill="none" stroke="{colour}" stroke-width="{width}"{_dash(dash)} '
        f'marker-end="url(#arrow-{edge.style or "plain"})"><title>{_esc(title)}</title></path>{label}'
    )


def _svg_header(view: View) -> str:
    parts = [
        f'<text x="{MARGIN}" y="28" font-size="18" font-weight="bold" fill="#111827">{_esc(view.title)}</text>',
        f'<text x="{MARGIN}" y="48" font-size="12" fill="#4b5563">{_esc(view.subtitle)}</text>',
    ]
    kinds, marks = _legend()
    for y, swatches in ((62, kinds), (84, marks)):
        x: float = MARGIN
        for label, fill, stroke, width in swatches:
            parts.append(
                f'<rect x="{x}" y="{y}" width="14" height="14" rx="3" fill="{fill}" stroke="{stroke}" '
                f'stroke-width="{width}"/>'
            )
            parts.append(f'<text x="{x + 19}" y="{y + 11}" font-size="11" fill="#374151">{_esc(label)}</text>')
            x += 28 + len(label) * 6.2
    for colour, width, dash, label in EDGE_STYLE.values():
        if label:
            parts.append(
                f'<line x1="{x}" y1="91" x2="{x + 24}" y2="91" stroke="{colour}" stroke-width="{width}"{_dash(dash)}/>'
            )
            parts.append(f'<text x="{x + 30}" y="95" font-size="11" fill="#374151">{_esc(label)}</text>')
            x += 44 + len(label) * 6.2
    return f'<g class="chrome" text-anchor="start">{"".join(parts)}</g>'


def to_svg(view: View, standalone: bool = True) -> str:
    """The view as SVG; `standalone` adds the XML declaration, a title and a legend."""
    markers = "".join(
        f'<marker id="arrow-{style or "plain"}" viewBox="0 0 10 10" refX="9" refY="5" markerUnits="userSpaceOnUse" '
        'markerWidth="9" markerHeight="9" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
        for style, (colour, *_rest) in EDGE_STYLE.items()
    )
    body = "".join(_svg_edge(e) for e in view.edges) + "".join(_svg_node(n) for n in view.nodes.values())
    size = f'width="{view.width:.0f}" height="{view.height:.0f}" viewBox="0 0 {view.width:.0f} {view.height:.0f}"'
    if not standalone:
        size = 'width="100%" height="100%"'
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" id="graph" {size} '
        'font-family="Helvetica, Arial, sans-serif" text-anchor="middle">'
        f"<defs>{markers}</defs>"
        + (f'<rect width="100%" height="100%" fill="#ffffff"/>{_svg_header(view)}' if standalone else "")
        + f'<g id="viewport">{body}</g></svg>'
    )
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + svg + "\n" if standalone else svg


def _dot_id(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(view: View) -> str:
    """The view as Graphviz DOT (Graphviz does its own layout): `dot -Tsvg OUT.dot`."""
    title = _dot_id(f"{view.title}\n{view.subtitle}")
    lines = [
        "digraph normpass {",
        f"  graph [rankdir=TB, labelloc=t, fontname=Helvetica, label={title}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
        "  edge [arrowsize=0.7];",
    ]
    for node in view.nodes.values():
        fill, stroke, width, dash = _node_style(node)
        label = "\n".join([node.op, node.label, *_lines(node)[2:]])
        style = "rounded,filled,dashed" if dash else "rounded,filled"
        tooltip = ", ".join([node.kind, *node.roles])
        lines.append(
            f"  {_dot_id(node.id)} [label={_dot_id(label)}, fillcolor={_dot_id(fill)}, color={_dot_id(stroke)}, "
            f"penwidth={width}, style={_dot_id(style)}, tooltip={_dot_id(tooltip)}];"
        )
    for edge in view.edges:
        colour, width, dash, _ = EDGE_STYLE[edge.style]
        attrs = f"color={_dot_id(colour)}, penwidth={width}" + (", style=dashed" if dash else "")
        if edge.tensors:
            attrs += f", tooltip={_dot_id(', '.join(edge.tensors))}"
        if edge.hidden:
            attrs += f', label="{edge.hidden} hidden", fontsize=8, fontcolor="#6b7280"'
        lines.append(f"  {_dot_id(edge.source)} -> {_dot_id(edge.target)} [{attrs}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_html(view: View) -> str:
    """One self-contained page: the SVG, the data as JSON, pan/zoom/search/details (no network)."""
    data = {
        "title": view.title,
        "subtitle": view.subtitle,
        "nodes": {n.id: {**n.info, "x": round(n.x, 1), "y": round(n.y, 1)} for n in view.nodes.values()},
        "norms": view.norms,
    }
    payload = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # no markup inside the script
    kinds, marks = _legend()
    legend = "".join(
        f'<span class="swatch" style="background:{fill};border:{width}px solid {stroke}"></span>{_esc(label)}<br>'
        for label, fill, stroke, width in kinds + marks
    ) + "".join(
        f'<span class="line" style="border-top:{width}px {"dashed" if dash else "solid"} {colour}"></span>'
        f"{_esc(label)}<br>"
        for colour, width, dash, label in EDGE_STYLE.values()
        if label
    )
    return _HTML.format(
        title=_esc(view.title),
        subtitle=_esc(view.subtitle),
        legend=legend,
        svg=to_svg(view, standalone=False),
        data=payload,
        script=_SCRIPT,
    )


FORMATS = {"html": to_html, "svg": to_svg, "dot": to_dot}


def render(zmg: ZeroMeanGraph, plan: FoldPlan, fmt: str = "html", full: bool = False, norm: str | None = None) -> str:
    """The zero-mean graph of `zmg` with the decisions of `plan`, as html, svg or dot text."""
    if fmt not in FORMATS:
        raise InputError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt](build_view(zmg, plan, full, norm))


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>normpass: {title}</title>
<link rel="icon" href="data:,">
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
html, body {{ margin: 0; height: 100%; font: 13px Helvetica, Arial, sans-serif; color: #111827; }}
body {{ display: grid; grid-template-columns: 340px 1fr; grid-template-rows: auto 1fr; }}
header {{ grid-column: 1 / 3; padding: 8px 14px; border-bottom: 1px solid #e5e7eb; }}
header h1 {{ font-size: 16px; margin: 0 0 2px; }}
header p {{ margin: 0; color: #4b5563; }}
aside {{ overflow: auto; padding: 10px 14px; border-right: 1px solid #e5e7eb; background: #f9fafb; }}
main {{ position: relative; overflow: hidden; background: #fff; cursor: grab; }}
main.dragging {{ cursor: grabbing; }}
#search {{ width: 100%; box-sizing: border-box; padding: 6px 8px; font-size: 13px; }}
#matches {{ color: #6b7280; margin: 4px 0 8px; min-height: 1em; }}
h2 {{ font-size: 13px; margin: 12px 0 6px; text-transform: uppercase; color: #6b7280; letter-spacing: .04em; }}
#norms button, .link {{ display: block; width: 100%; text-align: left; border: 0; background: none; padding: 3px 4px;
  font: inherit; cursor: pointer; border-radius: 4px; color: inherit; }}
#norms button:hover, .link:hover {{ background: #e5e7eb; }}
.dot {{ display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 6px; }}
.folded-dot {{ background: #15803d; }} .refused-dot {{ background: #b91c1c; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; border-radius: 3px; margin-right: 6px;
  vertical-align: -2px; box-sizing: border-box; }}
.line {{ display: inline-block; width: 22px; margin-right: 6px; vertical-align: 3px; }}
#details dl {{ margin: 0; }} #details dt {{ font-weight: bold; margin-top: 6px; }} #details dd {{ margin: 2px 0 0 0; }}
#details code {{ font-size: 12px; word-break: break-all; }}
.toolbar {{ position: absolute; right: 10px; top: 10px; display: flex; gap: 4px; }}
.toolbar button {{ font: inherit; padding: 3px 9px; border: 1px solid #d1d5db; background: #fff; border-radius: 4px;
  cursor: pointer; }}
#graph {{ display: block; }}
svg .node {{ cursor: pointer; }}
svg.searching .node:not(.match) {{ opacity: .25; }}
svg .node.match rect {{ stroke: #f59e0b; stroke-width: 4px; }}
svg .node.selected rect {{ stroke: #111827; stroke-width: 4px; }}
</style></head>
<body>
<header><h1>{title}</h1><p>{subtitle}</p></header>
<aside>
<input id="search" type="search" placeholder="search nodes by name or op (Enter: next)" autocomplete="off">
<div id="matches"></div>
<h2>Details</h2><div id="details">Click a node.</div>
<h2>Norms</h2><div id="norms"></div>
<h2>Legend</h2><div id="legend">{legend}</div>
</aside>
<main id="canvas"><div class="toolbar"><button id="zoom-in" title="zoom in">+</button>
<button id="zoom-out" title="zoom out">−</button><button id="fit" title="fit to width">fit</button></div>
{svg}</main>
<script type="application/json" id="normpass-data">{data}</script>
<script>{script}</script>
</body></html>
"""

_SCRIPT = r"""
"use strict";
const data = JSON.parse(document.getElementById("normpass-data").textContent);
const svg = document.getElementById("graph"), viewport = document.getElementById("viewport");
const canvas = document.getElementById("canvas");
const elements = new Map();
svg.querySelectorAll(".node").forEach(el => elements.set(el.dataset.id, el));
let view = {x: 0, y: 0, k: 1}, selected = null;

function apply() { viewport.setAttribute("transform", `translate(${view.x},${view.y}) scale(${view.k})`); }
function zoomAt(px, py, factor) {
  const k = Math.min(4, Math.max(0.05, view.k * factor));
  view = {x: px - (px - view.x) * k / view.k, y: py - (py - view.y) * k / view.k, k};
  apply();
}
function fit() {
  const box = viewport.getBBox(), rect = svg.getBoundingClientRect();
  const k = Math.min(1, (rect.width - 40) / Math.max(box.width, 1));
  const fitsHeight = box.height * k < rect.height - 40;
  view = {k, x: (rect.width - box.width * k) / 2 - box.x * k,
          y: fitsHeight ? (rect.height - box.height * k) / 2 - box.y * k : 20 - box.y * k};
  apply();
}
function centre(id) {
  const node = data.nodes[id], rect = svg.getBoundingClientRect();
  const k = Math.max(view.k, 0.8);
  view = {k, x: rect.width / 2 - node.x * k, y: rect.height / 2 - node.y * k};
  apply();
}

function text(tag, content, cls) {
  const el = document.createElement(tag);
  if (content !== undefined) el.textContent = content;
  if (cls) el.className = cls;
  return el;
}
function link(name) {
  if (!elements.has(name)) return text("div", name);
  const button = text("button", name, "link");
  button.addEventListener("click", () => { select(name); centre(name); });
  return button;
}
function shape(s) { return s === null ? "?" : "[" + s.map(d => d === null ? "?" : d).join(", ") + "]"; }

function details(id) {
  const node = data.nodes[id], box = document.getElementById("details");
  box.replaceChildren();
  const dl = document.createElement("dl");
  const add = (term, ...values) => {
    dl.append(text("dt", term));
    values.forEach(v => { const dd = document.createElement("dd"); dd.append(v); dl.append(dd); });
  };
  add("name", text("code", node.name));
  add("op", node.op);
  add("kind", node.kind + (node.roles.length ? " · " + node.roles.join(", ") : ""));
  const decision = node.decision;
  if (decision) {
    add("decision", decision.foldable ? "folded into RMSNorm" : "refused (kept as is)");
    add("reason", decision.reason || `input proved zero-mean; centres ${decision.centred_layers.length} layer(s)`);
    if (decision.centred_layers.length) add("centred layers", ...decision.centred_layers.map(link));
    const inserted = decision.inserted_centering.map(n => text("code", n));
    if (inserted.length) add("inserted x − mean(x) on", ...inserted);
    if (decision.blocked_by) add("blocked by", link(decision.blocked_by));
    if (decision.blocking_path.length) add("blocking path", ...decision.blocking_path.map(link));
  }
  for (const [note, norms] of Object.entries(node.notes)) add(note, ...norms.map(link));
  if (node.rule) add("rule", text("code", node.rule));
  if (node.inputs.length) add("inputs", ...node.inputs.map(([t, s]) => text("code", `${t} ${shape(s)}`)));
  if (node.outputs.length) add("outputs", ...node.outputs.map(([t, s]) => text("code", `${t} ${shape(s)}`)));
  box.append(dl);
}
function select(id) {
  if (selected) selected.classList.remove("selected");
  selected = elements.get(id) || null;
  if (selected) selected.classList.add("selected");
  details(id);
}

let drag = null;
canvas.addEventListener("pointerdown", e => {
  if (e.target.closest(".toolbar")) return;
  drag = {x: e.clientX, y: e.clientY, vx: view.x, vy: view.y, moved: false};
  canvas.classList.add("dragging");
});
window.addEventListener("pointermove", e => {
  if (!drag) return;
  const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
  if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
  if (drag.moved) { view.x = drag.vx + dx; view.y = drag.vy + dy; apply(); }
});
window.addEventListener("pointerup", e => {
  if (!drag) return;
  const moved = drag.moved;
  drag = null;
  canvas.classList.remove("dragging");
  const node = e.target.closest && e.target.closest(".node");
  if (!moved && node) select(node.dataset.id);
});
svg.addEventListener("wheel", e => {
  e.preventDefault();
  const rect = svg.getBoundingClientRect();
  zoomAt(e.clientX - rect.left, e.clientY - rect.top, Math.exp(-e.deltaY * 0.0015));
}, {passive: false});
const middle = () => { const r = svg.getBoundingClientRect(); return [r.width / 2, r.height / 2]; };
document.getElementById("zoom-in").addEventListener("click", () => zoomAt(...middle(), 1.25));
document.getElementById("zoom-out").addEventListener("click", () => zoomAt(...middle(), 0.8));
document.getElementById("fit").addEventListener("click", fit);

const search = document.getElementById("search"), matchInfo = document.getElementById("matches");
let matches = [], cursor = -1;
search.addEventListener("input", () => {
  const query = search.value.trim().toLowerCase();
  matches = [];
  cursor = -1;
  elements.forEach((el, id) => {
    const hit = query !== "" && (id.toLowerCase().includes(query) || data.nodes[id].op.toLowerCase().includes(query));
    el.classList.toggle("match", hit);
    if (hit) matches.push(id);
  });
  svg.classList.toggle("searching", query !== "");
  matchInfo.textContent = query ? `${matches.length} match(es)` : "";
});
search.addEventListener("keydown", e => {
  if (e.key !== "Enter" || !matches.length) return;
  cursor = (cursor + 1) % matches.length;
  select(matches[cursor]);
  centre(matches[cursor]);
  matchInfo.textContent = `${cursor + 1} of ${matches.length} match(es)`;
});

const list = document.getElementById("norms");
data.norms.forEach(norm => {
  const button = text("button");
  button.append(text("span", "", "dot " + (norm.foldable ? "folded-dot" : "refused-dot")), `${norm.name} (${norm.op})`);
  button.title = norm.reason || "folds";
  button.dataset.norm = norm.name;
  button.addEventListener("click", () => { select(norm.name); if (elements.has(norm.name)) centre(norm.name); });
  list.append(button);
});
fit();
"""
