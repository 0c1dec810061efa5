"""`normpass fold MODEL -o OUT [--report R.json]`: fold, verify, write atomically.

`normpass fold --torch package.module:factory -o OUT.onnx` folds a PyTorch module instead and
exports the folded module.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from ..errors import InputError
from ..io import write_text_atomic
from ..onnx.fold.driver import TARGETS, FoldOptions, fold_onnx
from ..onnx.fold.rewrite import RMS_OPS
from ..onnx.runtime.ortopt import OrtOptimizer
from .common import (
    add_decision_arguments,
    add_model_arguments,
    add_verification_arguments,
    checked_paths,
    command_model,
    model_source,
    replace_hint,
    save_result,
    verification_options,
)


def add_parser(sub) -> None:
    parser = sub.add_parser("fold", help="fold provable LayerNorms into RMSNorms and verify")
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the folded model")
    parser.add_argument("--report", help="write a JSON report here")
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default="ort",
        help="ort: ONNX Runtime, contrib ops allowed (default); onnx: standard ops only, for other runtimes",
    )
    add_decision_arguments(parser)
    parser.add_argument(
        "--rms-op",
        choices=RMS_OPS,
        help="simplified: ORT SimplifiedLayerNormalization (default for --target ort); onnx: opset-23 "
        "RMSNormalization (default for --target onnx); decomposed: Mul/ReduceMean/Add/Sqrt/Div",
    )
    parser.add_argument(
        "--no-migrate-affine",
        action="store_true",
        help="keep γ in the RMS op and β as an Add instead of moving them into the next linear layers",
    )
    parser.add_argument(
        "--no-fuse-skip", action="store_true", help="never fuse residual Adds into SkipSimplifiedLayerNormalization"
    )
    parser.add_argument(
        "--ort-optimizer",
        metavar="TYPE[:HEADS:HIDDEN]",
        help="run ONNX Runtime's transformers optimizer (model type bert, gpt2, vit, swin, …; heads and hidden "
        "size detected unless given: HEADS must divide HIDDEN) first and fold its output: the order that keeps "
        "every fusion; for the GPU with --provider cuda, else for the CPU; verified against MODEL as given; "
        "not with --torch (the optimizer takes an ONNX graph: export the module, then fold the file)",
    )
    add_verification_arguments(parser)
    parser.add_argument(
        "--torch",
        metavar="PACKAGE.MODULE:FACTORY",
        help="fold a PyTorch model instead: FACTORY() returns (module, example_inputs); the folded "
        "module is exported to ONNX at -o (--target, --provider, --rms-op, --fold-with-beta-add, "
        "--no-fuse-skip, --input-shape and --seed do not apply: the exporter writes the RMS ops, "
        "verification uses the example inputs; --ort-optimizer is refused: it must run before the fold, on "
        "an ONNX graph; input dimensions stay dynamic where the module allows it)",
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="with --torch: rewrite torch.export's graph (normpass.fold_graph) instead of swapping modules, so "
        "that a centring inside a module's forward (after a functional op) is made too and the module folds as "
        "its ONNX export does; captured with every input dimension dynamic where the module allows it, or with "
        "the batch axis alone dynamic where that folds more (the summary says which); needs torch.export (no "
        "symbolic_trace fallback); γ and β stay in the RMS op (--no-migrate-affine does not apply)",
    )


def _factory_file(spec: str | None) -> dict[str, Path]:
    """The source file of a --torch factory's module, where it can be found without running it."""
    module_name = (spec or "").partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name) if module_name else None
    except (ImportError, ValueError):  # load_factory says why, later
        return {}
    origin = getattr(found, "origin", None)
    return {"--torch's module": Path(origin)} if origin and Path(origin).is_file() else {}


def _print_summary(
    label: str, plan, comparison, out, extra: str = "", notes: list[str] | None = None, hint: str | None = None
) -> None:
    unverified = "not verified" if plan.folded else "nothing rewritten"
    error = unverified if comparison is None else comparison.describe()
    print(f"{label}: {len(plan.folded)} of {plan.total} norms folded into RMSNorm ({error}{extra}); wrote {out}")
    for decision in plan.decisions:
        if not decision.foldable:
            print(f"  kept {decision.name}: {decision.reason}")
    for note in notes or []:
        print(f"note: {note}")
    if hint:
        print(hint)


def run(args: argparse.Namespace) -> int:
    if args.torch:
        return _run_torch(args)
    if args.graph:
        raise InputError("--graph applies to --torch only: an ONNX model is folded on its graph already")
    out, inputs = checked_paths(args, _factory_file(args.torch))
    options = FoldOptions(
        target=args.target,
        provider=args.provider,
        rms_op=args.rms_op,
        insert_centering=not args.no_insert_centering,
        migrate_affine=not args.no_migrate_affine,
        fold_with_beta_add=args.fold_with_beta_add,
        fuse_skip=False if args.no_fuse_skip else None,
        **verification_options(args),
        ort_optimizer=None
        if args.ort_optimizer is None
        else OrtOptimizer.parse(args.ort_optimizer, use_gpu=args.provider == "cuda"),
    )
    model, label = model_source(args)
    result = fold_onnx(model, options, name=label)
    save_result(result, out, inputs, label, args.report, args.genai)
    optimized = result.emitted.get("ort_optimizer")
    extra = f"; after ORT's {optimized['model_type']} optimizer" if optimized else ""
    hint = replace_hint(result.plan, command_model(args))
    _print_summary(label, result.plan, result.comparison, out, extra, result.notes, hint)
    return 0


def _run_torch(args: argparse.Namespace) -> int:
    """Fold a PyTorch model from a factory and export the folded module to ONNX."""
    if args.model is not None or args.builtin is not None:
        raise InputError("--torch replaces MODEL and --builtin; give only one")
    if args.ort_optimizer is not None:
        raise InputError(
            "--ort-optimizer does not apply to --torch: ONNX Runtime's optimizer must run before the fold, on an "
            "ONNX graph (its Attention fusions start from LayerNorms); export the module to ONNX, then run "
            "normpass fold MODEL.onnx --ort-optimizer TYPE"
        )
    from ..torch.api import export_onnx, fold, load_factory

    out, _ = checked_paths(args, _factory_file(args.torch))
    label = f"torch:{args.torch}"
    module, inputs = load_factory(args.torch)
    dynamic, captured = None, ""
    if args.graph:
        folded, report, dynamic, captured = _fold_graph_for_export(module, inputs, not args.no_verify, label)
    else:
        folded, report = fold(
            module, inputs, migrate_affine=not args.no_migrate_affine, verify=not args.no_verify, name=label
        )
    export_onnx(folded, inputs, out, dynamic)
    if args.report:
        write_text_atomic(
            json.dumps({"model": label, "output": str(out), **report.to_json()}, indent=2) + "\n", args.report
        )
    _print_summary(label, report.plan, report.comparison, out, f"; captured with {report.capture}{captured}")
    return 0


def _fold_graph_for_export(module, inputs: tuple, verify: bool, label: str):
    """`fold_graph` captured with every input dimension `Dim.AUTO` (dynamic where the module allows it), or
    with axis 0 alone dynamic where that folds more: a proof may need sizes along the tokens or space (a
    reshape's, a concatenation's parts'), which a dynamic dimension hides. Returns the graph, the report, the
    `dynamic_shapes` to export it with, and what the summary says of them."""
    from ..torch.api import auto_dynamic_shapes, fold_graph

    dynamic = auto_dynamic_shapes(inputs)
    folded, report = fold_graph(module, inputs, dynamic_shapes=dynamic, verify=verify, name=label)
    if len(report.plan.folded) == report.plan.total:
        return folded, report, dynamic, ""
    batch = auto_dynamic_shapes(inputs, batch_only=True)
    by_batch, batch_report = fold_graph(module, inputs, dynamic_shapes=batch, verify=verify, name=label)
    more = len(batch_report.plan.folded) - len(report.plan.folded)
    if more <= 0:
        return folded, report, dynamic, ""
    note = f", axis 0 alone dynamic ({more} more norm(s) fold than with every dimension dynamic)"
    return by_batch, batch_report, batch, note
