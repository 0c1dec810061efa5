"""Export a transformer, rotate its residual stream with normpass, quantize it with ONNX Runtime, run it.

    python examples/rotate_quantize.py [WORKDIR]

The pipeline, step by step (each one what a user runs), on a small GPT-2 (a LayerNorm model, which
the PyTorch rotation tools built for Llama-style RMSNorm models do not take):

1. **export**: `torch.onnx.export` (TorchScript, as HF Optimum does; `_shared.tiny_gpt2`);
2. **rotate**: `normpass rotate model.onnx -o model.rotated.onnx --provider cpu`: the LayerNorms folded
   into RMSNorms, the residual stream rotated by a randomised Hadamard matrix, the result verified
   against the original (it computes the same function);
3. **quantize**: ONNX Runtime's `quantize_static` (QDQ, INT8 activations and weights) calibrated on a
   few inputs, for the original and the rotated model alike;
4. **run**: ONNX Runtime inference on other inputs, compared with the original's fp32 outputs.

Prints, as JSON, normpass's summary and the relative error ‖y − y_fp32‖ / ‖y_fp32‖ of each model; stops
with an error if the rotated fp32 model is not the original (beyond 1e-4) or its INT8 version misses
`BUDGET`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
from _shared import cli, run, tiny_gpt2, token_ids
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

FP32_TOLERANCE = 1e-4
BUDGET = 0.2  # largest mean relative error of the quantized rotated model


class Calibration(CalibrationDataReader):
    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def quantize(model: Path, out: Path, calibration: list[dict[str, np.ndarray]]) -> Path:
    """Step 3: ONNX Runtime's static INT8 quantization in QDQ format."""
    logging.disable(logging.WARNING)  # its advice to pre-process the model
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(model),
            str(out),
            Calibration(calibration),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
        )
    logging.disable(logging.NOTSET)
    return out


def relative_error(reference: list[np.ndarray], outputs: list[np.ndarray]) -> float:
    return float(np.mean([np.linalg.norm(o - r) / np.linalg.norm(r) for r, o in zip(reference, outputs, strict=True)]))


def rotate_quantize(source: Path, workdir: Path) -> dict:
    """Steps 2 to 4 on the exported model at `source`; files go to `workdir`."""
    rotated = workdir / "model.rotated.onnx"
    command = [sys.executable, "-m", "normpass", "rotate", str(source), "-o", str(rotated), "--provider", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"normpass rotate failed ({done.returncode}): {done.stderr.strip()}")
    calibration = [token_ids((1, 16), seed=100 + i) for i in range(8)]
    held_out = [token_ids((1, 16), seed=200 + i) for i in range(8)]

    def outputs(model: Path) -> list[np.ndarray]:  # step 4
        return [run(model, feeds)[0] for feeds in held_out]

    reference = outputs(source)
    errors = {"rotated fp32": relative_error(reference, outputs(rotated))}
    for label, model in (("original", source), ("rotated", rotated)):
        errors[f"{label} int8"] = relative_error(
            reference, outputs(quantize(model, workdir / f"{label}.int8.onnx", calibration))
        )
    if errors["rotated fp32"] > FP32_TOLERANCE or errors["rotated int8"] > BUDGET:
        raise SystemExit(f"the rotated model misses its budget: {errors}")
    return {"normpass": done.stdout.strip().splitlines()[0], "mean_relative_error": errors}


def main(workdir: Path) -> dict:
    return rotate_quantize(tiny_gpt2(workdir), workdir)  # step 1: the export


if __name__ == "__main__":
    cli(main)
