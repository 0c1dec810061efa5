"""`normpass` command line: one sub-command per module in this package; verbs parse, call, print.

Exit codes: 0 success, 1 verification failed (nothing written), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..errors import NormpassError
from . import bench, fold, inspect, replace, viz

COMMANDS = {"inspect": inspect, "fold": fold, "viz": viz, "bench": bench, "replace": replace}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normpass", description="Fold LayerNorms into RMSNorms, exactly, with proof.")
    parser.add_argument("--version", action="version", version=f"normpass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except NormpassError as e:
        print(f"normpass {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # e.g. `normpass inspect --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"normpass {args.command}: interrupted; nothing written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
