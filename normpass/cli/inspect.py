"""`normpass inspect MODEL [--json]`: which norms fold, which do not, and why."""

from __future__ import annotations

import argparse
import json

from ..passes import inspect_onnx
from ..plan import FoldPlan
from .common import add_model_arguments, load_model


def add_parser(sub) -> None:
    parser = sub.add_parser("inspect", help="explain which norms fold and why")
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")


def render_table(plan: FoldPlan, label: str) -> str:
    rows = [(d.name, d.op, "fold" if d.foldable else "keep", d.reason or f"centres {len(d.centred_layers)} layer(s)"
             + (f", inserts centring on {', '.join(i.tensor for i in d.insertions)}" if d.insertions else ""))
            for d in plan.decisions]
    header = ("norm", "op", "decision", "why")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    lines = [f"{label}: {len(plan.folded)} of {plan.total} norms fold exactly into RMSNorm", ""]
    for row in [header] + rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model, label = load_model(args)
    plan = inspect_onnx(model, insert_centering=not args.no_insert_centering, name=label)
    if args.json:
        print(json.dumps({"model": label, **plan.to_json()}, indent=2))
    else:
        print(render_table(plan, label))
    return 0
