"""The CLI check shared by the corpus tests (test_corpus.py, test_thirdparty.py).

`cli_exit_code`: one `normpass` command on a file through `normpass.cli.main.main`, quietly. (The
independent numerical check is `builtin_models.reference.rewrite_error`, shared with tools/corpus.py.)
"""

from __future__ import annotations

import contextlib
import io
import pathlib

from normpass.cli.main import main


def cli_exit_code(command: str, path: pathlib.Path, workdir: pathlib.Path, *options: str) -> tuple[int, str]:
    """(exit code, captured output) of `normpass COMMAND PATH [OPTIONS]` (fold and viz write into `workdir`)."""
    outputs = {"inspect": [], "fold": ["-o", str(workdir / "folded.onnx")], "viz": ["-o", str(workdir / "graph.html")]}
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        code = main([command, str(path), *outputs[command], *options])
    return code, sink.getvalue()
