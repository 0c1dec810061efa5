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
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import build, check_structure, randn, rng, run_ort

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


def classic_attention(scale_op: str) -> onnx.ModelProto:
    """A pre-LN block whose attention scales the scores after Q·Kᵀ (`Div`, as older exporters wrote it, which
    ORT's bert fusion matches; `Mul` without a mask it does not), its output projection's bias into the
    residual Add the second norm reads."""
    gen = rng(0)
    d, heads = 8, 2
    weights: dict[str, Any] = {
        name: randn(gen, 6 if name == "We" else d, d) for name in ("We", "Wq", "Wk", "Wv", "Wo", "Wf")
    }
    weights |= {name: randn(gen, d) for name in ("bq", "bk", "bv", "bo", "bf")}
    weights |= {name: 1 + randn(gen, d, scale=0.3) for name in ("g1", "g2")}
    weights |= {name: randn(gen, d, scale=0.3) for name in ("b1", "b2")}
    weights |= {
        "split": np.array([0, 0, heads, d // heads], np.int64),
        "merge": np.array([0, 0, d], np.int64),
        "scale": np.array(2.0, np.float32),
    }
    return build(
        f"""<ir_version: 10, opset_import: ["" : 17]>
agraph (float[2, 4, 6] x) => (float[2, 4, 8] y) {{
  h = MatMul(x, We)
  n1 = LayerNormalization<axis=-1>(h, g1, b1)
  q0 = MatMul(n1, Wq)
  q1 = Add(q0, bq)
  q2 = Reshape(q1, split)
  q = Transpose<perm=[0, 2, 1, 3]>(q2)
  k0 = MatMul(n1, Wk)
  k1 = Add(k0, bk)
  k2 = Reshape(k1, split)
  k = Transpose<perm=[0, 2, 3, 1]>(k2)
  v0 = MatMul(n1, Wv)
  v1 = Add(v0, bv)
  v2 = Reshape(v1, split)
  v = Transpose<perm=[0, 2, 1, 3]>(v2)
  s0 = MatMul(q, k)
  s1 = {scale_op}(s0, scale)
  p = Softmax<axis=-1>(s1)
  a0 = MatMul(p, v)
  a1 = Transpose<perm=[0, 2, 1, 3]>(a0)
  a2 = Reshape(a1, merge)
  o0 = MatMul(a2, Wo)
  o1 = Add(o0, bo)
  r = Add(h, o1)
  n2 = LayerNormalization<axis=-1>(r, g2, b2)
  y0 = MatMul(n2, Wf)
  y = Add(y0, bf)
}}""",
        **weights,
    )


@pytest.mark.parametrize("scale_op, fused", [("Div", True), ("Mul", False)])
def test_fold_notes_the_order_only_where_the_optimizer_fuses_attention(scale_op, fused):
    """The note when ORT's optimizer fuses the original's attention and no longer the folded model's; not
    where it fuses none, nor on its own output."""
    from normpass.onnx.runtime.ortopt import OrtOptimizer, optimize

    settings = OrtOptimizer("bert", 2, 8)
    model = classic_attention(scale_op)
    result = fold_onnx(model)
    assert result.folded == 2
    assert optimize(model, settings)[1].get("Attention", 0) == int(fused)
    assert "Attention" not in optimize(result.model, settings)[1], "the optimizer after the fold fuses none"
    assert ("run it before the fold" in " ".join(result.notes)) == fused
    assert fold_onnx(model, FoldOptions(ort_optimizer=settings)).notes == []


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_no_ordering_note_on_exports_whose_attention_the_optimizer_does_not_fuse(name, registry_export):
    """Today's exports scale q and k apart (or guard the Softmax with IsNaN/Where): no attention fusion fires."""
    from normpass import models as builtin_models
    from normpass.onnx.runtime.ortopt import OrtOptimizer, optimize

    spec = builtin_models.get(name)
    source = onnx.load(str(registry_export(name)))
    _, fused = optimize(source, OrtOptimizer(spec.ort_model_type, spec.num_heads, spec.hidden_size))
    assert "Attention" not in fused
    assert fold_onnx(source).notes == []
