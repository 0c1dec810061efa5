"""How a verb runs: whatever happens, one line on stderr and a documented exit code.

* A `NormpassError` is its message, exit `error.exit_code` (1 or 2).
* SIGINT, SIGTERM and SIGHUP raise `Stopped` in the main thread, so the clean-up code of the
  write in progress runs (`io.save_onnx_atomic` removes its temporary files; renames and
  clean-ups defer signals, `io.signals_deferred`); further signals are ignored while it does.
  Exit 128 + the signal's number (130, 143, 129), and the line says what was written before:
  "nothing written", or which outputs. Once the verb has returned, its outputs written and its
  summary printed, the work is done: the signals are ignored from then on and the exit code is the
  verb's. For the program itself (`run(..., program=True)`: `main()` reading the process's command
  line) they stay ignored until the process exits, so that a signal during the interpreter's
  shutdown cannot turn a finished run into a silent 143.
* Anything else is a bug: one line, exit 3 (the traceback with NORMPASS_DEBUG=1).

What libraries print on the way is not printed as it comes: Python warnings (a NumPy overflow)
and log records (onnx-ir's) are caught, and so is what native code (ONNX's C++, ONNX Runtime's
coloured log lines) writes to file descriptor 2, which Python's `sys.stderr` then no longer
points at. After a success each is a `warning:` line; after an error the first is added to the
error's line (unless the error already says it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import warnings

from .. import io
from ..errors import NormpassError

INTERNAL_ERROR = 3
STOPPING_SIGNALS: dict[int, str] = {
    signal.SIGINT: "interrupted",
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGHUP: "hung up (SIGHUP)",
}
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class Stopped(BaseException):
    """A stopping signal arrived (a BaseException, like KeyboardInterrupt: nothing catches it by accident)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run(command: str, verb, args, program: bool = False) -> int:
    """`verb(args)` under the rules of the module docstring; returns the exit code. `program`: this run is the
    process's command, which ends when it returns (the stopping signals are then left ignored)."""
    written = len(io.WRITTEN)
    notes: list[str] = []
    try:
        with _stopping_signals(program), _caught_messages(notes):
            code = verb(args)
            _ignore_stopping_signals()  # done: a signal from here on changes nothing
    except NormpassError as e:
        _say(command, f"error: {_with_notes(str(e), notes)}")
        return e.exit_code
    except BrokenPipeError:  # e.g. `normpass inspect --json | head`
        sys.stderr.close()
        return 0
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        outputs = io.WRITTEN[written:]
        done = f"wrote only {', '.join(map(str, outputs))}" if outputs else "nothing written"
        _say(command, f"{STOPPING_SIGNALS[signum]}; {done}")
        return 128 + signum
    except Exception as e:
        if os.environ.get("NORMPASS_DEBUG") == "1":
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        _say(
            command,
            f"internal error: {type(e).__name__}: {first} (a bug in normpass; "
            "re-run with NORMPASS_DEBUG=1 for the traceback and report it)",
        )
        return INTERNAL_ERROR
    for note in notes:
        _say(command, f"warning: {note}")
    return code


def _say(command: str, text: str) -> None:
    """One line on stderr, without the colour codes some libraries put in their messages."""
    print(f"normpass {command}: {ANSI_ESCAPE.sub('', text)}", file=sys.stderr)


def _with_notes(message: str, notes: list[str]) -> str:
    """`message` and the first note that it does not already contain (ONNX Runtime's log line of the
    error it raised, say)."""
    new = [note for note in notes if _core(note) not in message]
    if not new:
        return message
    more = f" and {len(new) - 1} more" if len(new) > 1 else ""
    return f"{message} (also reported: {new[0]}{more})"


def _core(note: str) -> str:
    """A log line without ONNX Runtime's `[E:onnxruntime:, file.cc:12 Function]` prefix."""
    return re.sub(r"^.*?\[[EWIV]:onnxruntime:[^\]]*\]\s*", "", note)[:80]


@contextlib.contextmanager
def _stopping_signals(program: bool = False):
    """SIGINT, SIGTERM and SIGHUP raise `Stopped`; the first one sets every one to be ignored until
    the block ends (the clean-up runs in peace); the previous handlers come back after, unless this is
    the `program`, which leaves them ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        _ignore_stopping_signals()
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if program else handler)


def _ignore_stopping_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for signum in STOPPING_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


class _Collector(logging.Handler):
    def __init__(self, notes: list[str]):
        super().__init__(logging.WARNING)
        self.notes = notes

    def emit(self, record: logging.LogRecord) -> None:
        _note(self.notes, f"{record.name}: {record.getMessage()}")


def _note(notes: list[str], text: str) -> None:
    lines = ANSI_ESCAPE.sub("", text).strip().splitlines()
    line = lines[0].strip() if lines else ""
    if line and line not in notes:
        notes.append(line)


@contextlib.contextmanager
def _caught_messages(notes: list[str]):
    """Warnings, log records and native writes to file descriptor 2 become `notes` (see the module docstring)."""
    root = logging.getLogger()
    collector = _Collector(notes)
    root.addHandler(collector)
    try:
        with warnings.catch_warnings(record=True) as caught, _native_stderr(notes):
            yield
    finally:
        root.removeHandler(collector)
        for warning in caught:
            _note(notes, f"{warning.category.__name__}: {warning.message}")


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # pytest's capture, a closed stream
        return None


@contextlib.contextmanager
def _native_stderr(notes: list[str]):
    """File descriptor 2 goes to a temporary file while the block runs; `sys.stderr`, where it wrote
    to descriptor 2, writes to a copy of the real one meanwhile. What was captured becomes notes."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    python_stderr = sys.stderr
    with tempfile.TemporaryFile() as capture:
        if _fileno(python_stderr) == 2:
            sys.stderr = open(  # noqa: SIM115 (closed in the finally below, once descriptor 2 is back)
                os.dup(real), "w", buffering=1, encoding=python_stderr.encoding, errors="backslashreplace"
            )
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(real, 2)
            os.close(real)
            if sys.stderr is not python_stderr:
                sys.stderr.close()
                sys.stderr = python_stderr
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                _note(notes, line)
