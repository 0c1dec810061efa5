"""The exact fold pass for ONNX models: build → plan → apply → verify.

`inspect_onnx` stops after planning; `fold_onnx` returns a new model (the input is never
modified) and refuses, with `VerificationError`, a rewrite whose outputs differ from the
original's beyond the dtype's tolerance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import onnx

from . import __version__
from .analysis import plan as make_plan
from .errors import InputError, UnsupportedModelError, VerificationError
from .frontends.onnx import build_zero_mean_graph, load_graph
from .frontends.onnx_export import export_model
from .frontends.onnx_fuse import fuse_skip_rms
from .frontends.onnx_rewrite import RMS_OPS, Rewriter
from .plan import FoldPlan
from .verify import Comparison, verify

RMS_OPSET = 23  # RMSNormalization
RMS_IR_VERSION = 11  # the IR version that goes with opset 23; ONNX Runtime 1.31 accepts ≤ 13


@dataclass
class FoldOptions:
    rms_op: str = "simplified"
    insert_centering: bool = True
    migrate_affine: bool = True
    fuse_skip: bool = True  # with rms_op "simplified": Add + RMS → SkipSimplifiedLayerNormalization
    verify: bool = True
    input_shapes: dict = field(default_factory=dict)
    seed: int = 0


@dataclass
class FoldResult:
    model: onnx.ModelProto
    plan: FoldPlan
    comparison: Comparison | None
    affine_notes: dict[str, str]
    seconds: dict[str, float]

    @property
    def folded(self) -> int:
        return len(self.plan.folded)

    def report(self) -> dict:
        report = fold_report(self.plan, self.comparison, self.affine_notes, self.seconds)
        report["input_shapes"] = {} if self.comparison is None else self.comparison.input_shapes
        return report


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
        "outputs": [] if comparison is None else [vars(o) | {"passed": o.passed} for o in comparison.outputs],
        "norms": decisions,
        "seconds": seconds,
    }


def _to_rms_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at opset 23 (for RMSNormalization), at an IR version ONNX Runtime accepts."""
    from onnx import version_converter

    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    if current >= RMS_OPSET:
        return model
    try:
        converted = version_converter.convert_version(model, RMS_OPSET)
    except Exception as e:
        raise UnsupportedModelError(
            f"cannot convert the model from opset {current} to {RMS_OPSET} for RMSNormalization ({e}); "
            "use --rms-op simplified or decomposed"
        ) from e
    converted.ir_version = max(model.ir_version, RMS_IR_VERSION)
    return converted


def inspect_onnx(model: onnx.ModelProto, insert_centering: bool = True, name: str = "model") -> FoldPlan:
    """Which norms of `model` fold exactly, and why the others do not."""
    return make_plan(build_zero_mean_graph(load_graph(model, name)), insert_centering)


def fold_onnx(model: onnx.ModelProto, options: FoldOptions | None = None, name: str = "model") -> FoldResult:
    """Fold every provable LayerNorm of `model` into an RMSNorm; verify unless told not to."""
    options = options or FoldOptions()
    if options.rms_op not in RMS_OPS:
        raise InputError(f"--rms-op {options.rms_op!r}: choose one of {', '.join(RMS_OPS)}")
    seconds = {}
    start = time.perf_counter()
    source = _to_rms_opset(model) if options.rms_op == "onnx" else model
    ctx = load_graph(source, name)
    zmg = build_zero_mean_graph(ctx)
    fold_plan = make_plan(zmg, options.insert_centering)
    seconds["analysis"] = time.perf_counter() - start
    start = time.perf_counter()
    rewriter = Rewriter(ctx, zmg, options.rms_op)
    notes = rewriter.apply(fold_plan, options.migrate_affine) if fold_plan.folded else {}
    rewritten = _export(ctx, source, fold_plan, rewriter.docs)
    if options.fuse_skip and options.rms_op == "simplified":
        fuse_skip_rms(rewritten, ctx.shapes)
    seconds["rewrite"] = time.perf_counter() - start
    comparison = None
    if options.verify:
        start = time.perf_counter()
        comparison = verify(model, rewritten, options.input_shapes, options.seed)
        seconds["verify"] = time.perf_counter() - start
        if not comparison.passed:
            raise VerificationError(f"{name}: folded model does not match the original: {comparison.failures()}; nothing written")
    return FoldResult(rewritten, fold_plan, comparison, notes, seconds)


def _export(ctx, source: onnx.ModelProto, fold_plan: FoldPlan, docs: dict[str, str]) -> onnx.ModelProto:
    metadata = {
        "normpass.version": __version__,
        "normpass.folded": f"{len(fold_plan.folded)} of {fold_plan.total} norms folded into RMSNorm",
        "normpass.folded_norms": ", ".join(d.name for d in fold_plan.folded),
    }
    return export_model(ctx.graph, source, docs, metadata)
