"""Progress of a long verb where nobody sees a progress bar: a line on stderr at least every `INTERVAL` seconds.

On a terminal the library's own bars show (`--progress`, tqdm: one updating line). In a log file or a pipe
those are off, and a verb that calibrates for minutes would say nothing; there `Heartbeat` prints, from a
background thread, `normpass VERB: 1 min 20 s: STAGE` every `INTERVAL` seconds, STAGE being the last stage
the library reported (`core.progress.stage`, log records of the `normpass.progress` logger), until the verb
ends. Reusable by any verb: `with Heartbeat("replace"): ...`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from ..core.progress import LOGGER_NAME

INTERVAL = 10.0  # seconds between two lines, at most


class Heartbeat(logging.Handler):
    """A context manager: while its block runs and stderr is not a terminal, a line every `interval` seconds."""

    def __init__(self, verb: str, interval: float | None = None):
        super().__init__(logging.INFO)
        self.verb, self.interval = verb, INTERVAL if interval is None else interval
        self.current = "started"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logger = logging.getLogger(LOGGER_NAME)
        self._saved = (self._logger.level, self._logger.propagate)

    def emit(self, record: logging.LogRecord) -> None:
        self.current = record.getMessage()

    def __enter__(self) -> Heartbeat:
        if sys.stderr.isatty():
            return self
        self._saved = (self._logger.level, self._logger.propagate)
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False  # the stages are this handler's alone
        self._logger.addHandler(self)
        self._thread = threading.Thread(target=self._beat, args=(time.monotonic(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved[0])
        self._logger.propagate = self._saved[1]

    def _beat(self, start: float) -> None:
        while not self._stop.wait(self.interval):
            line = f"normpass {self.verb}: {elapsed(time.monotonic() - start)}: {self.current}"
            print(line, file=sys.stderr, flush=True)


def elapsed(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
