"""The exact fold on small hand-built ONNX graphs, one pattern per test.

Every test asserts the fold count and reasons, the structure of the rewritten graph (which ops
remain, which initializers were rewritten and how), `onnx.checker`, and the numerics: `fold_onnx`
verifies on its own seeded inputs, and `assert_equivalent` runs the original and the folded model
in ONNX Runtime on other inputs and compares within 1e-5 of each output's scale.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import (
    assert_equivalent,
    build,
    check_plain,
    check_structure,
    consumers,
    initializers,
    nodes_of,
    op_counts,
    producer,
    randn,
    rms_nodes,
    rms_scale,
    rng,
)

from normpass import FoldOptions, InputError, fold_onnx, inspect_onnx

D, S, V = 8, 4, 10  # hidden width, sequence length, vocabulary
HEADER = '<ir_version: 10, opset_import: ["" : {opset}]>'
FLOAT_SPECIALS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")


def header(opset: int = 18) -> str:
    return HEADER.format(opset=opset)


def gamma(gen, width=D):
    return 1 + randn(gen, width, scale=0.3)


def beta(gen, width=D):
    return randn(gen, width, scale=0.3)


def decision(plan, name):
    matches = [d for d in plan.decisions if d.name == name]
    assert len(matches) == 1, [d.name for d in plan.decisions]
    return matches[0]


def fold_and_check(model: onnx.ModelProto, rel_tol: float = 1e-5, **options):
    """fold_onnx with verification, then checker, equivalence on new inputs, input untouched.

    Most models here end in a norm whose β has nowhere to go; these tests are about the rewrite,
    so they fold it anyway (`fold_with_beta_add`) unless told otherwise. The default, which keeps
    such norms, is tested in test_emission.py.
    """
    options.setdefault("fold_with_beta_add", True)
    before = model.SerializeToString()
    result = fold_onnx(model, FoldOptions(**options))
    assert model.SerializeToString() == before, "fold_onnx modified its input model"
    assert result.comparison is not None and result.comparison.passed
    assert result.comparison.max_rel_error <= rel_tol
    rms_op = options.get("rms_op", "simplified")
    if rms_op == "simplified":
        check_structure(result.model)
    else:
        check_plain(result.model)
    assert_equivalent(model, result.model, rel_tol=rel_tol)
    simplified = len(rms_nodes(result.model))
    onnx_rms = len(nodes_of(result.model, "RMSNormalization"))
    if rms_op == "simplified":
        assert simplified == len(result.plan.folded) and onnx_rms == 0
    elif rms_op == "onnx":
        assert onnx_rms == len(result.plan.folded) and simplified == 0
    return result


def weight_of(model: onnx.ModelProto, node_output: str, index: int = 1) -> tuple[str, np.ndarray]:
    """The initializer read at input `index` of the node producing `node_output`."""
    node = producer(model, node_output)
    assert node is not None, node_output
    name = node.input[index]
    values = initializers(model)
    assert name in values, f"{node.op_type} {node.name} input {index} ({name}) is not an initializer"
    return name, values[name]


def assert_centred(values: np.ndarray, axis: int) -> None:
    sums = values.astype(np.float64).sum(axis=axis)
    scale = np.abs(values.astype(np.float64)).sum(axis=axis) + 1e-30
    assert np.all(np.abs(sums) <= 1e-5 * scale), f"not zero-mean along axis {axis}: {sums}"


def assert_not_centred(values: np.ndarray, axis: int) -> None:
    assert np.abs(values.astype(np.float64).mean(axis=axis)).max() > 1e-3


def test_check_structure_still_rejects_broken_models():
    """The checker helper hides only the contrib op's domain, not real errors."""
    gen = rng(0)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1>(h, g1, b1)
}}""",
        W=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    folded = fold_onnx(model, FoldOptions(fold_with_beta_add=True)).model
    check_structure(folded)
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        check_plain(folded)
    broken = onnx.ModelProto()
    broken.CopyFrom(folded)
    broken.graph.node[0].input[1] = "no_such_tensor"
    with pytest.raises(onnx.checker.ValidationError):
        check_structure(broken)


# --- pre-LN transformer block ---------------------------------------------------------------------


def pre_ln_block(gen, linear="MatMul"):
    """Token + position embeddings → LN → linear → Relu → linear → residual add → LN."""
    if linear == "MatMul":
        ids, stream, up, down = (
            f"int64[B, {S}] ids",
            f"float[B, {S}, {D}] out",
            "m1 = MatMul(n1, w1)\n  a1 = Add(m1, c1)",
            "m2 = MatMul(r1, w2)\n  a2 = Add(m2, c2)",
        )
        w1, w2 = randn(gen, D, 12), randn(gen, 12, D)
    else:  # Gemm on a [S, D] stream, Linear-style [out, in] weights
        ids, stream, up, down = (
            f"int64[{S}] ids",
            f"float[{S}, {D}] out",
            "a1 = Gemm<transB=1>(n1, w1, c1)",
            "a2 = Gemm<transB=1>(r1, w2, c2)",
        )
        w1, w2 = randn(gen, 12, D), randn(gen, D, 12)
    model = build(
        f"""{header()}
agraph ({ids}) => ({stream}) {{
  emb = Gather<axis=0>(table, ids)
  h0 = Add(emb, pos)
  n1 = LayerNormalization<axis=-1, epsilon=1e-5>(h0, g1, b1)
  {up}
  r1 = Relu(a1)
  {down}
  h1 = Add(h0, a2)
  out = LayerNormalization<axis=-1, epsilon=1e-5>(h1, g2, b2)
}}""",
        table=randn(gen, V, D),
        pos=randn(gen, S, D),
        g1=gamma(gen),
        b1=beta(gen),
        w1=w1,
        c1=randn(gen, 12),
        w2=w2,
        c2=randn(gen, D),
        g2=gamma(gen),
        b2=beta(gen),
    )
    return model


@pytest.mark.parametrize("fuse_skip", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("linear", ["MatMul", "Gemm"])
def test_pre_ln_block_folds_everything(linear, fuse_skip):
    model = pre_ln_block(rng(1), linear)
    plan = inspect_onnx(model)
    assert plan.total == 2 and len(plan.folded) == 2, plan.to_json()
    assert all(d.reason is None and d.blocker is None for d in plan.decisions)
    # the stream is written by the embedding Gather, the position constant and the second linear
    assert set(decision(plan, "n1").centred_layers) == {"emb", "pos"}
    stream_writer = "a2" if linear == "Gemm" else "m2"
    assert {"emb", "pos", stream_writer} <= set(decision(plan, "out").centred_layers)

    result = fold_and_check(model, fuse_skip=fuse_skip)
    folded = result.model
    counts = op_counts(folded)
    assert counts["LayerNormalization"] == 0
    original = initializers(model)
    # embedding table rows, the position table and the stream-writing layer are centred
    _, table = weight_of(folded, "emb", 0)
    assert_centred(table, 1)
    np.testing.assert_allclose(table, original["table"] - original["table"].mean(1, keepdims=True), atol=1e-6)
    add = producer(folded, "h0")
    pos = initializers(folded)[next(i for i in add.input if i != "emb")]
    assert_centred(pos, 1)
    if linear == "MatMul":
        _, w2 = weight_of(folded, "m2")
        assert_centred(w2, 1)
        if not fuse_skip:
            _, c2 = weight_of(folded, "a2")
            assert_centred(c2, 0)
    else:
        _, w2 = weight_of(folded, "a2")
        assert_centred(w2, 0)  # [out, in] with transB=1
        _, c2 = weight_of(folded, "a2", 2)
        assert_centred(c2, 0)
    # the up-projection is not written into the stream: it is not centred (γ/β may be migrated into it)
    first = "m1" if linear == "MatMul" else "a1"
    _, w1 = weight_of(folded, first)
    assert_not_centred(w1, 1 if linear == "MatMul" else 0)
    # n1 feeds only the up-projection: γ/β migrate into it, the RMS op has a unit scale
    rms_n1 = producer(folded, "n1")
    assert rms_n1.op_type == "SimplifiedLayerNormalization"
    np.testing.assert_array_equal(initializers(folded)[rms_n1.input[1]], np.ones(D, np.float32))
    # the last LN is a graph output: γ stays in the RMS op and β is an Add
    last = producer(folded, "out")
    assert last.op_type == "Add"
    rms_out = producer(folded, next(i for i in last.input if i not in initializers(folded)))
    assert next(a.f for a in rms_out.attribute if a.name == "epsilon") == pytest.approx(1e-5)
    if fuse_skip:  # the residual Add h1 = h0 + a2 is fused into the RMS op, and h1 is no longer needed
        assert counts["SimplifiedLayerNormalization"] == 1 and counts["SkipSimplifiedLayerNormalization"] == 1
        assert rms_out.op_type == "SkipSimplifiedLayerNormalization" and rms_out.domain == "com.microsoft"
        if linear == "MatMul":  # the bias Add a2 = m2 + c2 goes into the op's bias input too
            assert sorted(rms_out.input[:2]) == ["h0", "m2"] and len(rms_out.input) == 4
            assert producer(folded, "a2") is None
            assert_centred(initializers(folded)[rms_out.input[3]], 0)
        else:
            assert sorted(rms_out.input[:2]) == ["a2", "h0"] and len(rms_out.input) == 3
        assert producer(folded, "h1") is None
    else:
        assert counts["SimplifiedLayerNormalization"] == 2 and counts["SkipSimplifiedLayerNormalization"] == 0
        assert rms_out.op_type == "SimplifiedLayerNormalization" and rms_out.input[0] == "h1"
    np.testing.assert_array_equal(initializers(folded)[rms_scale(rms_out)], original["g2"])


def test_skip_fusion_keeps_a_residual_sum_that_is_read_on():
    """h1 = h0 + a feeds the norm and the next residual add: the fused op must still provide h1."""
    gen = rng(47)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h0 = MatMul(x, W0)
  n0 = LayerNormalization<axis=-1>(h0, g0, b0)
  a0 = MatMul(n0, W1)
  h1 = Add(h0, a0)
  n1 = LayerNormalization<axis=-1>(h1, g1, b1)
  a1 = MatMul(n1, W2)
  h2 = Add(h1, a1)
  y = LayerNormalization<axis=-1>(h2, g2, b2)
}}""",
        W0=randn(gen, 6, D),
        W1=randn(gen, D, D),
        W2=randn(gen, D, D),
        g0=gamma(gen),
        b0=beta(gen),
        g1=gamma(gen),
        b1=beta(gen),
        g2=gamma(gen),
        b2=beta(gen),
    )
    result = fold_and_check(model)
    assert len(result.plan.folded) == 3
    folded = result.model
    assert op_counts(folded)["SkipSimplifiedLayerNormalization"] == 2
    assert op_counts(folded)["LayerNormalization"] == 0
    h1_producer = producer(folded, "h1")
    assert h1_producer is not None and h1_producer.op_type in ("Add", "SkipSimplifiedLayerNormalization")
    unfused = fold_and_check(model, fuse_skip=False).model
    assert op_counts(unfused)["SkipSimplifiedLayerNormalization"] == 0
    assert op_counts(unfused)["SimplifiedLayerNormalization"] == 3


# --- single linear layers feeding an LN -----------------------------------------------------------


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_with_bias_feeding_ln(trans_b):
    gen = rng(2)
    weight = randn(gen, 6, D) if trans_b == 0 else randn(gen, D, 6)
    model = build(
        f"""{header()}
agraph (float[N, 6] x) => (float[N, {D}] y) {{
  h = Gemm<transB={trans_b}>(x, W, C)
  y = LayerNormalization<axis=-1>(h, g1, b1)
}}""",
        W=weight,
        C=randn(gen, D) + 2,
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1 and decision(plan, "y").centred_layers == ["h"]
    result = fold_and_check(model)
    counts = op_counts(result.model)
    assert counts["LayerNormalization"] == 0 and len(rms_nodes(result.model)) == 1
    w_name, w = weight_of(result.model, "h", 1)
    out_axis = 1 - trans_b
    assert_centred(w, out_axis)
    assert_not_centred(w, 1 - out_axis)  # centred along the output axis, not the input one
    np.testing.assert_allclose(w, weight - weight.mean(out_axis, keepdims=True), atol=1e-6)
    _, c = weight_of(result.model, "h", 2)
    assert_centred(c, 0)
    assert "W" not in initializers(result.model) and w_name != "W"


def test_matmul_plus_bias_feeding_ln():
    gen = rng(3)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  hb = Add(h, c)
  y = LayerNormalization<axis=-1>(hb, g1, b1)
}}""",
        W=randn(gen, 6, D),
        c=randn(gen, D) + 1,
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1
    assert set(decision(plan, "y").centred_layers) == {"h", "c"}
    result = fold_and_check(model)
    assert op_counts(result.model)["LayerNormalization"] == 0
    _, w = weight_of(result.model, "h")
    assert_centred(w, 1)
    add = producer(result.model, "hb")
    bias = initializers(result.model)[next(i for i in add.input if i != "h")]
    assert_centred(bias, 0)


# --- convolution (patch embedding) ---------------------------------------------------------------


def patch_embedding(gen, group=1, channels=3):
    text = f"""{header()}
agraph (float[B, {channels}, 8, 8] x) => (float[B, 4, {D}] y) {{
  c = Conv<kernel_shape=[4, 4], strides=[4, 4], group={group}>(x, W, Bc)
  r = Reshape(c, shp)
  t = Transpose<perm=[0, 2, 1]>(r)
  y = LayerNormalization<axis=-1>(t, g1, b1)
}}"""
    return build(
        text,
        W=randn(gen, D, channels // group, 4, 4),
        Bc=randn(gen, D) + 1,
        shp=np.array([0, D, 4], np.int64),
        g1=gamma(gen),
        b1=beta(gen),
    )


def test_conv_patch_embedding_folds():
    model = patch_embedding(rng(4))
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1 and decision(plan, "y").centred_layers == ["c"]
    result = fold_and_check(model)
    assert op_counts(result.model)["LayerNormalization"] == 0
    _, w = weight_of(result.model, "c", 1)
    assert w.shape == (D, 3, 4, 4)
    assert_centred(w, 0)  # along output channels
    _, b = weight_of(result.model, "c", 2)
    assert_centred(b, 0)


def test_depthwise_conv_is_refused():
    model = patch_embedding(rng(5), group=D, channels=D)
    plan = inspect_onnx(model)
    assert plan.total == 1 and not plan.folded
    refused = decision(plan, "y")
    assert "depthwise" in refused.reason or "grouped" in refused.reason
    assert refused.blocker is not None and refused.blocker.node == "c"
    result = fold_and_check(model)
    assert op_counts(result.model)["LayerNormalization"] == 1
    assert initializers(result.model)["W"].tobytes() == initializers(model)["W"].tobytes()


# --- decomposed LayerNorm ----------------------------------------------------------------------------


def decomposed_ln(gen, square="Pow", divide="Div", casts=None, opset=18, affine=True):
    """Gemm → x − mean → d² → mean → +ε → sqrt → d / · → ⊙γ → +β.

    `casts`: None; "inside" (the variance is computed in double: Cast after the square, Cast
    back after the Sqrt); "around" (the whole chain runs in double between a Cast pair).
    """
    wide = casts == "around"
    dt = np.float64 if wide else np.float32
    mean = "ReduceMean<axes=[-1]>({})" if opset < 18 else "ReduceMean({}, ax)"
    lines = ["h = Gemm<transB=1>(x, W, C)"]
    src = "h"
    if wide:
        lines.append("hw = Cast<to=11>(h)")
        src = "hw"
    lines += [f"mu = {mean.format(src)}", f"d = Sub({src}, mu)"]
    lines.append("d2 = Pow(d, two)" if square == "Pow" else "d2 = Mul(d, d)")
    var_in = "d2"
    if casts == "inside":
        lines.append("d2w = Cast<to=11>(d2)")
        var_in = "d2w"
    lines += [f"v = {mean.format(var_in)}", "ve = Add(v, eps)", "s = Sqrt(ve)"]
    root = "s"
    if casts == "inside":
        lines.append("sf = Cast<to=1>(s)")
        root = "sf"
    if divide == "Div":
        lines.append(f"xn = Div(d, {root})")
    else:
        lines += [f"rs = Reciprocal({root})", "xn = Mul(d, rs)"]
    out = "yw" if wide else "y"
    if affine:
        lines += ["xg = Mul(xn, g1)", f"{out} = Add(xg, b1)"]
    else:
        lines.append(f"{out} = Identity(xn)")
    if wide:
        lines.append("y = Cast<to=1>(yw)")
    body = "\n  ".join(lines)
    text = f"""{header(opset)}
agraph (float[N, 6] x) => (float[N, {D}] y) {{
  {body}
}}"""
    values = dict(
        W=randn(gen, D, 6),
        C=randn(gen, D) + 1,
        two=np.array(2.0, dt),
        eps=np.array(1e-5, np.float64 if casts else np.float32),
        g1=gamma(gen).astype(dt),
        b1=beta(gen).astype(dt),
        ax=np.array([-1], np.int64),
    )
    used = {name for node in onnx.parser.parse_model(text).graph.node for name in node.input}
    return build(text, **{k: v for k, v in values.items() if k in used})


DECOMPOSED_OPS = ("ReduceMean", "Sub", "Pow", "Sqrt", "Div", "Reciprocal")


def assert_decomposed_folds(model):
    plan = inspect_onnx(model)
    assert plan.total == 1, plan.to_json()
    norm = plan.decisions[0]
    assert norm.op == "decomposed LayerNorm"
    assert norm.foldable, norm.reason
    assert norm.centred_layers == ["h"]
    result = fold_and_check(model)
    counts = op_counts(result.model)
    assert counts["SimplifiedLayerNormalization"] == 1
    assert not any(counts[op] for op in DECOMPOSED_OPS), counts
    _, w = weight_of(result.model, "h", 1)
    assert_centred(w, 0)
    return result


@pytest.mark.parametrize("opset", [13, 18])
def test_decomposed_ln_pow_div(opset):
    assert_decomposed_folds(decomposed_ln(rng(6), opset=opset))


def test_decomposed_ln_reciprocal_mul():
    assert_decomposed_folds(decomposed_ln(rng(7), divide="Reciprocal"))


def test_decomposed_ln_without_affine():
    result = assert_decomposed_folds(decomposed_ln(rng(8), affine=False))
    rms = nodes_of(result.model, "SimplifiedLayerNormalization")[0]
    np.testing.assert_array_equal(initializers(result.model)[rms.input[1]], np.ones(D, np.float32))


def test_decomposed_ln_with_casts_between_steps():
    assert_decomposed_folds(decomposed_ln(rng(9), casts="inside"))


def test_decomposed_ln_mul_square():
    assert_decomposed_folds(decomposed_ln(rng(10), square="Mul"))


@pytest.mark.parametrize("affine", [True, False])
def test_decomposed_ln_in_double_between_a_cast_pair(affine):
    assert_decomposed_folds(decomposed_ln(rng(11), casts="around", affine=affine))


def test_decomposed_ln_in_double_between_a_cast_pair_with_value_info():
    """The same model with inferred types stored as value_info."""
    assert_decomposed_folds(onnx.shape_inference.infer_shapes(decomposed_ln(rng(11), casts="around")))


def test_decomposed_ln_with_private_tensor_used_elsewhere_is_listed_not_rewritten():
    """A chain whose intermediate d is also a graph output is listed, once, and declined naming d."""
    model = decomposed_ln(rng(12))
    model.graph.output.append(onnx.helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, ["N", D]))
    plan = inspect_onnx(model)
    assert [(d.op, d.foldable) for d in plan.decisions] == [("decomposed LayerNorm", False)], plan.to_json()
    assert plan.decisions[0].reason == "not rewritten: its intermediate d is also a graph output"
    result = fold_and_check(model)
    assert op_counts(result.model) == op_counts(model)


# --- post-LN --------------------------------------------------------------------------------------------


def post_ln(gen, g1=None, b1=None):
    return build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W0)
  n1 = LayerNormalization<axis=-1>(h, g1, b1)
  m1 = MatMul(n1, W1)
  a1 = Add(m1, c1)
  r = Add(n1, a1)
  y = LayerNormalization<axis=-1>(r, g2, b2)
}}""",
        W0=randn(gen, 6, D),
        W1=randn(gen, D, D),
        c1=randn(gen, D),
        g1=gamma(gen) if g1 is None else g1,
        b1=beta(gen) if b1 is None else b1,
        g2=gamma(gen),
        b2=beta(gen),
    )


def test_post_ln_second_norm_refused_naming_the_first():
    model = post_ln(rng(13))
    plan = inspect_onnx(model)
    assert plan.total == 2 and [d.name for d in plan.folded] == ["n1"]
    refused = decision(plan, "y")
    assert not refused.foldable
    assert "n1" in refused.reason and "post-LN" in refused.reason
    assert refused.blocker is not None and refused.blocker.node == "n1"
    result = fold_and_check(model)
    counts = op_counts(result.model)
    assert counts["LayerNormalization"] == 1 and counts["SimplifiedLayerNormalization"] == 1
    assert producer(result.model, "y").op_type == "LayerNormalization"
    # n1 feeds the residual Add as well as a MatMul: γ stays in the RMS op; β moves into the MatMul's
    # bias (β·W1) and across the residual Add into the same bias (the other summand): c1 + β·W1 + β
    assert producer(result.model, "n1").op_type == "SimplifiedLayerNormalization"
    assert counts["Add"] == 2
    source = initializers(model)
    bias_add = producer(result.model, "a1")
    moved = initializers(result.model)[bias_add.input[1]]
    expected = source["c1"].astype(np.float64) + source["b1"] @ source["W1"].astype(np.float64) + source["b1"]
    np.testing.assert_allclose(moved, expected, rtol=1e-5, atol=1e-5)
    assert "β migrated into" in result.affine_notes["n1"]


def test_post_ln_with_centred_affine_folds_both():
    """If the first LN's output is itself zero-mean (uniform γ, mean(β) = 0), the second folds too."""
    gen = rng(14)
    b1 = beta(gen)
    model = post_ln(gen, g1=np.full(D, 1.5, np.float32), b1=(b1 - b1.mean()).astype(np.float32))
    plan = inspect_onnx(model)
    assert len(plan.folded) == 2, plan.to_json()
    fold_and_check(model)


# --- safety --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("leak", ["graph_output", "matmul"])
def test_unsafe_centring_refused(leak):
    gen = rng(15)
    if leak == "graph_output":
        outputs, extra, inits = f"float[B, {S}, {D}] y, float[B, {S}, {D}] h", "", {}
    else:
        outputs, extra, inits = (
            f"float[B, {S}, {D}] y, float[B, {S}, 5] z",
            "z = MatMul(h, W1)",
            {"W1": randn(gen, D, 5)},
        )
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => ({outputs}) {{
  h = MatMul(x, W0)
  y = LayerNormalization<axis=-1>(h, g1, b1)
  {extra}
}}""",
        W0=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
        **inits,
    )
    plan = inspect_onnx(model)
    assert plan.total == 1 and not plan.folded
    refused = plan.decisions[0]
    assert "unsafe" in refused.reason and "h" in refused.reason
    assert refused.blocker.node == ("h" if leak == "graph_output" else "z")
    result = fold_and_check(model)
    assert op_counts(result.model) == op_counts(model)
    assert initializers(result.model)["W0"].tobytes() == initializers(model)["W0"].tobytes()


def test_shared_weight_is_copied_on_write():
    """W feeds the centred MatMul and another MatMul whose output is a graph output."""
    gen = rng(16)
    weight = randn(gen, D, D)
    model = build(
        f"""{header()}
agraph (float[B, {S}, {D}] x) => (float[B, {S}, {D}] y, float[B, {S}, {D}] z) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1>(h, g1, b1)
  z = MatMul(x, W)
}}""",
        W=weight,
        g1=gamma(gen),
        b1=beta(gen),
    )
    result = fold_and_check(model)
    assert len(result.plan.folded) == 1
    folded = result.model
    assert producer(folded, "z").input[1] == "W"
    np.testing.assert_array_equal(initializers(folded)["W"], weight)
    centred_name, centred = weight_of(folded, "h")
    assert centred_name != "W"
    assert_centred(centred, 1)


def test_tied_embedding_and_shared_bias_are_copied_on_write():
    """The token table is also the (transposed) LM head; the stream bias also feeds a side output."""
    gen = rng(17)
    model = build(
        f"""{header()}
agraph (int64[B, {S}] ids) => (float[B, {S}, {V}] logits, float[B, {S}, {D}] side) {{
  emb = Gather<axis=0>(table, ids)
  h = Add(emb, bias)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  head = Transpose<perm=[1, 0]>(table)
  logits = MatMul(n, head)
  side = Add(n, bias)
}}""",
        table=randn(gen, V, D),
        bias=randn(gen, D) + 1,
        g1=gamma(gen),
        b1=beta(gen),
    )
    result = fold_and_check(model)
    assert len(result.plan.folded) == 1
    folded, original = result.model, initializers(model)
    assert producer(folded, "head").input[0] == "table"
    np.testing.assert_array_equal(initializers(folded)["table"], original["table"])
    assert producer(folded, "side").input[1] == "bias"
    np.testing.assert_array_equal(initializers(folded)["bias"], original["bias"])
    _, table = weight_of(folded, "emb", 0)
    assert_centred(table, 1)
    stream_add = producer(folded, "h")
    stream_bias = next(i for i in stream_add.input if i != "emb")
    assert stream_bias != "bias"
    assert_centred(initializers(folded)[stream_bias], 0)


# --- γ/β migration -----------------------------------------------------------------------------------------


def test_affine_migrates_into_linear_consumers():
    gen = rng(18)
    model = build(
        f"""{header()}
agraph (float[N, 6] x) => (float[N, 5] q, float[N, 7] k, float[N, 3] v) {{
  h = Gemm(x, W0, c0)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  q = Gemm<transB=1>(n, Wq, cq)
  k = Gemm(n, Wk)
  mv = MatMul(n, Wv)
  v = Add(mv, cv)
}}""",
        W0=randn(gen, 6, D),
        c0=randn(gen, D),
        Wq=randn(gen, 5, D),
        cq=randn(gen, 5),
        Wk=randn(gen, D, 7),
        Wv=randn(gen, D, 3),
        cv=randn(gen, 3),
        g1=gamma(gen),
        b1=beta(gen),
    )
    result = fold_and_check(model)
    assert len(result.plan.folded) == 1
    folded = result.model
    rms = producer(folded, "n")
    assert rms.op_type == "SimplifiedLayerNormalization"
    np.testing.assert_array_equal(initializers(folded)[rms.input[1]], np.ones(D, np.float32))
    assert op_counts(folded)["Add"] == 1  # only v's own bias; no Add for β
    assert {c.op_type for c in consumers(folded, "n")} == {"Gemm", "MatMul"}
    assert "migrated" in result.affine_notes["n"]
    original = initializers(model)
    for out, name in (("q", "Wq"), ("k", "Wk"), ("mv", "Wv")):
        new_name, new = weight_of(folded, out)
        assert new_name != name and not np.allclose(new, original[name])
        np.testing.assert_array_equal(initializers(folded).get(name, original[name]), original[name])
    assert len(producer(folded, "k").input) == 3  # β·W became a new bias on the bias-less Gemm


def test_affine_stays_with_a_non_linear_consumer():
    gen = rng(19)
    model = build(
        f"""{header()}
agraph (float[N, 6] x) => (float[N, 5] q, float[N, {D}] k) {{
  h = Gemm(x, W0, c0)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  q = Gemm<transB=1>(n, Wq, cq)
  k = Relu(n)
}}""",
        W0=randn(gen, 6, D),
        c0=randn(gen, D),
        Wq=randn(gen, 5, D),
        cq=randn(gen, 5),
        g1=gamma(gen),
        b1=beta(gen),
    )
    result = fold_and_check(model)
    folded, original = result.model, initializers(model)
    beta_add = producer(folded, "n")
    assert beta_add.op_type == "Add"
    rms = producer(folded, next(i for i in beta_add.input if i not in initializers(folded)))
    assert rms.op_type == "SimplifiedLayerNormalization"
    np.testing.assert_array_equal(initializers(folded)[rms.input[1]], original["g1"])
    beta_const = next(i for i in beta_add.input if i in initializers(folded))
    np.testing.assert_array_equal(initializers(folded)[beta_const], original["b1"])
    assert producer(folded, "q").input[1] == "Wq"  # the Gemm consumer is untouched
    np.testing.assert_array_equal(initializers(folded)["Wq"], original["Wq"])


def test_no_migrate_affine_option_keeps_affine():
    gen = rng(20)
    model = build(
        f"""{header()}
agraph (float[N, 6] x) => (float[N, 5] q) {{
  h = Gemm(x, W0, c0)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  q = Gemm<transB=1>(n, Wq, cq)
}}""",
        W0=randn(gen, 6, D),
        c0=randn(gen, D),
        Wq=randn(gen, 5, D),
        cq=randn(gen, 5),
        g1=gamma(gen),
        b1=beta(gen),
    )
    migrated = fold_and_check(model).model
    assert op_counts(migrated)["Add"] == 0
    kept = fold_and_check(model, migrate_affine=False).model
    assert op_counts(kept)["Add"] == 1
    assert producer(kept, "q").input[1] == "Wq"


@pytest.mark.parametrize("attrs,with_bias", [("alpha=0.5", True), ("beta=2.0", True), ("alpha=0.5", False)])
def test_affine_migrates_into_gemm_with_alpha_beta(attrs, with_bias):
    gen = rng(21)
    bias = ", cq" if with_bias else ""
    model = build(
        f"""{header()}
agraph (float[N, 6] x) => (float[N, 5] q) {{
  h = Gemm(x, W0, c0)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  q = Gemm<transB=1, {attrs}>(n, Wq{bias})
}}""",
        W0=randn(gen, 6, D),
        c0=randn(gen, D),
        Wq=randn(gen, 5, D),
        g1=gamma(gen),
        b1=beta(gen),
        **({"cq": randn(gen, 5)} if with_bias else {}),
    )
    result = fold_and_check(model)
    assert len(result.plan.folded) == 1


# --- inserted centring ------------------------------------------------------------------------------------


def pre_ln_from_input(gen, layers=2):
    lines = ["h0 = Add(x, pos)"]
    values = dict(pos=randn(gen, S, D))
    for i in range(layers):
        lines += [
            f"n{i} = LayerNormalization<axis=-1>(h{i}, g{i}, b{i})",
            f"m{i} = MatMul(n{i}, W{i})",
            f"a{i} = Add(m{i}, c{i})",
            f"h{i + 1} = Add(h{i}, a{i})",
        ]
        values.update({f"g{i}": gamma(gen), f"b{i}": beta(gen), f"W{i}": randn(gen, D, D), f"c{i}": randn(gen, D)})
    lines.append(f"y = LayerNormalization<axis=-1>(h{layers}, gf, bf)")
    values.update(gf=gamma(gen), bf=beta(gen))
    body = "\n  ".join(lines)
    return build(
        f"""{header()}
agraph (float[B, {S}, {D}] x) => (float[B, {S}, {D}] y) {{
  {body}
}}""",
        **values,
    )


def test_inserted_centring_is_planned_once_for_all_norms():
    model = pre_ln_from_input(rng(22))
    plan = inspect_onnx(model)
    assert plan.total == 3 and len(plan.folded) == 3, plan.to_json()
    assert len(plan.insertions) == 1
    assert plan.insertions[0].tensor == "x" and plan.insertions[0].axis == 2
    refused = inspect_onnx(model, insert_centering=False)
    assert not refused.folded
    assert all("graph input x" in d.reason and d.blocker.node == "x" for d in refused.decisions)


def test_inserted_centring_fold():
    model = pre_ln_from_input(rng(22))
    assert len(rms_nodes(fold_and_check(model).model)) == 3
    result = fold_and_check(model, fuse_skip=False)
    folded = result.model
    counts = op_counts(folded)
    assert counts["LayerNormalization"] == 0 and counts["SimplifiedLayerNormalization"] == 3
    assert counts["ReduceMean"] == 1 and counts["Sub"] == 1
    sub = nodes_of(folded, "Sub")[0]
    mean = producer(folded, sub.input[1])
    assert sub.input[0] == "x" and mean.op_type == "ReduceMean" and mean.input[0] == "x"
    assert sorted(c.op_type for c in consumers(folded, "x")) == ["ReduceMean", "Sub"]
    assert producer(folded, "h0").input[0] == sub.output[0]


def test_inserted_centring_on_a_norm_input():
    """x feeds the first norm directly and the residual stream: the insertion must feed both."""
    gen = rng(41)
    model = build(
        f"""{header()}
agraph (float[B, {S}, {D}] x) => (float[B, {S}, {D}] y) {{
  n0 = LayerNormalization<axis=-1>(x, g0, b0)
  m0 = MatMul(n0, W0)
  h1 = Add(x, m0)
  y = LayerNormalization<axis=-1>(h1, g1, b1)
}}""",
        g0=gamma(gen),
        b0=beta(gen),
        W0=randn(gen, D, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert len(plan.folded) == 2 and [(i.tensor, i.axis) for i in plan.insertions] == [("x", 2)]
    fold_and_check(model)
    result = fold_and_check(model, fuse_skip=False)
    sub = nodes_of(result.model, "Sub")[0]
    assert sub.input[0] == "x" and producer(result.model, sub.input[1]).op_type == "ReduceMean"
    rms_inputs = sorted(n.input[0] for n in nodes_of(result.model, "SimplifiedLayerNormalization"))
    assert rms_inputs == sorted([sub.output[0], "h1"])  # the first norm reads the centred x
    assert producer(result.model, "h1").input[0] == sub.output[0]  # and so does the residual stream


def test_no_insertion_without_option():
    model = pre_ln_from_input(rng(22))
    result = fold_and_check(model, insert_centering=False)
    assert not result.plan.folded
    assert op_counts(result.model) == op_counts(model)


def test_single_ln_on_graph_input_is_refused():
    """One insertion costs about what one fold saves: no insertion for a single norm."""
    gen = rng(23)
    model = build(
        f"""{header()}
agraph (float[B, {S}, {D}] x) => (float[B, {S}, {D}] y) {{
  y = LayerNormalization<axis=-1>(x, g1, b1)
}}""",
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert plan.total == 1 and not plan.folded and not plan.insertions
    assert "graph input x" in plan.decisions[0].reason
    result = fold_and_check(model)
    assert op_counts(result.model) == op_counts(model)


# --- refusals --------------------------------------------------------------------------------------------


def test_multi_axis_ln_refused():
    gen = rng(24)
    model = build(
        f"""{header()}
agraph (float[B, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  hr = Reshape(h, shp)
  y = LayerNormalization<axis=-2>(hr, g1, b1)
}}""",
        W=randn(gen, 6, S * D),
        shp=np.array([-1, S, D], np.int64),
        g1=1 + randn(gen, S, D, scale=0.3),
        b1=randn(gen, S, D, scale=0.3),
    )
    plan = inspect_onnx(model)
    assert plan.total == 1 and not plan.folded
    assert "axes" in plan.decisions[0].reason and "multi-axis" in plan.decisions[0].reason
    result = fold_and_check(model)
    assert op_counts(result.model) == op_counts(model)


def test_ln_with_mean_output_consumed_is_refused():
    gen = rng(25)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y, float[B, {S}, 1] z) {{
  h = MatMul(x, W0)
  y, mu, isd = LayerNormalization<axis=-1>(h, g1, b1)
  z = Relu(mu)
}}""",
        W0=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert not plan.folded and "Mean" in plan.decisions[0].reason
    fold_and_check(model)


def test_ln_with_mean_output_as_graph_output_is_refused():
    gen = rng(25)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y, float[B, {S}, 1] mu) {{
  h = MatMul(x, W0)
  y, mu, isd = LayerNormalization<axis=-1>(h, g1, b1)
}}""",
        W0=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert not plan.folded
    fold_and_check(model)


def test_group_norm_reported_not_folded():
    gen = rng(26)
    model = build(
        f"""{header(21)}
agraph (float[B, 3, 4, 4] x) => (float[B, {D}, 4, 4] y) {{
  c = Conv<kernel_shape=[1, 1]>(x, W, Bc)
  y = GroupNormalization<num_groups=2>(c, g1, b1)
}}""",
        W=randn(gen, D, 3, 1, 1),
        Bc=randn(gen, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert plan.total == 1 and not plan.folded
    assert plan.decisions[0].op == "GroupNormalization"
    assert "GroupNorm" in plan.decisions[0].reason
    result = fold_and_check(model)
    assert op_counts(result.model) == op_counts(model)


def scaled(gen, factor):
    return build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  hs = Mul(h, s)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W=randn(gen, 6, D),
        s=factor,
        g1=gamma(gen),
        b1=beta(gen),
    )


def test_per_feature_mul_is_refused():
    """On a tensor that something else reads too (right after a linear layer, it is a LayerScale): the proof
    centres the layer weighted by the factor, and that centring's shift reaches the other reader."""
    gen = rng(27)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y, float[B, {S}, {D}] h) {{
  h = MatMul(x, W)
  hs = Mul(h, s)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W=randn(gen, 6, D),
        s=1 + randn(gen, D, scale=0.5),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert not plan.folded
    assert plan.decisions[0].reason == "centring h is unsafe: the shift reaches graph output h"
    assert plan.decisions[0].blocker.node == "h"
    result = fold_and_check(model)
    assert op_counts(result.model) == op_counts(model)


@pytest.mark.parametrize(
    "factor",
    [np.array(0.7, np.float32), np.array([0.7], np.float32), np.array([[0.5], [1.0], [2.0], [-1.0]], np.float32)],
    ids=["scalar", "shape-1", "per-token"],
)
def test_mul_constant_along_the_axis_folds(factor):
    gen = rng(28)
    model = scaled(gen, factor)
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1 and plan.decisions[0].centred_layers == ["h"]
    result = fold_and_check(model)
    assert op_counts(result.model)["Mul"] == 1
    _, w = weight_of(result.model, "h")
    assert_centred(w, 1)
    np.testing.assert_array_equal(initializers(result.model)["s"], factor)


def test_sums_differences_and_scalings_of_linear_layers_fold():
    """c − (h − (−k)) / 3 through Identity: every linear branch and the constant are centred."""
    gen = rng(42)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W0)
  k = MatMul(x, W1)
  kn = Neg(k)
  d = Sub(h, kn)
  dd = Div(d, s)
  di = Identity(dd)
  e = Sub(c0, di)
  y = LayerNormalization<axis=-1>(e, g1, b1)
}}""",
        W0=randn(gen, 6, D),
        W1=randn(gen, 6, D),
        s=np.array(3.0, np.float32),
        c0=randn(gen, D) + 1,
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1 and set(plan.decisions[0].centred_layers) == {"h", "k", "c0"}
    result = fold_and_check(model)
    for out in ("h", "k"):
        assert_centred(weight_of(result.model, out)[1], 1)


def test_runtime_factor_constant_along_the_axis_folds():
    """A per-token factor computed at run time (shape [B, S, 1]) scales every feature alike."""
    gen = rng(43)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x, float[B, {S}, 1] f) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W0)
  hs = Mul(f, h)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W0=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    assert len(inspect_onnx(model).folded) == 1
    fold_and_check(model)


@pytest.mark.parametrize("factor", ["stream", "division"])
def test_non_linear_products_refused(factor):
    gen = rng(44)
    body = "hs = Mul(k, h)" if factor == "stream" else "hs = Div(s, h)"
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W0)
  k = MatMul(x, W1)
  {body}
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W0=randn(gen, 6, D),
        W1=randn(gen, 6, D),
        s=np.array(3.0, np.float32),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert not plan.folded and plan.decisions[0].blocker.node == "hs"
    fold_and_check(model)


def test_softmax_consumer_removes_the_shift():
    """Softmax over the normalized axis is shift-invariant: centring its input is safe."""
    gen = rng(45)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y, float[B, {S}, {D}] z) {{
  h = MatMul(x, W0)
  y = LayerNormalization<axis=-1>(h, g1, b1)
  z = Softmax<axis=-1>(h)
}}""",
        W0=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    assert len(inspect_onnx(model).folded) == 1
    fold_and_check(model)


def test_softmax_over_another_axis_is_unsafe():
    gen = rng(46)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y, float[B, {S}, {D}] z) {{
  h = MatMul(x, W0)
  y = LayerNormalization<axis=-1>(h, g1, b1)
  z = Softmax<axis=1>(h)
}}""",
        W0=randn(gen, 6, D),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert not plan.folded and "unsafe" in plan.decisions[0].reason
    fold_and_check(model)


def test_slice_along_normalized_axis_refused():
    gen = rng(29)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, 4] y) {{
  h = MatMul(x, W)
  hs = Slice(h, st, en, ax)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W=randn(gen, 6, D),
        st=np.array([0], np.int64),
        en=np.array([4], np.int64),
        ax=np.array([-1], np.int64),
        g1=gamma(gen, 4),
        b1=beta(gen, 4),
    )
    plan = inspect_onnx(model)
    assert not plan.folded and "slices the normalized axis" in plan.decisions[0].reason
    fold_and_check(model)


def test_slice_along_other_axis_folds():
    gen = rng(30)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, 2, {D}] y) {{
  h = MatMul(x, W)
  hs = Slice(h, st, en, ax)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W=randn(gen, 6, D),
        st=np.array([1], np.int64),
        en=np.array([3], np.int64),
        ax=np.array([1], np.int64),
        g1=gamma(gen),
        b1=beta(gen),
    )
    assert len(inspect_onnx(model).folded) == 1
    fold_and_check(model)


@pytest.mark.parametrize("batch", ["2", "B"])
def test_reshape_keeping_last_axis_folds(batch):
    gen = rng(31)
    model = build(
        f"""{header()}
agraph (float[{batch}, {S}, 6] x) => (float[N, {D}] y) {{
  h = MatMul(x, W)
  hs = Reshape(h, shp)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W=randn(gen, 6, D),
        shp=np.array([-1, D], np.int64),
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1, plan.to_json()
    result = fold_and_check(model)
    assert op_counts(result.model)["Reshape"] == 1


def test_reshape_splitting_normalized_axis_refused():
    gen = rng(32)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, 2, {D // 2}] y) {{
  h = MatMul(x, W)
  hs = Reshape(h, shp)
  y = LayerNormalization<axis=-1>(hs, g1, b1)
}}""",
        W=randn(gen, 6, D),
        shp=np.array([0, 0, 2, D // 2], np.int64),
        g1=gamma(gen, D // 2),
        b1=beta(gen, D // 2),
    )
    plan = inspect_onnx(model)
    assert not plan.folded and "intact" in plan.decisions[0].reason
    fold_and_check(model)


def flattened_patches(gen, kept: int) -> onnx.ModelProto:
    """Conv → Reshape to Concat(Shape(h)[:kept], [-1]) (TorchScript's `flatten(kept)`) → [Transpose] → LN."""
    width, layout = (D, "t = Transpose<perm=[0, 2, 1]>(flat)") if kept == 2 else (16 * D, "t = Identity(flat)")
    out = f"float[B, M, {D}] y" if kept == 2 else f"float[B, {16 * D}] y"
    return build(
        f"""{header(17)}
agraph (float[B, 3, 8, 8] x) => ({out}) {{
  h = Conv<kernel_shape=[2, 2], strides=[2, 2]>(x, W, C)
  s = Shape(h)
  lead = Slice(s, zero, upto)
  shp = Concat<axis=0>(lead, minus_one)
  flat = Reshape(h, shp)
  {layout}
  y = LayerNormalization<axis=-1>(t, g1, b1)
}}""",
        W=randn(gen, D, 3, 2, 2),
        C=randn(gen, D),
        zero=np.array([0], np.int64),
        upto=np.array([kept], np.int64),
        minus_one=np.array([-1], np.int64),
        g1=gamma(gen, width),
        b1=beta(gen, width),
    )


def test_reshape_to_shape_arithmetic_keeping_channels_folds():
    """flatten(2) of a Conv output written with Shape arithmetic, (B, D, 4, 4) → (B, D, unknown): the
    unknown dimension is 16 by element count, so the channel axis is intact."""
    model = flattened_patches(rng(35), kept=2)
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1, plan.to_json()
    fold_and_check(model)


def test_reshape_to_shape_arithmetic_merging_channels_refused():
    """flatten(1) of the same output, (B, D, 4, 4) → (B, unknown = 16·D): the channels are merged."""
    plan = inspect_onnx(flattened_patches(rng(35), kept=1))
    assert not plan.folded and "intact" in plan.decisions[0].reason, plan.to_json()


def test_weights_from_constant_nodes_fold():
    gen = rng(33)
    weight, bias = randn(gen, 6, D), randn(gen, D)

    def literal(values):
        return ", ".join(repr(float(v)) for v in values.ravel())

    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  W = Constant<value=float[6, {D}] {{{literal(weight)}}}>()
  c = Constant<value=float[{D}] {{{literal(bias)}}}>()
  h = MatMul(x, W)
  hb = Add(h, c)
  y = LayerNormalization<axis=-1>(hb, g1, b1)
}}""",
        g1=gamma(gen),
        b1=beta(gen),
    )
    plan = inspect_onnx(model)
    assert len(plan.folded) == 1, plan.to_json()
    assert set(plan.decisions[0].centred_layers) == {"h", "c"}
    result = fold_and_check(model)
    assert op_counts(result.model)["LayerNormalization"] == 0


# --- dtypes -----------------------------------------------------------------------------------------------


def typed_model(dtype: str, gen):
    np_type = {"double": np.float64, "float16": np.float16}[dtype]
    return build(
        f"""{header()}
agraph ({dtype}[B, {S}, 6] x) => ({dtype}[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1>(h, g1, b1)
}}""",
        W=randn(gen, 6, D).astype(np_type),
        g1=gamma(gen).astype(np_type),
        b1=beta(gen).astype(np_type),
    )


@pytest.mark.parametrize("value_info", [True, False], ids=["value_info", "no_value_info"])
@pytest.mark.parametrize("rms_op", ["simplified", "onnx", "decomposed"])
@pytest.mark.parametrize("dtype,tol", [("double", 1e-10), ("float16", 1e-2)])
def test_non_float32_models_fold(dtype, tol, rms_op, value_info):
    """Without value_info the rewriter must still give its new constants the norm's dtype."""
    model = typed_model(dtype, rng(34))
    if value_info:
        model = onnx.shape_inference.infer_shapes(model)
    result = fold_and_check(model, rel_tol=tol, rms_op=rms_op)
    assert len(result.plan.folded) == 1
    assert result.model.graph.output[0].type.tensor_type.elem_type == model.graph.output[0].type.tensor_type.elem_type


# --- RMS op forms ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linear", ["MatMul", "Gemm"])
def test_rms_op_onnx(linear):
    model = pre_ln_block(rng(35), linear)
    result = fold_and_check(model, rms_op="onnx")
    folded = result.model
    counts = op_counts(folded)
    assert counts["RMSNormalization"] == 2 and counts["LayerNormalization"] == 0
    assert counts["SimplifiedLayerNormalization"] == 0
    opset = {o.domain: o.version for o in folded.opset_import}
    assert opset.get("", opset.get("ai.onnx")) == 23
    assert 11 <= folded.ir_version <= 13
    for node in nodes_of(folded, "RMSNormalization"):
        axis = next(a.i for a in node.attribute if a.name == "axis")
        assert axis in (-1, 2 if linear == "MatMul" else 1)


def test_rms_op_onnx_from_opset_17():
    gen = rng(36)
    model = build(
        f"""{header(17)}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1>(h, g1)
}}""",
        W=randn(gen, 6, D),
        g1=gamma(gen),
    )
    result = fold_and_check(model, rms_op="onnx")
    assert op_counts(result.model)["RMSNormalization"] == 1
    assert {o.domain: o.version for o in result.model.opset_import}[""] == 23


@pytest.mark.parametrize("opset", [17, 18])
def test_rms_op_decomposed(opset):
    gen = rng(37)
    model = build(
        f"""{header(opset)}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1, epsilon=0.5>(h, g1, b1)
}}""",
        W=randn(gen, 6, D, scale=0.3),
        g1=gamma(gen),
        b1=beta(gen),
    )
    result = fold_and_check(model, rms_op="decomposed")
    counts = op_counts(result.model)
    assert not any(counts[op] for op in FLOAT_SPECIALS), counts
    schemas = {n.op_type for n in result.model.graph.node}
    for op in schemas:
        assert onnx.defs.has(op, ""), op
    assert counts["ReduceMean"] == 1 and counts["Sqrt"] == 1
    assert {o.domain: o.version for o in result.model.opset_import}[""] == opset


def test_epsilon_is_carried_into_the_rms_op():
    """A large ε makes a dropped or defaulted ε visible in the numerics."""
    gen = rng(38)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1, epsilon=2.0>(h, g1, b1)
}}""",
        W=randn(gen, 6, D, scale=0.3),
        g1=gamma(gen),
        b1=beta(gen),
    )
    result = fold_and_check(model)
    rms = nodes_of(result.model, "SimplifiedLayerNormalization")[0]
    assert next(a.f for a in rms.attribute if a.name == "epsilon") == pytest.approx(2.0)


def test_unknown_rms_op_is_an_input_error():
    model = pre_ln_block(rng(39))
    with pytest.raises(InputError):
        fold_onnx(model, FoldOptions(rms_op="fused"))


# --- nothing to do ------------------------------------------------------------------------------------------


def test_model_without_norms():
    gen = rng(40)
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y) {{
  h = MatMul(x, W)
  y = Relu(h)
}}""",
        W=randn(gen, 6, D),
    )
    plan = inspect_onnx(model)
    assert plan.total == 0 and plan.folded == []
    assert plan.to_json() == {"norms": [], "total": 0, "foldable": 0}
    result = fold_and_check(model)
    assert result.folded == 0 and result.plan.total == 0
    assert result.report()["folded"] == 0 and result.report()["total"] == 0
    assert op_counts(result.model) == op_counts(model)
    np.testing.assert_array_equal(initializers(result.model)["W"], initializers(model)["W"])
