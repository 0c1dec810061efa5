"""What the fold emits for its target: kept norms, β across residual Adds, targets and providers.

* A proven fold whose non-zero β can move nowhere would cost an RMS op plus a separate `Add`
  (more than the LayerNorm); by default the norm is kept, unchanged, with the reason.
* β moves into the private bias of a residual Add's other summand, so a BERT-style embedding LN
  (whose output is both the residual stream and the Q/K/V input) folds without an `Add`.
* `target="onnx"` emits standard ops only; `provider="cpu"` leaves fp16 residual Adds unfused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from conftest import (
    assert_equivalent,
    build,
    check_plain,
    check_structure,
    initializers,
    op_counts,
    producer,
    randn,
    rng,
)

from normpass import FoldOptions, InputError, fold_onnx, inspect_onnx

D, S = 8, 4
HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def ln_to_output(gen, beta_scale: float = 0.3) -> onnx.ModelProto:
    return build(
        f"""{HEADER}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1>(h, g, b)
}}""",
        W=randn(gen, 6, D),
        g=1 + randn(gen, D, scale=0.3),
        b=randn(gen, D, scale=beta_scale),
    )


def test_norm_whose_beta_goes_nowhere_is_kept_unchanged():
    model = ln_to_output(rng(0))
    assert len(inspect_onnx(model).folded) == 1  # the proof holds
    result = fold_onnx(model)
    [decision] = result.plan.decisions
    assert result.folded == 0 and decision.kept and not decision.foldable
    assert "β" in decision.reason and "--fold-with-beta-add" in decision.reason
    assert op_counts(result.model) == op_counts(model)
    source = initializers(model)
    assert all(np.array_equal(values, source[name]) for name, values in initializers(result.model).items())
    forced = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    assert forced.folded == 1 and op_counts(forced.model)["Add"] == 1 and forced.comparison.passed


def test_norm_without_beta_folds():
    model = ln_to_output(rng(1), beta_scale=0.0)
    result = fold_onnx(model)
    assert (
        result.folded == 1
        and op_counts(result.model)["Add"] == 0
        and op_counts(result.model)["LayerNormalization"] == 0
    )
    check_structure(result.model)


def embedding_block(gen, branch_is_output: bool = False) -> onnx.ModelProto:
    """BERT-style: embeddings → LN → (Q projection, residual); the attention output adds a bias o."""
    outputs = f"float[B, {S}, {D}] y" + (f", float[B, {S}, {D}] ob" if branch_is_output else "")
    return build(
        f"""{HEADER}
agraph (int64[B, {S}] ids) => ({outputs}) {{
  emb = Gather<axis=0>(table, ids)
  h0 = Add(emb, pos)
  e = LayerNormalization<axis=-1>(h0, g1, b1)
  q = MatMul(e, Wq)
  qb = Add(q, q_b)
  a = Relu(qb)
  o_mm = MatMul(a, Wo)
  ob = Add(o_mm, o)
  r = Add(e, ob)
  y = LayerNormalization<axis=-1>(r, g2, b2)
}}""",
        table=randn(gen, 10, D),
        pos=randn(gen, S, D),
        g1=1 + randn(gen, D, scale=0.3),
        b1=randn(gen, D, scale=0.3),
        Wq=randn(gen, D, D),
        q_b=randn(gen, D),
        Wo=randn(gen, D, D),
        o=randn(gen, D),
        g2=1 + randn(gen, D, scale=0.3),
        b2=randn(gen, D, scale=0.3),
    )


def test_embedding_beta_moves_across_the_residual_add():
    model = embedding_block(rng(2))
    result = fold_onnx(model)
    decisions = {d.name: d for d in result.plan.decisions}
    assert decisions["e"].foldable and not decisions["y"].foldable and "post-LN" in decisions["y"].reason
    assert result.comparison.passed and result.comparison.max_rel_error <= 1e-5
    folded = result.model
    assert producer(folded, "e").op_type == "SimplifiedLayerNormalization"
    assert op_counts(folded)["Add"] == op_counts(model)["Add"]  # no β Add
    source, values = initializers(model), initializers(folded)
    beta = source["b1"].astype(np.float64)
    q_bias = values[producer(folded, "qb").input[1]]
    np.testing.assert_allclose(q_bias, source["q_b"] + beta @ source["Wq"], rtol=1e-5, atol=1e-6)
    o_bias = values[producer(folded, "ob").input[1]]
    np.testing.assert_allclose(o_bias, source["o"] + beta, rtol=1e-6, atol=1e-6)
    assert result.affine_notes["e"].startswith("γ kept in the RMS op, β migrated into ")
    assert set(result.affine_notes["e"].rpartition(" into ")[2].split(", ")) == {"q", "ob"}
    np.testing.assert_array_equal(values[producer(folded, "e").input[1]], source["g1"])  # γ stays in the RMS op
    assert_equivalent(model, folded, rel_tol=1e-5)


def test_beta_does_not_move_into_a_summand_read_elsewhere():
    """When the attention output is also a graph output, adding β to its bias would change it: kept."""
    model = embedding_block(rng(3), branch_is_output=True)
    result = fold_onnx(model)
    kept = [d for d in result.plan.decisions if d.kept]
    assert [d.name for d in kept] == ["e"] and result.folded == 0
    forced = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    assert forced.folded == 1 and forced.comparison.passed


def test_target_onnx_emits_standard_ops_only():
    model = embedding_block(rng(4))
    result = fold_onnx(model, FoldOptions(target="onnx"))
    check_plain(result.model)  # the full checker: no contrib op anywhere
    assert op_counts(result.model)["RMSNormalization"] == 1 and result.emitted["rms_op"] == "onnx"
    assert all(o.domain in ("", "ai.onnx") for o in result.model.opset_import)
    decomposed = fold_onnx(model, FoldOptions(target="onnx", rms_op="decomposed"))
    check_plain(decomposed.model)


@pytest.mark.parametrize(
    "options",
    [
        FoldOptions(target="onnx", rms_op="simplified"),
        FoldOptions(target="onnx", fuse_skip=True),
        FoldOptions(target="tensorrt"),
        FoldOptions(provider="rocm"),
    ],
)
def test_bad_emission_options_are_refused(options):
    with pytest.raises(InputError):
        fold_onnx(ln_to_output(rng(5)), options)


def residual_model(dtype: str, gen) -> onnx.ModelProto:
    """Pre-LN: a residual Add feeds the second norm, whose γ/β move into the head."""
    np_type = {"float": np.float32, "float16": np.float16}[dtype]
    weights = dict(
        W0=randn(gen, 6, D),
        g1=1 + randn(gen, D, scale=0.3),
        b1=randn(gen, D, scale=0.3),
        W1=randn(gen, D, D),
        c1=randn(gen, D),
        g2=1 + randn(gen, D, scale=0.3),
        b2=randn(gen, D, scale=0.3),
        W2=randn(gen, D, 5),
        c2=randn(gen, 5),
    )
    arrays: dict[str, Any] = {name: values.astype(np_type) for name, values in weights.items()}
    return build(
        f"""{HEADER}
agraph ({dtype}[B, {S}, 6] x) => ({dtype}[B, {S}, 5] y) {{
  h = MatMul(x, W0)
  n1 = LayerNormalization<axis=-1>(h, g1, b1)
  m1 = MatMul(n1, W1)
  a1 = Add(m1, c1)
  r = Add(h, a1)
  n2 = LayerNormalization<axis=-1>(r, g2, b2)
  m2 = MatMul(n2, W2)
  y = Add(m2, c2)
}}""",
        **arrays,
    )


@pytest.mark.parametrize(
    "dtype,provider,fused", [("float", "cuda", 1), ("float", "cpu", 1), ("float16", "cuda", 1), ("float16", "cpu", 0)]
)
def test_skip_fusion_per_provider_and_dtype(dtype, provider, fused):
    model = residual_model(dtype, rng(6))
    result = fold_onnx(model, FoldOptions(provider=provider))
    assert result.folded == 2 and result.comparison.passed
    counts = op_counts(result.model)
    assert counts["SkipSimplifiedLayerNormalization"] == fused == result.emitted["skip_fused"]
    assert counts["SimplifiedLayerNormalization"] == 2 - fused
    # fused: the bias Add a1 = m1 + c1 went into the op's bias input as well
    assert counts["Add"] == (1 if fused else 3)  # the head's bias Add stays (its input is not a residual sum)
    if fused:
        [skip] = [n for n in result.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
        assert list(skip.input[:2]) == ["h", "m1"] and skip.input[3].startswith("c1")
    check_structure(result.model)


def test_on_cpu_a_norm_that_ort_would_skip_fuse_is_folded_with_its_beta_add():
    """ORT's CPU SkipLayerNormalization is slower than RMS op + Add: the last norm of a residual stack folds."""
    gen = rng(7)
    model = build(
        f"""{HEADER}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W0)
  n1 = LayerNormalization<axis=-1>(h, g1, b1)
  m1 = MatMul(n1, W1)
  a1 = Add(m1, c1)
  r = Add(h, a1)
  y = LayerNormalization<axis=-1>(r, g2, b2)
}}""",
        W0=randn(gen, 6, D),
        g1=1 + randn(gen, D, scale=0.3),
        b1=randn(gen, D, scale=0.3),
        W1=randn(gen, D, D),
        c1=randn(gen, D),
        g2=1 + randn(gen, D, scale=0.3),
        b2=randn(gen, D, scale=0.3),
    )
    cuda = fold_onnx(model)
    assert [d.name for d in cuda.plan.decisions if d.kept] == ["y"] and cuda.folded == 1
    cpu = fold_onnx(model, FoldOptions(provider="cpu"))
    assert cpu.folded == 2 and not any(d.kept for d in cpu.plan.decisions)
    assert "β kept as an Add" in cpu.affine_notes["y"] and op_counts(cpu.model)["SkipSimplifiedLayerNormalization"] == 1
    assert cpu.comparison.passed


def test_double_models_keep_the_residual_add_unfused():
    """ORT has no double kernel for SkipSimplifiedLayerNormalization: fusing would emit a model it refuses."""
    gen = rng(5)
    model = build(
        f"""{HEADER}
agraph (double[B, {S}, {D}] x) => (double[B, {S}, {D}] y) {{
  h = MatMul(x, W0)
  n1 = LayerNormalization<axis=-1>(h, g1)
  f = MatMul(n1, W1)
  r = Add(h, f)
  n2 = LayerNormalization<axis=-1>(r, g2)
  y = MatMul(n2, W2)
}}""",
        **{
            name: randn(gen, *shape).astype(np.float64)
            for name, shape in (("W0", (D, D)), ("W1", (D, D)), ("W2", (D, D)), ("g1", (D,)), ("g2", (D,)))
        },
    )
    result = fold_onnx(model)
    assert result.folded == 2 and result.emitted["skip_fused"] == 0
    assert op_counts(result.model)["SimplifiedLayerNormalization"] == 2
    assert_equivalent(model, result.model)
