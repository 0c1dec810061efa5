"""`normpass bench ORIGINAL OPTIMIZED`: is the optimized model faster in ONNX Runtime, and by how much?

Interleaved runs after warm-up at one point (`--batch`, `--seq`) or along a sweep
(`--sweep seq=64,256,1024`); medians and the ratio per point (see `normpass.onnx.runtime.bench`). Refuses
(exit 1) when the two models' outputs differ beyond the dtype's tolerance, unless `--max-diff REL`
bounds the relative error explicitly (a `normpass replace` output keeps a budget, not the outputs).
"""

from __future__ import annotations

import argparse
import json
import math

from .. import genai
from ..errors import InputError, VerificationError
from ..io import check_paths, load_onnx, model_files, replacing, write_text_atomic


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="time an optimized model against its original in ONNX Runtime")
    parser.add_argument("original", help="the baseline .onnx model (or GenAI folder: its decoder)")
    parser.add_argument(
        "optimized", help="the .onnx model (or GenAI folder) to compare with it (e.g. the output of normpass fold)"
    )
    parser.add_argument(
        "--provider",
        choices=("cpu", "cuda"),
        default="cpu",
        help="execution provider; cuda needs onnxruntime-gpu (inputs and outputs stay on the GPU)",
    )
    parser.add_argument("--batch", type=int, default=1, help="size of dynamic first axes (default 1)")
    parser.add_argument(
        "--seq",
        type=int,
        default=128,
        help="size of other dynamic axes (default 128); for a KV-cache graph, the past of a one-token decode step",
    )
    parser.add_argument(
        "--sweep", metavar="AXIS=N,N,...", help="time several points, e.g. seq=64,256,1024 or batch=1,4"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per model and point (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per model and point first (default 2)")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="time per point: short points get more than --repeats runs (default 0: --repeats only)",
    )
    parser.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (default 0: ORT's choice)")
    parser.add_argument(
        "--max-diff",
        type=float,
        metavar="REL",
        help="time OPTIMIZED even though its outputs differ, if its max relative error against ORIGINAL "
        "is at most REL (e.g. 0.05 for a normpass replace output); default: refuse any difference "
        "beyond the dtype's tolerance",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument("--json", metavar="PATH", help="write the full report (every run time) as JSON")
    parser.add_argument("--csv", metavar="PATH", help="write one row per point and model as CSV")
    parser.add_argument("--plot", metavar="PATH", help="draw times and ratios as a PNG (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..onnx.runtime.bench import (  # ONNX Runtime: only when benchmarking
        ORT_ERRORS,
        Candidate,
        parse_sweep,
        plot,
        run_benchmark,
        to_csv,
    )

    for option, value, least in (
        ("--batch", args.batch, 1),
        ("--seq", args.seq, 1),
        ("--threads", args.threads, 0),
        ("--repeats", args.repeats, 1),
        ("--warmup", args.warmup, 0),
        ("--budget", args.budget, 0),
    ):
        if not least <= value < math.inf:  # NaN fails too
            raise InputError(f"{option} {value}: give a number of at least {least}")
    args.original, args.optimized = (
        str(genai.open_folder(path).model) if genai.is_folder(path) else path
        for path in (args.original, args.optimized)
    )
    inputs = model_files("ORIGINAL", args.original) | model_files("OPTIMIZED", args.optimized)
    outputs = list(check_paths(inputs, {"--json": args.json, "--csv": args.csv, "--plot": args.plot}).values())
    for path in (args.original, args.optimized):
        load_onnx(path)  # clear errors for a missing or unreadable file
    if args.plot and not args.plot.lower().endswith(".png"):
        raise InputError(f"{args.plot}: --plot draws a PNG; name the file *.png")
    sweep, points = None, [(args.batch, args.seq)]
    if args.sweep:
        sweep, values = parse_sweep(args.sweep)
        points = [(v, args.seq) if sweep == "batch" else (args.batch, v) for v in values]
    if args.max_diff is not None and not args.max_diff >= 0:
        raise InputError(f"--max-diff {args.max_diff}: give a relative error >= 0")
    candidates = [Candidate("original", args.original), Candidate("optimized", args.optimized, bound=args.max_diff)]
    try:
        report = run_benchmark(
            candidates,
            points,
            provider=args.provider,
            threads=args.threads,
            repeats=args.repeats,
            warmup=args.warmup,
            budget_s=args.budget,
            seed=args.seed,
            progress=not args.no_progress,
            sweep=sweep,
        )
    except VerificationError as e:
        raise VerificationError(str(e).replace("Candidate.bound", "--max-diff REL")) from e
    except ORT_ERRORS as e:  # one the benchmark could not pin on either model
        raise InputError(
            f"{args.original}, {args.optimized}: ONNX Runtime cannot run them: {str(e).splitlines()[0]}; "
            "check that both models run in ONNX Runtime"
        ) from e
    print(f"{'batch':>5} {'seq':>6} {'original ms':>12} {'optimized ms':>13} {'ratio':>7}  quartiles of ratio  verdict")
    for point in report["points"]:
        base, cand = point["results"]["original"], point["results"]["optimized"]
        verdict = "faster" if cand["ratio_p75"] < 1 else "slower" if cand["ratio_p25"] > 1 else "within noise"
        print(
            f"{point['batch']:>5} {point['seq']:>6} {base['median_ms']:>12.3f} {cand['median_ms']:>13.3f} "
            f"{cand['ratio']:>7.3f}  {cand['ratio_p25']:.3f}–{cand['ratio_p75']:.3f}        {verdict}"
        )
    if args.json:
        write_text_atomic(json.dumps(report, indent=2) + "\n", args.json)
    if args.csv:
        write_text_atomic(to_csv(report), args.csv)
    if args.plot:
        with replacing(args.plot) as tmp:
            plot(report, tmp)
    if outputs:
        print("wrote " + ", ".join(str(p) for p in outputs))
    return 0
