"""The exact fold pass for ONNX models: build → plan → apply → verify.

`inspect_onnx` stops after planning (what can be proven); `fold_onnx` returns a new model (the
input is never modified; a path is read lazily, its external weights memory-mapped) and
refuses, with `VerificationError`, a rewrite that changes the model's inputs or outputs
(checked even without verification), or whose outputs differ from the
original's beyond the dtype's tolerance on any verification run (`verify`: both values of
boolean inputs, a second size for dynamic dims); and, with `WeightOverflowError`, verified or
not, one whose new weights overflow their dtype (`targets.refuse_overflow`: an fp16 weight whose
centred values become ±inf), where they are computed: a large weight when the model is written.

What `fold_onnx` emits depends on where the model will run (`FoldOptions.target`, `provider`):

* target "ort" (ONNX Runtime, default): `SimplifiedLayerNormalization`, and a residual Add fused
  into `com.microsoft.SkipSimplifiedLayerNormalization`, except for fp16 models on the CPU
  provider, whose fp16 Skip kernel is slower than the unfused pair (docs/BENCHMARKS.md); a
  flattened `Reshape → Gemm → Reshape` (HF Conv1D) reading an RMS op becomes `MatMul → Add`, as
  ORT's transformers optimizer does after a LayerNorm but not after an RMS op (`matmul.py`);
* target "onnx": standard ops only (opset-23 `RMSNormalization`, or the decomposed chain).

A proven fold whose non-zero β could move nowhere would leave RMSNorm + a separate `Add`, which
costs more than the LayerNorm it replaces (DESIGN §1, docs/BENCHMARKS.md); such norms stay
LayerNorms, reported as kept, unless `fold_with_beta_add` is set. One exception, for ORT's CPU
provider: a LayerNorm that ORT would fuse with the residual `Add` before it runs in ORT's CPU
`SkipLayerNormalization` kernel, 2.2–4.6× slower than the pair; the RMS op plus `Add` beats it,
so there it is folded.

The result (`FoldResult`) holds the folded `ir.Model` (`ir_model`): `save(path)` writes it, the
weights streamed tensor by tensor; `model` is it as a `ModelProto` with every weight in memory,
made on first use, for in-memory callers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np
import onnx
import onnx_ir as ir

from ... import __version__
from ...core.analysis import plan as make_plan
from ...core.graph import ZeroMeanGraph
from ...core.plan import FoldPlan
from ...errors import InputError, UnsupportedModelError
from ...io import checked_model, in_memory_proto, interface, save_onnx_atomic
from ..graph.export import export_model
from ..graph.frontend import OnnxGraph, build_zero_mean_graph, load_graph, open_graph
from ..graphsurgeon import from_graphsurgeon, to_graphsurgeon
from ..runtime.ortopt import OrtOptimizer, optimize, ordering_note
from ..runtime.verify import Comparison, Model, check_input_shapes, checked
from .fuse import fuse_skip_rms, ort_fuses_into_skip_layer_norm
from .matmul import gemms_to_matmuls
from .rewrite import RMS_OPS, Rewriter

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs

# What fold_onnx and inspect_onnx take: a ModelProto, an .onnx path, or an onnx-graphsurgeon Graph.
ModelSource = Union[onnx.ModelProto, str, os.PathLike, "gs.Graph"]

RMS_OPSET = 23  # RMSNormalization
RMS_IR_VERSION = 11  # the IR version that goes with opset 23; ONNX Runtime 1.31 accepts ≤ 13


TARGETS = ("ort", "onnx")
PROVIDERS = ("cuda", "cpu")


@dataclass
class FoldOptions:
    target: str = "ort"  # "ort": ONNX Runtime, contrib ops allowed; "onnx": standard ops only
    provider: str = "cuda"  # with target "ort": the execution provider the model is for
    rms_op: str | None = None  # None: "simplified" for target "ort", "onnx" for target "onnx"
    insert_centering: bool = True
    migrate_affine: bool = True
    fold_with_beta_add: bool = False  # also fold norms whose β would stay a separate Add
    fuse_skip: bool | None = None  # Add + RMS → SkipSimplifiedLayerNormalization; None: per target, provider, dtype
    verify: bool = True
    input_shapes: dict = field(default_factory=dict)
    seed: int = 0
    # With target "ort": run ORT's transformers optimizer first and fold its output (`ortopt.py`), verified
    # against the model as given.
    ort_optimizer: OrtOptimizer | None = None

    def emission(self) -> tuple[str, bool | None]:
        """The RMS op and the skip-fusion choice (None: decided per dtype), after checking the options."""
        if self.ort_optimizer is not None and self.target != "ort":
            raise InputError("the ORT optimizer option is for the target ort; the target onnx emits standard ops only")
        if self.ort_optimizer is not None:
            self.ort_optimizer.checked()
        if self.target not in TARGETS:
            raise InputError(f"target {self.target!r}: choose one of {', '.join(TARGETS)}")
        if self.provider not in PROVIDERS:
            raise InputError(f"provider {self.provider!r}: choose one of {', '.join(PROVIDERS)}")
        rms_op = self.rms_op or ("simplified" if self.target == "ort" else "onnx")
        if rms_op not in RMS_OPS:
            raise InputError(f"rms_op {rms_op!r}: choose one of {', '.join(RMS_OPS)}")
        if self.target == "onnx" and (rms_op == "simplified" or self.fuse_skip):
            raise InputError(
                "target onnx emits standard ops only: SimplifiedLayerNormalization and its Skip fusion are "
                "ONNX Runtime contrib ops; choose the rms_op onnx or decomposed, or the target ort"
            )
        fuse_skip = False if rms_op != "simplified" or self.target == "onnx" else self.fuse_skip
        return rms_op, fuse_skip


@dataclass
class FoldResult:
    """A fold's outcome. `ir_model` is the folded model (its unchanged weights still the tensors they
    were loaded as: memory-mapped external data for a model loaded from a file, also where the file holds
    its weights inside it: write it with `save`, or with `ir.save` after `io.unmapped`); `save(path)` writes
    it atomically, streaming the weights, and `model` is it as a `ModelProto` with every weight in
    memory, made on first use (for in-memory callers and small models)."""

    ir_model: ir.Model
    plan: FoldPlan
    comparison: Comparison | None
    affine_notes: dict[str, str]
    seconds: dict[str, float]
    modified: bool = True  # whether the folded model differs from the input (see FoldPass)
    emitted: dict = field(default_factory=dict)  # target, provider, RMS op, number of skip fusions, …
    notes: list[str] = field(default_factory=list)  # what the user should know about the result
    shapes: dict = field(default_factory=dict, repr=False)  # the original's inferred shapes, by tensor name
    _proto: onnx.ModelProto | None = field(default=None, repr=False)

    @property
    def model(self) -> onnx.ModelProto:
        if self._proto is None:
            self._proto = in_memory_proto(self.ir_model)
        return self._proto

    def graphsurgeon(self) -> gs.Graph:
        """The folded model as an onnx-graphsurgeon `Graph` (the `graphsurgeon` extra), made from `model`."""
        return to_graphsurgeon(self.model)

    def save(self, path: str | os.PathLike) -> None:
        """Write the folded model to `path` atomically (its weights in `path.data` where `io.save_ir` puts them);
        a large changed weight is computed now, and refused here if it overflows (`WeightOverflowError`:
        nothing is written)."""
        save_onnx_atomic(self.ir_model, path)

    @property
    def folded(self) -> int:
        return len(self.plan.folded)

    def report(self) -> dict:
        report = fold_report(self.plan, self.comparison, self.affine_notes, self.seconds)
        report["input_shapes"] = {} if self.comparison is None else self.comparison.input_shapes
        return report | self.emitted | {"notes": self.notes}


def fold_report(plan: FoldPlan, comparison, affine_notes: dict[str, str], seconds: dict[str, float]) -> dict:
    """The report both front ends write: counts, errors per output, and every norm's decision."""
    decisions = plan.to_json()["norms"]
    for decision in decisions:
        decision["affine"] = affine_notes.get(decision["name"])
    return {
        "normpass_version": __version__,
        "folded": len(plan.folded),
        "total": plan.total,
        "max_abs_error": None if comparison is None else comparison.max_abs_error,
        "max_rel_error": None if comparison is None else comparison.max_rel_error,
        "verified": comparison is not None,
        "verification_runs": [] if comparison is None else [vars(r) for r in comparison.runs],
        "outputs": [] if comparison is None else [vars(o) | {"passed": o.passed} for o in comparison.outputs],
        "norms": decisions,
        "seconds": seconds,
    }


def _to_rms_opset(ctx: OnnxGraph) -> OnnxGraph:
    """The graph at opset 23 (for RMSNormalization), at an IR version ONNX Runtime accepts.

    ONNX's version converter works on a whole ModelProto: the weights are read into memory here.
    """
    from onnx import version_converter

    if ctx.opset >= RMS_OPSET:
        return ctx
    try:
        converted = version_converter.convert_version(in_memory_proto(ctx.model), RMS_OPSET)
    except Exception as e:
        raise UnsupportedModelError(
            f"cannot convert the model from opset {ctx.opset} to {RMS_OPSET} for RMSNormalization ({e}); "
            "choose the rms_op simplified or decomposed"
        ) from e
    converted.ir_version = max(ctx.model.ir_version, RMS_IR_VERSION)
    return load_graph(converted, ctx.name, ctx.source)


def inspect_onnx(model: ModelSource, insert_centering: bool = True, name: str = "model") -> FoldPlan:
    """Which norms of `model` (a ModelProto, an .onnx path or an onnx-graphsurgeon Graph) fold exactly, and why
    the others do not."""
    return make_plan(build_zero_mean_graph(open_graph(from_graphsurgeon(model), name)), insert_centering)


def fold_decisions(
    model: onnx.ModelProto | str | os.PathLike, options: FoldOptions | None = None, name: str = "model"
) -> tuple[ZeroMeanGraph, FoldPlan]:
    """The zero-mean graph of `model` and what `fold_onnx(model, options)` folds and keeps, and why, without
    rewriting: `inspect_onnx`'s proof less the proven norms the fold keeps (a β that would stay an Add).
    What `normpass inspect` and `normpass viz` show, so that they say what `normpass fold` does."""
    options = options or FoldOptions()
    rms_op, _ = options.emission()
    ctx = open_graph(model, name)
    zmg = build_zero_mean_graph(ctx)
    return zmg, _decide(ctx, zmg, Rewriter(ctx, zmg, rms_op), options)


def _decide(ctx: OnnxGraph, zmg: ZeroMeanGraph, rewriter: Rewriter, options: FoldOptions) -> FoldPlan:
    """The proven norms, less those whose β could move nowhere (see the module docstring) unless `options`
    fold them anyway."""
    fold_plan = make_plan(zmg, options.insert_centering)
    if not options.migrate_affine or options.fold_with_beta_add:
        return fold_plan
    stranded = rewriter.stranded_beta(fold_plan)
    if options.target == "ort" and options.provider == "cpu":
        stranded = {
            name: why
            for name, why in stranded.items()
            if not ort_fuses_into_skip_layer_norm(zmg.norm_by_name(name).ref.x, ctx.shapes, zmg.graph_outputs)
        }
    return make_plan(zmg, options.insert_centering, keep=stranded) if stranded else fold_plan


def fold_onnx(model: ModelSource, options: FoldOptions | None = None, name: str = "model") -> FoldResult:
    """Fold every provable LayerNorm of `model` into an RMSNorm; verify unless told not to.

    `model`: a ModelProto (not modified), the path of an .onnx file (read lazily) or an
    onnx-graphsurgeon `Graph` (exported to a ModelProto first; `FoldResult.graphsurgeon()` gives
    the result back as one). The same fold as `FoldPass`, which runs on an `ir.Model`.
    """
    options = options or FoldOptions()
    options.emission()  # bad options are refused before the model is read
    model = from_graphsurgeon(model)
    if options.ort_optimizer is None:
        ctx = open_graph(model, name)
        return _fold(ctx, ctx.source or model, options, name)
    original = Path(model) if isinstance(model, (str, os.PathLike)) else model
    start = time.perf_counter()
    optimized, fused = optimize(checked_model(model, name), options.ort_optimizer)
    seconds = time.perf_counter() - start
    result = _fold(load_graph(optimized, name), original, options, name, optimized=True)
    result.seconds["ort_optimizer"] = seconds
    result.emitted["ort_optimizer"] = options.ort_optimizer.report(optimized, fused)
    return result


class FoldPass(ir.passes.FunctionalPass):
    """The exact fold as an onnx-ir pass, for `ir.passes.PassManager` pipelines (beside onnx-ir's and
    onnxscript's passes): `FoldPass(FoldOptions(...))(model)` → `PassResult(folded model, modified)`.

    Functional, as onnx-ir defines it: the input `ir.Model` is never changed. The pass clones it
    (nodes and values; weights are shared, and every weight the fold changes is a new tensor),
    rewrites the clone and verifies it against the input, exactly as `fold_onnx` does.

    * `modified` is True when the returned model differs from the input: a norm folded, a
      residual Add fused, or the opset converted for `RMSNormalization`. Run again on its own
      output the pass finds nothing to fold and returns False, so a `PassManager` with several
      steps converges; a model with nothing to fold comes back as an unannotated clone.
    * Errors: options are checked when the pass is made (`InputError`); `requires` refuses input
      shapes that do not fit the model (onnx-ir raises `PreconditionError` from the `InputError`);
      `call` raises `VerificationError` when the folded model does not match the input, and
      `UnsupportedModelError` when it cannot be analysed or run. Then nothing is returned and the
      input is as it was. Inside a `PassManager` these surface as its `PassError`, with the
      normpass error as the cause.
    * `result`: the `FoldResult` of the latest call (the plan with every norm's decision, the
      verification, `report()`), which the `PassResult` a `PassManager` returns does not carry.
    """

    def __init__(self, options: FoldOptions | None = None, name: str = "model"):
        super().__init__()
        self.options = options or FoldOptions()
        self.options.emission()
        if self.options.ort_optimizer is not None:
            raise InputError("FoldPass does not run ORT's transformers optimizer: run it as the step before the pass")
        self.name = name
        self.result: FoldResult | None = None

    def requires(self, model: ir.Model) -> None:
        check_input_shapes(interface(model), self.options.input_shapes)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.result = _fold(load_graph(model.clone(), self.name), model, self.options, self.name)
        folded = self.result.ir_model if self.result.modified else model.clone()
        return ir.passes.PassResult(folded, modified=self.result.modified)


def _fold(ctx: OnnxGraph, original: Model, options: FoldOptions, name: str, optimized: bool = False) -> FoldResult:
    """Fold `ctx`'s model in place and verify it against `original` (the same model, untouched: its
    path, its ModelProto or the `ir.Model` it was cloned from; `optimized`: `ctx` is ORT's transformers
    optimizer's output for it, a rewrite to verify too). A model left as it was that does not run on the
    verification inputs is written unverified: there is nothing to verify."""
    rms_op, fuse_skip = options.emission()
    seconds = {}
    start = time.perf_counter()
    before = ctx.structure
    check_input_shapes(before, options.input_shapes)
    converted = rms_op == "onnx" and ctx.opset < RMS_OPSET
    if converted:
        ctx = _to_rms_opset(ctx)
    zmg = build_zero_mean_graph(ctx)
    rewriter = Rewriter(ctx, zmg, rms_op)
    fold_plan = _decide(ctx, zmg, rewriter, options)
    if fuse_skip is None:
        fuse_skip = not (options.provider == "cpu" and _is_half(ctx, zmg, fold_plan))
    seconds["analysis"] = time.perf_counter() - start
    start = time.perf_counter()
    note = None
    if options.target == "ort" and fold_plan.folded:
        refs = [zmg.norm_by_name(d.name).ref for d in fold_plan.folded]
        note = ordering_note(ctx.model.graph, [ref.x for ref in refs] + [ref.y for ref in refs])
    affine_notes = rewriter.apply(fold_plan, options.migrate_affine) if fold_plan.folded else {}
    rewritten = ctx.model
    if fold_plan.folded or converted:  # a model left as it was carries no note (a second run keeps the first's)
        rewritten = _annotate(ctx, fold_plan, rewriter.docs)
    matmuls = gemms_to_matmuls(rewritten, ctx.shapes) if options.target == "ort" and fold_plan.folded else 0
    fused = fuse_skip_rms(rewritten, ctx.shapes) if fuse_skip else 0
    modified = bool(fold_plan.folded) or converted or fused > 0 or optimized
    seconds["rewrite"] = time.perf_counter() - start
    done = f"{len(fold_plan.folded)} of {fold_plan.total} norms folded"
    comparison = checked(original, rewritten, before, options, name, done, ("fold", "folded"), seconds, modified)
    emitted = {
        "target": options.target,
        "provider": options.provider,
        "rms_op": rms_op,
        "skip_fused": fused,
        "gemms_to_matmul": matmuls,
    }
    return FoldResult(
        rewritten,
        fold_plan,
        comparison,
        affine_notes,
        seconds,
        modified,
        emitted,
        notes=[note] if note else [],
        shapes=ctx.shapes,
    )


def _is_half(ctx, zmg, fold_plan: FoldPlan) -> bool:
    """Whether the folded norms compute in fp16."""
    return any(
        np.dtype(ctx.dtypes.get(zmg.norm_by_name(d.name).input) or np.float32) == np.float16 for d in fold_plan.folded
    )


def _annotate(ctx: OnnxGraph, fold_plan: FoldPlan, docs: dict[str, str]) -> ir.Model:
    metadata = {
        "normpass.version": __version__,
        "normpass.folded": f"{len(fold_plan.folded)} of {fold_plan.total} norms folded into RMSNorm",
        "normpass.folded_norms": ", ".join(d.name for d in fold_plan.folded),
    }
    return export_model(ctx.model, docs, metadata)
