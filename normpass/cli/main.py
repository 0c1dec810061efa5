"""`normpass` command line: one sub-command per module in this package; verbs parse, call, print.

Exit codes: 0 success, 1 verification failed (nothing written), 2 bad input, 3 internal error (a bug:
one line, and the traceback with NORMPASS_DEBUG=1), 130 interrupted, 143 terminated (SIGTERM),
129 hung up (SIGHUP). Every error is one line on stderr (`guard.py`).
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import bench, distill, fold, guard, inspect, replace, rotate, slice, viz

COMMANDS = {
    "inspect": inspect,
    "fold": fold,
    "rotate": rotate,
    "slice": slice,
    "viz": viz,
    "bench": bench,
    "replace": replace,
    "distill": distill,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normpass", description="Fold LayerNorms into RMSNorms, exactly, with proof.")
    parser.add_argument("--version", action="version", version=f"normpass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for _name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (None: the process's own command line, `sys.argv`); returns the exit code."""
    args = build_parser().parse_args(argv)
    return guard.run(args.command, COMMANDS[args.command].run, args, program=argv is None)


if __name__ == "__main__":
    sys.exit(main())
