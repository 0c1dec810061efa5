"""`normpass rotate MODEL -o OUT [--calib DATA [--smooth [ALPHA]]] [--online-rotation [BLOCK]] [--report R.json]`:
fold, rotate every provable residual stream, with `--calib` centre attention's keys (and with `--smooth` smooth
the norm outputs no rotation reached), with `--online-rotation` rotate the MLP down projections' inputs at run
time, verify, write.

The rotation makes the model quantize better (QuaRot): run ONNX Runtime's quantizer on OUT.
"""

from __future__ import annotations

import argparse
import contextlib

from ..core.orthogonal import KINDS
from ..io import calibration_files
from ..onnx.calibrate import CalibData
from ..onnx.fold.driver import PROVIDERS, TARGETS
from ..onnx.rotate.driver import RotateOptions, RotateResult, rotate_onnx
from ..onnx.rotate.online import DEFAULT_BLOCK
from ..onnx.rotate.online import METADATA_KEY as KEEP_FP32
from ..onnx.rotate.smooth import DEFAULT_ALPHA
from .common import (
    add_data_arguments,
    add_model_arguments,
    add_verification_arguments,
    checked_paths,
    model_source,
    save_result,
    unproven,
    verification_options,
)
from .progress import Heartbeat


def option_value(kind: type, option: str, what: str):
    """The type of an option whose value may be left out (`nargs="?"`): a word that is not a number, most
    often the model path written after the option, is refused with what to do instead of argparse's
    "invalid float value"."""

    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {what}; give {option} a value or write it after the model path"
            ) from None

    return convert


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "rotate",
        help="fold, then rotate residual streams by an orthogonal matrix (exact; spreads outliers for quantization)",
        description="Fold every provable LayerNorm into an RMSNorm with its affine moved into the next layers, "
        "prove which residual streams are read only by such norms and linear layers, rotate each by an "
        "orthogonal matrix (writers W·Q, readers Qᵀ·W: no op is added), and verify against the original.",
    )
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the rotated model")
    parser.add_argument("--report", help="write a JSON report here")
    parser.add_argument(
        "--rotation",
        choices=KINDS,
        default="hadamard",
        help="hadamard: a seeded randomised Hadamard matrix where the hidden size allows one (12·2ᵏ, 20·2ᵏ, "
        "28·2ᵏ, 2ᵏ …), else a random orthogonal one (default); orthogonal: always a random orthogonal one",
    )
    parser.add_argument(
        "--rotation-seed", type=int, default=0, help="seed of the rotation (stream i uses seed + i; default 0)"
    )
    parser.add_argument(
        "--target", choices=TARGETS, default="ort", help="the fold's target: ort (default) or onnx (standard ops)"
    )
    parser.add_argument(
        "--provider", choices=PROVIDERS, default="cuda", help="the fold's execution provider, as for fold"
    )
    add_data_arguments(
        parser,
        required=False,
        more_data="; with it, also centre every provable attention's keys on it (exact: softmax ignores a "
        "constant per row; narrower ranges for INT8)",
    )
    parser.add_argument(
        "--smooth",
        type=option_value(float, "--smooth", "a number α"),
        nargs="?",
        const=DEFAULT_ALPHA,
        default=None,
        metavar="ALPHA",
        help="with --calib: also smooth the output of every norm no rotation reached (SmoothQuant, exact: a "
        "per-feature scale max|x|^α / max|W|^(1−α) moved into the linear layers reading it, x divided by it in "
        f"the norm or by one inserted Mul); α from 0 to 1 (default {DEFAULT_ALPHA})",
    )
    parser.add_argument(
        "--online-rotation",
        type=option_value(int, "--online-rotation", "a whole block size"),
        nargs="?",
        const=DEFAULT_BLOCK,
        default=None,
        metavar="BLOCK",
        help="also rotate the input of every MLP down projection at run time by a block-diagonal Hadamard "
        "matrix (exact: an inserted Reshape, MatMul, Reshape, the weight rotated back); quantize with those "
        f"MatMuls kept in fp32 (named in the model's metadata {KEEP_FP32}); blocks of BLOCK (default "
        f"{DEFAULT_BLOCK})",
    )
    add_verification_arguments(parser)


def summary(label: str, result: RotateResult, out) -> list[str]:
    """The lines `rotate` prints: the counts and error, then each stream not rotated and norm not folded, with why."""
    rotation = result.rotation
    unverified = "not verified" if result.modified else "nothing rewritten"
    error = unverified if result.comparison is None else result.comparison.describe()
    matrices = sorted(set(result.matrices.values()))
    lines = [
        f"{label}: {result.folded} of {result.plan.total} norms folded, {len(rotation.rotatable)} of "
        f"{len(rotation.streams)} residual streams rotated{' (' + ', '.join(matrices) + ')' if matrices else ''} "
        f"({error}); wrote {out}"
    ]
    unproven_norms = set(unproven(result.plan))
    for stream in rotation.streams:
        if not stream.rotatable:
            lines.append(f"  not rotated: the stream of {stream.name}: {stream.reason}")
            blocker = stream.blocker.node if stream.blocker is not None else None
            if blocker in unproven_norms:
                lines.append(
                    f"    it would rotate if {blocker} were an RMSNorm: the fold cannot prove its input zero-mean "
                    "(normpass inspect says why), so it stays a LayerNorm"
                )
    if result.keys is not None:
        lines.append(f"  keys centred in {len(result.keys.sites)} of {result.keys.total} attentions")
        for softmax, reason in result.keys.refused.items():
            lines.append(f"  keys not centred at {softmax}: {reason}")
    if result.smoothing is not None:
        lines.append(f"  {result.smoothing.summary}")
        for norm, reason in result.smoothing.refused.items():
            lines.append(f"  not smoothed {norm}: {reason}")
    if result.online is not None:
        lines.append(f"  {result.online.summary}")
        if result.online.keep_fp32:
            lines.append(
                f"  keep the {len(result.online.keep_fp32)} inserted rotations in fp32 when quantizing "
                f"(nodes_to_exclude; metadata {KEEP_FP32}): {', '.join(result.online.keep_fp32)}"
            )
        for node, reason in result.online.refused.items():
            lines.append(f"  not rotated online {node}: {reason}")
    for decision in result.plan.decisions:
        if not decision.foldable:
            lines.append(f"  not folded {decision.name}: {decision.reason}")
    return lines


def run(args: argparse.Namespace) -> int:
    out, inputs = checked_paths(
        args, calibration_files("--calib", args.calib) | calibration_files("--tokenizer", args.tokenizer)
    )
    options = RotateOptions(
        rotation=args.rotation,
        rotation_seed=args.rotation_seed,
        target=args.target,
        provider=args.provider,
        insert_centering=not args.no_insert_centering,
        **verification_options(args),
        calib=args.calib,
        calib_data=CalibData(args.batch_size, args.tokenizer, args.max_length),
        smooth=args.smooth,
        online_block=args.online_rotation,
    )
    model, label = model_source(args)
    with Heartbeat("rotate") if args.calib else contextlib.nullcontext():
        result = rotate_onnx(model, options, name=label)
    save_result(result, out, inputs, label, args.report, args.genai)
    print("\n".join(summary(label, result, out)))
    return 0
