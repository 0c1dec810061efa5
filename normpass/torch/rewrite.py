"""Apply a `FoldPlan` to a PyTorch module: centre parameters, swap LayerNorm modules for RMSNorms.

The rewrite works on modules, not on the captured graph: the returned module keeps its class and
its forward code, only some parameters get new values and folded LayerNorm submodules
(`nn.LayerNorm`, its subclasses, and any module whose forward is `F.layer_norm` over its own weight
and bias, between permutes or not: `fx._layer_norm_module`) are replaced by `torch.nn.RMSNorm`
(inside `Permuted` where the LayerNorm permuted around its norm). So it runs eagerly at any input
shape, compiles and exports like the original.

* Centring (algebra.centre) of each attribute a planned layer reads, along the axis that indexes
  its output features: nn.Linear W [out, in] axis 0, HF Conv1D W [in, out] axis 1, embedding
  tables axis 1, conv W axis 0, their biases, and parameters added into the stream (position
  tables, CLS tokens) along the stream's axis.
* LayerScale (`core.rules.layer_scale`; CaiT, DINOv2): a per-channel factor s multiplying a linear
  layer's output is absorbed first, (x·W + b)⊙s = x·(W⊙s) + b⊙s, the factor set to ones, so the
  layer is centred as any other; only where nothing else reads s, W or b.
* Inserted centring (the plan's `Insertion`s; BLOOM's and mBART's embedding LayerNorms, PVT-v2's
  patch norms, XCiT's BatchNorm stem, wav2vec2's positional convolution's Add): where the tensor to
  centre is the output of a one-op module called once, that module (or the RMSNorm it became,
  keeping γ and β) is wrapped in `Centred`, y − mean(y); where its one reader is a pass-through
  module called once (wav2vec2's encoder dropout), that module is, since its output is the tensor.
  A centring anywhere else (after a functional `F.gelu`) is declined; `torch/graph_rewrite.py`
  makes it on the captured graph instead.
* Copy-on-write: an edit assigns a new `nn.Parameter` to the one attribute the graph read it
  through, so a parameter tied elsewhere (GPT-2's LM head is the token table) keeps its value
  there; HF tying metadata is updated so `tie_weights()` will not tie them again.
* Affine migration (algebra.migrate_affine; `torch/targets.py`): when every consumer of a folded
  norm is a linear layer whose parameters nothing else reads, γ and β move into it
  (W' = diag(γ)·W, b' = b + β·W) and the norm becomes an `nn.RMSNorm` without affine; otherwise
  it keeps γ, and β as a bias (`RMSNormWithBias`), or (`beta_across_residuals`, as the ONNX fold)
  β moves into the linear consumers and across residual adds into the other summand's bias.

A module edit applies to every call of the module and every reader of the attribute, which the
graph-level plan does not assume; `restrict` declines the folds a module rewrite cannot express.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..core.algebra import centre, migrate_affine, scale_along
from ..core.analysis import ShiftChecker
from ..core.plan import Blocker, Centring, FoldPlan, Insertion, NormDecision
from ..core.rules import Linear, layer_scale
from .capture import Attr
from .fx import PASS_THROUGH, NodeRef, NormSite, TorchGraph, to_numpy
from .targets import BiasTarget, Stream, claim_residual, migration_targets


class RMSNormWithBias(nn.RMSNorm):
    """`torch.nn.RMSNorm` plus a bias: a folded LayerNorm whose β could not move into its consumers."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class Centred(nn.Module):
    """`module` with its output centred along `axis` (y − mean(y)): a centring the plan inserts where a
    stream starts at a norm module's affine output (BLOOM's embedding LayerNorm, PVT-v2's patch norms)."""

    def __init__(self, module: nn.Module, axis: int):
        super().__init__()
        self.module, self.axis = module, axis

    def forward(self, *args, **kwargs) -> torch.Tensor:
        y = self.module(*args, **kwargs)
        return y - y.mean(self.axis, keepdim=True)


class Permuted(nn.Module):
    """`norm` between two permutes: the RMSNorm that replaces a channels-first LayerNorm (timm LayerNorm2d)."""

    def __init__(self, norm: nn.Module, before: tuple[int, ...] | None, after: tuple[int, ...] | None):
        super().__init__()
        self.norm, self.before, self.after = norm, before, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.before is None else x.permute(self.before)
        x = self.norm(x)
        return x if self.after is None else x.permute(self.after)


# --- what a module rewrite can express ---------------------------------------------------------


AxisWeight = tuple[int | None, str | None]  # how a constant is centred: along an axis, weighted by a constant or not


@dataclass(frozen=True)
class LayerScale:
    """A per-channel factor s after a linear layer, absorbed into it: W ← W⊙s along its outputs, b ← b⊙s, s ← 1."""

    mul: str
    factor: str
    linear: str


def _layer_scale(tg: TorchGraph, centring: Centring) -> LayerScale | None:
    """The LayerScale `centring` centres by absorbing it into its layer (`core.rules.layer_scale`), if any."""
    if centring.input_index is not None or centring.axis is None:
        return None
    node = tg.zmg.nodes[centring.node]
    found = layer_scale(tg.zmg, node, centring.axis)
    if found is None:
        return None
    index, linear, _ = found
    return LayerScale(node.name, node.inputs[index], linear.name)


def _layer_scale_blocked(tg: TorchGraph, scale: LayerScale, uses: dict) -> str | None:
    """Why absorbing `scale` would change another reader of its factor or of its layer's parameters."""
    linear = tg.zmg.nodes[scale.linear].ref.linear
    if linear.bias is not None and linear.bias_axis is None:
        return f"the LayerScale {scale.mul} cannot be absorbed: its layer's bias is one number for every channel"
    for node, tensor in [(scale.mul, scale.factor), (scale.linear, linear.weight), (scale.linear, linear.bias)]:
        attr = None if tensor is None else tg.attr(node, tensor)
        if tensor is not None and attr is None:
            return f"{tensor}, read by {node}, is not a module parameter or buffer"
        others = [] if attr is None else [n for n, _ in uses.get(attr, []) if n != node]
        if others:
            return f"the LayerScale {scale.mul} cannot be absorbed: {attr} is also read by {others[0]}"
    return None


def _edits_of(tg: TorchGraph, centring: Centring, absorbing: bool = False) -> list[tuple[str, str, int | None]] | str:
    """(node, constant, axis) reads that `centring` edits, or why it cannot be done on a module.

    A LayerScale's centring is its layer's, once the caller has absorbed the factor (`absorbing`):
    centring the layer alone would leave a shift times the factor, which no norm removes.
    """
    reads: list[tuple[str, str, int | None]]
    scale = _layer_scale(tg, centring)
    if scale is not None and not absorbing:
        return f"the LayerScale {scale.mul} would have to be absorbed into {scale.linear} first"
    if scale is not None:  # the layer takes the factor, and is centred
        centring = dataclasses.replace(centring, node=scale.linear)
    if centring.input_index is not None:
        assert centring.tensor is not None  # a constant's centring names it
        reads = [(centring.node, centring.tensor, centring.axis)]
    else:
        linear = tg.zmg.nodes[centring.node].ref.linear
        reads = [(centring.node, linear.weight, linear.out_axis)]
        if linear.bias is not None:
            reads.append((centring.node, linear.bias, linear.bias_axis))
    for node, tensor, axis in reads:
        if tg.attr(node, tensor) is None:
            return f"{tensor}, read by {node}, is not a module parameter or buffer"
        if centring.weight is not None and axis is None:
            return f"{tensor}, read by {node}, is one number for every channel: it has no centring weighted by a factor"
    return reads


def weighted_centre(tg: TorchGraph, values: np.ndarray, axis: int | None, weight: str | None) -> np.ndarray:
    """`values` centred along `axis`, weighted by the constant `weight` where one is named (`algebra.centre`)."""
    return centre(values, axis, None if weight is None else np.ravel(tg.zmg.constant(weight)))


def _harmless(tg: TorchGraph, checker: ShiftChecker, node: str, tensor: str, centring: AxisWeight) -> str | None:
    """None if centring `tensor` as `centring` says (an axis, a weight) where `node` reads it leaves the model
    unchanged, else why not."""
    axis, weight = centring
    znode = tg.zmg.nodes[node]
    linear = znode.ref.linear if isinstance(znode.ref, NodeRef) else None
    if linear is None or (tensor, axis) not in ((linear.weight, linear.out_axis), (linear.bias, linear.bias_axis)):
        return f"it is also read by {node}, which centring it would change"
    assert isinstance(znode.rule, Linear)  # the node of a linear layer
    blocker = checker.removed(znode.outputs[0], znode.rule.axis, weight)
    return None if blocker is None else f"it is also read by {node}, where centring is unsafe: {blocker.reason}"


def restrict(tg: TorchGraph, plan: FoldPlan) -> FoldPlan:
    """The plan less the folds a module rewrite cannot express, each declined with its reason.

    A fold stays only if (1) its norm is a LayerNorm module whose every call folds, and (2)
    every constant it centres is a module attribute whose every reader is centred alike, or reads
    it in a layer whose centring is safe anyway.
    """
    zmg = tg.zmg
    checker = ShiftChecker(zmg)
    uses = tg.uses()
    decisions = [dataclasses.replace(d) for d in plan.decisions]
    sites = {d.name: zmg.norm_by_name(d.name).ref for d in decisions}
    calls_of: dict[str, list[NormDecision]] = {}
    for decision in decisions:
        if sites[decision.name].replace_blocked is None:
            calls_of.setdefault(sites[decision.name].module, []).append(decision)
    norms = {n.name for n in zmg.norms}
    affine_readers = {
        module: sorted({node for name in ("weight", "bias") for node, _ in uses.get(Attr(module, name), [])} - norms)
        for module in calls_of
    }

    def decline(decision: NormDecision, node: str, reason: str) -> None:
        decision.foldable = False
        decision.reason = f"provably foldable, but the PyTorch rewrite cannot apply it: {reason}"
        decision.blocker = Blocker(node, reason, (decision.name, node))

    placements = {i: _place(tg, i) for d in decisions if d.foldable for i in d.insertions}

    while True:
        before = sum(d.foldable for d in decisions)
        for decision in (d for d in decisions if d.foldable):
            site: NormSite = sites[decision.name]
            kept = [d for d in calls_of.get(site.module, []) if not d.foldable]
            if site.replace_blocked:
                decline(decision, decision.name, site.replace_blocked)
            elif why := next((p for p in (placements[i] for i in decision.insertions) if isinstance(p, str)), None):
                decline(decision, decision.name, why)
            elif affine_readers[site.module]:
                reader = affine_readers[site.module][0]
                decline(decision, reader, f"{reader} also reads the γ or β of {site.module}, which the swap removes")
            elif kept:
                decline(
                    decision,
                    kept[0].name,
                    f"module {site.module} is also called as {kept[0].name}, which "
                    "does not fold, and a module swap replaces every call",
                )
        for decision in (d for d in decisions if d.foldable):
            for scale in filter(None, (_layer_scale(tg, c) for c in decision.centrings)):
                if why := _layer_scale_blocked(tg, scale, uses):
                    decline(decision, scale.mul, why)
                    break
        edits, needs = _planned_edits(tg, decisions, decline)
        for attr, reads in edits.items():
            reason = _conflict(tg, checker, attr, reads, uses.get(attr, []))
            for decision in decisions:
                if reason and decision.foldable and decision.name in needs[attr]:
                    decline(decision, str(attr), reason)
        if sum(d.foldable for d in decisions) == before:
            return FoldPlan(decisions)


def _centred_module(tg: TorchGraph, tensor: str) -> str | None:
    """The module whose output is `tensor`, where a `Centred` wrapper can centre it.

    It must be a module without submodules whose one call in the graph is one op making that tensor
    (a LayerNorm, a BatchNorm, a GELU module), so that wrapping it centres exactly that tensor.
    """
    producer = next((c for c in tg.capture.calls if tensor in c.outputs), None)
    if producer is None or not producer.module:
        return None
    if next(tg.model.get_submodule(producer.module).children(), None) is not None:
        return None
    if [c.node for c in tg.capture.calls if c.module == producer.module] != [producer.node]:
        return None  # its forward makes other calls too, or it is called more than once
    return producer.module


def _pass_through_reader(tg: TorchGraph, tensor: str) -> str | None:
    """The module to wrap where `tensor`'s one reader is a pass-through module (a dropout at inference)."""
    readers = [c for c in tg.capture.calls if tensor in c.refs()]
    if len(readers) != 1 or tensor in tg.capture.outputs:
        return None
    reader = readers[0]
    if reader.op not in PASS_THROUGH or reader.args.get("train") or reader.refs() != [tensor]:
        return None
    return _centred_module(tg, reader.outputs[0])


def _place(tg: TorchGraph, insertion: Insertion) -> tuple[str, int] | str:
    """The module to wrap in `Centred`, and the axis, that centres `insertion`'s tensor; or why there is none.

    The tensor is that module's output, or its one reader is that module, a pass-through (a dropout
    at inference) whose output is the tensor. (The planner already cuts as far upstream as a
    centring is exact, so moving the cut up through linear ops finds no other module output.)
    """
    module = _centred_module(tg, insertion.tensor) or _pass_through_reader(tg, insertion.tensor)
    if module is None:
        return (
            f"the centring it needs on {insertion.tensor} is not at the output of a one-op module called once, "
            "nor read only by one (the graph rewrite, normpass.fold_graph, inserts it)"
        )
    return module, insertion.axis - len(tg.zmg.shape(insertion.tensor) or ())


def _planned_edits(tg: TorchGraph, decisions: list[NormDecision], decline):
    """Per attribute: the (node, constant) reads the folded decisions centre, with their axes; and who needs it."""
    edits: dict[Attr, dict[tuple[str, str], AxisWeight]] = {}
    needs: dict[Attr, set[str]] = {}
    for decision in decisions:
        if not decision.foldable:
            continue
        planned = [_edits_of(tg, c, absorbing=True) for c in decision.centrings]
        failed = next((p for p in planned if isinstance(p, str)), None)
        if failed:
            decline(decision, decision.name, failed)
            continue
        for centring, reads in zip(decision.centrings, planned, strict=True):
            assert not isinstance(reads, str)  # `failed` above
            for node, tensor, axis in reads:
                attr = tg.attr(node, tensor)
                assert attr is not None  # checked by _edits_of
                edits.setdefault(attr, {})[(node, tensor)] = (axis, centring.weight)
                needs.setdefault(attr, set()).add(decision.name)
    return edits, needs


def _conflict(tg, checker, attr: Attr, reads: dict, uses: list[tuple[str, str]]) -> str | None:
    """Why centring `attr` as `reads` says would change the model somewhere else, or None."""
    centrings = set(reads.values())
    if len(centrings) > 1:
        return f"{attr} would be centred along different axes, or weighted differently"
    for node, tensor in uses:
        if (node, tensor) not in reads and (why := _harmless(tg, checker, node, tensor, next(iter(centrings)))):
            return f"{attr} cannot be centred: {why}"
    return None


# --- apply -------------------------------------------------------------------------------------


class _Editor:
    """Replaces attributes of `module` with new values, copy-on-write, and records what it untied."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.holders: dict[int, list[str]] = {}
        for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)
        ):
            self.holders.setdefault(id(tensor), []).append(name)
        self.untied: dict[str, list[str]] = {}  # attribute → the other attributes that shared its tensor

    def get(self, attr: Attr) -> torch.Tensor | None:
        return getattr(self.module.get_submodule(attr.module), attr.name)

    def parameter(self, attr: Attr) -> torch.Tensor:
        """The tensor at `attr`, which must be set."""
        tensor = self.get(attr)
        assert tensor is not None, f"{attr} is a parameter or buffer"
        return tensor

    def set(self, attr: Attr, values: np.ndarray) -> None:
        owner = self.module.get_submodule(attr.module)
        old = getattr(owner, attr.name)
        new = torch.as_tensor(values).to(dtype=old.dtype, device=old.device)
        others = [p for p in self.holders.get(id(old), []) if p != str(attr)]
        if others:
            self.untied[str(attr)] = others
            self.holders[id(old)] = others
        if isinstance(old, nn.Parameter):
            setattr(owner, attr.name, nn.Parameter(new, requires_grad=old.requires_grad))
        else:
            owner._buffers[attr.name] = new

    def add_bias(self, linear: nn.Linear, values: np.ndarray) -> None:
        linear.bias = nn.Parameter(torch.as_tensor(values).to(dtype=linear.weight.dtype, device=linear.weight.device))

    def forget_hf_ties(self) -> None:
        """Drop untied pairs from Hugging Face tying metadata, so `tie_weights()` keeps them apart."""
        untied = set(self.untied)
        for path, sub in self.module.named_modules():
            ties = getattr(sub, "all_tied_weights_keys", None)
            if not isinstance(ties, dict):
                continue
            prefix = f"{path}." if path else ""
            dropped = {k for k, v in ties.items() if f"{prefix}{k}" in untied or f"{prefix}{v}" in untied}
            if dropped:
                sub.all_tied_weights_keys = {k: v for k, v in ties.items() if k not in dropped}
                if getattr(getattr(sub, "config", None), "tie_word_embeddings", False):
                    sub.config.tie_word_embeddings = False


def _wide(tensor: torch.Tensor) -> np.ndarray:
    return to_numpy(tensor).astype(np.float64)


def add_to_bias(editor: _Editor, attr: Attr, values: np.ndarray) -> None:
    """attr += values (float64 arithmetic, rounded once to the parameter's dtype)."""
    current = editor.parameter(attr)
    editor.set(attr, (_wide(current) + values).reshape(tuple(current.shape)))


def move_affine(tg: TorchGraph, editor: _Editor, targets: list, gamma, beta) -> list[str]:
    """γ and β into linear targets (W' = diag(γ)·W, b' = b + β·W), β into `BiasTarget`s (b' = b + β).

    Pass None for a γ of ones or a β of zeros. Returns the nodes whose parameters changed.
    """
    changed = []
    for target in targets:
        if isinstance(target, BiasTarget):
            add_to_bias(editor, target.attr, np.asarray(beta, dtype=np.float64))
            changed.append(target.node)
            continue
        linear = target.ref.linear
        weight_attr = tg.attr(target.name, linear.weight)
        assert weight_attr is not None, f"{target.name}'s weight is a parameter (checked by migration_targets)"
        bias_attr = None if linear.bias is None else tg.attr(target.name, linear.bias)
        bias = None if bias_attr is None else _wide(editor.parameter(bias_attr))
        new_weight, new_bias = migrate_affine(_wide(editor.parameter(weight_attr)), bias, gamma, beta, linear.in_axis)
        editor.set(weight_attr, new_weight)
        if new_bias is not None and bias_attr is not None:
            editor.set(bias_attr, new_bias)
        elif new_bias is not None:
            owner = editor.module.get_submodule(weight_attr.module)
            assert isinstance(owner, nn.Linear), f"{weight_attr.module} gains a bias: an nn.Linear"
            editor.add_bias(owner, new_bias)
        changed.append(target.name)
    return changed


def carry_along_stream(tg: TorchGraph, editor: _Editor, stream: Stream, scale: np.ndarray) -> list[str]:
    """Carry a per-feature scale D along a residual stream (`core/stream.py`): its linear readers'
    input rows times D, its writers' output rows and bias divided by D. Returns the changed nodes."""
    edits = [(node, scale, "in") for node in stream.readers] + [(node, 1.0 / scale, "out") for node in stream.writers]
    for node, factors, side in edits:
        linear = node.ref.linear
        weight = tg.attr(node.name, linear.weight)
        assert weight is not None, f"{node.name}'s weight is a parameter (checked by stream_targets)"
        axis = linear.in_axis if side == "in" else linear.out_axis
        editor.set(weight, scale_along(_wide(editor.parameter(weight)), axis, factors))
        bias = None if linear.bias is None or side == "in" else tg.attr(node.name, linear.bias)
        if bias is not None:
            editor.set(bias, scale_along(_wide(editor.parameter(bias)), linear.bias_axis, factors))
    return [node.name for node, _, _ in edits]


def _absorb(tg: TorchGraph, editor: _Editor, scale: LayerScale) -> None:
    """(x·W + b)⊙s = x·(W⊙s) + b⊙s: the layer's output rows and bias times s, the factor set to ones."""
    factor_attr = tg.attr(scale.mul, scale.factor)
    linear = tg.zmg.nodes[scale.linear].ref.linear
    assert factor_attr is not None  # checked by _layer_scale_blocked
    factor = _wide(editor.parameter(factor_attr))
    s = factor.reshape(-1)
    for tensor, axis in ((linear.weight, linear.out_axis), (linear.bias, linear.bias_axis)):
        attr = None if tensor is None else tg.attr(scale.linear, tensor)
        if attr is not None:
            editor.set(attr, scale_along(_wide(editor.parameter(attr)), axis, s))
    editor.set(factor_attr, np.ones_like(factor))


def _swap_norm(tg: TorchGraph, editor: _Editor, norm_name: str, full, beta_only) -> str:
    """Replace the folded LayerNorm module by an RMSNorm (between its permutes); returns a note on where γ/β went."""
    norm = tg.zmg.norm_by_name(norm_name)
    site: NormSite = norm.ref
    path = site.module
    layer_norm = editor.module.get_submodule(path)
    gamma = None if norm.scale is None else getattr(layer_norm, "weight")  # noqa: B009 (the module's own, by fx._layer_norm_module)
    beta = None if norm.bias is None else getattr(layer_norm, "bias")  # noqa: B009
    shape, eps = tuple(site.call.args["normalized_shape"]), norm.epsilon
    like = {} if gamma is None else {"dtype": gamma.dtype, "device": gamma.device}
    replacement: nn.Module
    wide_gamma = None if gamma is None else _wide(gamma)
    if full is not None:
        moved = move_affine(tg, editor, full, wide_gamma, None if beta is None else _wide(beta))
        replacement = nn.RMSNorm(shape, eps=eps, elementwise_affine=False, **like)
        note = "γ/β migrated into " + ", ".join(moved)
    elif beta is not None and beta_only is None:
        with_bias = RMSNormWithBias(shape, eps=eps, **like)
        with torch.no_grad():
            if gamma is not None:
                with_bias.weight.copy_(gamma)
            with_bias.bias.copy_(beta)
        replacement = with_bias
        note = "γ and β kept in the RMSNorm"
    else:
        moved = [] if beta is None else move_affine(tg, editor, beta_only, None, _wide(beta))
        rms = nn.RMSNorm(shape, eps=eps, elementwise_affine=gamma is not None, **like)
        if gamma is not None:
            with torch.no_grad():
                rms.weight.copy_(gamma)
        replacement = rms
        note = "γ kept in the RMSNorm" if gamma is not None else "no affine"
        note += f", β migrated into {', '.join(moved)}" if moved else ""
    if site.layout != (None, None):
        replacement = Permuted(replacement, *site.layout)
    parent, _, child = path.rpartition(".")
    setattr(editor.module.get_submodule(parent), child, replacement.train(layer_norm.training))
    return note


def apply(
    tg: TorchGraph, plan: FoldPlan, module: nn.Module, migrate: bool = True, beta_across_residuals: bool = False
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Rewrite `module` (a copy of `tg.model`) in place per a restricted `plan`.

    With `beta_across_residuals`, a β that cannot move with γ into linear layers moves into them and
    across residual adds (`targets.claim_residual`), γ staying in the RMSNorm, as the ONNX fold does.
    Returns, per folded norm, where its γ/β went; and each untied attribute with those it was shared with.
    """
    uses = tg.uses()
    editor = _Editor(module)
    centred: dict[str, int] = {}  # module → the axis its output is centred along
    for insertion in {i for decision in plan.folded for i in decision.insertions}:
        placement = _place(tg, insertion)
        assert not isinstance(placement, str), f"restrict() checked the centring of {insertion.tensor}"
        centred.update([placement])
    # Decide migrations on the original graph, before any parameter is rewritten. A norm whose
    # output is centred keeps its γ and β: the centring is planned on γ⊙x̂+β.
    targets: dict[str, tuple[list | None, list | None]] = {}
    for decision in plan.folded:
        norm = tg.zmg.norm_by_name(decision.name)
        if norm.ref.module in centred:
            targets[norm.name] = (None, None)
            continue
        full = migration_targets(tg, norm.name, uses, norm.bias is not None) if migrate else None
        beta_only = None
        if full is None and migrate and beta_across_residuals and norm.bias is not None:
            width = (tg.zmg.shape(norm.output) or (None,))[-1]
            beta_only = migration_targets(tg, norm.name, uses, True, claim_residual(tg, width, uses))
        targets[norm.name] = (full, beta_only)
    for scale in {s for c in plan.centrings if (s := _layer_scale(tg, c)) is not None}:
        _absorb(tg, editor, scale)
    centrings: dict[Attr, AxisWeight] = {}
    for centring in plan.centrings:
        edits = _edits_of(tg, centring, absorbing=True)
        assert not isinstance(edits, str), f"restrict() checked the centring of {centring.node}: {edits}"
        for node, tensor, axis in edits:
            attr = tg.attr(node, tensor)
            assert attr is not None  # checked by _edits_of
            centrings[attr] = (axis, centring.weight)
    for attr, (axis, weight) in centrings.items():
        editor.set(attr, weighted_centre(tg, _wide(editor.parameter(attr)), axis, weight))
    notes = {d.name: _swap_norm(tg, editor, d.name, *targets[d.name]) for d in plan.folded}
    for path, axis in centred.items():
        parent, _, child = path.rpartition(".")
        setattr(editor.module.get_submodule(parent), child, Centred(editor.module.get_submodule(path), axis))
        notes[path] = notes.get(path, "not folded") + f"; output centred along axis {axis}"
    editor.forget_hf_ties()
    return notes, editor.untied
