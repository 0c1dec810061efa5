"""A folded model loses none of ONNX Runtime's fusions: op counts after ORT's own optimizers.

* Session optimizer (`ORT_ENABLE_ALL`, the optimized model written with
  `SessionOptions.optimized_model_filepath`): the folded model has no more `Add` nodes and at
  least as many fused skip norms (`Skip*LayerNormalization`) as the original, and the same number
  of norms in all.
* ORT's Python transformers optimizer (`ortopt.py`), in both orders (fold → optimize, optimize → fold),
  on TorchScript and dynamo exports, for the CUDA and the CPU provider: every fusion, every
  Gemm → MatMul conversion and no more nodes than the optimizer's output for the original.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import check_structure, run_ort

from normpass.onnx.fold.driver import FoldOptions, fold_onnx
from normpass.onnx.runtime.bench import make_feeds

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


# Registry models of a type ORT's transformers optimizer knows, their exports, and the fold's providers.
OPTIMIZED = [
    (name, form, provider)
    for name in ("gpt2", "bert", "vit")
    for form in ("torchscript", "dynamo")
    for provider in ("cuda", "cpu")
]


def _kept_beta_adds(result) -> int:
    """The β Adds a fold kept on purpose (for the CPU provider it folds a norm ORT would otherwise fuse into its
    slow CPU SkipLayerNormalization)."""
    return sum("β kept as an Add" in (norm["affine"] or "") for norm in result.report()["norms"])


@pytest.mark.parametrize(("name", "form", "provider"), OPTIMIZED)
def test_transformers_optimizer_loses_no_fusion_in_either_order(name, form, provider, registry_export):
    """fold → optimize and optimize → fold both have every fusion, every Gemm → MatMul conversion and no more
    nodes than the optimizer's output for the original; both compute the original's outputs."""
    from normpass import models as builtin_models
    from normpass.onnx.runtime.ortopt import OrtOptimizer, fusion_losses, optimize

    entry = builtin_models.get(name)
    settings = OrtOptimizer(entry.ort_model_type, entry.num_heads, entry.hidden_size, use_gpu=provider == "cuda")
    source = onnx.load(str(registry_export(name, form)))
    reference, _ = optimize(source, settings)
    folded = fold_onnx(source, FoldOptions(provider=provider))
    fold_first, _ = optimize(folded.model, settings)
    optimize_first = fold_onnx(source, FoldOptions(provider=provider, ort_optimizer=settings))
    assert folded.folded == entry.expected_rewritten + (_kept_beta_adds(folded) if provider == "cpu" else 0)
    assert fusion_losses(reference, fold_first, extra_nodes=_kept_beta_adds(folded)) == []
    assert fusion_losses(reference, optimize_first.model, extra_nodes=_kept_beta_adds(optimize_first)) == []
    assert optimize_first.folded == entry.expected_rewritten
    check_structure(folded.model)  # (ORT's optimizer may leave out the com.microsoft opset import its ops need)
    check_structure(optimize_first.model)
    feeds = make_feeds(source, 2, 7)
    expected = run_ort(source, feeds)
    for model in (fold_first, optimize_first.model):
        for want, got in zip(expected.values(), run_ort(model, feeds).values(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_fusion_losses_names_what_the_fold_would_lose_without_its_matmul_conversion(registry_export, monkeypatch):
    """Without the fold's own Gemm → MatMul conversion, ORT's gpt2 optimizer keeps the Conv1D Gemms that read
    an RMS op, with their Reshapes and shape arithmetic: the comparison names exactly that."""
    from normpass.onnx.fold import driver as passes
    from normpass.onnx.runtime.ortopt import OrtOptimizer, fusion_losses, optimize

    settings = OrtOptimizer("gpt2", 4, 64)
    source = onnx.load(str(registry_export("gpt2", "torchscript")))
    reference, _ = optimize(source, settings)
    monkeypatch.setattr(passes, "gemms_to_matmuls", lambda model, shapes: 0)
    losses = fusion_losses(reference, optimize(fold_onnx(source).model, settings)[0])
    assert len(losses) == 2, losses
    assert losses[0].startswith("Gemm → MatMul: 6 Gemm and 7 MatMul, the reference has 2 and 11"), losses
    assert losses[1].startswith("278 nodes instead of 179"), losses


def test_fold_notes_the_order_for_the_transformers_optimizer(registry_export):
    """A raw export with attention gets the note; the optimizer's own output does not."""
    from normpass.onnx.runtime.ortopt import OrtOptimizer

    source = onnx.load(str(registry_export("gpt2")))
    assert "run it before the fold" in " ".join(fold_onnx(source).notes)
    assert fold_onnx(source, FoldOptions(ort_optimizer=OrtOptimizer("gpt2", 4, 64))).notes == []
