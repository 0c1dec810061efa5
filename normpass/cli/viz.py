"""`normpass viz MODEL -o OUT.{html,svg,dot} [--full] [--norm NAME]`: draw the zero-mean graph.

The format follows the output's suffix unless `--format` says otherwise. HTML is one
self-contained file (pan, zoom, search, details on click); SVG and DOT are for docs and papers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.analysis import plan as make_plan
from ..errors import InputError
from ..io import check_paths, model_files, write_text_atomic
from ..onnx.fold.driver import open_graph
from ..onnx.graph.frontend import build_zero_mean_graph
from .common import add_model_arguments, model_source

FORMATS = ("html", "svg", "dot")  # normpass.viz.FORMATS, named here so that other commands start without networkx


def add_parser(sub) -> None:
    parser = sub.add_parser("viz", help="draw the zero-mean graph around every norm (html, svg or dot)")
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write it: OUT.html, OUT.svg or OUT.dot")
    parser.add_argument("--format", choices=FORMATS, help="output format (default: from the suffix of -o)")
    parser.add_argument(
        "--full", action="store_true", help="draw every node instead of collapsing what no decision depends on"
    )
    parser.add_argument("--norm", metavar="NAME", help="focus on one norm (names as printed by `normpass inspect`)")


def run(args: argparse.Namespace) -> int:
    from ..viz import render

    out = check_paths(model_files("the input model", args.model), {"-o": args.output})["-o"]
    fmt = args.format or out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise InputError(
            f"{out}: cannot tell the format from the suffix {Path(out).suffix!r}; "
            f"use .html, .svg or .dot, or pass --format"
        )
    model, label = model_source(args)
    zmg = build_zero_mean_graph(open_graph(model, label))
    fold_plan = make_plan(zmg, not args.no_insert_centering)
    write_text_atomic(render(zmg, fold_plan, fmt, full=args.full, norm=args.norm), out)
    print(f"{label}: {len(fold_plan.folded)} of {fold_plan.total} norms fold; wrote {fmt} to {out}")
    return 0
