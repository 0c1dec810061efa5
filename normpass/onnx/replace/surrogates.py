"""Emit surrogate norms into an ONNX graph (an onnx-ir `ir.Model`), moving constants where exact.

A surrogate (`core/surrogates.py` `Surrogate`) computes y = γ ⊙ core(x − c) + β. The norm's nodes are
removed and the cheapest exact form of that formula is emitted:

* **shift c** — when every consumer of x is the norm and x is a sum (Adds whose intermediate
  results feed only the next Add) with a constant summand that broadcasts along the feature axis
  (a bias), that constant becomes b − c (copy-on-write) and no op is needed: the producing layer
  then outputs x − c, exactly. Otherwise an explicit `Sub(x, c)`. Affine and scalebias are linear
  in x: c goes into β instead (β − γ ⊙ c), and so does that bias b, whose `Add` is removed
  (β + γ ⊙ (b − c)): the Add ORT fused into the norm's SkipLayerNormalization does not come back.
* **γ along the residual stream** (`emit_all`, `core/stream.py`): a linear surrogate's γ that no
  linear layer can take alone is carried into the stream's readers and writers and the linear
  surrogates downstream (`targets.stream_plan`, `targets.scale_writers`).
* **biases along the residual stream** (`emit_all`): where x is also read by the residual Add that
  carries the stream on (pre-LN), its bias b still leaves, if everything downstream can take it:
  the stream then holds v − b, each linear surrogate reading it takes γ_m ⊙ b into β_m, and each
  linear layer reading it takes W·b into its bias (`stream_plan` from x). ORT fuses a norm with its
  residual and bias Adds; without the norm, each site keeps one Add instead of two.
* **core** — rms: `SimplifiedLayerNormalization` (ORT), opset-23 `RMSNormalization`, or the
  decomposed chain, emitted by the exact fold's `onnx/fold/rewrite.py` `rms_nodes` (the chain ends at the
  division when γ is ones); affine, scalebias: nothing; dyt: `Mul(α)` → `Tanh`; derf:
  `Mul(α)` → `Erf` (Derf's s is part of the shift: erf(α u + s) = erf(α (u + s/α))).
* **γ and β** — when every path from y reaches a linear layer that contracts over the features
  (through feature-preserving reshapes; `onnx/fold/targets.py` `migration_targets`), both migrate into it:
  W' = diag(γ)·W, b' = b + β·W. Otherwise γ stays (the RMS op's scale, else a `Mul`; a scalar
  one for scalebias), and β
  still migrates if every consumer is such a linear layer or a residual `Add` whose other
  summand carries a private bias: Add(y, s) = Add(y − β, s + β). Else an `Add(β)`.

**Input centring (exact preconditioning).** A LayerNorm removes any per-token shift of its
input: LN(x − m·1) = LN(x). The linear layers and constants that the analysis finds on the way
back from x (`core/analysis.py` `safe_centrings`: those of `prove`, whether or not the proof
succeeds, whose shift is removed downstream) are centred along the features (W' = W − mean_out(W),
b' = b − mean(b), seed 003 §3, with the exact pass's `Rewriter.centre_layer`) without changing the
model. Their per-token mean, which the surrogates cannot remove, is then gone; what is left comes
from what blocked the proof (in a post-LN model, the previous norm's output). `centre_inputs`
does this for every remaining LayerNorm.

Norms are those of the front end's zero-mean graph (`build_zero_mean_graph`), built once per
working graph; the RMS core is the exact pass's `rms_nodes`.

**Fusions** (priced for a `provider`, `ReplaceOptions.provider`). ONNX Runtime runs a
LayerNormalization whose input is a residual `Add` (and that Add's bias `Add`) as one
`SkipLayerNormalization` kernel, so that is the norm's cost (`norm_cost`; on the CPU provider that
kernel is slower than the LayerNorm and Adds it fuses, docs/BENCHMARKS.md). Removing the norm
leaves those Adds to run alone: they are priced into the emission (`Emission.unfused_adds`). An
rms surrogate (`SimplifiedLayerNormalization` reading x) gets them back: the final model fuses
them into `SkipSimplifiedLayerNormalization` (`export_model(fuse_skip=True)`, with or without a
provider), which ORT's optimizer does not do.

`light_model` turns a working graph into a model whose large constants are graph inputs (fed at
run time), so that an ONNX Runtime session per trial costs milliseconds instead of serialising
every weight; `export_model` writes the final model with every weight in it. What an emission
costs is `core/cost.py`'s table; `norm_cost` prices the norm it replaces.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ...core.analysis import ShiftChecker, safe_centrings
from ...core.cost import Emission, costs
from ...core.graph import NormInfo, NormType
from ...core.plan import Centring
from ...core.stream import STREAM_KINDS, on_scaled_input, scale_limit, stream_scale
from ...core.surrogates import NormSpec, Surrogate
from ...io import in_memory_proto
from ..fold.fuse import fuse_skip_rms, skip_fused_adds
from ..fold.rewrite import Rewriter, new_value, rms_nodes
from ..fold.targets import (
    StreamPlan,
    affine_plan,
    move_affine,
    new_initializer,
    private_bias,
    scale_writers,
    stream_plan,
    value_readers,
)
from ..graph.constants import constant_values
from ..graph.export import export_model as annotate
from ..graph.frontend import OnnxGraph, body_holders, build_zero_mean_graph, graph_values
from ..graph.values import input_at, name_of, take_over

LIGHT_LIMIT = 4096  # elements; larger constants become graph inputs of a light model


def norm_cost(norm: NormInfo, fused_adds: int = 0, provider: str | None = None) -> float:
    """Estimated cost of the original norm (its ops), in LayerNorm units of `provider`'s table (`core/cost.py`).

    A LayerNorm that ORT fuses with its residual Add (`fused_adds` > 0, `Emitter.ort_fused_adds`)
    runs as one SkipLayerNormalization kernel: on the CPU provider a slow one (7.5 LayerNorms), on
    CUDA one pass over the activations (0.8). In a decomposed norm the ops right after a ReduceMean up
    to the reciprocal of the root (Add(ε), Sqrt, Reciprocal, Casts) work on reduced tensors and
    cost ~0.
    """
    table = costs(provider)
    nodes = norm.ref.nodes
    if fused_adds and provider is not None:
        return table["SkipLayerNormalization"]
    if len(nodes) == 1:
        return table.get(nodes[0].op_type, 1.0)
    total, reduced = 0.0, False
    for node in nodes:
        if node.op_type == "ReduceMean":
            total, reduced = total + table["ReduceMean"], True
        elif reduced and node.op_type in ("Add", "Sqrt", "Reciprocal", "Cast"):
            total += table["Sqrt"]
        elif node.op_type != "Cast":
            total, reduced = total + table.get(node.op_type, table["Add"]), False
    return total


# --- working graphs -----------------------------------------------------------------------------


def working_graph(model: onnx.ModelProto, shapes: dict, name: str = "model", dtypes: dict | None = None) -> OnnxGraph:
    """A disposable working graph of `model` (node names must already be unique), with known shapes
    and dtypes (`model`'s tensors are shared, never written; it is the graph's structure as loaded)."""
    working = ir.from_proto(model)
    return OnnxGraph(working, model, shapes, dtypes or {}, name, body_holders(working.graph))


def norm_spec(norm: NormInfo) -> NormSpec:
    """The norm's exact formula, for computing its output from its input in NumPy."""
    match = norm.ref
    gamma = None if match.gamma is None else constant_values(match.gamma)
    beta = None if match.beta is None else constant_values(match.beta)
    return NormSpec(
        norm.norm_type is NormType.LAYER,
        norm.epsilon,
        None if gamma is None else np.asarray(gamma).reshape(-1),
        None if beta is None else np.asarray(beta).reshape(-1),
    )


def width_of(shapes: dict, norm: NormInfo) -> int | None:
    """The normalized width: γ's length (a γ of more than one value), else the input's static last dimension."""
    shape = shapes.get(norm.input)
    gamma = None if norm.ref.gamma is None else constant_values(norm.ref.gamma)
    if gamma is not None and np.asarray(gamma).size > 1:
        return int(np.asarray(gamma).shape[-1])
    return shape[-1] if shape and isinstance(shape[-1], int) else None


# --- where constants can go --------------------------------------------------------------------


def _only_read_by(tensor: ir.Value, nodes: list[ir.Node], graph_outputs: set[str]) -> bool:
    """Whether only `nodes` read the values of `tensor` (its `Shape` readers see no change of them)."""
    members = {id(n) for n in nodes}
    return tensor.name not in graph_outputs and all(id(c) in members for c in value_readers(tensor))


def shift_target(norm: NormInfo, width: int, graph_outputs: set[str]) -> tuple[ir.Node, int] | None:
    """Where the shift c of a surrogate can go exactly: a private bias of x, if x feeds only the norm."""
    match = norm.ref
    if not _only_read_by(match.x, match.nodes, graph_outputs):
        return None
    return private_bias(match.x, width, graph_outputs)


# --- emission -----------------------------------------------------------------------------------


class Emitter(Rewriter):
    """Rewrites one working graph (norms from its zero-mean graph); `docs` collects per-node notes."""

    def __init__(self, ctx: OnnxGraph, rms_op: str = "simplified", provider: str | None = None):
        super().__init__(ctx, build_zero_mean_graph(ctx), rms_op)
        self.provider = provider  # None: ORT's fusions are not priced
        self.graph = ctx.graph
        self.graph_outputs = self.zmg.graph_outputs
        self.norms = {norm.name: norm for norm in self.zmg.norms}
        self._checker = ShiftChecker(self.zmg)
        self._stream_inputs: dict[int, NormInfo] = {}  # id(x) → a norm emitted as a linear surrogate
        self._carried: dict[str, np.ndarray] = {}  # norm → the per-feature scale its input is divided by
        self._offsets: dict[str, np.ndarray] = {}  # norm → the biases its input lacks (taken off upstream)
        self._centred: set[Centring] = set()  # layers centred by `centre_inputs`

    def _const(self, base: str, values) -> ir.Value:
        return new_initializer(self.graph, self._unique(base), values)

    # exact preconditioning

    def centre_inputs(self, norm: NormInfo) -> list[str]:
        """Centre what the analysis finds summed into the norm's input (exact for a LayerNorm); returns
        the nodes rewritten, in graph order (for an absorbed LayerScale, the layer that took its scale)."""
        if not norm.removes_mean:
            return []
        done = set()
        for centring in safe_centrings(self.zmg, norm, self._checker):
            if centring not in self._centred:  # a layer centred for an earlier norm already is (idempotent)
                self.centre_layer(centring, [norm.name])
                self._centred.add(centring)
            done.update(self.rewritten_for(centring.node))
        return [node.name for node in self.graph if node.name in done]

    # surrogates

    def ort_fused_adds(self, norm: NormInfo) -> int:
        """The Adds ORT would run inside this norm's SkipLayerNormalization (`fuse.skip_fused_adds`);
        0 when no provider is priced."""
        nodes = norm.ref.nodes
        if self.provider is None or len(nodes) != 1 or nodes[0].op_type != "LayerNormalization":
            return 0
        return skip_fused_adds(norm.ref.x, self.ctx.shapes, self.graph_outputs)

    def emit_all(self, surrogates: list[tuple[str, Surrogate]]) -> dict[str, Emission]:
        """Emit surrogates (in topological order); a linear one's γ that stays is carried along the
        residual stream into the linear surrogates downstream where it can be (`core/stream.py`)."""
        self._stream_inputs = {id(self.norms[n].ref.x): self.norms[n] for n, s in surrogates if s.kind in STREAM_KINDS}
        emissions = {}
        for name, surrogate in surrogates:
            if name in self._carried:  # a scaled stream starts at a norm's output, an offset one runs through norms
                assert name not in self._offsets, f"{name}: its input is both scaled and offset"
                surrogate = on_scaled_input(surrogate, self._carried.pop(name))
            emissions[name] = self.emit(self.norms[name], surrogate)
        self._stream_inputs, self._carried, self._offsets = {}, {}, {}
        return emissions

    def _stream(self, surrogate: Surrogate, y: ir.Value, width: int, dtype) -> tuple[np.ndarray, StreamPlan] | None:
        """(γ, where it goes) if the surrogate's γ can be carried along the stream `y` starts (in `emit_all`)."""
        if not self._stream_inputs:
            return None
        scale = stream_scale(surrogate, width, scale_limit(np.dtype(dtype).name))
        plan = None if scale is None else stream_plan(self.ctx, self.graph_outputs, y, width, self._absorbs)
        if scale is None or plan is None or self._offsets.keys() & self._absorbers(plan):  # scaled or offset
            return None
        return scale, plan

    def _stream_bias(self, norm: NormInfo, width: int) -> tuple[tuple[ir.Node, int], StreamPlan] | None:
        """(the bias summed into the norm's input x, where it goes downstream) when x is read by more than
        the norm (in `emit_all`): every reader of the stream from x on is the norm, a linear surrogate's
        norm, an Add (whatever it adds, the sum lacks the bias too) or a linear layer with a bias."""
        if not self._stream_inputs:
            return None
        target = private_bias(norm.ref.x, width, self.graph_outputs)  # (`_remove_bias` checks its Add)
        if target is None:
            return None
        plan = stream_plan(self.ctx, self.graph_outputs, norm.ref.x, width, self._absorbs, writers=False)
        if plan is None or any(reader.bias_node is None for reader in plan.readers):
            return None
        if self._carried.keys() & self._absorbers(plan):  # an input is offset or scaled, never both
            return None
        return target, plan

    def _absorbers(self, plan: StreamPlan) -> list[str]:
        """The linear surrogates downstream whose inputs `plan`'s stream reaches."""
        return [self._stream_inputs[id(value)].name for value in plan.absorbed]

    def _carry_bias(self, norm: NormInfo, bias: np.ndarray, plan: StreamPlan) -> list[str]:
        """The stream from the norm's input on lacks `bias`: its linear readers and the linear surrogates
        downstream take it; returns what took it."""
        changed = move_affine(self.graph, plan.readers, None, bias, self._unique)
        for name in changed:
            self._note(name, f"absorbed the bias taken off the residual stream at {norm.name}")
        for value in plan.absorbed:
            downstream = self._stream_inputs[id(value)]
            if downstream is not norm:
                self._offsets[downstream.name] = self._offsets.get(downstream.name, 0.0) + bias
                changed.append(downstream.name)
        return changed

    def _absorbs(self, consumer: ir.Node, value: ir.Value) -> bool:
        norm = self._stream_inputs.get(id(value))
        return norm is not None and value is norm.ref.x and any(consumer is n for n in norm.ref.nodes)

    def _remove_bias(self, target: tuple[ir.Node, int]) -> tuple[np.ndarray, ir.Value] | None:
        """Remove the `Add(v, b)` that `target` (of `private_bias`) names, its readers reading v instead;
        returns (b's values, v), or None where the Add is not one of a run-time v and a constant b."""
        holder, index = target
        other = input_at(holder, 1 - index)
        values = constant_values(holder.inputs[index])
        if holder.op_type != "Add" or other is None or values is None or constant_values(other) is not None:
            return None
        holder.outputs[0].replace_all_uses_with(other)
        self.graph.remove(holder, safe=True)
        return values.astype(np.float64).reshape(-1), other

    def emit(self, norm: NormInfo, surrogate: Surrogate) -> Emission:
        """Replace `norm` by `surrogate` in the graph (see the module docstring)."""
        match = norm.ref
        width = width_of(self.ctx.shapes, norm)
        axis = norm.axis
        assert width is not None and axis is not None, f"{norm.name}: candidates have one axis of known width"
        dtype = self._dtype(match.x)
        emission = Emission(provider=self.provider)
        x, y = match.x, match.y
        # decide on the original wiring, before the norm's nodes go
        fused_adds = self.ort_fused_adds(norm)
        linear = surrogate.kind in STREAM_KINDS
        target = shift_target(norm, width, self.graph_outputs) if surrogate.has_shift or linear else None
        if linear:  # γ ⊙ (x − c) + β = γ ⊙ x' + β + γ ⊙ (b − c), x = x' + b: no Sub, and x's bias Add goes
            incoming = self._offsets.pop(norm.name, None)  # biases taken off the stream upstream
            along = self._stream_bias(norm, width) if target is None else None
            target = along[0] if along is not None else target
            removed = self._remove_bias(target) if target is not None else None
            bias = (0.0 if removed is None else removed[0]) + (0.0 if incoming is None else incoming)
            if removed is not None or surrogate.has_shift or incoming is not None:
                offset = bias - np.asarray(surrogate.shift, dtype=np.float64)
                surrogate = dataclasses.replace(surrogate, beta=surrogate.beta + surrogate.gamma * offset, shift=0.0)
            if removed is not None and target is not None:
                emission.shift = f"none: the bias of {name_of(target[0])} went into β"
                emission.changed.append(name_of(target[0]))
                if along is not None:
                    downstream = self._carry_bias(norm, removed[0], along[1])
                    emission.shift += f" and along the residual stream into {', '.join(downstream)}"
                fused_adds = max(fused_adds - 1, 0)  # that Add is gone
                x = removed[1] if target[0].outputs[0] is x else x
            target = None
        output = affine_plan(self.ctx, self.graph_outputs, y, width, needs_bias=True)
        doc = f"{surrogate.kind} surrogate for {norm.name} ({norm.op})"
        nodes: list[ir.Node] = []
        current = x

        def emitted(new: list[ir.Node]) -> ir.Value:
            """Append `new`; ops after a ReduceMean up to the division work on reduced tensors and
            are counted apart (they cost ~0)."""
            reduced = False
            for node in new:
                reduced = node.op_type == "ReduceMean" or (reduced and node.op_type in ("Add", "Sqrt"))
                emission.ops["Add(ε)" if reduced and node.op_type == "Add" else node.op_type] += 1
            nodes.extend(new)
            return new[-1].outputs[0]

        def add(op: str, inputs: list, label: str) -> ir.Value:
            out = new_value(self._unique, f"{norm.name}.{label}", dtype)
            return emitted([ir.node(op, inputs, outputs=[out], name=self._unique(f"{norm.name}.{label}"))])

        shift = np.asarray(surrogate.shift, dtype=np.float64)
        if surrogate.has_shift:
            if target is not None:
                holder, index = target
                self._replace_input(
                    holder,
                    index,
                    f"shifted:{norm.name}",
                    lambda b: (b.astype(np.float64) - shift).reshape(b.shape).astype(b.dtype),
                )
                self._note(name_of(holder), f"absorbed the calibrated shift of {norm.name}")
                emission.shift = f"migrated into {name_of(holder)}"
                emission.changed.append(name_of(holder))
            else:
                current = add("Sub", [current, self._const(f"{norm.name}.shift", shift.astype(dtype))], "shift")
                emission.shift = "Sub"

        gamma = np.asarray(surrogate.gamma, dtype=np.float64)
        beta = np.asarray(surrogate.beta, dtype=np.float64)
        keep_gamma = output.full is None and not np.all(gamma == 1)
        keep_beta = output.full is None and output.beta is None and np.any(beta != 0)
        carry = self._stream(surrogate, y, width, dtype) if keep_gamma else None  # on the original wiring
        kept_beta = beta
        if carry is not None:
            keep_gamma = False
            kept_beta = beta / carry[0]  # added to the stream, which is now divided by the scale
        if surrogate.kind == "rms":
            scale = gamma if keep_gamma else np.ones(width)
            unit = self.rms_op == "decomposed" and np.all(scale == 1)  # the chain needs no Mul by ones
            scale_const = None if unit else self._const(f"{norm.name}.rms_scale", scale.astype(dtype))
            out = new_value(self._unique, f"{norm.name}.rms", dtype)
            current = emitted(
                rms_nodes(
                    self.graph,
                    self._unique,
                    self.ctx.opset,
                    self.rms_op,
                    f"{norm.name}.rms",
                    current,
                    scale_const,
                    out,
                    axis,
                    float(surrogate.epsilon),
                    dtype,
                )
            )
            keep_gamma = False  # γ is the RMS op's scale
        elif surrogate.kind in ("dyt", "derf"):
            current = add(
                "Mul", [current, self._const(f"{norm.name}.alpha", np.array(surrogate.alpha, dtype=dtype))], "alpha"
            )
            op = "Tanh" if surrogate.kind == "dyt" else "Erf"
            current = add(op, [current], op.lower())
        if keep_gamma:  # NoMorelization's α·x: one scalar
            factor = np.array(surrogate.alpha) if surrogate.kind == "scalebias" else gamma
            current = add("Mul", [current, self._const(f"{norm.name}.gamma", factor.astype(dtype))], "gamma")
        if keep_beta:
            current = add("Add", [current, self._const(f"{norm.name}.beta", kept_beta.astype(dtype))], "beta")

        moved_to = []
        if output.full is not None:
            moved_to = move_affine(
                self.graph,
                output.full,
                None if np.all(gamma == 1) else gamma,
                beta if np.any(beta != 0) else None,
                self._unique,
            )
            emission.gamma = emission.beta = "migrated into " + ", ".join(moved_to)
            emission.changed += moved_to
        else:
            emission.gamma = (
                ("in the RMS op's scale" if surrogate.kind == "rms" else "Mul") if not np.all(gamma == 1) else "none"
            )
            if output.beta is not None and np.any(beta != 0):
                moved_to = move_affine(self.graph, output.beta, None, beta, self._unique)
                emission.beta = "migrated into " + ", ".join(moved_to)
                emission.changed += moved_to
            else:
                emission.beta = "Add" if keep_beta else "none"
        for name in moved_to:
            self._note(name, f"absorbed {'γ/β' if output.full is not None else 'β'} of the {norm.name} surrogate")
        if carry is not None:  # the stream's weights change after β has moved into them
            scale, stream = carry
            changed = move_affine(self.graph, stream.readers, scale, None, self._unique)
            changed += scale_writers(self.graph, stream.writers, 1.0 / scale, self._unique)
            absorbers = self._absorbers(stream)
            for absorber in absorbers:
                self._carried[absorber] = scale
            for name in changed:
                self._note(name, f"absorbed γ of the {norm.name} surrogate, carried along the residual stream")
            emission.gamma = f"carried along the residual stream into {', '.join(changed + absorbers)}"
            emission.changed += changed

        refused = surrogate.kind == "rms" and self.rms_op == "simplified" and emission.shift != "Sub"
        if fused_adds and refused and dtype == np.float32:  # export_model(fuse_skip=True) fuses them again
            del emission.ops["SimplifiedLayerNormalization"]
            emission.ops["SkipSimplifiedLayerNormalization"] += 1
        elif fused_adds:
            emission.ops["Add"] += fused_adds  # they ran inside ORT's SkipLayerNormalization
            emission.unfused_adds = fused_adds

        # the last emitted op's output takes y's place; with nothing emitted, y's readers read x
        if not nodes and y.name in self.graph_outputs:
            current = add("Identity", [current], "identity")  # an identity surrogate on a graph output
        for node in nodes:
            self._note(name_of(node), doc)
        if nodes:  # where the norm was: the graph stays topologically sorted
            self.graph.insert_before(match.nodes[0], nodes)
            take_over(y, current)
        else:
            y.replace_all_uses_with(current)
        self.graph.remove(match.nodes, safe=True)
        for other in self.norms.values():  # a norm reading this one's output reads what replaced it
            if other.ref.x is y:
                other.ref.x = current
        return emission


# --- models -------------------------------------------------------------------------------------


def light_model(
    ctx: OnnxGraph,
    source: onnx.ModelProto,
    extra_outputs: dict[str, np.dtype] | None = None,
    cache: dict[str, np.ndarray] | None = None,
    limit: int = LIGHT_LIMIT,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The working graph as a model whose large constants are inputs; returns (model, their values).

    Consumes the working graph. `extra_outputs` (tensor name → dtype) become graph outputs;
    `cache` holds the values of untouched source initializers (by name, which a rewritten constant
    never keeps) so they are converted once.
    """
    RemoveUnusedNodesPass()(ctx.model)  # emitted nodes stand where their norms stood: still sorted
    graph = ctx.graph
    feeds: dict[str, np.ndarray] = {}
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or tensor.size <= limit or value.is_graph_input():
            continue
        untouched = isinstance(tensor, ir.TensorProtoTensor)  # as loaded from `source`, not computed by a rewrite
        if cache is not None and untouched and name in cache:
            values = cache[name]
        else:
            values = np.ascontiguousarray(tensor.numpy())
            if cache is not None and untouched:
                cache[name] = values
        feeds[name] = values
        graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)
    if extra_outputs:
        by_name = {v.name: v for v in graph_values(graph)}
        for name, dtype in extra_outputs.items():
            value = by_name[name]
            if value.type is None:
                value.type = ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype)))
            if value not in graph.outputs:
                graph.outputs.append(value)
    model = ir.to_proto(ctx.model)
    model.ir_version = source.ir_version
    del model.opset_import[:]
    model.opset_import.extend(source.opset_import)
    return model, feeds


def export_model(
    ctx: OnnxGraph, source: onnx.ModelProto, docs: dict[str, str], properties: dict[str, str], fuse_skip: bool = False
) -> onnx.ModelProto:
    """The final model: every weight inside, `source`'s opsets and metadata plus `properties`.

    `fuse_skip`: residual Adds before `SimplifiedLayerNormalization`s fused into ORT's
    `SkipSimplifiedLayerNormalization` (`fuse.fuse_skip_rms`), which ORT's own optimizer does not
    do: an rms surrogate then keeps the fusion the LayerNorm it replaces had.
    """
    RemoveUnusedNodesPass()(ctx.model)
    if fuse_skip:
        fuse_skip_rms(ctx.model, ctx.shapes)
    ctx.graph.sort()
    return in_memory_proto(annotate(ctx.model, docs, properties))
