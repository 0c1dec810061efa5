"""The slice pass for PyTorch modules: `normpass.slice`, SliceGPT on torch.export's graph.

    sliced, report = normpass.slice(module, example_inputs, calibration, SliceOptions(ratio=0.25))

The same proof, bases and cut as the ONNX front end (`onnx/slice/driver.py`, docs/slice.md), applied
to a captured graph as `fold_graph` applies the fold (`torch/graph_rewrite.py`), because a module swap
cannot express a cut: a stream's width is named in the forward code's reshapes, and `basis="layer"`'s
shortcuts sit on residual edges inside a forward. The result is a `torch.fx.GraphModule` called like the
module, with k-column weights (trainable parameters: `torch/slice_train.py` trains it back).

1. **Fold** (`fold_graph`, verified), then capture the folded graph again: its zero-mean graph has
   `aten.rms_norm` norms, γ kept in each and β as an `add` after it.
2. **Prove** (`core/rotation.plan_rotation`, the rotation's proof): a linear layer contracting the
   stream's last axis with a constant weight (`aten.linear`, `addmm`, `mm`: `LinearParams.in_axis`) is
   a reader, and so is a convolution, plain or transposed, of groups 1 contracting it as its channel
   axis 1 (a dense-prediction head reading the patch tokens as a map: `read_weight`). A stream stays
   whole, with the reason, where one of its norms is not an `aten.rms_norm` call with a constant γ.
3. **Bases** (`core/pca.py`, `core/layers.py`): Σ uᵀu over the unit-length tokens where the stream's
   RMS ops read it, over the fitting batches (float64, combined across processes), with `basis="layer"`
   fitted in sequence on the graph cut before each piece, as the ONNX front end fits them.
4. **Cut**, per read of each constant (a parameter read twice, as a tied embedding and LM head are,
   gets one copy per read; the rest stay shared):
   * writers: W·Q_k along their output features (`rotate`; a LayerScale after a layer absorbed into
     it first, its factor ones over k), a constant added into the stream along its axis;
   * β after a norm, u⊙γ + β: where every reader of that sum reaches it through layout ops alone
     (views, slices, permutes, dropout at inference), β·W is added to each reader's bias (a bias-less
     `aten.linear` gets one) and the `add` leaves the graph: the same function, so nothing of β is lost
     to the cut, as the ONNX fold migrates β into the readers' biases. Elsewhere β is a writer,
     (β⊘γ)·Q_k;
   * readers: Q_kᵀ·diag(γ)·W along their input features (γ of the norm whose output they read);
   * each `aten.rms_norm` over k columns: normalized shape [k], γ → (ones, or a uniform γ's first k
     entries)·√(d/k), ε → ε·d/k (`core/pca.rms_rescale`);
   * a `view`/`reshape`/`expand` on the stream whose target shape names d along the stream's axis names k;
   * `basis="layer"`: on each residual edge between two pieces a → b, `aten.matmul` by the k×k
     parameter Q_a,kᵀ·Q_b,k;
   * `head="full"` (SliceGPT's default): the stream's end — its final norm and the head reading it, the
     pieces no shortcut leaves (`core/layers.stream_pieces`) — takes no basis and is left whole (Q = I):
     its writers, norm and head keep all d columns, and the piece before it reaches it through the k×d
     shortcut Q_kᵀ (with `basis="stream"` the rest of the stream is one piece), as the ONNX cut.
5. **Judge** on the held-out batches against the module (`core/budget.compare`); `budget`,
   `write_best` as for ONNX; at R = 0 (a rotation) verified against the module within fp32 tolerance.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx, nn

from ..calibration import DEFAULT_BATCH_SIZE, Batch, InputSpec, find_mask_input, split_batches
from ..core.algebra import rotate, scale_along
from ..core.budget import Budget, Metrics, compare
from ..core.graph import NormInfo, ZNode
from ..core.layers import Shortcut, stream_pieces
from ..core.pca import Basis, Covariance, combine, eigenbasis, rms_rescale, sliced_width
from ..core.progress import stage
from ..core.replace import BudgetMissed, ReplaceOptions, ReplaceReport
from ..core.rotation import Stream, gamma_of, plan_rotation
from ..core.stats import token_rows
from ..errors import InputError, UnsupportedModelError, VerificationError
from ..onnx.slice.driver import SliceOptions, SlicePlan, Trial
from .api import TorchFoldReport, _arguments, _compare, _outputs, auto_dynamic_shapes, fold_graph
from .capture import Ref, capture
from .fx import NormSite, TorchGraph, build_zero_mean_graph, to_numpy
from .graph_rewrite import _Reads
from .replace import _run, _tensors, input_spec, load
from .rewrite import _edits_of, _layer_scale
from .slice_train import StreamState, train_back

ATEN = torch.ops.aten
LAYOUT = {  # ops that move rows of a tensor about without changing them: β added before them is added after
    ATEN.view.default,
    ATEN._unsafe_view.default,
    ATEN.reshape.default,
    ATEN.slice.Tensor,
    ATEN.select.int,
    ATEN.permute.default,
    ATEN.transpose.int,
    ATEN.unsqueeze.default,
    ATEN.squeeze.dim,
    ATEN.clone.default,
    ATEN.alias.default,
    ATEN.dropout.default,
    ATEN.contiguous.default,
}
CONVOLUTIONS = {"convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
RESHAPING = {ATEN.view.default, ATEN._unsafe_view.default, ATEN.reshape.default, ATEN.expand.default}


@dataclass
class TorchSliceReport:
    """What `slice` did: the fold's report, which streams were cut (and why the others not), the bases'
    pieces, the ratio chosen with its held-out figures, every ratio tried, and the time of each stage."""

    fold: TorchFoldReport
    slicing: SlicePlan
    pieces: dict[str, list[str]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    shortcuts: int = 0
    parameters: int = 0  # elements of the original module's parameters and buffers
    chosen: Trial | None = None
    tried: list[Trial] = field(default_factory=list)
    requested_ratio: float = 0.0
    budget: Budget | None = None
    basis: str = "layer"
    whole: list[str] = field(default_factory=list)  # pieces left at full width (`SliceOptions.head` "full")
    comparison: object = None  # at R = 0: the check against the module
    seconds: dict[str, float] = field(default_factory=dict)
    bases: dict[str, Basis] = field(default_factory=dict, repr=False)
    folded: fx.GraphModule | None = field(default=None, repr=False)  # the folded graph the cut started from
    states: list[StreamState] = field(default_factory=list, repr=False)  # the last cut's (`stream_states`)

    @property
    def ratio(self) -> float:
        return 0.0 if self.chosen is None else self.chosen.ratio

    @property
    def held_out(self) -> Metrics | None:
        return None if self.chosen is None else self.chosen.held_out

    def to_json(self) -> dict:
        kept = {} if self.chosen is None else self.chosen.kept
        plan = self.slicing.cut_json(kept, self.pieces, self.bases, self.tokens)
        chosen = self.chosen
        return {
            "frontend": "pytorch",
            "fold": self.fold.to_json(),
            "slice": {
                "requested_ratio": self.requested_ratio,
                "ratio": self.ratio,
                "basis": self.basis,
                "shortcuts": self.shortcuts,
                "head": "full" if self.whole else "cut",
                "left_whole": self.whole,
                "budget": None if self.budget is None else str(self.budget),
                "wrote_fallback": chosen is not None and self.ratio != self.requested_ratio,
                "held_out": None if self.held_out is None else self.held_out.to_json(),
                "training": None if chosen is None or chosen.recovery is None else chosen.recovery.to_json(),
                "parameters": {"original": self.parameters, "sliced": None if chosen is None else chosen.parameters},
                "tried": [t.to_json() for t in self.tried],
                **plan,
            },
            "seconds": self.seconds,
        }


# --- the folded graph and its streams -----------------------------------------------------------


@dataclass
class Folded:
    """The folded graph (every cut starts from a copy of it), its zero-mean graph and its streams."""

    graph: fx.GraphModule
    tg: TorchGraph
    plan: SlicePlan
    pieces: dict[str, list[Stream]]
    shortcuts: list[Shortcut]
    whole: set[str] = field(default_factory=set)  # pieces left at full width (head "full"): no basis, Q = I

    @property
    def fitted(self) -> list[Stream]:
        """Every piece that takes a basis (all but those left whole)."""
        return [p for found in self.pieces.values() for p in found if p.name not in self.whole]

    def fx_node(self, name: str) -> str:
        """The fx node of zero-mean graph node `name` (a tensor's name is its fx node's already)."""
        return self.tg.zmg.nodes[name].ref.call.node

    def norm_node(self, norm: str) -> str:
        site: NormSite = self.tg.zmg.norm_by_name(norm).ref
        return site.call.node


@dataclass(frozen=True)
class ReadWeight:
    """What a reader contracts the stream with: its constant weight, the weight's input-feature axis, and the
    axis of its data input it contracts (None: the last)."""

    weight: str
    in_axis: int
    data_axis: int | None = None


def read_weight(tg: TorchGraph, node: ZNode) -> ReadWeight | None:
    """A general linear op whose weight has an input-feature axis (`LinearParams.in_axis`), contracting its
    data input's last axis; or a convolution, plain or transposed, with groups 1 and a constant weight,
    contracting the channel axis 1 (weight [C_out, C_in, k…] or, transposed, [C_in, C_out, k…]), as the
    ONNX front end reads `Conv` and `ConvTranspose`."""
    call = getattr(node.ref, "call", None)
    if call is not None and call.op in CONVOLUTIONS:
        weight = call.args.get("weight")
        if call.args.get("groups", 1) != 1 or not isinstance(weight, Ref) or weight not in tg.capture.constants:
            return None
        transposed = call.op.startswith("conv_transpose") or call.args.get("transposed")
        return ReadWeight(weight, 0 if transposed else 1, 1)
    linear = getattr(node.ref, "linear", None)
    return None if linear is None or linear.in_axis is None else ReadWeight(linear.weight, linear.in_axis)


def _reader(tg: TorchGraph):
    """The rotation proof's question to this front end: does `node` contract input `index` along `axis`
    with a constant weight (`read_weight`)?"""

    def reads(node: ZNode, index: int, axis: int) -> bool:
        found = read_weight(tg, node)
        shape = tg.zmg.shape(node.inputs[0])
        if found is None or index != 0 or shape is None:
            return False
        return axis == (len(shape) - 1 if found.data_axis is None else found.data_axis)

    return reads


def _refusal(folded_graph: fx.GraphModule, tg: TorchGraph, stream: Stream) -> str | None:
    """Why a stream the rotation proof accepts cannot be cut on this graph, or None."""
    nodes = {n.name: n for n in folded_graph.graph.nodes}
    for name in stream.norms:
        norm = tg.zmg.norm_by_name(name)
        call = norm.ref.call
        node = nodes.get(call.node)
        if node is None or node.target is not ATEN.rms_norm.default:
            return f"{call.target} {name} is not an aten.rms_norm call of the folded graph"
        if norm.scale is None or not tg.zmg.is_constant(norm.scale) or _attr_arg(node, 2) is None:
            return f"{name} has no constant γ to carry the rescale √(d/k) of a sliced RMS op"
    return None


def _attr_arg(node: fx.Node, index: int) -> fx.Node | None:
    arg = node.args[index] if index < len(node.args) else None
    return arg if isinstance(arg, fx.Node) and arg.op == "get_attr" else None


def _pieces(
    tg: TorchGraph, plan: SlicePlan, basis: str, head: str
) -> tuple[dict[str, list[Stream]], list[Shortcut], set[str]]:
    """Per sliceable stream its pieces, the shortcuts between them, and the pieces left at full width, as
    the ONNX front end's (`core/layers.stream_pieces`)."""
    pieces: dict[str, list[Stream]] = {}
    shortcuts: list[Shortcut] = []
    whole: set[str] = set()

    def rank(tensor: str) -> int | None:
        shape = tg.zmg.shape(tensor)
        return None if shape is None else len(shape)

    for stream in plan.sliceable:
        found, between, end = stream_pieces(tg.zmg, stream, basis, head, rank)
        pieces[stream.name] = found
        shortcuts += between
        whole |= end
    return pieces, shortcuts, whole


def fold_and_plan(
    module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes, basis: str, name: str, head: str = "cut"
):
    """Step 1 and 2 of the module docstring, with the pieces of `basis` and `head`: (`Folded`, the fold's
    report)."""
    folded, report = fold_graph(module, args, example_kwargs=kwargs, dynamic_shapes=dynamic_shapes, name=name)
    captured = capture(folded, args, kwargs, dynamic_shapes)
    if captured.program is None:
        raise UnsupportedModelError(f"{name}: torch.export cannot capture the folded graph ({captured.export_error})")
    tg = build_zero_mean_graph(module, captured, name)  # module paths in the graph are the module's own
    graph = captured.program.module()
    rotation = plan_rotation(tg.zmg, _reader(tg))
    reasons = {}
    for stream in rotation.streams:
        why = stream.reason if not stream.rotatable else _refusal(graph, tg, stream)
        if why is not None:
            reasons[stream.name] = why
    plan = SlicePlan(rotation.streams, reasons)
    pieces, shortcuts, whole = _pieces(tg, plan, basis, head)
    return Folded(graph, tg, plan, pieces, shortcuts, whole), report


# --- the cut -------------------------------------------------------------------------------------


def _row_path(node: fx.Node) -> fx.Node:
    """The first node above `node` that is not a layout op (following each layout op's first input)."""
    while node.op == "call_function" and node.target in LAYOUT and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _carried_betas(f: Folded, stream: Stream) -> dict[str, list]:
    """β adds whose sum every reader reaches through layout ops alone: add node → [(Reader, …)]; the rest
    of the stream's constants stay writers."""
    nodes = {n.name: n for n in f.graph.graph.nodes}
    norms = {f.norm_node(n) for n in stream.norms}
    by_add: dict[str, list] = {}
    for centring in stream.writers:
        if centring.input_index is None or centring.tensor is None:
            continue
        add = nodes.get(f.fx_node(centring.node))
        others = [] if add is None else [a for a in add.args if isinstance(a, fx.Node) and a.op != "get_attr"]
        if add is None or add.target is not ATEN.add.Tensor or len(others) != 1 or others[0].name not in norms:
            continue
        by_add[add.name] = []
    for reader in stream.readers:
        source = _row_path(nodes[f.tg.zmg.nodes[reader.node].inputs[0]])  # the data input (addmm's is mat1)
        if source.name in by_add:
            by_add[source.name].append(reader)
    for name in list(by_add):
        users = _row_users(nodes[name])
        readers = {f.fx_node(r.node) for r in by_add[name]}
        convolution = any(getattr(read_weight(f.tg, f.tg.zmg.nodes[r.node]), "data_axis", None) for r in by_add[name])
        if not by_add[name] or convolution or any(u.name not in readers for u in users):
            del by_add[name]  # something else reads the sum, or a convolution (β is no bias at its borders): a writer
    return by_add


PASS_THROUGH = {ATEN.dropout.default, ATEN.clone.default, ATEN.alias.default, ATEN.contiguous.default}


def _passed(node: fx.Node) -> fx.Node:
    """The tensor `node` passes on unchanged (the capture makes no node of dropout at inference, copies)."""
    while node.op == "call_function" and node.target in PASS_THROUGH and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _row_users(node: fx.Node) -> list[fx.Node]:
    """The readers of `node` past layout ops."""
    found = []
    for user in node.users:
        found += _row_users(user) if user.op == "call_function" and user.target in LAYOUT else [user]
    return found


class Cutter:
    """One cut of a copy of the folded graph (the module docstring's step 4)."""

    def __init__(self, f: Folded):
        self.f = f
        self.graph = copy.deepcopy(f.graph)
        self.reads = _Reads(f.tg, self.graph)
        self.nodes = {n.name: n for n in self.graph.graph.nodes}
        self.biases: dict[str, np.ndarray] = {}  # bias-less reader (fx node) → the bias it gets
        self.dropped: list[str] = []  # β adds that leave the graph

    def cut(self, stream: Stream, basis: np.ndarray) -> None:
        assert stream.width is not None  # a stream without a static width is refused
        tg, width, kept = self.f.tg, stream.width, basis.shape[1]
        gammas = {n: gamma_of(tg.zmg, tg.zmg.norm_by_name(n)).astype(np.float64) for n in stream.moved_gamma}
        carried = _carried_betas(self.f, stream)
        for centring, scale in stream.writers.items():
            add = self.f.fx_node(centring.node) if centring.input_index is not None else None
            if add in carried:
                self._carry(centring, carried[add])
                continue
            inverse = None if scale is None else 1.0 / gammas[scale]
            layer_scale = _layer_scale(tg, centring)
            edits = _edits_of(tg, centring, absorbing=True)
            assert not isinstance(edits, str), f"the fold found the writer {centring.node}"
            factor = None
            if layer_scale is not None:
                factor = np.ravel(self.reads.get(layer_scale.mul, layer_scale.factor))
                self.reads.set(layer_scale.mul, layer_scale.factor, np.ones(kept))
            for node, tensor, axis in edits:
                values = self.reads.get(node, tensor)
                if factor is not None and axis is not None:
                    values = scale_along(values, axis, factor)
                if axis is None:  # one number along the stream: zero on a proven stream (`rotation._constant_refusal`)
                    self.reads.set(node, tensor, values)
                    continue
                self.reads.set(node, tensor, rotate(values, axis, basis, inverse))
        for reader in stream.readers:
            read = read_weight(tg, tg.zmg.nodes[reader.node])
            assert read is not None  # the proof's readers are `read_weight`'s
            gamma = None if reader.scale is None else gammas[reader.scale]
            values = self.reads.get(reader.node, read.weight)
            self.reads.set(reader.node, read.weight, rotate(values, read.in_axis, basis, gamma))
        gamma_factor, eps_factor = rms_rescale(width, kept)
        for name in stream.norms:
            self._rescale(tg.zmg.norm_by_name(name), name in stream.moved_gamma, kept, gamma_factor, eps_factor)
        if kept < width:
            self._cut_shapes(stream, width, kept)

    def _carry(self, centring, readers: list) -> None:
        """β of a carried add: β·W into each reader's bias (with the reader's γ, β being after it)."""
        tg = self.f.tg
        beta = np.ravel(self.reads.get(centring.node, centring.tensor)).astype(np.float64)
        for reader in readers:
            linear = tg.zmg.nodes[reader.node].ref.linear
            weight = self.reads.get(reader.node, linear.weight)
            contribution = np.tensordot(beta, np.moveaxis(weight, linear.in_axis, 0), axes=(0, 0))
            if linear.bias is None:
                node = self.f.fx_node(reader.node)
                self.biases[node] = self.biases.get(node, 0.0) + contribution
            else:
                bias = self.reads.get(reader.node, linear.bias)
                self.reads.set(reader.node, linear.bias, bias + contribution.reshape(bias.shape))
        self.dropped.append(self.f.fx_node(centring.node))

    def _rescale(self, norm: NormInfo, moved: bool, kept: int, gamma_factor: float, eps_factor: float) -> None:
        node = self.nodes[norm.ref.call.node]
        assert norm.scale is not None  # `_refusal` refuses a norm without γ
        gamma = np.ravel(to_numpy(self.f.tg.capture.constants[norm.scale])).astype(np.float64)
        values = (np.ones(kept) if moved else gamma[:kept]) * gamma_factor
        self._set_attr(node, 2, values, norm.name)
        args = list(node.args) + [None] * (4 - len(node.args))
        eps = args[3] if args[3] is not None else torch.finfo(torch.float32).eps  # aten.rms_norm's default
        node.args = (args[0], [kept], args[2], float(eps) * eps_factor)

    def _set_attr(self, node: fx.Node, index: int, values: np.ndarray, label: str, parameter: bool = True) -> None:
        """Input `index` of `node` becomes a new attribute holding `values` (float32)."""
        name = f"normpass_sliced_{label.replace('.', '_').replace('/', '_')}_{index}"
        while hasattr(self.graph, name):
            name += "_"
        tensor = torch.as_tensor(values, dtype=torch.float32)
        if parameter:
            self.graph.register_parameter(name, nn.Parameter(tensor))
        else:
            self.graph.register_buffer(name, tensor)
        with self.graph.graph.inserting_before(node):
            attr = self.graph.graph.get_attr(name)
        args = list(node.args) + [None] * (index + 1 - len(node.args))
        args[index] = attr
        node.args = tuple(args)

    def _cut_shapes(self, stream: Stream, width: int, kept: int) -> None:
        for tensor, axis in stream.states:
            node = self.nodes.get(tensor)
            if node is None or node.target not in RESHAPING:
                continue
            shape = list(node.args[1])
            if axis < len(shape) and shape[axis] == width:
                shape[axis] = kept
                node.args = (node.args[0], shape, *node.args[2:])

    def shortcut(self, shortcut: Shortcut, matrix: np.ndarray) -> None:
        """`aten.matmul` by `matrix` on the residual edge `shortcut` (a trainable parameter)."""
        add = self.nodes[self.f.fx_node(shortcut.node)]
        operand = next(a for a in add.args if isinstance(a, fx.Node) and _passed(a).name == shortcut.tensor)
        label = f"shortcut_{shortcut.tensor}_{add.name}"
        self.graph.register_parameter(label, nn.Parameter(torch.as_tensor(matrix, dtype=torch.float32)))
        with self.graph.graph.inserting_before(add):
            weight = self.graph.graph.get_attr(label)
            changed = self.graph.graph.call_function(ATEN.matmul.default, (operand, weight))
        add.replace_input_with(operand, changed)

    def finish(self) -> fx.GraphModule:
        """Write the new constants, the carried biases; drop the carried β adds; recompile."""
        self.reads.write()
        for name, bias in self.biases.items():
            node = self.nodes[name]
            assert node.target is ATEN.linear.default, f"a bias-less reader other than aten.linear: {node.target}"
            self._set_attr(node, 2, bias, name)
        for name in self.dropped:
            add = self.nodes[name]
            norm = next(a for a in add.args if isinstance(a, fx.Node) and a.op != "get_attr")
            add.replace_all_uses_with(norm)
            self.graph.graph.erase_node(add)
        self.graph.graph.eliminate_dead_code()
        read = {str(n.target) for n in self.graph.graph.nodes if n.op == "get_attr"}
        for name, _ in [*self.graph.named_parameters(), *self.graph.named_buffers()]:
            if name not in read:  # a constant the cut replaced or dropped: not a parameter of the result
                owner, _, attr = name.rpartition(".")
                delattr(self.graph.get_submodule(owner), attr)
        self.graph.delete_all_unused_submodules()
        self.graph.graph.lint()
        self.graph.recompile()
        return self.graph.eval()


def _cut(f: Folded, bases: dict[str, Basis], kept: dict[str, int]) -> fx.GraphModule:
    """A copy of the folded graph with each piece that has a basis in `bases` cut to its stream's `kept`
    columns, the others whole (Q = I), and the shortcuts between pieces (`onnx/slice/driver._cut_pieces`)."""
    cutter = Cutter(f)
    columns: dict[str, np.ndarray] = {}
    for stream, found in f.pieces.items():
        for piece in found:
            columns[piece.name] = (
                bases[piece.name].vectors[:, : kept[stream]] if piece.name in bases else np.eye(piece.width or 0)
            )
            if piece.name in bases:
                cutter.cut(piece, columns[piece.name])
    for shortcut in f.shortcuts:
        if shortcut.source in bases or shortcut.target in bases:
            cutter.shortcut(shortcut, columns[shortcut.source].T @ columns[shortcut.target])
    return cutter.finish()


# --- bases ---------------------------------------------------------------------------------------


class _Tap(nn.Module):
    def __init__(self, store: dict, key: str):
        super().__init__()
        self.store, self.key = store, key

    def forward(self, x: torch.Tensor) -> None:
        self.store[self.key] = x.detach()


def _tapped(graph: fx.GraphModule, names: list[str], store: dict) -> fx.GraphModule:
    """A copy of `graph` that also stores the values of the nodes `names` in `store` on each call."""
    tapped = copy.deepcopy(graph)
    nodes = {n.name: n for n in tapped.graph.nodes}
    for i, name in enumerate(names):
        tapped.add_submodule(f"normpass_tap_{i}", _Tap(store, name))
        with tapped.graph.inserting_after(nodes[name]):
            tapped.graph.call_module(f"normpass_tap_{i}", (nodes[name],))
    tapped.recompile()
    return tapped


def covariances(
    f: Folded, graph: fx.GraphModule, pieces: list[Stream], batches: list[Batch], mask_input: str | None
) -> dict[str, Covariance]:
    """Σ uᵀu per piece over the unit-length tokens where its RMS ops read it (`core/pca.Covariance`),
    on `graph`, summed across processes."""
    reads = {p.name: [(n, dict(p.states)[f.tg.zmg.norm_by_name(n).input]) for n in p.norms] for p in pieces}
    wanted = sorted({f.tg.zmg.norm_by_name(n).input for p in pieces for n in p.norms})
    store: dict[str, torch.Tensor] = {}
    tapped = _tapped(graph, wanted, store)
    sums = {p.name: Covariance(p.width or 0) for p in pieces}
    with torch.no_grad():
        for batch in batches:
            tapped(**_tensors(batch))
            mask = batch.get(mask_input) if mask_input else None
            for piece in pieces:
                for norm, axis in reads[piece.name]:
                    values = to_numpy(store[f.tg.zmg.norm_by_name(norm).input]).astype(np.float64)
                    sums[piece.name].add(token_rows(np.moveaxis(values, axis, -1), mask))
    combine(list(sums.values()))
    return sums


def stream_states(f: Folded, bases: dict[str, Basis], kept: dict[str, int]) -> list[StreamState]:
    """Where each cut piece's RMS ops read its stream, with the piece's kept basis: the cut graph's state
    there is the folded graph's times Q_k (`torch/slice_train.py`'s hidden-state targets)."""
    found = []
    for stream, pieces in f.pieces.items():
        for piece in pieces:
            if piece.name not in bases:
                continue
            axes = dict(piece.states)
            for norm in piece.norms:
                state = f.tg.zmg.norm_by_name(norm).input
                found.append(StreamState(state, axes[state], bases[piece.name].vectors[:, : kept[stream]]))
    return found


def _in_graph_order(f: Folded) -> list[Stream]:
    """Every piece that takes a basis, in the order of its first norm in the folded graph."""
    position = {n.name: i for i, n in enumerate(f.graph.graph.nodes)}
    return sorted(f.fitted, key=lambda p: min(position[f.norm_node(n)] for n in p.norms))


def sequential_bases(
    f: Folded, kept: dict[str, int], batches: list[Batch], mask_input: str | None
) -> dict[str, Covariance]:
    """SliceGPT's sequential fit, as `onnx/slice/driver.sequential_covariances`: each piece's Σ uᵀu on the
    graph whose earlier pieces are already cut to `kept` columns, with their shortcuts (a piece left whole
    takes no basis)."""
    sums: dict[str, Covariance] = {}
    bases: dict[str, Basis] = {}
    for piece in _in_graph_order(f):
        stage(f"basis of {piece.name}, on the graph cut before it")
        sums[piece.name] = covariances(f, _cut(f, bases, kept), [piece], batches, mask_input)[piece.name]
        bases[piece.name] = eigenbasis(sums[piece.name])
    return sums


# --- the pass ------------------------------------------------------------------------------------


def _data(module: nn.Module, calibration, options: SliceOptions) -> tuple[list[Batch], list[Batch]]:
    """(fitting, held-out) batches: a seeded split of `calibration`, or all of it and `options.holdout`."""
    reading = ReplaceOptions(batch_size=options.batch_size, tokenizer=options.tokenizer, max_length=options.max_length)
    if options.holdout is not None:
        return load(calibration, module, reading), load(options.holdout, module, reading)
    whole = load(calibration, module, reading)
    size = options.batch_size or DEFAULT_BATCH_SIZE  # a module fixes no batch
    fit, held = split_batches(whole, tuple(options.split), options.seed, size)
    return fit, held


def _parameters(module: nn.Module) -> int:
    return sum(t.numel() for t in [*module.parameters(), *module.buffers()])


def slice(
    module: nn.Module,
    example_inputs,
    calibration,
    options: SliceOptions | None = None,
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    name: str | None = None,
) -> tuple[fx.GraphModule, TorchSliceReport]:
    """`module` folded, every provable residual stream cut to its principal subspace, judged on held-out
    data (the module docstring); `options.recover_train` seconds of training per ratio
    (`torch/slice_train.py`). Returns the sliced graph (a `GraphModule` called like `module`) and a report.

    `calibration`: a file (the CLI's forms) or an iterable of input dicts keyed by the forward's parameter
    names. `dynamic_shapes` as for `fold_graph`; default: every input dimension `Dim.AUTO`. Raises
    `BudgetMissed` when the budget is missed (its report attached), `UnsupportedModelError` where the
    module cannot be captured, `VerificationError` where the fold or the rotation at R = 0 does not hold.
    """
    options = options or SliceOptions()
    budget = options.checked()
    if options.recover:
        raise InputError(
            "recover refits the layers of an ONNX graph; a PyTorch module is trained back instead: recover_train"
        )
    args, kwargs = _arguments(module, example_inputs, example_kwargs)
    name = name or type(module).__name__
    dynamic = auto_dynamic_shapes(args) if dynamic_shapes is None else dynamic_shapes
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    stage("fold")
    f, fold_report = fold_and_plan(module, args, kwargs, dynamic, options.basis, name, options.head)
    seconds["fold"] = time.perf_counter() - start

    fit, held = _data(module, calibration, options)
    spec = input_spec(module)
    mask_input = find_mask_input(
        InputSpec({k: v for k, v in spec.inputs.items() if k in fit[0]}), options.mask_input, fit + held
    )
    masks = [b.get(mask_input) if mask_input else None for b in held]
    references = [_run(module, b) for b in held]
    one_pass: dict[str, Covariance] = {}
    tried: list[Trial] = []
    chosen, graph = None, None
    seconds["bases"] = seconds["judge"] = seconds["training"] = 0.0
    for ratio in options.ladder():
        kept = {s.name: sliced_width(s.width or 0, ratio, options.round_to) for s in f.plan.sliceable}
        if tried and kept == tried[-1].kept:
            continue
        start = time.perf_counter()
        cut_any = any(kept[s.name] < (s.width or 0) for s in f.plan.sliceable)
        if options.basis == "layer" and cut_any:
            sums = sequential_bases(f, kept, fit, mask_input)
        else:
            if not one_pass:
                one_pass = covariances(f, f.graph, f.fitted, fit, mask_input)
            sums = one_pass
        bases = {piece: eigenbasis(c) for piece, c in sums.items()}
        seconds["bases"] += time.perf_counter() - start
        start = time.perf_counter()
        stage(f"slicing at ratio {ratio:g} and judging it on the held-out data")
        graph = _cut(f, bases, kept)
        metrics = compare(references, [_run(graph, b) for b in held], masks)
        seconds["judge"] += time.perf_counter() - start
        training = None
        if options.recover_train and cut_any:
            start = time.perf_counter()
            states = stream_states(f, bases, kept)
            training = train_back(module, graph, fit, mask_input, options, states, f.graph)
            seconds["training"] += time.perf_counter() - start
            training.held_out_before, metrics = metrics, compare(references, [_run(graph, b) for b in held], masks)
            training.held_out_after = metrics
        met = None if budget is None else budget.holds(metrics)
        tried.append(Trial(ratio, kept, metrics, met, _parameters(graph), training))  # type: ignore[arg-type]
        if met is not False:
            chosen = tried[-1]
            break
    assert graph is not None  # the ladder has one ratio at least
    report = TorchSliceReport(
        fold_report,
        f.plan,
        pieces={s: [p.name for p in found] for s, found in f.pieces.items()},
        tokens={p: c.tokens for p, c in sums.items()},
        shortcuts=len(f.shortcuts),
        parameters=_parameters(module),
        chosen=chosen,
        tried=tried,
        requested_ratio=options.ratio,
        budget=budget,
        basis=options.basis,
        whole=sorted(f.whole),
        seconds=seconds,
        bases=bases,
        folded=f.graph,
        states=stream_states(f, bases, tried[-1].kept),
    )
    if chosen is None:
        last = tried[-1].held_out
        raise BudgetMissed(
            ReplaceReport({"output": None, **report.to_json()}),
            f"{name}: sliced at ratio {tried[-1].ratio:g}, the module misses the budget {budget} on {last.samples} "
            f"held-out samples (cos min {last.cos_min:.6f}, rel max {last.rel_max:.3g}); nothing written; "
            + ("no ratio tried meets it" if options.write_best else "try a smaller ratio, or --write-best"),
            graph,
        )
    if all(chosen.kept[s.name] == s.width for s in f.plan.sliceable):  # k = d: a rotation, verified
        report.comparison = _compare(_outputs(module, args, kwargs), _outputs(graph, args, kwargs))
        if not report.comparison.passed:
            raise VerificationError(
                f"{name}: rotated into its principal bases, the graph does not match the module: "
                f"{report.comparison.failures()}"
            )
    return graph, report
