"""`normpass slice --torch FACTORY`: slice a PyTorch module's graph (`normpass.slice`), export it, check the file.

The sliced (and, with `--recover-train`, trained) graph is judged on the held-out data against the module by
`normpass.slice` itself, under the budget and `--write-best` as every slice is; the ONNX export is then run in
ONNX Runtime on the example inputs and compared with the graph (fp32 tolerance), and written only if it agrees.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.replace import BudgetMissed
from ..errors import InputError, VerificationError
from ..io import save_onnx_atomic, write_text_atomic
from ..onnx.slice.driver import SliceOptions
from .distill import check_export
from .progress import Heartbeat


def run_torch(args: argparse.Namespace, options: SliceOptions, out: Path) -> int:
    if args.model is not None or args.builtin is not None:
        raise InputError("--torch replaces MODEL and --builtin; give only one")
    if options.recover:
        raise InputError(
            "--recover refits the layers of an ONNX graph; with --torch the sliced module is trained back: "
            "--recover-train SECONDS"
        )
    from ..torch.api import auto_dynamic_shapes, load_factory, to_onnx
    from ..torch.slice import slice as slice_module

    label = f"torch:{args.torch}"
    module, inputs = load_factory(args.torch)
    dynamic = auto_dynamic_shapes(inputs)
    try:
        with Heartbeat("slice"):
            graph, report = slice_module(module, inputs, args.calib, options, dynamic_shapes=dynamic, name=label)
    except BudgetMissed as e:
        if args.report:
            write_text_atomic(json.dumps({"model": label, **e.report.to_json()}, indent=2) + "\n", args.report)
        raise
    exported = to_onnx(graph, inputs, dynamic)
    data = {"model": label, "output": str(out), **report.to_json()}
    try:
        comparison = check_export(exported, graph, inputs)
    except VerificationError as e:
        if args.report:
            data |= {"output": None, "onnx": {"check": str(e)}}
            write_text_atomic(json.dumps(data, indent=2) + "\n", args.report)
        raise
    save_onnx_atomic(exported, out)
    data["onnx"] = {"check": comparison.describe()}
    if args.report:
        write_text_atomic(json.dumps(data, indent=2) + "\n", args.report)
    print("\n".join(summary(label, report, comparison.describe(), out)))
    return 0


def summary(label: str, report, check: str, out: Path) -> list[str]:
    """What `slice --torch` prints: what was cut, the held-out figures (before and after training), each
    stream left whole with why."""
    chosen = report.chosen
    kept = chosen.kept
    widths = ", ".join(f"{s.width} → {kept[s.name]}" for s in report.slicing.sliceable)
    cut = f"{widths}; " if widths else ""  # no stream cut: the parameters alone
    held = chosen.held_out
    figures = (
        f"held out ({held.samples} samples): cos min {held.cos_min:.6f}, mean {held.cos_mean:.6f}, "
        f"rel max {held.rel_max:.3g}"
    )
    training = chosen.recovery
    if training is not None and training.held_out_before is not None:
        before = training.held_out_before
        figures += (
            f"; {training.describe()} (held out before it: cos min {before.cos_min:.6f}, mean "
            f"{before.cos_mean:.6f}, rel max {before.rel_max:.3g})"
        )
    budget = "" if report.budget is None else f"; budget {report.budget}"
    lines = [
        f"{label}: {len(report.slicing.sliceable)} of {len(report.slicing.streams)} residual streams sliced at "
        f"ratio {report.ratio:g} ({cut}{chosen.parameters} of {report.parameters} parameters); {figures}"
        f"{budget}; ONNX export {check}; wrote {out}"
    ]
    if chosen.ratio != report.requested_ratio:
        lines.append(
            f"  ratio {report.requested_ratio:g} missed the budget: wrote ratio {report.ratio:g}, the largest tried "
            "that meets it (--write-best)"
        )
    for stream in report.slicing.streams:
        if stream.name in report.slicing.reasons:
            lines.append(f"  left whole: the stream of {stream.name}: {report.slicing.reasons[stream.name]}")
    return lines
