"""Calibration running, shared by every calibrated pass (`replace`, `rotate --calib`, `slice`): the inputs a
model takes and batches read or made for it (`data`), and ONNX Runtime over them (`runner`)."""

from .data import (
    CalibData,
    DataOptions,
    input_spec,
    load,
    load_fitting,
    refuse_scalar_inputs,
    run_time_inputs,
    synthetic_batches,
)
from .runner import Runner, captured, check_runs, opened, reference_runner

__all__ = [
    "CalibData",
    "DataOptions",
    "Runner",
    "captured",
    "check_runs",
    "input_spec",
    "load",
    "load_fitting",
    "opened",
    "reference_runner",
    "refuse_scalar_inputs",
    "run_time_inputs",
    "synthetic_batches",
]
