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

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import build, check_structure, randn, rng
from onnx import numpy_helper

from normpass import FoldOptions, VerificationError, fold_onnx, inspect_onnx
from normpass.onnx.runtime.verify import check_signature, compare_outputs, make_inputs, verify

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
            np.testing.assert_allclose(
                got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=f"cond={cond}"
            )


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
    weights: dict[str, Any] = dict(
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        g0=1 + randn(gen, D, scale=0.3),
        be0=randn(gen, D, scale=0.3),
        W1=randn(gen, D, D),
        b1=randn(gen, D),
    )
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


def test_outer_scope_reader_in_a_loop_body_blocks_the_centring():
    gen = rng(0)
    text = f"""{HEADER}
    agraph (float[2, 4, {D}] x, bool cond) => (float[2, 4, {D}] y, float[2, 4, {D}] z) {{
        xw = MatMul(x, W0)
        h = Add(xw, b0)
        n = LayerNormalization<axis=-1>(h, g0, be0)
        nw = MatMul(n, W1)
        y = Add(nw, b1)
        z = Loop(trips, cond, x) <body = loop_body (int64 i, bool c, float[2, 4, {D}] acc)
                                          => (bool c_out, float[2, 4, {D}] acc_out) {{
            c_out = Identity(c)
            acc_out = Add(acc, h)
        }}>
    }}"""
    model = build(
        text,
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        g0=1 + randn(gen, D, scale=0.3),
        be0=randn(gen, D, scale=0.3),
        W1=randn(gen, D, D),
        b1=randn(gen, D),
        trips=np.array(2, dtype=np.int64),
    )
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
    assert [run["bools"] for run in report["verification_runs"]] == ["true", "false", "random"]


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


# --- verification ------------------------------------------------------------------------------


def centred_upstream(model: onnx.ModelProto) -> onnx.ModelProto:
    """What folding without seeing the else-branch reader did: W0 and b0 centred (the LN hides it from y)."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    for init in wrong.graph.initializer:
        if init.name in ("W0", "b0"):
            values = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(values - values.mean(axis=-1, keepdims=True), init.name))
    return wrong


def test_verification_runs_both_values_of_a_boolean_input():
    model = ln_model("e = Identity(h)")
    comparison = verify(model, centred_upstream(model))
    assert not comparison.passed and "z:" in comparison.failures() and "y:" not in comparison.failures()
    assert [run.bools for run in comparison.runs] == ["true", "false", "random"]
    assert comparison.exercised() == "3 runs: x 2x4x8, cond scalar with booleans true, false, random"


def test_verification_tries_other_sizes_for_dynamic_dims():
    text = f"""{HEADER}
    agraph (float[batch, seq, {D}] x) => (float[batch, seq, {D}] y) {{
        y = Add(x, b0)
    }}"""
    model = build(text, b0=randn(rng(0), D))
    comparison = verify(model, model, {"x": (1, 7, D)})
    assert comparison.passed
    assert [run.shapes["x"] for run in comparison.runs] == [[1, 7, D], [3, 5, D]]
    assert comparison.input_shapes == {"x": [1, 7, D]}


def test_named_dims_of_a_given_shape_size_the_other_inputs():
    text = f"""{HEADER}
    agraph (float[batch, seq, {D}] x, bool[batch, seq] keep) => (float[batch, seq, {D}] y) {{
        k = Unsqueeze(keep, axes)
        y = Where(k, x, zero)
    }}"""
    model = build(text, axes=np.array([-1], dtype=np.int64), zero=np.zeros((), np.float32))
    feeds = make_inputs(model, {"x": (1, 7, D)})
    assert feeds["keep"].shape == (1, 7) and feeds["keep"].all()
    comparison = verify(model, model, {"x": (1, 7, D)})
    assert comparison.passed and [run.shapes["keep"] for run in comparison.runs] == [[1, 7], [1, 7], [3, 5]]


def test_verification_says_when_the_original_rejects_other_sizes():
    text = f"""{HEADER}
    agraph (float[batch, seq, {D}] x) => (float[2, 32] y) {{
        y = Reshape(x, shape)
    }}"""
    model = build(text, shape=np.array([2, 32], dtype=np.int64))
    comparison = verify(model, model, {"x": (2, 4, D)})
    assert comparison.passed and comparison.runs[1].skipped.startswith("the original model rejects these sizes")
    assert "1 run:" in comparison.exercised()


def test_verification_compares_shapes_and_non_finite_values():
    ref = {"a": np.array([1.0, np.nan, np.inf], dtype=np.float32), "b": np.ones((2, 3), np.float32)}
    same = compare_outputs(ref, {"a": ref["a"].copy(), "b": ref["b"].copy()})
    assert same.passed
    assert not compare_outputs(ref, {"a": np.array([1.0, 2.0, np.inf], np.float32), "b": ref["b"]}).passed
    assert not compare_outputs(ref, {"a": ref["a"], "b": np.ones((1, 3), np.float32)}).passed
    assert not compare_outputs(ref, {"a": ref["a"]}).passed


def renamed(model: onnx.ModelProto, change) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    change(copy.graph)
    return copy


def test_a_rewrite_that_changes_the_signature_is_refused_before_running():
    model = ln_model("e = Identity(h)")
    broken_op = onnx.helper.make_node("NoSuchOp", ["x"], ["unused"], domain="no.such.domain")

    def reorder_inputs(graph):
        first, second = onnx.ValueInfoProto(), onnx.ValueInfoProto()
        first.CopyFrom(graph.input[0])
        second.CopyFrom(graph.input[1])
        graph.input[0].CopyFrom(second)
        graph.input[1].CopyFrom(first)

    changes = {
        "input order": reorder_inputs,
        "output name": lambda graph: setattr(graph.output[1], "name", "renamed"),
        "output type": lambda graph: setattr(graph.output[0].type.tensor_type, "elem_type", onnx.TensorProto.DOUBLE),
        "output rank": lambda graph: graph.output[0].type.tensor_type.shape.dim.pop(),
        "dropped input": lambda graph: graph.input.pop(),
    }
    for change in changes.values():
        wrong = renamed(model, change)
        wrong.graph.node.append(broken_op)  # ORT cannot load it: the refusal must come first
        with pytest.raises(VerificationError, match=r"changed the model's (inputs|outputs)"):
            verify(model, wrong, name="m.onnx")
        with pytest.raises(VerificationError):
            check_signature(model, wrong)
