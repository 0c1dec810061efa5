"""The CLI's progress lines where no bar shows (`normpass/cli/progress.py`): at least one per interval,
naming the stage the pass last reported; none on a terminal, where the bars show."""

from __future__ import annotations

import io
import time

import numpy as np
import onnx
from conftest import build, randn, rng
from test_replace import POST_LN

from normpass.cli import progress as cli_progress
from normpass.cli.main import main
from normpass.core.progress import progress, stage


def test_heartbeat_prints_the_latest_stage_every_interval(capsys):
    with cli_progress.Heartbeat("slice", interval=0.05):
        stage("reading the model")
        time.sleep(0.3)
        list(progress([1, 2, 3], "calibrating", enabled=False))
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 4, lines
    assert all(line.startswith("normpass slice: 0 s: ") for line in lines)
    assert "normpass slice: 0 s: reading the model" in lines
    assert lines[-1] == "normpass slice: 0 s: calibrating: batch 3/3"
    time.sleep(0.15)
    assert capsys.readouterr().err == "", "nothing after the block"


def test_no_heartbeat_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with cli_progress.Heartbeat("replace", interval=0.01):
        stage("calibrating")
        time.sleep(0.1)
    assert terminal.getvalue() == ""


def test_elapsed_reads_as_minutes_and_hours():
    assert [cli_progress.elapsed(s) for s in (9.9, 65, 3725)] == ["9 s", "1 min 05 s", "1 h 02 min"]


def test_replace_prints_progress_when_stderr_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    gen = rng(7)
    weights = dict(W1=randn(gen, 8, 8, scale=0.3), b1=randn(gen, 8), g=1 + randn(gen, 8, scale=0.2))
    weights |= dict(bb=randn(gen, 8, scale=0.2), W2=randn(gen, 8, 8, scale=0.3), b2=randn(gen, 8))
    path = tmp_path / "m.onnx"
    onnx.save(build(POST_LN, **weights), str(path))
    np.savez(tmp_path / "calib.npz", a=randn(gen, 96, 8))
    monkeypatch.setattr(cli_progress, "INTERVAL", 0.002)
    args = ["replace", str(path), "--calib", str(tmp_path / "calib.npz"), "--budget", "cos=0.01", "--orders", "input"]
    assert main([*args, "-o", str(tmp_path / "out.onnx")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("normpass replace: ")]
    assert lines, "a line at least every interval"
    stages = {line.split(": ", 2)[2] for line in lines}
    assert any(s.startswith(("calibrating", "original model")) for s in stages), stages
