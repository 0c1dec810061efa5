"""`normpass` command line: one sub-command per module in this package; verbs parse, call, print.

A mistyped option is answered by the verb's own usage and the closest option it has (`VerbParser`).

Exit codes: 0 success, 1 verification failed (nothing written), 2 bad input, 3 internal error (a bug:
one line, and the traceback with NORMPASS_DEBUG=1), 130 interrupted, 143 terminated (SIGTERM),
129 hung up (SIGHUP). Every error is one line on stderr (`guard.py`).
"""

from __future__ import annotations

import argparse
import difflib
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


class VerbParser(argparse.ArgumentParser):
    """A verb's parser: an argument it does not know is its error (its usage, not the top-level one), with the
    closest of its options when one is close, and it is named before a missing required argument is."""

    def parse_known_args(self, args=None, namespace=None):
        given = list(sys.argv[1:] if args is None else args)
        options = given[: given.index("--")] if "--" in given else given
        unknown = [arg for arg in options if arg.startswith("--") and not self._knows(arg.partition("=")[0])]
        if unknown:
            self.error(self._unrecognized(unknown))
        parsed, extras = super().parse_known_args(given, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return parsed, extras

    def _long_options(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings if option.startswith("--")]

    def _knows(self, option: str) -> bool:
        """Whether argparse takes `option`: one of ours, or the unambiguous start of one (abbreviations are allowed)."""
        return any(known.startswith(option) for known in self._long_options())

    def _unrecognized(self, arguments: list[str]) -> str:
        message = f"unrecognized argument{'s' if len(arguments) > 1 else ''}: {' '.join(arguments)}"
        first = next((arg.partition("=")[0] for arg in arguments if arg.startswith("-")), None)
        close = difflib.get_close_matches(first, self._long_options(), n=1) if first else []
        return message + (f"; did you mean {close[0]}?" if close else f" (see normpass {self._verb()} --help)")

    def _verb(self) -> str:
        return self.prog.split()[-1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normpass", description="Fold LayerNorms into RMSNorms, exactly, with proof.")
    parser.add_argument("--version", action="version", version=f"normpass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=VerbParser)
    for _name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (None: the process's own command line, `sys.argv`); returns the exit code."""
    args = build_parser().parse_args(argv)
    return guard.run(args.command, COMMANDS[args.command].run, args, program=argv is None)


if __name__ == "__main__":
    sys.exit(main())
