"""examples/rotate_quantize.py, the pipeline users run: export → `normpass rotate` → ONNX Runtime INT8 → inference.

It takes the session's TorchScript export of the registry's GPT-2, as the other examples' tests do.
"""

from __future__ import annotations

from test_examples import TOLERANCE, example


def test_export_rotate_quantize_run(registry_export, tmp_path):
    result = example("rotate_quantize").rotate_quantize(registry_export("gpt2", "torchscript"), tmp_path)
    assert "5 of 5 norms folded, 1 of 1 residual streams rotated" in result["normpass"]
    errors = result["mean_relative_error"]
    assert errors["rotated fp32"] <= TOLERANCE  # the rotation is exact
    assert 0 < errors["rotated int8"] <= 0.2 and errors["original int8"] > 0  # quantized: close, not equal
    assert {p.name for p in tmp_path.iterdir()} >= {"model.rotated.onnx", "rotated.int8.onnx", "original.int8.onnx"}
