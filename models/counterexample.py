"""Counter-examples for the norms a proof leaves: what each refused fold does when it is taken anyway.

A LayerNorm N over axis k folds exactly into an RMSNorm iff its input x is zero-mean along k:
LN(x) = RMS(x − mean_k(x)), which is RMS(x) only where mean_k(x) = 0. The proof makes x zero-mean by
centring the linear layers that write it (W' = W − mean_k(W), b' = b − mean_k(b)); each centring
shifts its layer's output by a per-row constant c·1ₖ, which every reader must remove. The proof
refuses N when some part of x is not the output of a layer it can centre (x̂·γ+β of another norm, a
grouped conv, a Gelu, …) or when a centring's shift reaches a reader that does not remove it.

The **forced fold** of a refused N (`forced_folds`) does what a proven fold would do regardless, on
top of the plan's own folds: it centres every layer the proof reached for N (safe or not,
`analysis.Prover`) besides the centrings and insertions of the norms the plan folds, replaces N by
the RMS op, and runs the result beside the original in ONNX Runtime (`reference.run_unoptimized`:
no normpass code in the run), on the example inputs. Two figures:

* **input |mean|/rms**: the largest |mean_k(x')| / rms_k(x') over the rows of N's input x' in the
  forced model: the mean that neither the plan nor centring the layers N's proof reaches removes;
* **output change**: the largest |y' − y| over the model's outputs, relative to the largest |y|.

An output change far above fp32 rounding shows that no fold of that form is exact there; one at
rounding level (below `ROUNDING`) means the refusal is over-cautious on this model.

**Exact by insertion.** Where an explicit t − mean_k(t) inserted on tensors of N's walk makes x
zero-mean exactly (`analysis.Cutter`), the fold with those insertions is measured too
(`insertion_change`). The planner takes an insertion only where it enables at least
`MIN_FOLDS_PER_INSERTION` folds: one insertion (a ReduceMean and a Sub) costs what the mean N
computes itself costs, so a fold bought with one insertion per norm (post-LN) saves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from normpass.core.analysis import Cutter, FirstUnsafe, Prover, ShiftChecker, State
from normpass.core.graph import NormType
from normpass.core.plan import FoldPlan, Insertion, NormDecision
from normpass.io import in_memory_proto
from normpass.onnx.fold.rewrite import Rewriter
from normpass.onnx.graph.export import export_model
from normpass.onnx.graph.frontend import build_zero_mean_graph, open_graph

from .reference import run_unoptimized

ROUNDING = 1e-5  # fp32: a figure below this is rounding, not a counter-example


@dataclass(frozen=True)
class ForcedFold:
    """What the refused fold of one norm does when taken (see the module docstring)."""

    norm: str
    input_mean: float  # largest |mean_k| / rms_k over the rows of the norm's input, after the centrings
    output_change: float  # largest |Δy| / max|y| over the model's outputs
    insertion_change: float | None  # the same with the Cutter's insertions; None where none makes it exact


def forced_folds(model: onnx.ModelProto, plan: FoldPlan, feeds: dict[str, np.ndarray]) -> list[ForcedFold]:
    """The forced fold of each LayerNorm that `plan` (`inspect_onnx(model)`) declines."""
    zmg = build_zero_mean_graph(open_graph(model))
    prover, checker = Prover(zmg), ShiftChecker(zmg)
    cutter = Cutter(FirstUnsafe(prover, checker))
    expected = run_unoptimized(model, feeds)
    found = []
    for decision in plan.decisions:
        norm = zmg.norm_by_name(decision.name)
        if decision.foldable or norm.norm_type is not NormType.LAYER or norm.axis is None or norm.unsupported:
            continue  # no fold of this form to take: an RMSNorm or a GroupNorm, a norm over several axes
        if zmg.is_constant(norm.input):
            continue  # a norm of a constant: nothing to centre
        forced = NormDecision(norm.name, norm.op, True, None, centrings=prover.prove(norm).centrings)
        output_change, x = _forced(model, [*plan.folded, forced], expected, feeds, probe=norm.input)
        cut = cutter.cut(State(norm.input, norm.axis))
        insertion_change = None
        if cut is not None:
            insertions = [Insertion(state.tensor, state.axis) for state in sorted(cut[0])]
            inserted = NormDecision(norm.name, norm.op, True, None, list(cut[1]), insertions)
            insertion_change, _ = _forced(model, [*plan.folded, inserted], expected, feeds)
        mean, rms = x.mean(axis=norm.axis), np.sqrt((x * x).mean(axis=norm.axis))
        input_mean = float((np.abs(mean) / np.maximum(rms, 1e-30)).max())
        found.append(ForcedFold(norm.name, input_mean, output_change, insertion_change))
    return found


def _forced(
    model: onnx.ModelProto, decisions: list[NormDecision], expected: dict, feeds: dict, probe: str | None = None
):
    """The output change of `model` rewritten as if `decisions` were proven, and the tensor `probe` of that model."""
    ctx = open_graph(model)
    zmg = build_zero_mean_graph(ctx)
    Rewriter(ctx, zmg).apply(FoldPlan(decisions), migrate=False)
    forced = export_model(ctx.model, {}, {})
    if probe is not None:
        forced.graph.outputs.append(_value(forced, probe))
    got = run_unoptimized(in_memory_proto(forced), feeds)
    read = got.pop(probe).astype(np.float64) if probe is not None else None
    change = max(
        float(np.abs(got[name].astype(np.float64) - ref.astype(np.float64)).max())
        / max(float(np.abs(ref).max()), 1e-30)
        for name, ref in expected.items()
    )
    return change, read


def _value(model: ir.Model, name: str) -> ir.Value:
    """The value `name` of `model`'s graph (a node's output or a graph input), to read as an extra output."""
    produced = (v for node in model.graph for v in node.outputs)
    return next(v for v in (*model.graph.inputs, *produced) if v.name == name)
