"""examples/rotate_quantize.py, the pipeline users run: export → `normpass rotate` → ONNX Runtime INT8 → inference."""

from __future__ import annotations

import importlib.util
import pathlib

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "rotate_quantize.py"


def test_export_rotate_quantize_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("rotate_quantize", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    errors = example.main(["--model", "opt", "--workdir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "5 of 5 norms folded, 1 of 1 residual streams rotated" in printed
    assert errors["rotated fp32"] <= 1e-4  # the rotation is exact
    assert 0 < errors["rotated int8"] <= 0.2 and errors["original int8"] > 0  # quantized: close, not equal
    assert {p.name for p in tmp_path.iterdir()} >= {"model.onnx", "model.rotated.onnx", "model.rotated.int8.onnx"}
