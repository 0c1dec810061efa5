"""What the verbs share: where the model comes from (a file, an ONNX Runtime GenAI folder or a built-in registry
model) and where it goes."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import onnx

from .. import genai
from ..calibration import TEXT_SUFFIXES
from ..core.graph import ZeroMeanGraph
from ..core.plan import FoldPlan
from ..errors import InputError
from ..io import check_paths, model_files, save_onnx_atomic, write_text_atomic
from ..onnx.fold.driver import PROVIDERS, FoldOptions, fold_decisions
from ..onnx.runtime.verify import parse_input_shapes


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", help="path of an .onnx model, or of a folder ONNX Runtime GenAI's builder wrote"
    )
    parser.set_defaults(genai=None)
    parser.add_argument(
        "--builtin", metavar="NAME", help="use a built-in model from the registry (e.g. gpt2) instead of a file"
    )
    parser.add_argument("--no-insert-centering", action="store_true", help="never insert an explicit x − mean(x)")


def add_decision_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that change which proven norms the fold folds (`fold`; `inspect` and `viz` show its decisions)."""
    parser.add_argument(
        "--provider",
        choices=PROVIDERS,
        default="cuda",
        help="with --target ort, the execution provider the model is for (default cuda); "
        "cpu: fp16 models keep residual Adds unfused (ORT's CPU fp16 Skip kernel is slower), and a "
        "norm ORT would fuse into its slow CPU SkipLayerNormalization folds even with a β Add",
    )
    parser.add_argument(
        "--fold-with-beta-add",
        action="store_true",
        help="also fold norms whose β can move nowhere (an RMSNorm plus an Add costs more than a LayerNorm)",
    )


def fold_decisions_of(args: argparse.Namespace, model, label: str) -> tuple[ZeroMeanGraph, FoldPlan]:
    """What `normpass fold` with these arguments folds and keeps (`fold_decisions`), for `inspect` and `viz`."""
    options = FoldOptions(
        provider=args.provider,
        insert_centering=not args.no_insert_centering,
        fold_with_beta_add=args.fold_with_beta_add,
    )
    return fold_decisions(model, options, label)


def unproven(plan: FoldPlan) -> list[str]:
    """The norms the fold's proof leaves (input not provably zero-mean: a post-LN stream, most often), not
    those it proves and keeps."""
    return [d.name for d in plan.decisions if not d.foldable and not d.kept]


def replace_hint(plan: FoldPlan, command_model: str) -> str | None:
    """What to run next for the norms the proof leaves, or None when it leaves none."""
    left = unproven(plan)
    if not left:
        return None
    norms, them = ("1 norm", "it") if len(left) == 1 else (f"{len(left)} norms", "them")
    return (
        f"next: {norms} cannot fold exactly; normpass replace {command_model} --calib DATA -o OUT replaces {them} "
        "by calibrated surrogates within an accuracy budget (docs/surrogates.md)"
    )


def command_model(args: argparse.Namespace) -> str:
    """The model as written on the command line, for a command to suggest."""
    return args.model if args.model is not None else f"--builtin {args.builtin}"


def add_verification_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", action="store_true", help="skip the numerical check against the original")
    parser.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME:DIMS",
        help="shape for verification inputs, e.g. input_ids:1x128 (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the verification inputs")


def verification_options(args: argparse.Namespace) -> dict:
    """The options `add_verification_arguments` sets, as `FoldOptions` (and the passes built on it) name them."""
    return {"verify": not args.no_verify, "input_shapes": parse_input_shapes(args.input_shape), "seed": args.seed}


def split_fractions(text: str, roles: str, example: str) -> tuple[float, ...]:
    """`--split`: as many comma-separated fractions as `roles` names (e.g. "FIT,HELD_OUT")."""
    count = roles.count(",") + 1
    message = f"--split {text!r}: expected {NUMBER_WORDS[count]} fractions {roles}, e.g. {example}"
    try:
        parts = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise InputError(message) from None
    if len(parts) != count:
        raise InputError(message)
    return parts


NUMBER_WORDS = {2: "two", 3: "three"}


def add_data_arguments(parser: argparse.ArgumentParser, required: bool, more_data: str = "") -> None:
    """Where calibration inputs come from and how they are batched (`calibration.load_batches`)."""
    parser.add_argument(
        "--calib",
        required=required,
        metavar="DATA",
        help="calibration inputs: an .npz (one array per model input, axis 0 = samples), a directory "
        'of NAME.npy files, or a .txt (one sentence per line) or .jsonl (a "text" field per line) file with '
        f"--tokenizer{more_data}",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the model's tokenizer.json (the tokenizers library) for .txt/.jsonl calibration text; it makes "
        "the inputs the model has among input_ids, attention_mask, token_type_ids",
    )
    parser.add_argument(
        "--max-length", type=int, default=128, help="tokens per sentence of calibration text (default 128)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch (default 16)")


def add_budget_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """How a pass that is not exact is judged: the budget, the held-out inputs, the mask (`core/budget.py`)."""
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="TERM=V",
        help="accuracy to keep, e.g. cos=0.999 (min per-sample cosine), rel=0.01 (max relative "
        f"error), top1=0.99 (arg-max agreement); repeat or comma-separate ({default})",
    )
    parser.add_argument(
        "--holdout", metavar="DATA", help="held-out inputs for the final check (default: a split of --calib)"
    )
    parser.add_argument(
        "--mask-input", metavar="NAME", help="attention-mask input (default: the rank-2 input named *mask*)"
    )


def checked_paths(
    args: argparse.Namespace, other_inputs: dict[str, Path] | None = None
) -> tuple[Path, dict[str, Path]]:
    """The `-o` path, and the files the inputs read (the model's and `other_inputs`), after `io.check_paths`."""
    folder = open_genai_folder(args)
    inputs = model_files("the input model", args.model) | (other_inputs or {})
    if folder is None:
        return check_paths(inputs, {"-o": args.output, "--report": args.report})["-o"], inputs
    check_paths(inputs, {"--report": args.report})
    return genai.check_output(folder, args.output), inputs


def open_genai_folder(args: argparse.Namespace) -> genai.Folder | None:
    """Where MODEL is an ONNX Runtime GenAI folder: the folder (also `args.genai`); MODEL then names its decoder,
    and calibration text without `--tokenizer` is read with the folder's `tokenizer.json`."""
    if args.genai is None and genai.is_folder(args.model):
        args.genai = genai.open_folder(args.model)
        args.model = str(args.genai.model)
        text = [getattr(args, "calib", None), getattr(args, "holdout", None)]
        if getattr(args, "tokenizer", "") is None and any(Path(t).suffix.lower() in TEXT_SUFFIXES for t in text if t):
            args.tokenizer = str(args.genai.tokenizer) if args.genai.tokenizer else None
    return args.genai


def save_result(
    result,
    out: Path,
    inputs: dict[str, Path],
    label: str,
    report: str | None,
    folder: genai.Folder | None = None,
    widths: dict[int, int] | None = None,
) -> None:
    """Write a pass's model to `out` (never over a file `inputs` reads), or the GenAI folder `out` for one read
    from `folder` (`widths`: a stream's width → the width it was cut to), and, if asked, its JSON report."""
    if folder is None:
        save_onnx_atomic(result.ir_model, out, keep=inputs.values())
    else:
        genai.write_folder(folder, result.ir_model, out, widths)
    if report:
        data = {"model": label, "output": str(out), **result.report()}
        write_text_atomic(json.dumps(data, indent=2) + "\n", report)


def model_source(args: argparse.Namespace) -> tuple[str | onnx.ModelProto, str]:
    """The model named on the command line, as its path (to be read lazily) or a built-in ModelProto, and a label."""
    if (args.model is None) == (args.builtin is None):
        raise InputError("give exactly one of MODEL (an .onnx path) or --builtin NAME")
    if args.model is not None:
        open_genai_folder(args)
        return str(args.model), str(args.model)
    try:
        from .. import models as builtin_models
    except ImportError as e:
        raise InputError(
            f"--builtin needs the model registry's dependencies: pip install 'normpass[models]' ({e})"
        ) from e
    if args.builtin not in builtin_models.names():
        raise InputError(
            f"--builtin {args.builtin!r}: unknown model; choose one of {', '.join(builtin_models.names())}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = builtin_models.export_onnx(args.builtin, Path(tmp) / f"{args.builtin}.onnx")
        return onnx.load(str(path)), f"builtin:{args.builtin}"
