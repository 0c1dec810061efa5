"""`normpass inspect MODEL [--json]`: which norms fold, which do not, and why, grouped by block.

The decisions are `normpass fold`'s with the same `--provider` and `--fold-with-beta-add` (`fold_decisions`):
the proven norms, less those the fold keeps as LayerNorms because their β could move nowhere.

A norm's *block* is read from the name of its γ (else β, else the norm's own name): the prefix up
to the first numeric component (`model.transformer.h.0.ln_1.weight` → `transformer.h.0`), or the
enclosing module when there is none (`model.transformer.ln_f.weight` → `transformer`). A leading
`model.` (the usual wrapper attribute) is dropped.

Output: on a terminal with `rich` installed (`normpass[pretty]`; rich honours NO_COLOR and COLUMNS), a
coloured list with each norm's reason on its own line, wrapped at the terminal's width; else (piped, or
no rich) a plain aligned table, one complete row per norm, that is easy to grep. `--json` prints a stable
object: {"model", "norms": [{"name", "op", "foldable", "kept", "reason", "centred_layers",
"inserted_centering", "blocked_by", "blocking_path", "block"}], "total", "foldable"} (docs/inspect.md
shows it; tests/test_docs.py checks that page against this command's output).

`--rotation` also folds the model as `normpass rotate` does and says which residual streams could
then be rotated, and why the others not, whose keys `rotate --calib` could centre, which norm outputs
`rotate --calib --smooth` could smooth and which down projections `--online-rotation` could rotate (a
section after the table; in JSON, added keys "rotation":
{"streams": [{"stream", "rotatable", "reason", "hidden_size", "norms", "writers", "readers",
"gamma_moved_from", "tensors", "blocked_by", "blocking_path"}], "total", "rotatable"}, "keys":
{"centred": [{"softmax", "bias_add"}], "refused": [{"softmax", "reason"}]}, "smoothing": {"alpha",
"smoothed": [{"norm", "tensor", "readers", "placement"}], "refused": [{"norm", "reason"}],
"on_rotated_streams"} and "online_rotation": {"block", "matrix", "rotated", "keep_fp32", "refused":
[{"node", "reason"}]}, what `--online-rotation` would rotate).
Names are those of the folded graph, as in the rotated model.

`--slice` says which residual streams `normpass slice` could cut, and why the others stay whole (a
section after the table; in JSON, the added key "slice": {"streams": [{"sliceable", "stream", "reason",
"hidden_size", "norms", "writers", "readers", "blocked_by", "blocking_path"}], "total", "sliceable"}).

`--graph OUT.graphml` (or `OUT.json`, networkx node-link JSON) also writes the zero-mean graph for
other tools (`ZeroMeanGraph.to_networkx`: nodes with kind, op, rule and, for norms, the decision;
edges labelled with their tensor and input index), atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys

from ..core.graph import ZeroMeanGraph
from ..core.plan import FoldPlan, NormDecision
from ..core.rotation import RotationPlan
from ..errors import InputError
from ..io import check_paths, model_files, write_text_atomic
from ..onnx.rotate.driver import RotateOptions, inspect_rotation
from ..onnx.rotate.keys import KeyPlan
from ..onnx.rotate.online import OnlinePlan
from ..onnx.rotate.smooth import SmoothPlan
from ..onnx.slice.driver import SliceOptions, SlicePlan, inspect_slice
from .common import add_decision_arguments, add_model_arguments, fold_decisions_of, model_source, open_genai_folder

PARAMETER_NAMES = {"weight", "bias", "gamma", "beta", "scale"}
HEADER = ("block", "norm", "op", "decision", "why")
REASON_INDENT = 6  # on a terminal, a norm's reason goes on the lines below its row, this far in


def add_parser(sub) -> None:
    parser = sub.add_parser("inspect", help="explain which norms fold and why")
    add_model_arguments(parser)
    add_decision_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    parser.add_argument(
        "--graph", metavar="OUT", help="also write the zero-mean graph: OUT.graphml or OUT.json (node-link)"
    )
    parser.add_argument(
        "--rotation",
        action="store_true",
        help="also say which residual streams `normpass rotate` could rotate after folding, and why the others not",
    )
    parser.add_argument(
        "--slice",
        action="store_true",
        help="also say which residual streams `normpass slice` could cut after folding, and why the others not",
    )


def block_of(name: str) -> str:
    """The block a parameter or node name belongs to (see the module docstring)."""
    parts = [p for p in re.split(r"[./]", name) if p]
    if len(parts) > 1 and parts[0] == "model":
        parts = parts[1:]
    if parts and parts[-1] in PARAMETER_NAMES:
        parts = parts[:-1]
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1]) or "(top level)"


def blocks(zmg: ZeroMeanGraph) -> dict[str, str]:
    """Norm name → block."""
    return {norm.name: block_of(norm.scale or norm.bias or norm.name) for norm in zmg.norms}


def why(decision: NormDecision) -> str:
    if decision.reason:
        return decision.reason
    text = f"centres {len(decision.centred_layers)} layer(s)"
    if decision.insertions:
        text += f", inserts centring on {', '.join(i.tensor for i in decision.insertions)}"
    return text


def grouped(plan: FoldPlan, block: dict[str, str]) -> list[tuple[str, list[NormDecision]]]:
    """Decisions grouped by block; blocks in order of their first norm, norms in graph order."""
    groups: dict[str, list[NormDecision]] = {}
    for decision in plan.decisions:
        groups.setdefault(block.get(decision.name, "(top level)"), []).append(decision)
    return list(groups.items())


def headline(plan: FoldPlan, label: str) -> str:
    return f"{label}: {len(plan.folded)} of {plan.total} norms fold exactly into RMSNorm"


def render_plain(plan: FoldPlan, label: str, block: dict[str, str]) -> str:
    """Aligned text: the block on its group's first row, a blank line between groups."""
    groups = grouped(plan, block)
    rows = [
        [(name if i == 0 else ""), d.name, d.op, "fold" if d.foldable else "keep", why(d)]
        for name, decisions in groups
        for i, d in enumerate(decisions)
    ]
    widths = [max(len(row[i]) for row in rows + [list(HEADER)]) for i in range(len(HEADER) - 1)]

    def line(row):
        return "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])) + "  " + row[-1]

    lines = [headline(plan, label), "", line(HEADER)]
    for index, row in enumerate(rows):
        if index and row[0]:
            lines.append("")
        lines.append(line(row))
    return "\n".join(lines)


def print_rich(plan: FoldPlan, label: str, block: dict[str, str], console) -> None:
    """For a terminal: a bold title row per block, one row per norm (fold in green, keep in red) and its
    reason on the line below, wrapped at the console's width, so that a reason reads in full at 80 columns."""
    from rich.text import Text

    groups = grouped(plan, block)
    name_width = max(len(d.name) for _, decisions in groups for d in decisions)
    op_width = max(len(d.op) for _, decisions in groups for d in decisions)
    console.print(Text(headline(plan, label), style="bold"))
    for name, decisions in groups:
        console.print()
        console.print(Text(name, style="bold cyan"))
        for d in decisions:
            row = Text(f"  {d.name.ljust(name_width)}  {d.op.ljust(op_width)}  ", no_wrap=True, overflow="fold")
            row.append("fold" if d.foldable else "keep", style="green" if d.foldable else "red")
            console.print(row)
            for line in Text(why(d), style="dim").wrap(console, max(console.width - REASON_INDENT, 20)):
                line.rstrip()
                console.print(Text(" " * REASON_INDENT) + line)


def to_json(plan: FoldPlan, label: str, block: dict[str, str]) -> dict:
    data = {"model": label, **plan.to_json()}
    for norm in data["norms"]:
        norm["block"] = block.get(norm["name"])
    return data


GRAPH_FORMATS = (".graphml", ".json")


def graph_text(zmg: ZeroMeanGraph, plan: FoldPlan, suffix: str) -> str:
    """The zero-mean graph with the plan's decisions as GraphML (`.graphml`) or node-link JSON (`.json`)."""
    import networkx as nx  # only for this output: every other command starts without it

    graph = zmg.to_networkx(plan)
    if suffix == ".graphml":
        return "\n".join(nx.generate_graphml(graph)) + "\n"
    return json.dumps(nx.node_link_data(graph, edges="edges"), indent=1) + "\n"


def render_rotation(rotation: RotationPlan, keys: KeyPlan, smoothing: SmoothPlan, online: OnlinePlan) -> str:
    """The rotation section: one line per stream, its verdict and why; then the attentions whose keys
    `rotate --calib` would centre, the norm outputs `--smooth` would smooth and the down projections
    `--online-rotation` would rotate, and why the others not."""
    lines = [
        f"rotation (after folding; names as in the rotated model): {len(rotation.rotatable)} of "
        f"{len(rotation.streams)} residual streams rotatable"
    ]
    for stream in rotation.streams:
        if stream.rotatable:
            verdict = (
                f"rotatable: hidden size {stream.width}, {len(stream.norms)} norms, "
                f"{len(stream.writers)} writers, {len(stream.readers)} readers"
            )
        else:
            verdict = f"not rotatable: {stream.reason}"
        lines.append(f"  stream of {stream.name}: {verdict}")
    lines.append(f"key centring (rotate --calib): {len(keys.sites)} of {keys.total} attentions")
    lines += [f"  keys not centred at {softmax}: {reason}" for softmax, reason in keys.refused.items()]
    lines.append(f"smoothing (rotate --calib --smooth): {smoothing.summary}")
    lines += [f"  not smoothed {norm}: {reason}" for norm, reason in smoothing.refused.items()]
    lines.append(f"online rotation (rotate --online-rotation): {online.summary}")
    lines += [f"  not rotated online {node}: {reason}" for node, reason in online.refused.items()]
    return "\n".join(lines)


def render_slice(plan: SlicePlan) -> str:
    """The slicing section: one line per stream, sliceable (its width, norms, writers and readers) or why not."""
    lines = [
        f"slicing (after folding; names as in the sliced model): {len(plan.sliceable)} of {len(plan.streams)} "
        "residual streams sliceable"
    ]
    for stream in plan.streams:
        reason = plan.reasons.get(stream.name)
        verdict = (
            f"sliceable: hidden size {stream.width}, {len(stream.norms)} norms, {len(stream.writers)} writers, "
            f"{len(stream.readers)} readers"
            if reason is None
            else f"left whole: {reason}"
        )
        lines.append(f"  stream of {stream.name}: {verdict}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    open_genai_folder(args)  # a folder stands for its decoder, whose files --graph must not overwrite
    graph_out = check_paths(model_files("the input model", args.model), {"--graph": args.graph}).get("--graph")
    if graph_out is not None and graph_out.suffix.lower() not in GRAPH_FORMATS:
        raise InputError(f"{graph_out}: --graph writes .graphml or .json; choose a path with one of those suffixes")
    with contextlib.redirect_stdout(sys.stderr):  # libraries' warnings stay off stdout
        model, label = model_source(args)
        zmg, fold_plan = fold_decisions_of(args, model, label)
        block = blocks(zmg)
        options = RotateOptions(insert_centering=not args.no_insert_centering)
        # streams, keys, smoothing, online
        rotation = inspect_rotation(model, options, label)[1:] if args.rotation else None
        slicing = (
            inspect_slice(model, SliceOptions(insert_centering=not args.no_insert_centering), label)
            if args.slice
            else None
        )
        if graph_out is not None:
            write_text_atomic(graph_text(zmg, fold_plan, graph_out.suffix.lower()), graph_out)
            print(f"{label}: wrote the zero-mean graph to {graph_out}")
    if args.json:
        data = to_json(fold_plan, label, block)
        if rotation is not None:
            streams, keys, smoothing, online = rotation
            data["rotation"], data["keys"], data["smoothing"] = streams.to_json(), keys.to_json(), smoothing.to_json()
            data["online_rotation"] = online.to_json()
        if slicing is not None:
            data["slice"] = slicing.to_json()
        print(json.dumps(data, indent=2))
        return 0
    console = _terminal_console()
    if console is None:
        print(render_plain(fold_plan, label, block))
    else:
        print_rich(fold_plan, label, block, console)
    if rotation is not None:
        print("\n" + render_rotation(*rotation))
    if slicing is not None:
        print("\n" + render_slice(slicing))
    return 0


def _terminal_console():
    """A rich Console when stdout is a terminal and rich is installed, else None."""
    if not sys.stdout.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console()
