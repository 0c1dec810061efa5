"""A model that fixes its batch axis (axis 0 of its inputs): calibration data is read in that batch where no
size is given, said in a note (not a warning), and a `--batch-size` the model does not take is exit 2 in one
line naming the flag and the size that works (`onnx/calibrate.batch_size_for`)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import rng
from test_slice import ids, low_rank_model

from normpass.cli.main import main
from normpass.errors import InputError
from normpass.onnx.calibrate import batch_size_for, fixed_batch
from normpass.onnx.slice import SliceOptions, slice_onnx

BATCH = 4


@pytest.fixture
def fixed(tmp_path):
    """A pre-LN block whose inputs and outputs fix the batch to 4, and calibration ids of 16 samples."""
    model = low_rank_model(rng(5))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = BATCH
    path, calib = tmp_path / "model.onnx", tmp_path / "calib.npz"
    onnx.save(model, path)
    np.savez(calib, **ids(7, 16))
    return tmp_path, path, calib


def test_the_batch_size_is_the_given_one_or_the_one_the_model_fixes(fixed):
    _, path, _ = fixed
    model = onnx.load(str(path))
    assert fixed_batch(model) == ("ids", BATCH)
    size, note = batch_size_for(model, None, "m")
    assert size == BATCH and note == "calibration data read in batches of 4, the batch m fixes (input ids, axis 0)"
    assert batch_size_for(model, BATCH, "m") == (BATCH, None)
    with pytest.raises(InputError, match=r"^--batch-size 16: m fixes the batch \(axis 0 of input ids\) to 4; pass"):
        batch_size_for(model, 16, "m")
    free = low_rank_model(rng(5))
    assert fixed_batch(free) is None
    assert batch_size_for(free, None) == (16, None) and batch_size_for(free, 3) == (3, None)


def test_slice_reads_calibration_in_the_batch_the_model_fixes_and_says_so(fixed, capsys):
    tmp, path, calib = fixed
    out, report = tmp / "out.onnx", tmp / "report.json"
    argv = ["slice", str(path), "-o", str(out), "--calib", str(calib), "--ratio", "0.5", "--report", str(report)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    note = f"note: calibration data read in batches of 4, the batch {path} fixes (input ids, axis 0)"
    assert note in captured.out.splitlines() and "warning" not in captured.err
    assert "held out (4 samples)" in captured.out  # 16 samples: 12 fit, 4 held out, in batches of 4
    assert note.removeprefix("note: ") in json.loads(report.read_text())["notes"]
    assert main([*argv, "--batch-size", "4"]) == 0
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["slice", "rotate"])
def test_a_batch_size_the_model_does_not_take_is_exit_2_naming_the_one_it_does(fixed, capsys, verb):
    tmp, path, calib = fixed
    out = tmp / "out.onnx"
    argv = [verb, str(path), "-o", str(out), "--calib", str(calib), "--batch-size", "16"]
    assert main(argv + (["--ratio", "0.5"] if verb == "slice" else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists(), err
    assert f"--batch-size 16: {path} fixes the batch (axis 0 of input ids) to 4; pass --batch-size 4" in err


def test_rotate_calibrates_in_the_batch_the_model_fixes(fixed, capsys):
    tmp, path, calib = fixed
    assert main(["rotate", str(path), "-o", str(tmp / "out.onnx"), "--calib", str(calib)]) == 0
    assert f"note: calibration data read in batches of 4, the batch {path} fixes" in capsys.readouterr().out


def test_the_api_takes_the_model_batch_by_default_and_refuses_another(fixed):
    _, path, calib = fixed
    result = slice_onnx(str(path), str(calib), SliceOptions(ratio=0.5), name="m")
    assert result.notes == ["calibration data read in batches of 4, the batch m fixes (input ids, axis 0)"]
    with pytest.raises(InputError, match="--batch-size 8: m fixes the batch"):
        slice_onnx(str(path), str(calib), SliceOptions(ratio=0.5, batch_size=8), name="m")


@pytest.mark.parametrize("verb", ["slice", "rotate"])
def test_samples_that_leave_a_partial_batch_are_refused_saying_how_many_to_give(fixed, capsys, verb):
    tmp, path, _ = fixed
    np.savez(tmp / "odd.npz", **ids(7, 18))
    argv = [verb, str(path), "-o", str(tmp / "out.onnx"), "--calib", str(tmp / "odd.npz")]
    assert main(argv + (["--ratio", "0.5"] if verb == "slice" else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "odd.npz: 18 samples do not fill batches of 4, the batch the model fixes (input ids, axis 0)" in err
    assert err.rstrip().endswith("give a multiple of 4 samples")


def test_slice_splits_whole_batches_where_samples_would_leave_a_part_of_one(fixed, capsys):
    """20 samples, 0.75/0.25: 15 and 5 samples would each end in a part of a batch the model refuses; the five
    batches of 4 split as they are, four to fit and one held out."""
    tmp, path, _ = fixed
    np.savez(tmp / "twenty.npz", **ids(7, 20))
    argv = ["slice", str(path), "-o", str(tmp / "out.onnx"), "--calib", str(tmp / "twenty.npz"), "--ratio", "0.5"]
    assert main(argv) == 0
    assert "held out (4 samples)" in capsys.readouterr().out
