"""`normpass` command line: one sub-command per module in this package; verbs parse, call, print.

Exit codes: 0 success, 1 verification failed (nothing written), 2 bad input, 3 internal error (a bug:
one line, and the traceback with NORMPASS_DEBUG=1), 130 interrupted. Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import NormpassError
from . import bench, fold, inspect, replace, rotate, viz

INTERNAL_ERROR = 3
COMMANDS = {"inspect": inspect, "fold": fold, "rotate": rotate, "viz": viz, "bench": bench, "replace": replace}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normpass", description="Fold LayerNorms into RMSNorms, exactly, with proof.")
    parser.add_argument("--version", action="version", version=f"normpass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for _name, module in COMMANDS.items():
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
    except Exception as e:
        if os.environ.get("NORMPASS_DEBUG") == "1":
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(
            f"normpass {args.command}: internal error: {type(e).__name__}: {first} (a bug in normpass; "
            "re-run with NORMPASS_DEBUG=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
