"""`normpass fold MODEL -o OUT [--report R.json]`: fold, verify, write atomically."""

from __future__ import annotations

import argparse
import json

from ..errors import InputError
from ..frontends.onnx_rewrite import RMS_OPS
from ..io import check_output_path, save_onnx_atomic, write_text_atomic
from ..passes import FoldOptions, fold_onnx
from ..verify import parse_input_shapes
from .common import add_model_arguments, load_model


def add_parser(sub) -> None:
    parser = sub.add_parser("fold", help="fold provable LayerNorms into RMSNorms and verify")
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the folded model")
    parser.add_argument("--report", help="write a JSON report here")
    parser.add_argument("--rms-op", choices=RMS_OPS, default="simplified",
                        help="simplified: ORT SimplifiedLayerNormalization (default); onnx: opset-23 RMSNormalization; "
                             "decomposed: standard ops for other runtimes")
    parser.add_argument("--no-migrate-affine", action="store_true", help="keep γ/β in the norm instead of the next linear layers")
    parser.add_argument("--no-fuse-skip", action="store_true",
                        help="with --rms-op simplified, do not fuse residual Adds into SkipSimplifiedLayerNormalization")
    parser.add_argument("--no-verify", action="store_true", help="skip the numerical check against the original")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:DIMS",
                        help="shape for verification inputs, e.g. input_ids:1x128 (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the verification inputs")


def run(args: argparse.Namespace) -> int:
    out = check_output_path(args.model, args.output)
    if args.report:
        report = check_output_path(args.model, args.report)
        if report.resolve() == out.resolve():
            raise InputError(f"{args.report}: the report must not overwrite the model written to -o; choose another --report path")
    options = FoldOptions(
        rms_op=args.rms_op,
        insert_centering=not args.no_insert_centering,
        migrate_affine=not args.no_migrate_affine,
        fuse_skip=not args.no_fuse_skip,
        verify=not args.no_verify,
        input_shapes=parse_input_shapes(args.input_shape),
        seed=args.seed,
    )
    model, label = load_model(args)
    result = fold_onnx(model, options, name=label)
    save_onnx_atomic(result.model, out)
    report = {"model": label, "output": str(out), "rms_op": args.rms_op, **result.report()}
    if args.report:
        write_text_atomic(json.dumps(report, indent=2) + "\n", args.report)
    error = "not verified" if result.comparison is None else (
        f"max abs error {result.comparison.max_abs_error:.3g}, max rel error {result.comparison.max_rel_error:.3g}")
    print(f"{label}: {result.folded} of {result.plan.total} norms folded into RMSNorm ({error}); wrote {out}")
    for decision in result.plan.decisions:
        if not decision.foldable:
            print(f"  kept {decision.name}: {decision.reason}")
    return 0
