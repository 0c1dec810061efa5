"""`normpass replace MODEL --with KIND --calib DATA --budget cos=0.999 -o OUT [--report R.json]`.

Folds what folds exactly, then replaces the remaining norms by fitted surrogates while the
budget holds on the selection split, backs off to what the check split confirms, judges the
result on the test split, and writes it atomically only if the budget holds there too (else exit
1, nothing written unless `--write-best`). The report is written either way. The input is never
modified.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..core.budget import Metrics
from ..core.replace import ORDERS, POLICIES, BudgetMissed, ReplaceOptions
from ..core.surrogates import KINDS
from ..errors import InputError
from ..io import calibration_files, check_paths, model_files, save_onnx_atomic, write_text_atomic
from ..onnx.fold.rewrite import RMS_OPS
from ..onnx.replace.driver import replace_onnx
from .common import (
    add_budget_arguments,
    add_data_arguments,
    add_model_arguments,
    model_source,
    open_genai_folder,
    split_fractions,
)
from .progress import Heartbeat


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "replace", help="replace norms that do not fold exactly by calibrated surrogates, under a budget"
    )
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the model")
    add_calibration_arguments(
        parser,
        "cos=0.999",
        "0.4,0.4,0.2",
        "FIT,VAL,TEST",
        "fitting, validation (selection and its check) and the final test",
        ", or 'synthetic' (seeded random inputs, for demos and tests only)",
    )
    parser.add_argument("--samples", type=int, default=64, help="samples of synthetic data (default 64)")
    parser.add_argument(
        "--with",
        dest="kind",
        default="auto",
        choices=("auto",) + KINDS,
        help="surrogate kind: auto (per norm, the cheapest that keeps the budget, only where it costs less than "
        "the norm; default), rms (calibrated RMSNorm of x − c), affine (DaMN), scalebias (α·x+β, α a scalar), dyt "
        "(γ·tanh(αx)+β), derf (γ·erf(αx+s)+β); a kind named here is emitted wherever it keeps the budget, with "
        "a warning where it costs more than the norm",
    )
    parser.add_argument(
        "--check",
        type=float,
        default=0.5,
        help="share of the validation split held back to check the selection, which backs off to the "
        "largest selection the check confirms (default 0.5; 0: decide on the selection split alone)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=0.8,
        help="share of the budget's allowance the greedy selection may use on the selection split (default 0.8)",
    )
    parser.add_argument(
        "--check-margin",
        type=float,
        default=0.8,
        help="share of the budget's allowance the check split may use: the selection backs off until it "
        "holds (default 0.8)",
    )
    parser.add_argument(
        "--write-best",
        action="store_true",
        help="when the selection misses the budget on the test split, write the largest selection on the way "
        "that meets it there (exit 0) instead of writing nothing (exit 1)",
    )
    parser.add_argument(
        "--orders", default="input,damage", help=f"greedy orders to try, best kept ({', '.join(ORDERS)})"
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="count",
        help="count: most norms first, then cheaper swaps (default); cheapest: per norm the cheapest that fits",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="calibrate every norm on the original model (ablation) instead of sequentially",
    )
    parser.add_argument("--norm", action="append", metavar="NAME", help="only consider these norms (repeatable)")
    parser.add_argument(
        "--all-norms",
        action="store_true",
        help="the norms the exact pass folds are candidates too (for a norm-free model; default: exact folds stay)",
    )
    centring = parser.add_mutually_exclusive_group()
    centring.add_argument(
        "--centre-inputs",
        dest="centre_inputs",
        action="store_true",
        default=None,
        help="centre the layers summed into LayerNorm inputs (exact; default: when rms is allowed)",
    )
    centring.add_argument("--no-centre-inputs", dest="centre_inputs", action="store_false", help="do not")
    parser.add_argument("--no-refit", action="store_true", help="rms: keep the norm's γ/β and the mean shift")
    parser.add_argument(
        "--rms-op", choices=RMS_OPS, default="simplified", help="RMS op for exact folds and rms surrogates"
    )
    parser.add_argument(
        "--provider",
        choices=("cpu", "cuda"),
        help="price what ONNX Runtime runs on this execution provider, with its measured table: a LayerNorm it "
        "fuses with its residual Add (SkipLayerNormalization; a slow kernel on cpu, one cheap kernel on cuda) and "
        "the Adds a surrogate leaves unfused there (default: ops priced alone)",
    )


def add_calibration_arguments(
    parser: argparse.ArgumentParser, budget: str, split: str, split_names: str, split_roles: str, more_data: str = ""
) -> None:
    """The calibration data, budget and report options `replace` and `distill` share."""
    add_data_arguments(parser, required=True, more_data=more_data)
    add_budget_arguments(parser, f"default {budget}")
    parser.add_argument(
        "--split",
        default=split,
        metavar=split_names,
        help=f"fractions of --calib for {split_roles} (default {split}; with --holdout the third is ignored)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the splits, sampling and synthetic data")
    parser.add_argument("--report", help="write a JSON report here (also when the budget is missed)")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="show progress")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="no progress")


def calibration_options(args: argparse.Namespace) -> dict:
    """The options `add_calibration_arguments` sets that `ReplaceOptions` and `DistillOptions` share."""
    return {
        "split": split_fractions(args.split, "FIT,VAL,TEST", "0.5,0.25,0.25"),
        "holdout": args.holdout,
        "batch_size": args.batch_size,
        "tokenizer": args.tokenizer,
        "max_length": args.max_length,
        "mask_input": args.mask_input,
        "seed": args.seed,
        "progress": sys.stderr.isatty() if args.progress is None else args.progress,
    }


def run(args: argparse.Namespace) -> int:
    open_genai_folder(args)  # a folder stands for its decoder, whose files -o must not overwrite
    inputs = (
        model_files("the input model", args.model)
        | calibration_files("--calib", args.calib)
        | calibration_files("--holdout", args.holdout)
        | calibration_files("--tokenizer", args.tokenizer)
    )
    out = check_paths(inputs, {"-o": args.output, "--report": args.report})["-o"]
    if args.batch_size < 1 or args.samples < 1 or args.max_length < 1:
        raise InputError("--batch-size, --samples and --max-length must be at least 1")
    options = ReplaceOptions(
        kind=args.kind,
        budget=",".join(args.budget or ["cos=0.999"]),
        sequential=not args.parallel,
        orders=tuple(o.strip() for o in args.orders.split(",") if o.strip()),
        policy=args.policy,
        check=args.check,
        margin=args.margin,
        check_margin=args.check_margin,
        write_best=args.write_best,
        centre_inputs=args.centre_inputs,
        refit=not args.no_refit,
        insert_centering=not args.no_insert_centering,
        norms=tuple(args.norm) if args.norm else None,
        all_norms=args.all_norms,
        rms_op=args.rms_op,
        provider=args.provider,
        samples=args.samples,
        **calibration_options(args),
    )
    try:
        options.budget = options.checked()[0]
    except InputError as e:
        raise InputError(f"--{e}") from None  # the library's message names the option
    model, label = model_source(args)  # a path is read lazily, its weights mapped (replace_onnx)
    try:
        with Heartbeat("replace"):
            result = replace_onnx(model, args.calib, options, name=label)
    except BudgetMissed as e:
        if args.report:
            write_text_atomic(json.dumps({"output": None, **e.report.to_json()}, indent=2) + "\n", args.report)
        raise
    save_onnx_atomic(result.model, out, keep=inputs.values())
    report = {"output": str(out), **result.report.to_json()}
    if args.report:
        write_text_atomic(json.dumps(report, indent=2) + "\n", args.report)
    test = report["test"]
    fallback = ""
    if report["wrote_fallback"]:
        fallback = (
            " (--write-best: the selection missed the budget on the test split; this is the largest on its way "
            "that meets it there)"
            if report["replaced"]
            else " (--write-best: the selection missed the budget on the test split and none on its way with a "
            "surrogate meets it there: only the exact folds are written)"
        )
    print(
        f"{label}: {report['exact']} of {report['total']} norms folded exactly, {report['replaced']} replaced by "
        f"surrogates{fallback}, {report['kept']} kept; test "
        f"({test['samples']} samples): {Metrics.from_json(test).describe(mean=False)}; "
        f"budget {options.budget}; wrote {out}"
    )
    for norm in report["norms"]:
        if norm["decision"] == "replaced":
            ops = ", ".join(f"{op}×{n}" for op, n in norm["emission"]["ops"].items()) or "no op"
            print(
                f"  {norm['name']}: {norm['surrogate']} ({ops}; cost {norm['emission']['cost']:.2f} vs "
                f"{norm['original_cost']:.2f})"
            )
        elif norm["decision"] != "exact":
            print(f"  kept {norm['name']}: {norm['reason']}")
    dearer = dearer_warning(report, args.kind, args.provider)
    if dearer:
        print(f"normpass replace: warning: {dearer}", file=sys.stderr)
    return 0


def dearer_warning(report: dict, kind: str, provider: str | None) -> str | None:
    """What the surrogates the user named cost where they cost more than the norms they replace, or None."""
    dearer = [
        norm
        for norm in report["norms"]
        if norm["decision"] == "replaced" and norm["emission"]["cost"] > norm["original_cost"]
    ]
    if not dearer:
        return None
    after = sum(norm["emission"]["cost"] for norm in dearer)
    before = sum(norm["original_cost"] for norm in dearer)
    table = f"ONNX Runtime's {provider} provider" if provider else "ops priced alone (no --provider)"
    return (
        f"--with {kind} costs more than the norm it replaces at {len(dearer)} of {report['replaced']} replaced "
        f"norms, by the measured table for {table} (core/cost.py): {after:.2f} instead of {before:.2f} "
        "LayerNorm units; --with auto emits only surrogates that cost less"
    )
