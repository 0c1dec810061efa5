"""Apply a `FoldPlan` to the captured graph (`torch.export`'s), not to the module: `fold_graph`.

The module rewrite (`torch/rewrite.py`) cannot edit a module's forward code, so it declines a
centring the plan inserts inside one (Whisper's stem, after a functional `F.gelu`; XCiT's local
patch interaction, after its LayerScale). This rewrite edits `ExportedProgram.module()`, a
`torch.fx.GraphModule` whose nodes are the captured calls, so it applies the plan as the ONNX
front end does:

* Centring, per read: where node n reads constant W and the plan centres it along axis k (a
  layer's weight and bias along its outputs, a position table along the features), n is given its
  own copy, W − mean_k(W); a LayerScale s after a layer is absorbed first, (x·W + b)⊙s =
  x·(W⊙s) + b⊙s, the mul reading ones. Other readers of W keep it, so no tie is broken.
* Inserted centring: the plan's x − mean(x) as `aten.mean` and `aten.sub` nodes after x, read by
  every reader of x.
* Each folded `aten.layer_norm(x, shape, γ, β, ε)` becomes `aten.rms_norm(x, shape, γ, ε) + β`:
  on zero-mean x, LayerNorm's variance is mean(x²), so both are the same function. γ and β stay.

What it costs: the result is a `GraphModule`, not the module's class, and the graph is specialised
to the captured shapes (torch.export's guards refuse others) unless it was captured with
`dynamic_shapes`. Graph surgery beyond that is torch.fx's own (`GraphModule.recompile`).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch
from torch import fx

from ..core.algebra import scale_along
from ..core.plan import Blocker, FoldPlan
from .fx import NormSite, TorchGraph, to_numpy
from .rewrite import AxisWeight, _edits_of, _layer_scale, weighted_centre

VIEWS = {torch.ops.aten.t.default, torch.ops.aten.numpy_T.default, torch.ops.aten.transpose.int}
VIEWS |= {torch.ops.aten.permute.default}  # the transposes `fx._Context.transposed_constant` reads through


def _fqn(constant: str) -> str:
    """The attribute path of a captured constant (`capture._constant_name` in reverse)."""
    return constant.removeprefix("self.")


def _reading_node(nodes: dict[str, fx.Node], tg: TorchGraph, node: str, constant: str) -> fx.Node | None:
    """The fx node whose input is the `get_attr` of `constant` on `node`'s read: the call itself, or the
    transpose it reads the constant through (`x @ W.T`, where only that call reads the transpose)."""
    call = nodes.get(tg.zmg.nodes[node].ref.call.node)
    if call is None:
        return None
    for candidate in [call, *(n for n in call.all_input_nodes if n.target in VIEWS and len(n.users) == 1)]:
        if any(n.op == "get_attr" and n.target == _fqn(constant) for n in candidate.all_input_nodes):
            return candidate
    return None


def restrict(tg: TorchGraph, plan: FoldPlan, graph_module: fx.GraphModule) -> FoldPlan:
    """The plan less the folds this rewrite cannot make, each declined with its reason: a norm that is
    not one `aten.layer_norm` call, a constant read this rewrite cannot find in the graph."""
    nodes = {n.name: n for n in graph_module.graph.nodes}
    decisions = [dataclasses.replace(d) for d in plan.decisions]
    for decision in (d for d in decisions if d.foldable):
        site: NormSite = tg.zmg.norm_by_name(decision.name).ref
        why = None
        if site.call.op != "layer_norm" or site.call.node not in nodes:
            why = f"{site.call.target} is not an aten.layer_norm call of the captured graph"
        for centring in decision.centrings:
            reads = _edits_of(tg, centring, absorbing=True)
            if isinstance(reads, str):
                why = why or reads
                continue
            scale = _layer_scale(tg, centring)
            extra = [] if scale is None else [(scale.mul, scale.factor, None)]
            missing = [(n, t) for n, t, _ in [*reads, *extra] if _reading_node(nodes, tg, n, t) is None]
            if missing:
                why = why or f"{missing[0][1]}, read by {missing[0][0]}, is not an attribute read of the graph"
        for insertion in decision.insertions:
            if insertion.tensor not in nodes:
                why = why or f"{insertion.tensor} is not a node of the captured graph"
        if why:
            decision.foldable = False
            decision.reason = f"provably foldable, but the graph rewrite cannot apply it: {why}"
            decision.blocker = Blocker(decision.name, why, (decision.name,))
    return FoldPlan(decisions)


class _Reads:
    """New values for single reads of constants, each then held by a fresh attribute of the graph module.

    A read is keyed by the fx node whose input is the constant's `get_attr` (`_reading_node`).
    """

    def __init__(self, tg: TorchGraph, graph_module: fx.GraphModule):
        self.tg, self.gm = tg, graph_module
        self.nodes = {n.name: n for n in graph_module.graph.nodes}
        self.values: dict[tuple[fx.Node, str], np.ndarray] = {}

    def _key(self, node: str, constant: str) -> tuple[fx.Node, str]:
        site = _reading_node(self.nodes, self.tg, node, constant)
        assert site is not None, f"restrict() found {constant} read by {node}"
        return site, constant

    def get(self, node: str, constant: str) -> np.ndarray:
        key = self._key(node, constant)
        if key not in self.values:
            self.values[key] = to_numpy(self.tg.capture.constants[constant]).astype(np.float64)
        return self.values[key]

    def set(self, node: str, constant: str, value: np.ndarray) -> None:
        self.values[self._key(node, constant)] = value

    def write(self) -> None:
        """Give each edited read its own attribute; drop the attributes nothing reads any more."""
        graph, counter, replaced = self.gm.graph, itertools.count(), set()
        for (site, constant), value in self.values.items():
            old = next(n for n in site.all_input_nodes if n.op == "get_attr" and n.target == _fqn(constant))
            original = self.tg.capture.constants[constant]
            tensor = torch.as_tensor(value).to(dtype=original.dtype, device=original.device)
            name = f"normpass_{_fqn(constant).replace('.', '_')}_{next(counter)}"
            while hasattr(self.gm, name):  # a graph rewritten before (a fold, then a slice) has such names
                name = f"normpass_{_fqn(constant).replace('.', '_')}_{next(counter)}"
            if isinstance(original, torch.nn.Parameter):
                self.gm.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=original.requires_grad))
            else:
                self.gm.register_buffer(name, tensor)
            with graph.inserting_before(site):
                site.replace_input_with(old, graph.get_attr(name))
            replaced.add(old)
        for node in (n for n in replaced if not n.users):
            owner, _, name = str(node.target).rpartition(".")
            graph.erase_node(node)
            delattr(self.gm.get_submodule(owner), name)


def apply(tg: TorchGraph, plan: FoldPlan, graph_module: fx.GraphModule) -> dict[str, str]:
    """Rewrite `graph_module` (`ExportedProgram.module()` of `tg`'s capture) in place per a restricted plan.

    Returns, per folded norm, what became of it.
    """
    reads = _Reads(tg, graph_module)
    for scale in {s for c in plan.centrings if (s := _layer_scale(tg, c)) is not None}:
        linear = tg.zmg.nodes[scale.linear].ref.linear
        factor = reads.get(scale.mul, scale.factor)
        for tensor, axis in ((linear.weight, linear.out_axis), (linear.bias, linear.bias_axis)):
            if tensor is not None:
                reads.set(scale.linear, tensor, scale_along(reads.get(scale.linear, tensor), axis, factor.reshape(-1)))
        reads.set(scale.mul, scale.factor, np.ones_like(factor))
    centred: dict[tuple[str, str], AxisWeight] = {}
    for centring in plan.centrings:
        edits = _edits_of(tg, centring, absorbing=True)
        assert not isinstance(edits, str), f"restrict() checked the centring of {centring.node}"
        centred.update({(node, tensor): (axis, centring.weight) for node, tensor, axis in edits})
    for (node, tensor), (axis, weight) in centred.items():
        reads.set(node, tensor, weighted_centre(tg, reads.get(node, tensor), axis, weight))
    reads.write()
    graph = graph_module.graph
    nodes = {n.name: n for n in graph.nodes}
    for insertion in plan.insertions:
        _insert_centring(graph, nodes[insertion.tensor], insertion.axis)
    notes = {}
    for decision in plan.folded:
        site: NormSite = tg.zmg.norm_by_name(decision.name).ref
        _to_rms_norm(graph, nodes[site.call.node])
        notes[decision.name] = "aten.rms_norm in the graph, γ and β kept"
    graph.lint()
    graph_module.recompile()
    return notes


def _insert_centring(graph: fx.Graph, node: fx.Node, axis: int) -> None:
    """x ← x − mean(x, axis) for every reader of `node` (torch.export's guard function keeps the input)."""
    with graph.inserting_after(node):
        mean = graph.call_function(torch.ops.aten.mean.dim, (node, [axis], True))
    with graph.inserting_after(mean):
        centred = graph.call_function(torch.ops.aten.sub.Tensor, (node, mean))
    node.replace_all_uses_with(
        centred, delete_user_cb=lambda user: user not in (mean, centred) and user.op != "call_module"
    )


def _to_rms_norm(graph: fx.Graph, node: fx.Node) -> None:
    """aten.layer_norm(x, shape, γ, β, ε) → aten.rms_norm(x, shape, γ, ε) (+ β)."""
    bound = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), node.args, strict=False)) | node.kwargs
    x, shape, weight, bias = bound["input"], bound["normalized_shape"], bound.get("weight"), bound.get("bias")
    eps = bound.get("eps", 1e-5)  # aten.layer_norm's default
    with graph.inserting_after(node):
        rms = graph.call_function(torch.ops.aten.rms_norm.default, (x, shape, weight, eps))
    result = rms
    if bias is not None:
        with graph.inserting_after(rms):
            result = graph.call_function(torch.ops.aten.add.Tensor, (rms, bias))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
