"""`normpass distill --torch package.module:factory --calib DATA --budget cos=0.99 -o OUT.onnx [--report R.json]`.

Distils the PyTorch module `factory()` returns (`(module, example_inputs)`, as `fold --torch`
takes it) into a student whose norms are trained reduction-free surrogates (`torch/distill.py`),
exports the student with `torch.onnx.export` and checks the file in ONNX Runtime against the
student on the example inputs. Exit 1 when the student misses the budget on the test split
(nothing written); the report is written either way. An ONNX model is refused (ONNX_REFUSAL).
"""

from __future__ import annotations

import argparse
import collections
import json

from ..core.budget import Budget, Metrics
from ..core.replace import BudgetMissed
from ..errors import InputError, VerificationError
from ..io import calibration_files, check_paths, save_onnx_atomic, write_text_atomic
from ..onnx.runtime.verify import compare_outputs
from ..onnx.runtime.verify import run as run_onnx
from .fold import _factory_file
from .progress import Heartbeat
from .replace import add_calibration_arguments, calibration_options

DEFAULT_BUDGET = "cos=0.99"
ONNX_REFUSAL = (
    "distill trains the model, which takes its PyTorch module: give --torch package.module:factory instead of "
    "an ONNX file (ONNX-to-PyTorch converters handle only some exporters' graphs, and a closed-form fit without "
    "training stays far from the budget; docs/distill.md)"
)
# ONNX ops that compute a norm's reduction: none may be left for a replaced norm.
NORM_OPS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "ReduceMean")


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "distill", help="train reduction-free surrogates for a PyTorch model's norms against the model itself"
    )
    parser.add_argument("model", nargs="?", help="(refused: distill takes the PyTorch module, --torch)")
    parser.add_argument(
        "--torch",
        metavar="PACKAGE.MODULE:FACTORY",
        help="the model: FACTORY() returns (module, example_inputs); the example inputs trace the export, "
        "whose input dimensions stay dynamic where the module allows it",
    )
    parser.add_argument("-o", "--output", required=True, help="where to write the distilled model (ONNX)")
    add_calibration_arguments(parser, DEFAULT_BUDGET, "0.7,0.15,0.15", "TRAIN,DECIDE,TEST", "training, deciding")
    parser.add_argument(
        "--with",
        dest="kind",
        default="affine",
        choices=("affine", "scalebias", "dyt", "derf"),
        help="surrogate kind: affine (DaMN; default), scalebias (α·x+β), dyt (γ·tanh(αx)+β), derf (γ·erf(αx+s)+β)",
    )
    parser.add_argument(
        "--keep",
        action="append",
        metavar="N|NAME",
        help="norms kept from the start: a count of the most damaging ones, or names (repeatable; default 0)",
    )
    parser.add_argument(
        "--all-norms",
        action="store_true",
        help="the norms the exact pass folds are replaced too (a norm-free model; default: exact folds stay)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="training rounds, each keeping one more norm (3)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per round (default 300)")
    parser.add_argument("--ramp", type=float, default=0.3, help="share of the steps removing the norms (0.3)")
    parser.add_argument(
        "--train",
        choices=("surrogates", "linears", "all"),
        default="linears",
        help="what trains besides the surrogates: nothing, the linear layers and kept norms (default), or all",
    )
    parser.add_argument("--lr", type=float, default=5e-5, help="learning rate of the model's parameters")
    parser.add_argument("--lr-surrogates", type=float, default=1e-3, help="learning rate of the surrogates")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between checks on the decide split")
    parser.add_argument(
        "--margin", type=float, default=1.0, help="share of the budget's allowance the decide split may use (1.0)"
    )
    parser.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop training after this long")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the student trains and is judged: cpu (default), cuda or cuda:N (the calibration before "
        "training and the emission after it run on the CPU)",
    )


def _keep(values: list[str] | None) -> tuple[str, ...] | int:
    if not values:
        return 0
    if len(values) == 1 and values[0].isdigit():
        return int(values[0])
    if any(v.isdigit() for v in values):
        raise InputError("--keep: give one count, or norm names")
    return tuple(values)


def _options(args: argparse.Namespace):
    from ..torch.distill import DistillOptions

    options = DistillOptions(
        kind=args.kind,
        budget=",".join(args.budget or [DEFAULT_BUDGET]),
        keep=_keep(args.keep),
        all_norms=args.all_norms,
        rounds=args.rounds,
        steps=args.steps,
        ramp=args.ramp,
        train=args.train,
        lr=args.lr,
        lr_surrogates=args.lr_surrogates,
        eval_every=args.eval_every,
        margin=args.margin,
        time_limit=args.time_limit,
        device=args.device,
        **calibration_options(args),
    )
    try:
        options.budget = Budget.parse(str(options.budget))
        options.replace_options().checked()
        options.torch_device()
    except InputError as e:  # the library's message starts with the option's name
        name, _, rest = str(e).partition(" ")
        flag = {"kind": "with"}.get(name, name.replace("_", "-"))
        raise InputError(f"--{flag} {rest}") from None
    return options


def norm_ops(model) -> dict[str, int]:
    """How many of each op that computes a norm's reduction `model` has."""
    counts = collections.Counter(node.op_type for node in model.graph.node)
    return {op: counts[op] for op in NORM_OPS if counts[op]}


def check_export(model, student, inputs: tuple):
    """The exported file in ONNX Runtime against the student on the example inputs."""
    from ..torch.api import _outputs
    from ..torch.fx import to_numpy

    expected = [to_numpy(v) for v in _outputs(student, inputs, {}).values()]
    feeds = {i.name: to_numpy(t) for i, t in zip(model.graph.input, inputs, strict=False)}
    got = run_onnx(model, feeds)
    names = [o.name for o in model.graph.output]
    comparison = compare_outputs(dict(zip(names, expected, strict=False)), got)
    if not comparison.passed:
        raise VerificationError(f"the exported ONNX file differs from the distilled module: {comparison.failures()}")
    return comparison


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        raise InputError(f"{args.model}: {ONNX_REFUSAL}")
    if not args.torch:
        raise InputError(
            "give the model to distill: --torch package.module:factory (returning (module, example_inputs))"
        )
    inputs_files = (
        _factory_file(args.torch)
        | calibration_files("--calib", args.calib)
        | calibration_files("--holdout", args.holdout)
        | calibration_files("--tokenizer", args.tokenizer)
    )
    out = check_paths(inputs_files, {"-o": args.output, "--report": args.report})["-o"]
    options = _options(args)
    from ..torch.api import load_factory, to_onnx
    from ..torch.distill import distill

    label = f"torch:{args.torch}"
    module, inputs = load_factory(args.torch)
    try:
        with Heartbeat("distill"):
            student, report = distill(module, args.calib, options, name=label)
    except BudgetMissed as e:
        if args.report:
            write_text_atomic(json.dumps({"output": None, **e.report.to_json()}, indent=2) + "\n", args.report)
        raise
    exported = to_onnx(student, inputs)
    ops = norm_ops(exported)
    try:
        comparison = check_export(exported, student, inputs)
    except VerificationError as e:
        if args.report:
            data = {"output": None, "onnx": {"norm_ops": ops, "check": str(e)}, **report.to_json()}
            write_text_atomic(json.dumps(data, indent=2) + "\n", args.report)
        raise
    save_onnx_atomic(exported, out)
    data = {"output": str(out), "onnx": {"norm_ops": ops, "check": comparison.describe()}, **report.to_json()}
    if args.report:
        write_text_atomic(json.dumps(data, indent=2) + "\n", args.report)
    test = data["test"]
    print(
        f"{label}: {data['exact']} of {data['total']} norms folded exactly, {data['replaced']} replaced by trained "
        f"{data['kind']} surrogates, {len(data['kept'])} kept; test ({test['samples']} samples): "
        f"{Metrics.from_json(test).describe()}; budget {options.budget}; {data['steps']} steps; "
        f"ONNX norm ops left: {', '.join(f'{op}×{n}' for op, n in ops.items()) or 'none'} "
        f"({comparison.describe()}); wrote {out}"
    )
    for name in data["kept"]:
        print(f"  kept {name}")
    return 0
