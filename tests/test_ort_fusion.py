"""A folded model loses none of ONNX Runtime's fusions: op counts after ORT's own optimizers.

* Session optimizer (`ORT_ENABLE_ALL`, the optimized model written with
  `SessionOptions.optimized_model_filepath`): the folded model has no more `Add` nodes and at
  least as many fused skip norms (`Skip*LayerNormalization`) as the original, and the same number
  of norms in all.
* ORT's Python transformers optimizer (`optimize_model(model_type="gpt2")`) fuses the folded GPT-2's
  residual Adds into `SkipSimplifiedLayerNormalization` as it fuses the original's into
  `SkipLayerNormalization`. It leaves the folded model a few more Adds; which, and why, is in
  docs/BENCHMARKS.md ("Fusions").
"""

from __future__ import annotations

import collections

import onnx
import onnxruntime as ort
import pytest

from normpass.onnx.passes import fold_onnx

NORM_OPS = (
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)


def _ort_optimized_counts(path, tmp_path, tag) -> collections.Counter:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / f"{tag}.ort-optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


def _skips(counts) -> int:
    return counts["SkipLayerNormalization"] + counts["SkipSimplifiedLayerNormalization"]


def _fold_to(path, out) -> str:
    onnx.save(fold_onnx(onnx.load(str(path))).model, str(out))
    return str(out)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_session_optimizer_unfuses_nothing(name, registry_export, tmp_path):
    original = registry_export(name)
    folded = _fold_to(original, tmp_path / f"{name}.rms.onnx")
    before = _ort_optimized_counts(original, tmp_path, "original")
    after = _ort_optimized_counts(folded, tmp_path, "folded")
    assert after["Add"] <= before["Add"], (before, after)
    assert _skips(after) >= _skips(before) > 0, (before, after)
    assert sum(after[op] for op in NORM_OPS) == sum(before[op] for op in NORM_OPS)
    # only the final LayerNorm, whose β has nowhere to go, is kept (and fused by ORT as in the original)
    assert after["LayerNormalization"] + after["SkipLayerNormalization"] == 1


def test_transformers_optimizer_fuses_folded_gpt2(registry_export, tmp_path):
    from onnxruntime.transformers.optimizer import optimize_model

    original = registry_export("gpt2")
    folded = _fold_to(original, tmp_path / "gpt2.rms.onnx")
    counts = {}
    for tag, path in (("original", original), ("folded", folded)):
        optimized = optimize_model(str(path), model_type="gpt2", num_heads=4, hidden_size=64)
        counts[tag] = collections.Counter(n.op_type for n in optimized.model.graph.node)
    before, after = counts["original"], counts["folded"]
    assert (
        before["SkipLayerNormalization"]
        == after["SkipSimplifiedLayerNormalization"] + after["SkipLayerNormalization"]
        == 4
    ), (before, after)
    assert after["SkipLayerNormalization"] == 1  # the kept final LayerNorm
    assert before["LayerNormalization"] == after["SimplifiedLayerNormalization"] == 1
