"""Recovery after slicing: a layer-wise least-squares refit of the linear layers the cut changed (ONNX, no torch).

SliceGPT's sliced reader Q_kᵀ·W is the best k-column reader only if its input were exactly x·Q_k; after the
cut it is not — every layer upstream lost what its dropped columns carried. Recovery refits each linear
layer the cut changed (a `MatMul` or `Gemm` with a constant 2-D weight whose shape the cut changed: the
stream's readers — QKV, fc1, a head — its writers — attention output, fc2 — and `--basis layer`'s shortcuts)
so that, on the calibration fitting split, its output on the *sliced* model's actual input matches what
the *unsliced* model computes there (`core/refit.py`: ridge least squares towards the cut's weights, biases
included, streamed normal equations in float64, λ chosen per layer by two-fold validation on the
calibration data itself, the cut kept where it validates best):

* **The target** is read from the same cut at full width, k = d: the folded model rotated into the same
  principal bases, exact (what slicing verifies at R = 0), with the same layers by name. A reader's
  target is that model's output of the layer; a writer's is its first k output columns, the original
  write projected onto the kept basis, Y·Q_k.
* **Sequential, in topological order.** Layer l's input X̃ is taken on the sliced model whose earlier
  layers are already refit, so each layer corrects what the ones before it left. Layers that do not
  depend on one another (a block's Q, K and V) are refit from one run; each group costs one run of the
  sliced model and one of the reference over the fitting batches, each truncated to what the group reads.
* **A time limit** (`seconds`): groups are refit in order until it is spent, then recovery stops and says
  how many layers it refit; the model is valid at every step. Across `torch.distributed` processes the
  normal equations and the elapsed time are summed, so every process refits the same layers alike.

A refit weight is a new initializer of that layer alone (a weight the cut shared between two uses, such as
a tied LM head, is shared no more). Layers of other kinds that the cut changed (a `Conv` patch embedding,
an embedding table) keep the cut's weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ...calibration import Batch
from ...core.budget import Metrics
from ...core.pca import summed_over_processes
from ...core.progress import stage
from ...core.refit import NormalEquations, combine
from ...core.stats import token_rows
from ...io import in_memory_proto
from ..calibrate import Runner
from ..fold.targets import new_initializer
from ..graph.values import attr, input_at, is_initializer


@dataclass(frozen=True)
class Linear:
    """A layer y = x·W (+ b) of a graph: its node, its weight (read [inputs, outputs]) and bias, its output."""

    node: ir.Node
    transposed: bool  # a Gemm with transB: its weight is stored [outputs, inputs]
    bias: tuple[ir.Node, int] | None  # (node, input) holding b: a Gemm's C or the constant of an Add after it
    output: ir.Value  # after the bias

    @property
    def name(self) -> str:
        return self.node.name or ""

    @property
    def input(self) -> ir.Value:
        value = self.node.inputs[0]
        assert value is not None  # `linear_layers` takes nodes with a data input
        return value

    def weight(self) -> np.ndarray:
        const = self.node.inputs[1].const_value  # type: ignore[union-attr]  # an initializer (`linear_layers`)
        assert const is not None
        values = const.numpy()
        return values.T if self.transposed else values

    def bias_values(self) -> np.ndarray | None:
        if self.bias is None:
            return None
        node, index = self.bias
        const = node.inputs[index].const_value  # type: ignore[union-attr]
        assert const is not None
        return np.ravel(const.numpy())


def linear_layers(model: ir.Model) -> dict[str, Linear]:
    """Every `MatMul` (x·W) and plain `Gemm` (transA 0, α = β = 1) of `model` with a 2-D initializer as weight
    and a run-time input, by node name; its bias: a Gemm's constant C, or a constant of the layer's width
    added by the output's only consumer."""
    found = {}
    for node in model.graph:
        data, weight = input_at(node, 0), input_at(node, 1)
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx") or not node.name:
            continue
        const = weight.const_value if weight is not None and is_initializer(weight) else None
        if data is None or is_initializer(data) or const is None or len(const.shape) != 2:
            continue
        transposed = node.op_type == "Gemm" and bool(attr(node, "transB", 0))
        width = const.numpy().shape[0 if transposed else 1]
        if node.op_type == "Gemm" and not _plain_gemm(node, width):
            continue
        bias, output = _bias(node, width)
        found[node.name] = Linear(node, transposed, bias, output)
    return found


def _bias(node: ir.Node, width: int) -> tuple[tuple[ir.Node, int] | None, ir.Value]:
    """(where the bias of the linear `node` is, the layer's output after it) (`linear_layers`)."""
    out = node.outputs[0]
    if node.op_type == "Gemm":
        c = input_at(node, 2)
        return ((node, 2) if c is not None and _is_bias(c, width) else None), out
    uses = list(out.uses())
    if len(uses) == 1 and not out.is_graph_output() and uses[0].node.op_type == "Add":
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        if other is not None and _is_bias(other, width):
            return (add, 1 - uses[0].idx), add.outputs[0]
    return None, out


def _plain_gemm(node: ir.Node, width: int) -> bool:
    """A Gemm computing x·W (+ b): no transposed input, α = β = 1, and C absent or one value per output."""
    c = input_at(node, 2)
    plain = not attr(node, "transA", 0) and attr(node, "alpha", 1.0) == 1 and attr(node, "beta", 1.0) == 1
    return plain and (c is None or _is_bias(c, width))


def _is_bias(value: ir.Value, width: int) -> bool:
    const = value.const_value if is_initializer(value) else None
    return const is not None and const.size == width and (not const.shape or const.shape[-1] == width)


@dataclass
class Recovery:
    """What recovery did: the layers it refit (in order) of those the cut changed, in how long, on how
    many calibration tokens; and the held-out figures before and after it."""

    limit_s: float
    ridge: float | None  # a fixed λ (`core/refit.py`), or None: chosen per layer
    layers: list[str]  # the linear layers the cut changed, in topological order
    refit: list[str] = field(default_factory=list)
    ridges: dict[str, float | None] = field(default_factory=dict)  # per layer refit, its λ; None: the cut kept
    seconds: float = 0.0
    tokens: int = 0  # calibration tokens (rows) each refit layer was fitted on
    held_out_before: Metrics | None = None
    held_out_after: Metrics | None = None

    @property
    def complete(self) -> bool:
        return len(self.refit) == len(self.layers)

    @property
    def kept(self) -> int:
        """Layers visited whose cut weights validated better than any refit."""
        return sum(r is None for r in self.ridges.values())

    def describe(self) -> str:
        stop = "" if self.complete else f", stopped by the time limit of {self.limit_s:g} s"
        kept = f" ({self.kept} kept as cut: it validated best)" if self.kept else ""
        return (
            f"recovery refit {len(self.refit)} of {len(self.layers)} linear layers{kept} in {self.seconds:.1f} s{stop}"
        )

    def to_json(self) -> dict:
        return {
            "limit_s": self.limit_s,
            "ridge": self.ridge,
            "layers": len(self.layers),
            "refit": len(self.refit),
            "refit_layers": list(self.refit),
            "kept_as_cut": self.kept,
            "ridges": dict(self.ridges),
            "complete": self.complete,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "held_out_before": None if self.held_out_before is None else self.held_out_before.to_json(),
            "held_out_after": None if self.held_out_after is None else self.held_out_after.to_json(),
        }


def recover(
    sliced: ir.Model,
    reference: ir.Model,
    batches: list[Batch],
    mask_input: str | None,
    seconds: float,
    ridge: float | None,
) -> Recovery:
    """Refit, in place, the linear layers of `sliced` whose weights' shapes differ from `reference`'s (the
    same cut at full width), group by group in topological order, until `seconds` are spent (the module
    docstring)."""
    start = time.perf_counter()
    ours, theirs = linear_layers(sliced), linear_layers(reference)
    changed = [
        name for name, layer in ours.items() if name in theirs and layer.weight().shape != theirs[name].weight().shape
    ]
    groups = _independent_groups(sliced, set(changed))
    recovery = Recovery(seconds, ridge, [name for group in groups for name in group])
    for group in groups:
        elapsed, processes = summed_over_processes(np.array([time.perf_counter() - start, 1.0]))
        if elapsed / processes >= seconds:
            break
        stage(
            f"recovery: refitting {', '.join(group)} ({len(recovery.refit) + len(group)} of "
            f"{len(recovery.layers)} layers, {time.perf_counter() - start:.0f} of {seconds:g} s)"
        )
        layers = [ours[name] for name in group]
        equations = _equations(layers, [theirs[name] for name in group], sliced, reference, batches, mask_input)
        combine(equations)
        for layer, eq in zip(layers, equations, strict=True):
            if ridge is None:
                weight, bias, chosen = eq.refit(layer.weight(), layer.bias_values())
            else:
                (weight, bias), chosen = eq.solve(layer.weight(), layer.bias_values(), ridge), ridge
            recovery.ridges[layer.name] = chosen
            if chosen is not None:
                _write(sliced.graph, layer, weight, bias)
        recovery.refit += group
        recovery.tokens = equations[0].rows
    RemoveUnusedNodesPass()(sliced)
    recovery.seconds = time.perf_counter() - start
    return recovery


def _independent_groups(model: ir.Model, layers: set[str]) -> list[list[str]]:
    """`layers` in the topological order of `model`, in runs of layers none of which reads another's output."""
    groups: list[list[str]] = [[]]
    tainted: set[int] = set()  # ids of the values computed from the current group's layers
    for node in model.graph:
        reads_group = any(v is not None and id(v) in tainted for v in node.inputs)
        if node.name in layers:
            if reads_group:
                groups.append([])
                tainted = set()
            groups[-1].append(node.name)
        if node.name in layers or reads_group:
            tainted |= {id(v) for v in node.outputs}
    return [g for g in groups if g]


def _equations(
    layers: list[Linear],
    targets: list[Linear],
    sliced: ir.Model,
    reference: ir.Model,
    batches: list[Batch],
    mask_input: str | None,
) -> list[NormalEquations]:
    """Each layer's normal equations: its input on `sliced`, the output of its twin on `reference` (the
    first columns, as many as the layer writes), token by token (padding excluded), one batch at a time;
    the batches alternate between the two folds (the halves of its rows where there is one batch)."""
    equations = [
        NormalEquations(w.shape[0], w.shape[1], layer.bias is not None)
        for layer, w in ((x, x.weight()) for x in layers)
    ]
    inputs = _values(sliced, [layer.input for layer in layers], batches)
    outputs = _values(reference, [layer.output for layer in targets], batches)
    for index, (batch, got, wanted) in enumerate(zip(batches, inputs, outputs, strict=True)):
        mask = batch.get(mask_input) if mask_input else None
        for eq, x, y in zip(equations, got, wanted, strict=True):
            rows, target = token_rows(x, mask), token_rows(y, mask)[:, : eq.outputs]
            if len(batches) > 1:
                eq.add(rows, target, index % 2)
                continue
            half = len(rows) // 2
            eq.add(rows[:half], target[:half], 0)
            eq.add(rows[half:], target[half:], 1)
    return equations


def _values(model: ir.Model, values: list[ir.Value], batches: list[Batch]) -> Iterator[list[np.ndarray]]:
    """`values` of `model` on each batch: ONNX Runtime on a copy whose outputs are those values alone (the
    nodes nothing of them needs are dropped)."""
    names = [v.name or "" for v in values]
    copy = ir.from_proto(in_memory_proto(model))
    by_name = {v.name: v for node in copy.graph for v in node.outputs} | {v.name: v for v in copy.graph.inputs}
    copy.graph.outputs.clear()
    for name in dict.fromkeys(names):
        copy.graph.outputs.append(by_name[name])
    RemoveUnusedNodesPass()(copy)
    runner = Runner(in_memory_proto(copy))
    for batch in batches:
        found = runner.run(batch)
        yield [found[name] for name in names]


def _write(graph: ir.Graph, layer: Linear, weight: np.ndarray, bias: np.ndarray | None) -> None:
    """Give `layer` its refit weight and bias, as new initializers of its own."""
    old = layer.node.inputs[1]
    assert old is not None and old.const_value is not None
    dtype = old.const_value.numpy().dtype
    values = (weight.T if layer.transposed else weight).astype(dtype)
    layer.node.replace_input_with(1, new_initializer(graph, _fresh(graph, f"{layer.name}.refit"), values))
    if layer.bias is not None and bias is not None:
        node, index = layer.bias
        held = node.inputs[index]
        assert held is not None and held.const_value is not None
        shape = held.const_value.shape
        refit = bias.reshape(tuple(shape) if shape else (-1,)).astype(held.const_value.numpy().dtype)
        node.replace_input_with(index, new_initializer(graph, _fresh(graph, f"{layer.name}.refit_bias"), refit))


def _fresh(graph: ir.Graph, name: str) -> str:
    """`name`, or `name.N` where that is taken."""
    taken = graph.initializers
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}.{n}", n + 1
    return candidate
