"""Calibration data under hostile input, for `replace`, `rotate` and `distill` (issue 37, items 1–7, and the
README's cases said but not decided): a file that cannot be read, data longer than the model's position table,
a split that leaves the test empty, a report redirected over a file, data of another dtype, a repeated
budget term. Each is one line on stderr and exit 2 naming the file, never exit 3 and never a pass on no data;
docs/contract.md, "Calibration files and budgets", states the decisions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import randn, rng
from test_contract import D, cli, ln_model, refused

POSITIONS, VOCAB = 64, 128  # the registry's BERT and GPT-2


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(ln_model(), path)
    return path


def good_npz(path: Path, count: int = 16) -> Path:
    np.savez(path, x=randn(rng(1), count, D))
    return path


def ids_npz(path: Path, length: int, count: int = 16, dtype=np.int64) -> Path:
    np.savez(path, input_ids=rng(2).integers(0, VOCAB, (count, length)).astype(dtype))
    return path


# --- 3. splits --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "says"), [("inf,1,1", "finite"), ("nan,1,1", "finite"), ("0.5,0.5,0", "judged on no data")]
)
def test_replace_refuses_a_split_that_cannot_be_judged(tmp_path, capsys, model_file, split, says):
    calib = good_npz(tmp_path / "calib.npz")
    line = refused(capsys, "replace", model_file, "--calib", calib, "--split", split, "-o", tmp_path / "o.onnx")
    assert "--split" in line and says in line and not (tmp_path / "o.onnx").exists()


def test_a_test_split_of_zero_is_fine_with_held_out_data(tmp_path, capsys, model_file):
    calib, holdout = good_npz(tmp_path / "calib.npz"), good_npz(tmp_path / "holdout.npz")
    args = ["--split", "0.5,0.5,0", "--holdout", holdout, "-o", tmp_path / "o.onnx"]
    code, out, err = cli(capsys, "replace", model_file, "--calib", calib, *args)
    assert code == 0 and "test (16 samples)" in out, err


# --- 4. a report redirected over a file ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/dev/stdout", "/proc/self/fd/1", "/dev/fd/1"])
def test_a_report_to_stdout_redirected_to_a_file_is_refused_and_the_file_kept(tmp_path, model_file, path):
    """`--report /dev/stdout >> log.txt`: a real process, since pytest captures stdout in-process."""
    log, out = tmp_path / "log.txt", tmp_path / "out.onnx"
    log.write_text("earlier lines\n")
    command = [sys.executable, "-m", "normpass", "replace", str(model_file), "--calib", "synthetic"]
    with log.open("a") as stdout:
        done = subprocess.run(
            [*command, "-o", str(out), "--report", path], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert done.returncode == 2 and "names an open file descriptor" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert log.read_text() == "earlier lines\n" and not out.exists()


def test_a_symlink_to_stdout_is_refused_too(tmp_path, capsys, model_file):
    link = tmp_path / "report.json"
    link.symlink_to("/dev/stdout")
    line = refused(capsys, "fold", model_file, "-o", tmp_path / "o.onnx", "--report", link)
    assert "open file descriptor" in line or "not a regular file" in line  # the file under it decides which


# --- undecided: budgets (--write-best: tests/test_replace.py) ----------------------------------------


def test_a_repeated_budget_term_is_refused(tmp_path, capsys, model_file):
    calib = good_npz(tmp_path / "calib.npz")
    for budget in (["--budget", "cos=0.99,cos=0.9"], ["--budget", "cos=0.99", "--budget", "cos=0.9"]):
        line = refused(capsys, "replace", model_file, "--calib", calib, *budget, "-o", tmp_path / "o.onnx")
        assert "cos is given twice" in line


def test_a_budget_is_printed_with_every_digit_given(tmp_path, capsys, model_file):
    calib = good_npz(tmp_path / "calib.npz")
    args = ["--budget", "cos=0.99999999,rel=0.00001", "-o", tmp_path / "o.onnx", "--report", tmp_path / "r.json"]
    code, out, err = cli(capsys, "replace", model_file, "--calib", calib, *args)
    assert code == 0 and "budget cos=0.99999999,rel=0.00001;" in out, err
    assert json.loads((tmp_path / "r.json").read_text())["budget"]["cos"] == 0.99999999
