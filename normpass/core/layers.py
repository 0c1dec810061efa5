"""One basis per layer of a residual stream (SliceGPT's): the stream's pieces and the shortcuts between them.

**Algebra (DESIGN §2c).** A stream proven rotatable (`core/rotation.py`) may take a different orthogonal
Q_p on each *piece* of it, provided every edge between two pieces a → b changes the basis:
x·Q_b = (x·Q_a)·(Q_aᵀ·Q_b). Sliced to k columns, Q_aᵀ·Q_b becomes the k×k *shortcut* Q_a,kᵀ·Q_b,k — exact
when k = d, an approximation below (the part of x·Q_a outside Q_b's first k columns is dropped), as in
SliceGPT (`rotate.py`: the shortcut `Q_lᵀ·Q_{l+1}` on the residual path).

**The pieces.** Every edge of the stream inside a layer (layout ops, scalings, an RMS op's input to its
output, a writer's output onwards) joins the two tensors into one piece. Only a residual sum may separate
pieces: an operand whose piece no RMS op reads (a block's branch: its writers' output) joins the sum's piece,
so the writers write straight into the next basis; an operand whose piece an RMS op reads (the skip path)
keeps its own basis and the edge becomes a shortcut. A piece no RMS op reads in the end (no data to fit
its basis on) joins a piece it shares a shortcut with. Each piece's basis is fitted where its RMS ops read
it: one per norm in a pre-LN transformer (the attention's and the MLP's), as SliceGPT fits one per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .graph import NodeKind, ZeroMeanGraph
from .rotation import Stream


@dataclass(frozen=True)
class Shortcut:
    """The operand `tensor` of the residual sum `node` comes from piece `source` into piece `target`."""

    node: str
    tensor: str
    source: str
    target: str


@dataclass
class _Pieces:
    """Union-find over the stream's tensors."""

    parent: dict[str, str] = field(default_factory=dict)

    def find(self, tensor: str) -> str:
        root = tensor
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[tensor] != root:
            self.parent[tensor], tensor = root, self.parent[tensor]
        return root

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def layer_pieces(zmg: ZeroMeanGraph, stream: Stream) -> tuple[list[Stream], list[Shortcut]]:
    """The pieces of `stream` (each a `Stream` named after its first norm, with its own writers, readers,
    norms and tensors) and the shortcuts between them (the module docstring)."""
    tensors = {tensor for tensor, _ in stream.states}
    pieces = _Pieces({t: t for t in tensors})
    edges: list[tuple[str, str, str]] = []  # (residual node, operand, its output)
    for node in zmg.nodes.values():
        outputs = [t for t in node.outputs if t in tensors]
        operands = [t for t in node.inputs if t in tensors]
        if not outputs or not operands:
            continue
        if node.kind is NodeKind.RESIDUAL and len(operands) > 1:
            edges += [(node.name, operand, outputs[0]) for operand in operands]
            continue
        for tensor in operands + outputs[1:]:
            pieces.join(tensor, outputs[0])
    read = {zmg.norm_by_name(name).input for name in stream.norms}

    def has_norm(tensor: str) -> bool:
        root = pieces.find(tensor)
        return any(pieces.find(t) == root for t in read)

    crossing = []
    for residual, operand, output in edges:
        if has_norm(operand):
            crossing.append((residual, operand, output))
        else:
            pieces.join(operand, output)
    changed = True
    while changed:  # a piece no norm reads joins a neighbour
        changed = False
        for _, operand, output in crossing:
            if pieces.find(operand) != pieces.find(output) and not (has_norm(operand) and has_norm(output)):
                pieces.join(operand, output)
                changed = True
    return _split(zmg, stream, pieces), [
        Shortcut(residual, operand, _name(zmg, stream, pieces, operand), _name(zmg, stream, pieces, output))
        for residual, operand, output in crossing
        if pieces.find(operand) != pieces.find(output)
    ]


def _name(zmg: ZeroMeanGraph, stream: Stream, pieces: _Pieces, tensor: str) -> str:
    """A piece's name: its first norm's."""
    root = pieces.find(tensor)
    return next(n for n in stream.norms if pieces.find(zmg.norm_by_name(n).input) == root)


def _split(zmg: ZeroMeanGraph, stream: Stream, pieces: _Pieces) -> list[Stream]:
    by_root: dict[str, Stream] = {}
    for norm in stream.norms:
        root = pieces.find(zmg.norm_by_name(norm).input)
        if root not in by_root:
            by_root[root] = replace(stream, name=norm, norms=[], writers={}, readers=[], states=[], moved_gamma=[])
        by_root[root].norms.append(norm)
    for state in stream.states:
        by_root[pieces.find(state[0])].states.append(state)
    for centring, scale in stream.writers.items():
        written = next(t for t in zmg.nodes[centring.node].outputs if t in pieces.parent)
        by_root[pieces.find(written)].writers[centring] = scale
    for reader in stream.readers:
        by_root[pieces.find(zmg.nodes[reader.node].inputs[reader.index])].readers.append(reader)
    for piece in by_root.values():
        piece.moved_gamma = [n for n in stream.moved_gamma if n in piece.norms]
        piece.tensors = len(piece.states)
    return list(by_root.values())


def ends(pieces: list[Stream], shortcuts: list[Shortcut]) -> list[Stream]:
    """The pieces no shortcut leaves: the stream's end, read by its last norm (the final norm, whose readers
    are the head). Empty when the stream is one piece (nothing separates its end from the rest)."""
    sources = {shortcut.source for shortcut in shortcuts}
    return [] if len(pieces) < 2 else [piece for piece in pieces if piece.name not in sources]


def end_apart(stream: Stream, pieces: list[Stream], shortcuts: list[Shortcut]) -> tuple[list[Stream], list[Shortcut]]:
    """`stream` as two bases: its end (`ends`) and all the rest of it as one piece, with the shortcuts into
    the end only (between the pieces merged into the rest, the basis is one: their residual sums read their
    operands as they are). The stream whole when it is one piece."""
    end = {piece.name for piece in ends(pieces, shortcuts)}
    rest = [piece for piece in pieces if piece.name not in end]
    if not end or not rest:
        return [stream], []
    norms = {norm for piece in rest for norm in piece.norms}
    merged = replace(
        stream,
        name=next(n for n in stream.norms if n in norms),
        norms=[n for n in stream.norms if n in norms],
        writers={w: s for piece in rest for w, s in piece.writers.items()},
        readers=[r for piece in rest for r in piece.readers],
        states=[s for piece in rest for s in piece.states],
        moved_gamma=[n for n in stream.moved_gamma if n in norms],
    )
    merged.tensors = len(merged.states)
    into_end = [replace(s, source=merged.name) for s in shortcuts if s.target in end and s.source not in end]
    return [merged, *(piece for piece in pieces if piece.name in end)], into_end


def stream_pieces(
    zmg: ZeroMeanGraph, stream: Stream, basis: str, head: str, rank: Callable[[str], int | None]
) -> tuple[list[Stream], list[Shortcut], set[str]]:
    """The pieces of `stream` that take a basis each (itself alone with `basis` "stream"), the shortcuts
    between them, and the pieces left at full width: with `head` "full", the stream's end (`ends`: its
    final norm and the head that reads it), which the piece before it writes into through a k×d shortcut
    Q_kᵀ (with `basis` "stream": the rest of the stream is one piece, `end_apart`). A stream whose shortcut
    would not read its last axis (`rank(tensor)`: the tensor's rank, None where unknown; a contraction of
    another axis cannot take the shortcut) keeps one basis, its end cut. Both front ends' pieces."""
    found: list[Stream] = [stream]
    between: list[Shortcut] = []
    if basis == "layer" or head == "full":
        found, between = layer_pieces(zmg, stream)
    axes = dict(stream.states)
    if any(axes[s.tensor] != (rank(s.tensor) or 0) - 1 for s in between):
        found, between = [stream], []
    if basis == "stream" and head == "full":
        found, between = end_apart(stream, found, between)
    elif basis == "stream":
        found, between = [stream], []
    whole = {piece.name for piece in ends(found, between)} if head == "full" else set()
    return found, between, whole
