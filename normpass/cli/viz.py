"""`normpass viz MODEL -o OUT.{html,svg,dot} [--full] [--norm NAME]`: draw the zero-mean graph.

The format follows the output's suffix unless `--format` says otherwise. HTML is one
self-contained file (pan, zoom, search, details on click); SVG and DOT are for docs and papers.
The decisions drawn are `normpass fold`'s with the same `--provider` and `--fold-with-beta-add`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InputError
from ..io import check_paths, model_files, write_text_atomic
from .common import add_decision_arguments, add_model_arguments, fold_decisions_of, model_source, open_genai_folder

FORMATS = ("html", "svg", "dot")  # normpass.viz.FORMATS, named here so that other commands start without networkx


def add_parser(sub) -> None:
    parser = sub.add_parser("viz", help="draw the zero-mean graph around every norm (html, svg or dot)")
    add_model_arguments(parser)
    add_decision_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write it: OUT.html, OUT.svg or OUT.dot")
    parser.add_argument("--format", choices=FORMATS, help="output format (default: from the suffix of -o)")
    parser.add_argument(
        "--full", action="store_true", help="draw every node instead of collapsing what no decision depends on"
    )
    parser.add_argument("--norm", metavar="NAME", help="focus on one norm (names as printed by `normpass inspect`)")


def run(args: argparse.Namespace) -> int:
    from ..viz import render

    open_genai_folder(args)  # a folder stands for its decoder, whose files -o must not overwrite
    out = check_paths(model_files("the input model", args.model), {"-o": args.output})["-o"]
    fmt = args.format or out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise InputError(
            f"{out}: cannot tell the format from the suffix {Path(out).suffix!r}; "
            f"use .html, .svg or .dot, or pass --format"
        )
    model, label = model_source(args)
    zmg, fold_plan = fold_decisions_of(args, model, label)
    write_text_atomic(render(zmg, fold_plan, fmt, full=args.full, norm=args.norm), out)
    print(f"{label}: {len(fold_plan.folded)} of {fold_plan.total} norms fold; wrote {fmt} to {out}")
    return 0
