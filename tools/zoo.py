"""Run the zoo (models/zoo.py): every architecture through the dynamo and TorchScript exporters and
the PyTorch front end; print one line per run and, with --write, the coverage table (docs/zoo.md).

    python tools/zoo.py                              # every model, every front end
    python tools/zoo.py --models gpt2 timm-vit --front-ends torch
    python tools/zoo.py --write docs/zoo.md          # regenerate the table (all models, all front ends)

Exits 1 if a folded model does not match its original, a front end lists fewer LayerNorms than the
module runs, or a run fails. timm models are skipped, with the install command, where timm is missing.
"""

from __future__ import annotations

import argparse
import sys
import time

from normpass.io import write_text_atomic
from normpass.models import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", metavar="NAME", help="models to run (default: all)")
    parser.add_argument("--front-ends", nargs="+", choices=zoo.FRONT_ENDS, default=list(zoo.FRONT_ENDS))
    parser.add_argument("--write", metavar="PATH", help="write the coverage table there (docs/zoo.md)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models or []) - {m.name for m in zoo.ZOO})
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; known: {', '.join(m.name for m in zoo.ZOO)}")
    models = [m for m in zoo.ZOO if not args.models or m.name in args.models]
    if not zoo.timm_available() and any(m.source == "timm" for m in models):
        print(f"zoo: timm is not installed; its models are skipped (install: {zoo.TIMM_INSTALL})")
    runs, bad = [], []
    start = time.perf_counter()
    for model in (m for m in models if m.available):
        for front_end in args.front_ends:
            run = zoo.run(model, front_end)
            runs.append(run)
            problem = zoo.problem(run)
            if problem:
                bad.append(f"{model.name} ({front_end}): {problem}")
            error = "" if run.error is None else f" error {run.error:.1e}"
            print(
                f"{model.name:18s} {front_end:12s} {run.proven:3d} / {run.norms:3d} proven "
                f"(runs {run.executed}, folded {run.folded}){error} {run.seconds:5.1f}s"
                + (f" FAILED {run.failure}" if run.failure else ""),
                flush=True,
            )
    print(f"zoo: {len(runs)} runs in {time.perf_counter() - start:.0f} s")
    if args.write:
        write_text_atomic(zoo.table(runs), args.write)
        print(f"zoo: wrote {args.write}")
    for line in bad:
        print(f"zoo: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
