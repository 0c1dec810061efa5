"""The pipelines in `examples/`, each run on a small model with its result checked: fold counts,
the fusions and ops present, and outputs close to the original's in ONNX Runtime.

The ONNX pipelines take the session's TorchScript export of the registry's GPT-2 (2 layers,
5 LayerNorms) instead of exporting their own; their `main` does only that export besides.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from conftest import load_module

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TOLERANCE = 1e-4  # fp32, relative to the largest output


def example(name: str):
    if str(EXAMPLES) not in sys.path:  # as when run as `python examples/NAME.py`: for examples/_shared.py
        sys.path.insert(0, str(EXAMPLES))
    return load_module(EXAMPLES / f"{name}.py", f"example_{name}")


def test_ort_transformers_optimizer_and_fold_in_either_order_lose_nothing(registry_export, tmp_path):
    module = example("fold_ort_optimizer")
    source = registry_export("gpt2", "torchscript")
    result = module.fold_and_optimize(source, tmp_path, "gpt2", 4, 64, example("_shared").token_ids((2, 16)))
    assert (result["folded"], result["norms"]) == (4, 5)
    baseline = result["baseline_ops"]
    assert baseline["SkipLayerNormalization"] == 4 and baseline["LayerNormalization"] == 1
    for order in ("optimize_then_fold", "fold_then_optimize"):
        ops = result[order]["ops"]
        assert result[order]["losses"] == [], order
        # the four folded norms become RMS ops (three fused with their residual Add); the kept final one stays
        assert ops["SkipSimplifiedLayerNormalization"] + ops["SimplifiedLayerNormalization"] == 4, order
        assert ops["SkipLayerNormalization"] + ops.get("LayerNormalization", 0) == 1, order
        # no linear layer lost and no Gemm → MatMul conversion undone; folding first may convert the MLP's
        # down projections too (their flattening is proven once symbolic shape inference reads the reshapes)
        linear = ops["MatMul"] + ops.get("Gemm", 0)
        assert (ops["FastGelu"], linear) == (2, baseline["MatMul"] + baseline["Gemm"]), order
        assert ops.get("Gemm", 0) <= baseline["Gemm"], order
        assert sum(ops.values()) <= sum(baseline.values()), order
        assert result[order]["max_rel_error"] < TOLERANCE, order


def test_pass_manager_pipeline_with_onnxscript_optimizer(registry_export, tmp_path):
    result = example("pass_manager").fold_in_pipeline(registry_export("gpt2", "torchscript"), tmp_path)
    assert result["modified"] and (result["folded"], result["norms"]) == (4, 5)
    assert result["verified_max_rel_error"] < TOLERANCE
    assert result["ops"]["RMSNormalization"] == 4 and result["ops"]["LayerNormalization"] == 1
    assert "Constant" not in result["ops"] and result["nodes_after"] < result["nodes_before"] / 1.5
    assert result["opset"] == 23 and result["max_rel_error"] < TOLERANCE


def test_olive_workflow_with_the_normpass_pass(registry_export, tmp_path):
    pytest.importorskip("olive", reason="the Olive example needs olive-ai: pip install -e '.[olive]'")
    result = example("olive_workflow").run_workflow(registry_export("gpt2", "torchscript"), tmp_path)
    # for the CPU provider the final LayerNorm folds too (ORT's CPU SkipLayerNormalization is slower)
    assert result["metadata"]["normpass.folded"] == "5 of 5 norms folded into RMSNorm"
    ops = result["ops"]
    assert ops["SkipSimplifiedLayerNormalization"] == 4 and ops["SimplifiedLayerNormalization"] == 1
    assert not {"LayerNormalization", "SkipLayerNormalization"} & ops.keys()
    assert result["max_rel_error"] < TOLERANCE


def test_torch_fold_then_export_and_run(tmp_path):
    result = example("torch_fold_export").main(tmp_path)
    assert (result["folded"], result["norms"], result["capture"]) == (5, 5, "torch.export")
    assert result["original_modules"] == {"LayerNorm": 5} and result["modules"] == {"RMSNorm": 5}
    assert result["ops"]["RMSNormalization"] == 5 and "LayerNormalization" not in result["ops"]
    assert result["verified_max_rel_error"] < TOLERANCE and result["max_rel_error"] < TOLERANCE
