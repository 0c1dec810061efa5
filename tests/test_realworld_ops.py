"""The analysis on graphs as real exporters write them: run-time initializers, shape readers,
constant subgraphs, more zero-mean-preserving ops, and handlers that never raise."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_equivalent, build, check_structure, initializers, producer, randn, run_ort

from normpass import FoldOptions, fold_onnx, inspect_onnx
from normpass.onnx.graph.constants import constant_values, is_constant
from normpass.onnx.graph.frontend import infer_shapes

OPSET = '<ir_version: 10, opset_import: ["" : 17]>'


def _fold(model, **options):
    return fold_onnx(model, FoldOptions(fold_with_beta_add=True, **options))


def _decision(plan, name):
    return next(d for d in plan.decisions if d.name == name)


# --- overridable initializers --------------------------------------------------------------------

PRE_LN = (
    OPSET
    + """
m (float[2,4,8] x, float[8,8] W0) => (float[2,4,8] y) {
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n = LayerNormalization<axis=-1>(h, g, be)
  y0 = MatMul(n, W1)
  y = Add(y0, b1)
}"""
)


def _pre_ln(gen, **extra):
    return build(
        PRE_LN,
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        b1=randn(gen, 8),
        **extra,
    )


def test_initializer_listed_as_input_is_a_runtime_input(gen):
    model = _pre_ln(gen)
    result = _fold(model)
    assert result.folded == 0
    assert "W0" in _decision(result.plan, "n").reason
    assert [i.name for i in result.model.graph.input] == ["x", "W0"]
    assert [i.type for i in result.model.graph.input] == [i.type for i in model.graph.input]
    check_structure(result.model)
    feeds = {"x": randn(gen, 2, 4, 8, scale=3.0), "W0": randn(gen, 8, 8) + 1.0}  # an override
    expected, got = run_ort(model, feeds), run_ort(result.model, feeds)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-5)
    assert_equivalent(model, result.model)  # the defaults, as the model runs without an override


def test_overridable_consumer_weight_is_no_migration_target(gen):
    """W1 can be overridden: γ/β must stay out of it, and the folded model must still take it."""
    model = build(
        PRE_LN.replace("float[8,8] W0)", "float[8,8] W1)"),
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        b1=randn(gen, 8),
    )
    result = _fold(model)
    assert result.folded == 1
    assert "migrated" not in (result.affine_notes["n"] or "")
    assert [i.name for i in result.model.graph.input] == ["x", "W1"]
    feeds = {"x": randn(gen, 2, 4, 8, scale=3.0), "W1": randn(gen, 8, 8) + 1.0}
    expected, got = run_ort(model, feeds), run_ort(result.model, feeds)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-4, atol=1e-4)


def test_overridable_gamma_declines_the_norm(gen):
    model = build(
        PRE_LN.replace("float[8,8] W0)", "float[8] g)"),
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        b1=randn(gen, 8),
    )
    result = _fold(model)
    assert result.folded == 0
    assert "run time" in _decision(result.plan, "n").reason
    assert [i.name for i in result.model.graph.input] == ["x", "g"]


# --- readers of shapes only ----------------------------------------------------------------------


def test_shape_readers_do_not_block_centring_or_affine_migration(gen):
    """Shape of the centred stream and of the norm's output (as TorchScript exports emit for every reshape)."""
    model = build(
        OPSET
        + """
m (float[B,S,8] x) => (float[B,S,8] y) {
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  hs = Shape(h)
  n = LayerNormalization<axis=-1>(h, g, be)
  ns = Shape(n)
  k = Size(n)
  y0 = MatMul(n, W1)
  y1 = Add(y0, b1)
  z = Reshape(y1, ns)
  y = Reshape(z, hs)
}""",
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        b1=randn(gen, 8),
    )
    plan = inspect_onnx(model)
    assert [d.foldable for d in plan.decisions] == [True]
    result = fold_onnx(model)  # default options: β must have somewhere to go
    assert result.folded == 1
    assert result.affine_notes["n"].startswith("γ/β migrated")
    check_structure(result.model)
    for shape in ((1, 3, 8), (2, 5, 8)):
        assert_equivalent(model, result.model, shapes={"x": shape})


def test_a_value_computed_from_shapes_is_not_a_constant_to_centre(gen):
    model = build(
        OPSET
        + """
m (float[2,4,8] x) => (float[2,4,8] y) {
  h0 = MatMul(x, W0)
  s = Shape(h0)
  f = Cast<to=1>(s)
  t = Slice(f, two, three)
  h = Add(h0, t)
  n = LayerNormalization<axis=-1>(h, g, be)
  y = MatMul(n, W1)
}""",
        W0=randn(gen, 8, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        two=np.array([2], np.int64),
        three=np.array([3], np.int64),
    )
    decision = _decision(inspect_onnx(model), "n")
    assert not decision.foldable and "broadcasts t along the normalized axis" in decision.reason


# --- constant-like tensors -----------------------------------------------------------------------


def test_weights_read_through_constant_subgraphs_are_constants(gen):
    """γ deduplicated and read through Identity by two norms (TorchScript), W0 transposed, b0 a
    `value_floats` Constant, W1 cast from double, b1 unsqueezed: all constants. Only n1 folds, and
    n2 keeps reading the original γ (copy-on-write)."""
    model = build(
        OPSET
        + """
m (float[2,4,8] x) => (float[2,4,8] y, float[2,4,8] y2) {
  b0 = Constant<value_floats = [0.5, -1.0, 2.0, 0.25, 1.5, -0.75, 3.0, 1.0]>()
  w0 = Transpose<perm=[1, 0]>(W0t)
  gi = Identity(g)
  w1 = Cast<to=1>(W1d)
  b1 = Unsqueeze(b1v, zero)
  h0 = MatMul(x, w0)
  h = Add(h0, b0)
  n1 = LayerNormalization<axis=-1>(h, gi, be)
  y0 = MatMul(n1, w1)
  y = Add(y0, b1)
  n2 = LayerNormalization<axis=-1>(x, gi, be)
  y2 = Mul(n2, two)
}""",
        W0t=randn(gen, 8, 8),
        g=randn(gen, 8) + 1.0,
        be=randn(gen, 8),
        W1d=randn(gen, 8, 8).astype(np.float64),
        b1v=randn(gen, 8),
        zero=np.array([0], np.int64),
        two=np.array(2.0, np.float32),
    )
    result = _fold(model)
    assert [(d.name, d.foldable) for d in result.plan.decisions] == [("n1", True), ("n2", False)]
    assert result.affine_notes["n1"].startswith("γ/β migrated")
    check_structure(result.model)
    (n2,) = [n for n in result.model.graph.node if n.op_type == "LayerNormalization"]
    g_reader = next(n for n in result.model.graph.node if n.output[0] == n2.input[1])
    assert g_reader.op_type == "Identity" and g_reader.input[0] == "g"
    assert initializers(result.model)["g"].tobytes() == initializers(model)["g"].tobytes()
    assert_equivalent(model, result.model)


def test_slice_and_concat_of_constants_feed_a_centred_layer(gen):
    text = (
        OPSET
        + """
m (float[2,4,8] x) => (float[2,4,8] y) {
  lo = Slice(W, zero, four, one)
  hi = Slice(W, four, eight, one, one)
  w = Concat<axis=1>(lo, hi)
  h = MatMul(x, w)
  b = Gather<axis=0>(B, idx)
  hb = Add(h, b)
  n = LayerNormalization<axis=-1>(hb, g, be)
  y = MatMul(n, W1)
}"""
    )
    model = build(
        text,
        W=randn(gen, 8, 8),
        zero=np.array([0], np.int64),
        four=np.array([4], np.int64),
        eight=np.array([8], np.int64),
        one=np.array([1], np.int64),
        B=randn(gen, 3, 8),
        idx=np.array(1, np.int64),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
    )
    result = _fold(model)
    assert result.folded == 1
    assert_equivalent(model, result.model)


# --- never crash -----------------------------------------------------------------------------------


def _as_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every initializer written as a `Constant` node, as PaddlePaddle exports do."""
    constants = [
        onnx.helper.make_node("Constant", [], [i.name], name=f"const_{i.name}", value=i)
        for i in model.graph.initializer
    ]
    nodes = constants + list(model.graph.node)
    del model.graph.initializer[:]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def test_opset_11_softmax_of_unknown_rank_and_constant_node_weights(gen):
    model = onnx.parser.parse_model("""<ir_version: 6, opset_import: ["" : 11]>
m (float x) => (float y, float p) {
  p = Softmax(x)
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n = LayerNormalization(h, g, be)
  y = MatMul(n, W1)
}""")
    for value in list(model.graph.input) + list(model.graph.output):
        value.type.tensor_type.ClearField("shape")  # unknown rank
    for name, value in dict(
        W0=randn(gen, 8, 8), b0=randn(gen, 8), g=randn(gen, 8), be=randn(gen, 8), W1=randn(gen, 8, 8)
    ).items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    plan = inspect_onnx(_as_constant_nodes(model))
    assert [(d.foldable, d.reason) for d in plan.decisions] == [
        (False, "the rank of h is unknown, so the normalized axis cannot be tracked")
    ]


@pytest.mark.parametrize(
    "node",
    [
        "p = Softmax<axis=1>(h)",
        "p = Gather<axis=-1>(h, idx)",
        "p = Transpose<perm=[0, 0, 1]>(h)",
        "p = Concat(h, h)",
        "p = custom.MatMul(h, W1)",
        "p = Sub(h)",
    ],
)
def test_malformed_or_unknown_readers_decline_with_a_reason(gen, node):
    """A reader of the centred stream that cannot be analysed makes the fold unsafe, with a reason."""
    model = onnx.parser.parse_model(
        OPSET.replace('"" : 17', '"" : 17, "custom" : 1')
        + """
m (float[2,4,8] x) => (float[2,4,8] y, float p) {
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n = LayerNormalization<axis=-1>(h, g, be)
  y = MatMul(n, W1)
  """
        + node
        + """
}"""
    )
    for name, value in dict(
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        idx=np.array([0], np.int64),
    ).items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    model.graph.output[1].type.tensor_type.ClearField("shape")
    (decision,) = inspect_onnx(model).decisions
    assert not decision.foldable and decision.reason


# --- more zero-mean-preserving ops ---------------------------------------------------------------

STREAM = (
    OPSET.replace('"" : 17', '"" : 17, "com.microsoft" : 1')
    + """
m (float[2,4,6,8] x) => (float[{y}] y) {{
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  {op}
  n = LayerNormalization<axis=-1>(t, g, be)
  y = MatMul(n, W1)
}}"""
)
NO_ROI = np.zeros(0, np.float32)


def _stream_model(gen, op: str, out: str, **constants):
    """The stream `h` → `op` → `t` → LayerNorm → MatMul; `out` is the shape of t.

    Shapes through contrib ops come from ONNX Runtime's symbolic shape inference."""
    shape = [int(d) for d in out.split(",")]
    text = STREAM.format(op=op, y=out[: out.rindex(",")] + ",8")
    width = shape[-1]
    return build(
        text,
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, width),
        be=randn(gen, width),
        W1=randn(gen, width, 8),
        **constants,
    )


@pytest.mark.parametrize(
    "op, out, constants",
    [
        (
            't = Resize<mode="linear">(h, roi, scales)',
            "2,8,12,8",
            dict(roi=NO_ROI, scales=np.array([1, 2, 2, 1], np.float32)),
        ),
        (
            't = Resize<mode="cubic">(h, roi, "", sizes)',
            "2,4,9,8",
            dict(roi=NO_ROI, sizes=np.array([2, 4, 9, 8], np.int64)),
        ),
        ("t = Pad(h, pads)", "2,7,6,8", dict(pads=np.array([0, 1, 0, 0, 0, 2, 0, 0], np.int64))),
        ('t = Pad<mode="reflect">(h, pads)', "2,4,8,8", dict(pads=np.array([0, 0, 1, 0, 0, 0, 1, 0], np.int64))),
        ("t = Tile(h, reps)", "2,8,6,8", dict(reps=np.array([1, 2, 1, 1], np.int64))),
        (
            "t = Where(rows, h, zero)",
            "2,4,6,8",
            dict(rows=np.arange(48).reshape(2, 4, 6, 1) % 3 == 0, zero=np.array(-1e4, np.float32)),
        ),
    ],
)
def test_ops_that_keep_rows_whole_fold(gen, op, out, constants):
    model = _stream_model(gen, op, out, **constants)
    result = _fold(model)
    assert result.folded == 1, result.plan.decisions
    check_structure(result.model)
    assert_equivalent(model, result.model)


@pytest.mark.parametrize(
    "op, out, constants, reason",
    [
        (
            't = Resize<mode="linear">(h, roi, scales)',
            "2,4,6,16",
            dict(roi=NO_ROI, scales=np.array([1, 1, 1, 2], np.float32)),
            "mixes or pads along the normalized axis",
        ),
        (
            "t = Pad(h, pads)",
            "2,4,6,9",
            dict(pads=np.array([0, 0, 0, 0, 0, 0, 0, 1], np.int64)),
            "mixes or pads along the normalized axis",
        ),
        (
            "t = Pad(h, pads, one)",
            "2,5,6,8",
            dict(pads=np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int64), one=np.array(1, np.float32)),
            "pads with a value that is not a constant zero",
        ),
        (
            "x0 = ReduceMax<keepdims=0>(x)\n  t = Pad(h, pads, x0)",
            "2,5,6,8",
            dict(pads=np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int64)),
            "not a constant zero",
        ),
        (
            "t = Tile(h, reps)",
            "2,4,6,16",
            dict(reps=np.array([1, 1, 1, 2], np.int64)),
            "mixes or pads along the normalized axis",
        ),
        (
            "t = Where(cols, h, zero)",
            "2,4,6,8",
            dict(cols=np.arange(8) % 2 == 0, zero=np.array(0, np.float32)),
            "not whole rows",
        ),
        ("t = com.microsoft.FastGelu(h)", "2,4,6,8", {}, "a GELU is nonlinear"),
    ],
)
def test_ops_that_mix_a_row_decline_with_a_reason(gen, op, out, constants, reason):
    (decision,) = inspect_onnx(_stream_model(gen, op, out, **constants)).decisions
    assert not decision.foldable and reason in decision.reason


def test_contrib_bias_add_is_a_residual_sum(gen):
    """com.microsoft.BiasAdd (x + bias + skip; ORT runs it on CUDA only, so checked by analysis alone)."""
    (decision,) = inspect_onnx(_stream_model(gen, "t = com.microsoft.BiasAdd(h0, b0, h)", "2,4,6,8")).decisions
    assert decision.foldable and {c.label for c in decision.centrings} == {"h0", "b0"}


POOLED = (
    OPSET
    + """
m (float[2,8,6,6] x) => (float[2,{side},{side},8] y) {{
  h = Conv(x, W0, b0)
  p = {pool}
  t = Transpose<perm=[0, 2, 3, 1]>(p)
  n = LayerNormalization<axis=-1>(t, g, be)
  y = MatMul(n, W1)
}}"""
)


@pytest.mark.parametrize(
    "pool, side", [("AveragePool<kernel_shape=[2, 2], strides=[2, 2]>(h)", 3), ("GlobalAveragePool(h)", 1)]
)
def test_average_pooling_over_spatial_axes_folds(gen, pool, side):
    model = build(
        POOLED.format(pool=pool, side=side),
        W0=randn(gen, 8, 8, 1, 1),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
    )
    result = _fold(model)
    assert result.folded == 1
    assert_equivalent(model, result.model)


@pytest.mark.parametrize("equation, weight", [("bhsd,de->bhse", (8, 8)), ("bhsd,ed->bhse", (8, 8))])
def test_einsum_with_a_constant_operand_is_a_linear_layer(gen, equation, weight):
    text = STREAM.format(op=f't = Einsum<equation="{equation}">(h, We)', y="2,4,6,8")
    model = build(
        text.replace("h = Add(h0, b0)", "h = Relu(h0)"),
        W0=randn(gen, 8, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
        We=randn(gen, *weight),
    )
    result = _fold(model)
    assert result.folded == 1
    assert_equivalent(model, result.model)


LAYER_SCALE = (
    OPSET
    + """
m (float[2,4,8] x) => (float[2,4,8] y) {
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n1 = LayerNormalization<axis=-1>(h, g1, be1)
  a0 = MatMul(n1, Wa)
  a = Add(a0, ba)
  s = Mul(a, ls)
  r = Add(h, s)
  n2 = LayerNormalization<axis=-1>(r, g2, be2)
  y = MatMul(n2, W1)
}"""
)


def test_layer_scale_after_a_linear_layer_is_absorbed_and_centred(gen):
    model = build(
        LAYER_SCALE,
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g1=randn(gen, 8),
        be1=randn(gen, 8),
        Wa=randn(gen, 8, 8),
        ba=randn(gen, 8),
        ls=randn(gen, 8) + 0.5,
        g2=randn(gen, 8),
        be2=randn(gen, 8),
        W1=randn(gen, 8, 8),
    )
    result = _fold(model)
    assert result.folded == 2, result.plan.decisions
    # the scale went into the layer's weight and bias, and its Mul is gone: the residual sum and the layer's
    # bias fuse into the second norm, which reads the layer's MatMul
    assert not [n for n in result.model.graph.node if n.op_type == "Mul"]
    (skip,) = [n for n in result.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert skip.input[0] == "h" and producer(result.model, skip.input[1]).op_type == "MatMul"
    check_structure(result.model)
    assert_equivalent(model, result.model)


def test_layer_scale_varying_along_other_axes_is_not_absorbed(gen):
    model = build(
        LAYER_SCALE,
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g1=randn(gen, 8),
        be1=randn(gen, 8),
        Wa=randn(gen, 8, 8),
        ba=randn(gen, 8),
        ls=randn(gen, 4, 8),
        g2=randn(gen, 8),
        be2=randn(gen, 8),
        W1=randn(gen, 8, 8),
    )
    decision = _decision(inspect_onnx(model), "n2")
    assert not decision.foldable and "factor that is not constant along the normalized axis" in decision.reason


def test_layer_scale_after_a_gemm_with_transposed_weight(gen):
    model = build(
        OPSET
        + """
m (float[4,8] x) => (float[4,8] y) {
  h = Gemm<transB=1>(x, W0, b0)
  n1 = LayerNormalization<axis=-1>(h, g1, be1)
  a = Gemm<transB=1, alpha=0.5>(n1, Wa, ba)
  s = Mul(ls, a)
  r = Add(h, s)
  n2 = LayerNormalization<axis=-1>(r, g2, be2)
  y = MatMul(n2, W1)
}""",
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g1=randn(gen, 8),
        be1=randn(gen, 8),
        Wa=randn(gen, 8, 8),
        ba=randn(gen, 8),
        ls=randn(gen, 1, 8) + 0.5,
        g2=randn(gen, 8),
        be2=randn(gen, 8),
        W1=randn(gen, 8, 8),
    )
    result = _fold(model)
    assert result.folded == 2, result.plan.decisions
    assert_equivalent(model, result.model)


def test_fused_attention_takes_the_affine_and_refuses_a_shift(gen):
    """com.microsoft.Attention computes x·W_qkv + b_qkv: γ/β migrate into them; centring its input would not be
    exact."""
    text = (
        OPSET.replace('"" : 17', '"" : 17, "com.microsoft" : 1')
        + """
m (float[2,4,8] x) => (float[2,4,8] y, float[2,4,8] z) {
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n = LayerNormalization<axis=-1>(h, g, be)
  y = com.microsoft.Attention<num_heads=2>(n, Wqkv, bqkv)
  z = com.microsoft.Attention<num_heads=2>(h0, Wqkv, bqkv)
}"""
    )
    constants = dict(
        W0=randn(gen, 8, 8),
        b0=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        Wqkv=randn(gen, 8, 24),
        bqkv=randn(gen, 24),
    )
    model = build(text, **constants)
    (decision,) = inspect_onnx(model).decisions
    assert not decision.foldable and "fused attention" in decision.reason
    model = build(text.replace("(h0, Wqkv, bqkv)", "(x, Wqkv, bqkv)"), **constants)
    result = fold_onnx(model)
    assert result.folded == 1 and result.affine_notes["n"].startswith("γ/β migrated")
    assert_equivalent(model, result.model)


def test_a_residual_chain_deeper_than_the_recursion_limit(gen):
    depth = 1100
    lines = ["h0 = MatMul(x, W0)"] + [f"h{i + 1} = Add(h{i}, b)" for i in range(depth)]
    model = build(
        OPSET
        + f"""
m (float[2,8] x) => (float[2,8] y) {{
  {chr(10).join(lines)}
  n = LayerNormalization<axis=-1>(h{depth}, g, be)
  y = MatMul(n, W1)
}}""",
        W0=randn(gen, 8, 8),
        b=randn(gen, 8),
        g=randn(gen, 8),
        be=randn(gen, 8),
        W1=randn(gen, 8, 8),
    )
    assert [d.foldable for d in inspect_onnx(model).decisions] == [True]


# --- end to end: TorchScript exports with dynamic axes ------------------------------------------


def _torchscript_export(name: str) -> onnx.ModelProto:
    """`name` built from `transformers` code (one layer, registry sizes), exported by
    `torch.onnx.export(dynamo=False)` at opset 17 with dynamic axes, as HF Optimum does."""
    import tempfile

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    import transformers

    from normpass.models.registry import _randomise, gpt2_config

    class LM(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):  # an explicit all-ones mask, computed from the input's shape
            return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    class Encoder(LM):
        def forward(self, pixels):
            return self.model(pixels).last_hidden_state

    torch.manual_seed(0)
    if name == "gpt2":
        model, args = LM(transformers.GPT2LMHeadModel(gpt2_config(n_layer=1))), (torch.randint(0, 128, (2, 8)),)
    elif name == "opt":
        opt_config = transformers.OPTConfig(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=1,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            pad_token_id=1,
        )
        model, args = LM(transformers.OPTForCausalLM(opt_config)), (torch.randint(0, 128, (2, 8)),)
    else:
        vit_config = transformers.ViTConfig(
            image_size=32,
            patch_size=8,
            num_channels=3,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=128,
        )
        model, args = Encoder(transformers.ViTModel(vit_config, add_pooling_layer=False)), (torch.randn(2, 3, 32, 32),)
    _randomise(model)
    dynamic = {0: "batch"} if name == "vit" else {0: "batch", 1: "sequence"}
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/{name}.onnx"
        torch.onnx.export(
            model.eval(),
            args,
            path,
            dynamo=False,
            opset_version=17,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": dynamic, "output": dynamic},
        )
        return onnx.load(path)


@pytest.mark.parametrize("name", ["gpt2", "opt", "vit"])
def test_torchscript_exports_fold_every_norm(name):
    """Shape readers on hidden states, γ/β through Identity, masks from shapes: all 3 norms fold."""
    model = _torchscript_export(name)
    result = _fold(model)
    assert (result.folded, result.plan.total) == (3, 3), result.plan.decisions
    shapes = [{"input": (1, 3, 32, 32)}] if name == "vit" else [{"input": (1, 5)}, {"input": (3, 11)}]
    for shape in shapes:
        assert_equivalent(model, result.model, shapes=shape)
    default = fold_onnx(model)  # only the final norm, whose β has nowhere to go, stays a LayerNorm
    assert [d.kept for d in default.plan.decisions] == [False, False, True]


@pytest.mark.parametrize(
    "opset, body",
    [
        (17, "y = Identity(a)"),
        (17, "y = Cast<to=10>(a)"),
        (17, "y = Reshape(a, shape)"),
        (17, "y = Flatten<axis=1>(a)"),
        (17, "y = Squeeze(u, zero)"),
        (11, "y = Squeeze<axes=[0]>(u)"),
        (11, "y = Unsqueeze<axes=[0, -1]>(a)"),
        (17, "y = Unsqueeze(a, zero)"),
        (17, "y = Transpose(a)"),
        (17, "y = Concat<axis=-1>(a, a)"),
        (17, "y = Gather<axis=1>(a, idx)"),
        (17, "y = Slice(a, one, big, minus_one_axis)"),
        (9, "y = Slice<starts=[1], ends=[2], axes=[0]>(a)"),
        (17, "y = Expand(a, wide)"),
        (17, "t = Neg(a)\n  s = Sub(t, a)\n  y = Mul(s, a)"),
        (17, "y = ConstantOfShape<value=float[1] {0.5}>(shape)"),
        (17, "y = Constant<value_ints=[3, 1, 2]>()"),
        (17, "r = Range(zero_f, three_f, half_f)\n  y = Add(r, zero_f)"),
    ],
)
def test_constant_subgraphs_evaluate_as_the_onnx_reference_does(gen, opset, body):
    from onnx.reference import ReferenceEvaluator

    from normpass.onnx.graph.frontend import load_graph

    text = f'<ir_version: 7, opset_import: ["" : {opset}]>\nm () => (y) {{\n  {body}\n}}'
    model = onnx.parser.parse_model(text)
    constants = dict(
        a=randn(gen, 2, 3),
        u=randn(gen, 1, 3),
        shape=np.array([3, 2], np.int64),
        zero=np.array([0], np.int64),
        idx=np.array([[2, 0]], np.int64),
        one=np.array([1], np.int64),
        big=np.array([2**62], np.int64),
        minus_one_axis=np.array([-1], np.int64),
        wide=np.array([4, 2, 3], np.int64),
        zero_f=np.array(0, np.float32),
        three_f=np.array(3, np.float32),
        half_f=np.array(0.5, np.float32),
    )
    used = {name for node in model.graph.node for name in node.input}
    model.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in constants.items() if k in used)
    (expected,) = ReferenceEvaluator(model).run(None, {})
    (tensor,) = load_graph(model).graph.outputs
    assert is_constant(tensor)
    got = constant_values(tensor)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_resize_to_sizes_that_copy_the_inputs_own_dims_keeps_those_axes(gen):
    """sizes = Concat(Slice(Shape(h)), …), as torch exports F.interpolate(size=…): the copied axes are not resized."""
    op = (
        "s = Shape(h)\n  keep = Slice(s, zero, two)\n  last = Slice(s, three, four)\n"
        '  sizes = Concat<axis=0>(keep, nine, last)\n  t = Resize<mode="cubic">(h, "", "", sizes)'
    )
    ints = {k: np.array([v], np.int64) for k, v in dict(zero=0, two=2, three=3, four=4, nine=9).items()}
    model = _stream_model(gen, op, "2,4,9,8", **ints)
    result = _fold(model)
    assert result.folded == 1 and not result.plan.insertions, result.plan.decisions
    assert_equivalent(model, result.model)
    resized_last = _stream_model(gen, op.replace("Slice(s, three, four)", "Slice(s, two, three)"), "2,4,9,6", **ints)
    assert _fold(resized_last).folded == 0  # the last entry copies axis 2's size: the normalized axis is resized


def test_shapes_through_onnx_runtime_ops_after_a_constant_given_as_ints():
    """ONNX Runtime's symbolic inference reads a `Constant`'s `value` tensor only and failed on the whole model at a
    `value_ints` (as unoptimized dynamo exports write them): every shape after an ONNX Runtime op was lost."""
    model = onnx.parser.parse_model(
        OPSET
        + """
m (float[2,4,8] x, float[8] g) => (float z) {
  s = Constant<value_ints=[8, 8]>()
  one = Constant<value_float=1.0>()
  r = Reshape(x, s)
  t = Mul(r, one)
  y = SimplifiedLayerNormalization<axis=-1>(t, g)
  z = Add(y, one)
}"""
    )
    shapes, _, _ = infer_shapes(model)
    assert shapes["y"] == (8, 8) and shapes["z"] == (8, 8)
    assert model.graph.node[0].attribute[0].name == "value_ints"  # the model itself is not changed
