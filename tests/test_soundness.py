"""Soundness: a fold is exact or refused, and verification can tell the difference.

* Tensors read inside `If` / `Loop` bodies through outer scope (at any depth) are read by the
  control-flow node: centring them is unsafe, and γ/β never migrate into a body.
* Norms inside control-flow bodies are listed, declined with where they are.
* Verification covers both values of boolean inputs, a second shape for dynamic dims and every
  output, and refuses a rewrite that changes the model's signature before running it.

Numerics are checked independently of normpass's verifier: both models run in ONNX Runtime
(optimizations off) with `cond` true and false.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from normpass import FoldOptions, fold_onnx, inspect_onnx

from conftest import build, check_structure, randn, rng

D = 8
HEADER = '<ir_version: 10, opset_import: ["" : 17]>'


def ort_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_same_for_both_conditions(original: onnx.ModelProto, folded: onnx.ModelProto) -> None:
    """Independent oracle: every output agrees with cond true and with cond false."""
    gen = rng(5)
    floats = {i.name: 3 * randn(gen, 2, 4, D) + 1 for i in original.graph.input if i.name != "cond"}
    for cond in (True, False):
        feeds = floats | {"cond": np.array(cond)}
        for expected, got in zip(ort_outputs(original, feeds), ort_outputs(folded, feeds), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=f"cond={cond}")


def ln_model(else_body: str, then_body: str = "t = Identity(x)", extra: str = "", **more) -> onnx.ModelProto:
    """x·W0 + b0 → h → LayerNorm → ·W1 + b1 → y, and z = If(cond) then `then_body` else `else_body`."""
    gen = rng(0)
    text = f"""{HEADER}
    agraph (float[2, 4, {D}] x, bool cond) => (float[2, 4, {D}] y, float[2, 4, {D}] z) {{
        xw = MatMul(x, W0)
        h = Add(xw, b0)
        n = LayerNormalization<axis=-1>(h, g0, be0)
        nw = MatMul(n, W1)
        y = Add(nw, b1)
        {extra}
        z = If(cond) <then_branch = then_g () => (float[2, 4, {D}] t) {{ {then_body} }},
                      else_branch = else_g () => (float[2, 4, {D}] e) {{ {else_body} }}>
    }}"""
    weights = dict(W0=randn(gen, D, D), b0=randn(gen, D), g0=1 + randn(gen, D, scale=0.3), be0=randn(gen, D, scale=0.3),
                   W1=randn(gen, D, D), b1=randn(gen, D))
    return build(text, **weights, **more)


def test_outer_scope_reader_in_an_if_branch_blocks_the_centring():
    model = ln_model("e = Identity(h)")
    plan = inspect_onnx(model)
    assert (plan.total, len(plan.folded)) == (1, 0)
    assert plan.decisions[0].blocker.node == "z" and "If z" in plan.decisions[0].reason
    result = fold_onnx(model)
    assert result.folded == 0
    assert_same_for_both_conditions(model, result.model)


def test_outer_scope_reader_two_bodies_deep_blocks_the_centring():
    inner = f"""e = If(cond) <then_branch = a () => (float[2, 4, {D}] p) {{ p = Identity(x) }},
                             else_branch = b () => (float[2, 4, {D}] q) {{ q = Neg(h) }}>"""
    model = ln_model(inner)
    plan = inspect_onnx(model)
    assert len(plan.folded) == 0 and plan.decisions[0].blocker.node == "z"
    assert_same_for_both_conditions(model, fold_onnx(model).model)


def test_a_body_reading_only_unaffected_tensors_does_not_block():
    model = ln_model("e = Neg(x)")
    result = fold_onnx(model)
    assert result.folded == 1
    check_structure(result.model)
    assert_same_for_both_conditions(model, result.model)


def test_affine_does_not_migrate_into_a_body():
    """n is read by y's linear layer and by one inside the else-branch: the body is not a target."""
    model = ln_model("m = MatMul(n, W2) e = Add(m, b2)", W2=randn(rng(1), D, D), b2=randn(rng(2), D))
    result = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    if_node = next(n for n in result.model.graph.node if n.op_type == "If")
    body = next(a.g for a in if_node.attribute if a.name == "else_branch")
    assert [(n.op_type, n.input[1]) for n in body.node] == [("MatMul", "W2"), ("Add", "b2")]
    assert "W1" in [n.input[1] for n in result.model.graph.node if n.op_type == "MatMul"]
    assert_same_for_both_conditions(model, result.model)


def test_norms_inside_bodies_are_listed_with_where_they_are():
    model = ln_model("e = LayerNormalization<axis=-1>(h, g0, be0)")
    plan = inspect_onnx(model)
    assert plan.total == 2
    nested = [d for d in plan.decisions if d.name != "n"]
    assert len(nested) == 1 and not nested[0].foldable
    assert nested[0].reason == "inside the else-branch of If z: norms in control-flow bodies are not rewritten"
    report = fold_onnx(model).report()
    assert report["total"] == 2 and report["folded"] == 0


def test_skip_fusion_keeps_a_residual_sum_read_inside_a_body():
    """t = a + a2 of two centred tensors folds without centring; the else-branch reads t."""
    gen = rng(0)
    text = f"""{HEADER}
    agraph (float[2, 4, {D}] x, float[2, 4, {D}] x2, bool cond) => (float[2, 4, {D}] y, float[2, 4, {D}] z) {{
        m1 = ReduceMean<axes=[-1]>(x)
        a = Sub(x, m1)
        m2 = ReduceMean<axes=[-1]>(x2)
        a2 = Sub(x2, m2)
        t = Add(a, a2)
        n = LayerNormalization<axis=-1>(t, g0, be0)
        nw = MatMul(n, W1)
        y = Add(nw, b1)
        z = If(cond) <then_branch = then_g () => (float[2, 4, {D}] p) {{ p = Identity(x) }},
                      else_branch = else_g () => (float[2, 4, {D}] q) {{ q = Identity(t) }}>
    }}"""
    model = build(text, g0=1 + randn(gen, D, scale=0.3), be0=randn(gen, D), W1=randn(gen, D, D), b1=randn(gen, D))
    result = fold_onnx(model, FoldOptions(fuse_skip=True))
    assert result.folded == 1 and result.emitted["skip_fused"] == 1
    skip = next(n for n in result.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    assert list(skip.output)[3] == "t"
    assert_same_for_both_conditions(model, result.model)
