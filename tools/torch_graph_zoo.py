"""The zoo (models/zoo.py) through the PyTorch front end's two rewrites: `normpass.fold` (module swap)
and `normpass.fold_graph` (torch.export's graph); one line per model, a Markdown table with --markdown.

    python tools/torch_graph_zoo.py                         # every model
    python tools/torch_graph_zoo.py --models whisper timm-xcit
    python tools/torch_graph_zoo.py --dynamic batch         # fold_graph captured with axis 0 of every input dynamic
    python tools/torch_graph_zoo.py --dynamic every         # … with every dimension Dim.AUTO

Each folded result is checked against the module's own outputs here (not by normpass's verifier):
the largest relative error is printed (with --dynamic, the larger of the errors at the example
batch and at one more). Exits 1 if one is above 1e-4 or a run fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

import normpass
from normpass.models import zoo
from normpass.torch.api import auto_dynamic_shapes

TOLERANCE = 1e-4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", metavar="NAME", help="models to run (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print the rows that differ as a Markdown table")
    parser.add_argument(
        "--dynamic",
        choices=["batch", "every"],
        help="capture fold_graph with axis 0 (batch) or every dimension (every) of every input Dim.AUTO, dynamic "
        "where the model allows it (`normpass fold --torch --graph` tries every, then batch), and check it at "
        "another batch size",
    )
    args = parser.parse_args(argv)
    models = [m for m in zoo.ZOO if m.available and (not args.models or m.name in args.models)]
    rows, bad = [], []
    for model in models:
        module, inputs = model.build()
        line = [model.name]
        for rewrite in (normpass.fold, normpass.fold_graph):
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if rewrite is normpass.fold_graph and args.dynamic:
                        dynamic = auto_dynamic_shapes(inputs, batch_only=args.dynamic == "batch")
                        folded, report = rewrite(module, inputs, verify=False, dynamic_shapes=dynamic)
                    else:
                        folded, report = rewrite(module, inputs, verify=False)
            except Exception as e:  # a capture refusal: the line says which
                line.append(f"failed: {type(e).__name__}")
                bad.append(f"{model.name} ({rewrite.__name__}): {e}")
                continue
            error = zoo.relative_error(module, folded, inputs)
            if args.dynamic:  # one more sample: the first again
                longer = tuple(torch.cat([x, x[:1]]) for x in inputs)
                error = max(error, zoo.relative_error(module, folded, longer))
            if error > TOLERANCE:
                bad.append(f"{model.name} ({rewrite.__name__}): error {error:.1e}")
            seconds = time.perf_counter() - start
            norms = sum(zoo._is_layer_norm(d.reason) for d in report.plan.decisions)  # as docs/zoo.md counts
            line.append(f"{report.folded} / {norms} ({error:.1e}, {seconds:.1f} s)")
        rows.append(line)
        print(f"{line[0]:18s} fold {line[1]:28s} fold_graph {line[2]}", flush=True)
    if args.markdown:
        print("\n| model | `fold` | `fold_graph` |\n|---|---|---|")
        for name, by_module, by_graph in (r for r in rows if len(r) == 3):
            if by_module.split(" (")[0] != by_graph.split(" (")[0]:
                print(f"| {name} | {by_module.split(' (')[0]} | {by_graph.split(' (')[0]} |")
    for problem in bad:
        print(f"torch_graph_zoo: {problem}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
