"""Export a transformer, rotate its residual stream with normpass, quantize it with ONNX Runtime, run it.

    python examples/rotate_quantize.py [--model opt] [--workdir DIR] [--budget 0.2]

The pipeline, step by step (each one what a user runs):

1. **export**: `torch.onnx.export` of a PyTorch model (here a small seeded pre-LN OPT from
   `normpass.models`; any exported pre-LN transformer will do);
2. **rotate**: `normpass rotate model.onnx -o model.rotated.onnx --provider cpu`: the LayerNorms folded
   into RMSNorms, the residual stream rotated by a randomised Hadamard matrix, the result verified
   against the original (it computes the same function);
3. **quantize**: ONNX Runtime's `quantize_static` (QDQ, INT8 activations and weights) calibrated on a
   few inputs, for the original and the rotated model alike;
4. **run**: ONNX Runtime inference on other inputs; the quantized models' outputs are compared with the
   original's fp32 outputs.

Prints the relative error ‖y − y_fp32‖ / ‖y_fp32‖ of each model, and exits with status 1 if the rotated
fp32 model is not the original (beyond 1e-4) or the quantized rotated model misses `--budget`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from normpass import models

FP32_TOLERANCE = 1e-4


def export(name: str, path: pathlib.Path) -> pathlib.Path:
    """Step 1: torch.onnx.export of the registry's seeded model `name` (what `export_onnx` does)."""
    return models.export_onnx(name, path)


def rotate(model: pathlib.Path, out: pathlib.Path) -> None:
    """Step 2: the normpass command line."""
    command = [sys.executable, "-m", "normpass", "rotate", str(model), "-o", str(out), "--provider", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"normpass rotate failed ({done.returncode}): {done.stderr.strip()}")
    print(done.stdout.strip().splitlines()[0])


class Calibration(CalibrationDataReader):
    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def quantize(model: pathlib.Path, out: pathlib.Path, calibration: list[dict[str, np.ndarray]]) -> pathlib.Path:
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


def run(model: pathlib.Path, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """Step 4: inference in ONNX Runtime."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return [session.run(None, feed)[0] for feed in feeds]


def relative_error(reference: list[np.ndarray], outputs: list[np.ndarray]) -> float:
    return float(np.mean([np.linalg.norm(o - r) / np.linalg.norm(r) for r, o in zip(reference, outputs, strict=True)]))


def token_feeds(name: str, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    entry = models.get(name)
    return [
        {entry.input_names[0]: entry.make_inputs(1, 16, seed + i)[0].numpy().astype(np.int64)} for i in range(count)
    ]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="opt", help="a registry model with token inputs (opt, gpt2, llama)")
    parser.add_argument("--workdir", help="keep the files here (default: a temporary directory)")
    parser.add_argument("--budget", type=float, default=0.2, help="largest mean relative error of the quantized model")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        original = export(args.model, work / "model.onnx")
        rotated = work / "model.rotated.onnx"
        rotate(original, rotated)
        calibration, held_out = token_feeds(args.model, 8, seed=100), token_feeds(args.model, 8, seed=200)
        reference = run(original, held_out)
        errors = {"rotated fp32": relative_error(reference, run(rotated, held_out))}
        for label, source in (("original", original), ("rotated", rotated)):
            quantized = quantize(source, work / f"{source.stem}.int8.onnx", calibration)
            errors[f"{label} int8"] = relative_error(reference, run(quantized, held_out))
    for label, error in errors.items():
        print(f"{label}: mean relative error {error:.4f}")
    if errors["rotated fp32"] > FP32_TOLERANCE or errors["rotated int8"] > args.budget:
        raise SystemExit(1)
    return errors


if __name__ == "__main__":
    main()
