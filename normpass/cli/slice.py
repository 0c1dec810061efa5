"""`normpass slice MODEL -o OUT --calib DATA --ratio R [--recover SECONDS] [--budget cos=V] [--write-best]
[--report R.json]`: fold, cut every provable residual stream to its principal subspace (SliceGPT), refit the
cut layers on the calibration data for up to SECONDS (recovery), judge on held-out data, write.
`normpass slice --torch package.module:factory -o OUT.onnx --calib DATA --ratio R [--recover-train SECONDS]`
slices the PyTorch module's captured graph instead (`normpass.slice`), trains it toward the module for up to
SECONDS per ratio, judges it, exports it to ONNX and checks the file in ONNX Runtime against it.

Exit 1 and nothing written when the budget is missed (the report is written either way); `--write-best`
writes the largest ratio of R, R − 0.05, … that meets it instead. At R = 0 the result is verified against
the original; at R > 0 the held-out figures are the verification. The input is never modified.
"""

from __future__ import annotations

import argparse
import json

from ..core.replace import BudgetMissed
from ..errors import InputError
from ..genai import sliced_widths
from ..io import calibration_files, write_text_atomic
from ..onnx.fold.driver import PROVIDERS, TARGETS
from ..onnx.slice.driver import (
    BASES,
    DEFAULT_ROUND_TO,
    HEADS,
    LADDER_STEP,
    TRAIN_LOSSES,
    TRAIN_PARAMS,
    SliceOptions,
    SliceResult,
    slice_onnx,
)
from .common import (
    add_budget_arguments,
    add_data_arguments,
    add_model_arguments,
    add_verification_arguments,
    check_sizes,
    checked_paths,
    model_source,
    save_result,
    split_fractions,
    verification_options,
)
from .fold import _factory_file
from .progress import Heartbeat


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "slice",
        help="fold, then cut residual streams to their principal subspace (SliceGPT: fewer FLOPs, judged on "
        "held-out data)",
        description="Fold every provable LayerNorm into an RMSNorm, prove which residual streams are read only "
        "by such norms and linear layers, rotate each into the principal basis of its calibration activations and "
        "keep its first k = (1 − R)·d columns (writers W·Q_k, readers Q_kᵀ·W, the RMS ops rescaled), then judge "
        "the result against the original on held-out inputs.",
    )
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the sliced model")
    parser.add_argument("--report", help="write a JSON report here (also when the budget is missed)")
    parser.add_argument(
        "--ratio", type=float, required=True, metavar="R", help="share of each stream's width to remove (0 ≤ R < 1)"
    )
    parser.add_argument(
        "--round-to",
        type=int,
        default=DEFAULT_ROUND_TO,
        metavar="N",
        help=f"keep a multiple of N columns (default {DEFAULT_ROUND_TO}: what fp16 and INT8 kernels tile by)",
    )
    parser.add_argument(
        "--basis",
        choices=BASES,
        default="layer",
        help="layer: one principal basis per norm, fitted in sequence on the model cut before it, with a k×k "
        "shortcut MatMul on the residual path between them (default; SliceGPT's); stream: one per residual "
        "stream (no op added, one calibration pass)",
    )
    parser.add_argument(
        "--head",
        choices=HEADS,
        default=SliceOptions.head,
        help="full: each stream's end — its final norm and the head that reads it (an LM head, a classifier) — "
        "keeps all d columns, the layer before it writing into them through a k×d shortcut (SliceGPT's default); "
        "cut: they read the k kept columns too (fewer bytes to read per token)",
    )
    parser.add_argument(
        "--recover",
        default="0",
        metavar="SECONDS",
        help="after the cut, refit each linear layer it changed, in order, by least squares on the fitting data so "
        "that it reproduces the unsliced model's output there, for up to SECONDS per ratio tried (default 0: none)",
    )
    parser.add_argument(
        "--torch",
        metavar="PACKAGE.MODULE:FACTORY",
        help="slice a PyTorch module instead of MODEL: FACTORY() returns (module, example_inputs); its torch.export "
        "graph is cut (normpass.slice) and exported to ONNX (input dimensions dynamic where the module allows it)",
    )
    parser.add_argument(
        "--recover-train",
        default="0",
        metavar="SECONDS",
        help="with --torch: after the cut, train every parameter of the sliced graph toward the module on the "
        "fitting data (label-free distillation) for up to SECONDS per ratio tried (default 0: none)",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-5, help="with --recover-train: AdamW's learning rate (default 1e-5)"
    )
    parser.add_argument(
        "--train-loss",
        choices=TRAIN_LOSSES,
        default="mse",
        help="with --recover-train: mse (relative squared error and cosine of the outputs; any output, default) "
        "or kl (KL divergence of the outputs' softmax: for logits, what perplexity sees)",
    )
    parser.add_argument(
        "--train-params",
        choices=TRAIN_PARAMS,
        default="full",
        help="with --recover-train: full (every parameter trains, default) or lora (a rank --lora-rank update of "
        "each matrix, added into it after training: the same shapes)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=8, help="with --train-params lora: the updates' rank (default 8)"
    )
    parser.add_argument(
        "--train-hidden",
        type=float,
        default=0.0,
        metavar="WEIGHT",
        help="with --recover-train: add WEIGHT × the relative error of the stream where each norm reads it, against "
        "the original's projected on the kept basis (default 0: the outputs alone)",
    )
    add_data_arguments(
        parser, required=True, more_data=", or 'synthetic' (seeded random inputs, for demos and tests only)"
    )
    parser.add_argument("--samples", type=int, default=64, help="samples of synthetic data (default 64)")
    add_budget_arguments(parser, "default: none, the held-out figures are reported")
    parser.add_argument(
        "--write-best",
        action="store_true",
        help=f"when R misses the budget, write the largest of R − {LADDER_STEP:g}, R − {2 * LADDER_STEP:g}, … "
        "(above 0) that meets it (exit 0) instead of writing nothing (exit 1)",
    )
    parser.add_argument(
        "--split",
        default="0.75,0.25",
        metavar="FIT,HELD_OUT",
        help="fractions of --calib for the bases and for judging (default 0.75,0.25; with --holdout all fits)",
    )
    parser.add_argument(
        "--target", choices=TARGETS, default="ort", help="the fold's target: ort (default) or onnx (standard ops)"
    )
    parser.add_argument(
        "--provider", choices=PROVIDERS, default="cuda", help="the fold's execution provider, as for fold"
    )
    add_verification_arguments(parser)


def _seconds(text: str, flag: str = "--recover") -> float:
    try:
        return float(text)
    except ValueError:
        raise InputError(f"{flag} {text!r}: give the seconds recovery may take, e.g. 300 (0: none)") from None


def summary(label: str, result: SliceResult, out) -> list[str]:
    """The lines `slice` prints: what was cut, the held-out figures, each stream left whole with why, the notes."""
    report = result.slice_report()
    kept = {} if result.chosen is None else result.chosen.kept
    widths = ", ".join(f"{s.width} → {kept[s.name]}" for s in result.slicing.sliceable)
    held = result.held_out
    figures = "" if held is None else f"; held out ({held.samples} samples): {held.describe()}"
    budget = "" if result.budget is None else f"; budget {result.budget}"
    check = "" if result.comparison is None else f" ({result.comparison.describe()})"
    sliced = "" if result.chosen is None else f"; {result.chosen.parameters} of {result.parameters} parameters"
    bases = sum(len(p) for p in result.pieces.values())
    layers = f", {bases} bases and {result.shortcuts} shortcuts" if result.basis == "layer" else ""
    recovery = None if result.chosen is None else result.chosen.recovery
    if recovery is not None:
        figures += f"; {recovery.describe()}"
        before = recovery.held_out_before
        if before is not None:
            figures += f" (held out before it: {before.describe()})"
    lines = [
        f"{label}: {len(result.slicing.sliceable)} of {len(result.slicing.streams)} residual streams sliced at "
        f"ratio {result.ratio:g}{' (' + widths + layers + sliced + ')' if widths else ''}{check}{figures}{budget}; "
        f"wrote {out}"
    ]
    if report["wrote_fallback"]:
        lines.append(
            f"  ratio {result.requested_ratio:g} missed the budget: wrote ratio {result.ratio:g}, the largest tried "
            "that meets it (--write-best)"
        )
    for stream in result.slicing.streams:
        if stream.name in result.slicing.reasons:
            lines.append(f"  left whole: the stream of {stream.name}: {result.slicing.reasons[stream.name]}")
    return lines + [f"note: {note}" for note in result.notes]


def run(args: argparse.Namespace) -> int:
    out, inputs = checked_paths(
        args,
        calibration_files("--calib", args.calib)
        | calibration_files("--holdout", args.holdout)
        | calibration_files("--tokenizer", args.tokenizer)
        | (_factory_file(args.torch) if args.torch else {}),
    )
    check_sizes(args)
    fit, held = split_fractions(args.split, "FIT,HELD_OUT", "0.75,0.25")
    options = SliceOptions(
        ratio=args.ratio,
        round_to=args.round_to,
        basis=args.basis,
        head=args.head,
        recover=_seconds(args.recover),
        recover_train=_seconds(args.recover_train, "--recover-train"),
        train_lr=args.lr,
        train_loss=args.train_loss,
        train_params=args.train_params,
        train_rank=args.lora_rank,
        train_hidden=args.train_hidden,
        budget=",".join(args.budget) if args.budget else None,
        write_best=args.write_best,
        split=(fit, held),
        holdout=args.holdout,
        batch_size=args.batch_size,
        tokenizer=args.tokenizer,
        max_length=args.max_length,
        mask_input=args.mask_input,
        samples=args.samples,
        target=args.target,
        provider=args.provider,
        insert_centering=not args.no_insert_centering,
        **verification_options(args),
    )
    try:
        options.checked()
    except InputError as e:  # the library's message starts with the option's name
        option, _, rest = str(e).partition(" ")
        raise InputError(f"--{option.replace('_', '-')} {rest}") from None
    if args.torch:
        from .slice_torch import run_torch

        return run_torch(args, options, out)
    if options.recover_train:
        raise InputError("--recover-train trains a PyTorch module: give it with --torch (an ONNX file takes --recover)")
    model, label = model_source(args)
    try:
        with Heartbeat("slice"):
            result = slice_onnx(model, args.calib, options, name=label)
    except BudgetMissed as e:
        if args.report:
            write_text_atomic(json.dumps({"model": label, **e.report.to_json()}, indent=2) + "\n", args.report)
        raise
    save_result(result, out, inputs, label, args.report, args.genai, sliced_widths(result))
    print("\n".join(summary(label, result, out)))
    return 0
