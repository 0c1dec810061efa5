"""Every spelling of a norm that normpass recognises, each on a small hand-built graph.

Foldable spellings assert the fold count, the ops of the rewritten graph, `onnx.checker`
(`check_structure`), normpass's own verification and an independent run of both models in ONNX
Runtime (optimizations off). Spellings that cannot fold are listed with their reason.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from conftest import (
    assert_equivalent,
    build,
    check_plain,
    check_structure,
    initializers,
    nodes_of,
    op_counts,
    randn,
    rng,
)
from onnx import numpy_helper

from normpass import FoldOptions, fold_onnx, inspect_onnx
from normpass.onnx.patterns import match_decomposed

D = 8
HEADER = '<ir_version: 10, opset_import: ["" : {opset}, "com.microsoft" : 1]>'


def header(opset: int = 18) -> str:
    return HEADER.format(opset=opset)


def affine(gen) -> dict[str, np.ndarray]:
    return dict(g1=1 + randn(gen, D, scale=0.3), b1=randn(gen, D, scale=0.3))


def parse_unchecked(text: str, **initializers: np.ndarray) -> onnx.ModelProto:
    """`build` without the checker, for ops ONNX does not define at the model's opset (ORT contrib ops)."""
    model = onnx.parser.parse_model(text)
    model.ir_version = 10
    for node in model.graph.node:
        node.name = node.name or node.output[0]
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items())
    return model


def fold_checked(model: onnx.ModelProto, folds: int, **options):
    """Fold (β kept as an Add where it has nowhere to go); verified, checked and run independently."""
    options.setdefault("fold_with_beta_add", True)
    result = fold_onnx(model, FoldOptions(**options))
    assert len(result.plan.folded) == folds, result.plan.to_json()
    assert result.comparison is not None and result.comparison.passed
    assert result.comparison.max_rel_error <= 1e-5
    (check_plain if options.get("rms_op") == "decomposed" else check_structure)(result.model)
    assert_equivalent(model, result.model)
    return result


def only_decision(model: onnx.ModelProto):
    plan = inspect_onnx(model)
    assert plan.total == 1, plan.to_json()
    return plan.decisions[0]


# --- LayerNormalization as one op ---------------------------------------------------------------


@pytest.mark.parametrize("stash_type", [0, 1])
@pytest.mark.parametrize("opset", [13, 17, 18, 21])
def test_layer_normalization_at_any_opset(opset, stash_type):
    """Opset 17+: the ONNX op; below 17, the contrib op of the same name that ORT's optimizer emits."""
    gen = rng(1)
    text = f"""{header(opset)}
agraph (float[N, 6] x) => (float[N, {D}] y) {{
  h = Gemm<transB=1>(x, W, C)
  y = LayerNormalization<axis=-1, epsilon=1e-5, stash_type={stash_type}>(h, g1, b1)
}}"""
    model = parse_unchecked(text, W=randn(gen, D, 6), C=randn(gen, D) + 1, **affine(gen))
    assert only_decision(model).op == "LayerNormalization"
    result = fold_checked(model, 1)
    assert op_counts(result.model)["SimplifiedLayerNormalization"] == 1
    assert not nodes_of(result.model, "LayerNormalization")


def test_com_microsoft_layer_normalization_is_recognised():
    gen = rng(2)
    model = parse_unchecked(
        f"""{header(13)}
agraph (float[N, 6] x) => (float[N, {D}] y) {{
  h = Gemm<transB=1>(x, W, C)
  y = com.microsoft.LayerNormalization<axis=-1, epsilon=1e-5>(h, g1, b1)
}}""",
        W=randn(gen, D, 6),
        C=randn(gen, D),
        **affine(gen),
    )
    norm = only_decision(model)
    assert norm.op == "LayerNormalization" and norm.foldable, norm.reason
    assert norm.centred_layers == ["h"]


# --- decomposed LayerNorm -------------------------------------------------------------------------


def decomposed(
    gen,
    *,
    opset=18,
    square="Pow",
    divide="Div",
    eps="inside",
    variance="centred",
    order="normal",
    beta_node=False,
    casts=False,
) -> onnx.ModelProto:
    """Gemm → a decomposed LayerNorm spelled as asked → γ, β.

    eps: "inside" √(v + ε), "outside" √v + ε. variance: "centred" mean((x − μ)²), "moments"
    mean(x²) − μ². divide: "Div" d / s, "Reciprocal" Mul(Reciprocal(s), d), "Div1" Mul(d, Div(1, s)).
    order: "swapped" writes γ⊙x̂ as Mul(γ, x̂) and + β as Add(β, ·).
    beta_node: β is a `Constant` node's output instead of an initializer. casts: the norm reads
    `Cast<to=float>(h)` and casts x̂ to float again before γ (TorchScript's `.to(dtype)`).
    """
    mean = "ReduceMean<axes=[-1]>({})" if opset < 18 else "ReduceMean({}, ax)"
    sq = "Pow({0}, two)" if square == "Pow" else "Mul({0}, {0})"
    src = "hc" if casts else "h"
    lines = (
        ["h = Gemm<transB=1>(x, W, C)"]
        + ["hc = Cast<to=1>(h)"] * casts
        + [f"mu = {mean.format(src)}", f"d = Sub({src}, mu)"]
    )
    if variance == "centred":
        lines += [f"d2 = {sq.format('d')}", f"v = {mean.format('d2')}"]
    else:
        lines += [f"h2 = {sq.format(src)}", f"m2 = {mean.format('h2')}", f"mu2 = {sq.format('mu')}", "v = Sub(m2, mu2)"]
    lines += ["ve = Add(v, eps)", "s = Sqrt(ve)"] if eps == "inside" else ["r = Sqrt(v)", "s = Add(r, eps)"]
    lines += {
        "Div": ["xn = Div(d, s)"],
        "Reciprocal": ["rs = Reciprocal(s)", "xn = Mul(rs, d)"],
        "Div1": ["rs = Div(one, s)", "xn = Mul(d, rs)"],
    }[divide]
    lines += ["xc = Cast<to=1>(xn)"] if casts else []
    xn = "xc" if casts else "xn"
    if beta_node:
        lines.insert(0, f"b1 = Constant<value=float[{D}] {{{', '.join(map(str, randn(gen, D).tolist()))}}}>()")
    lines += (
        [f"xg = Mul({xn}, g1)", "y = Add(xg, b1)"] if order == "normal" else [f"xg = Mul(g1, {xn})", "y = Add(b1, xg)"]
    )
    body = "\n  ".join(lines)
    text = f"""{header(opset)}
agraph (float[N, 6] x) => (float[N, {D}] y) {{
  {body}
}}"""
    values = dict(
        W=randn(gen, D, 6),
        C=randn(gen, D) + 1,
        two=np.array(2.0, np.float32),
        eps=np.array(1e-3, np.float32),
        one=np.array(1.0, np.float32),
        ax=np.array([-1], np.int64),
        **affine(gen),
    )
    if beta_node:
        del values["b1"]
    used = {name for node in onnx.parser.parse_model(text).graph.node for name in node.input}
    return build(text, **{k: v for k, v in values.items() if k in used})


DECOMPOSED_OPS = ("ReduceMean", "Sub", "Pow", "Sqrt", "Div", "Reciprocal")

SPELLINGS = {
    "axes-attribute": dict(opset=13),
    "mul-square": dict(square="Mul"),
    "reciprocal": dict(divide="Reciprocal"),
    "swapped-operands": dict(order="swapped"),
    "constant-node-beta": dict(beta_node=True),
    "moments": dict(variance="moments"),
    "moments-reciprocal-opset13": dict(variance="moments", divide="Reciprocal", square="Mul", opset=13),
    "div-one-reciprocal": dict(divide="Div1"),
    "torchscript-casts": dict(divide="Div1", casts=True, opset=17),
}


@pytest.mark.parametrize("spelling", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_decomposed_layer_norm_spellings_fold(spelling):
    model = decomposed(rng(3), **spelling)
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm" and norm.foldable, norm.reason
    assert norm.centred_layers == ["h"]
    result = fold_checked(model, 1)
    counts = op_counts(result.model)
    assert counts["SimplifiedLayerNormalization"] == 1
    assert not any(counts[op] for op in DECOMPOSED_OPS), counts


@pytest.mark.parametrize("rms_op", ["simplified", "onnx", "decomposed"])
def test_epsilon_outside_the_root_folds_into_the_same_algebra(rms_op):
    """x̂ = d / (√var + ε) is no RMSNorm op with that ε: it becomes the chain x / (√mean(x²) + ε)."""
    model = decomposed(rng(4), eps="outside", opset=23 if rms_op == "onnx" else 18)
    assert only_decision(model).foldable
    result = fold_checked(model, 1, rms_op=rms_op) if rms_op != "simplified" else fold_checked(model, 1)
    assert not nodes_of(result.model, "SimplifiedLayerNormalization") and not nodes_of(result.model, "RMSNormalization")
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.index("Sqrt") < ops.index("Add") < ops.index("Div"), ops
    assert ops.count("ReduceMean") == 1 and "Sub" not in ops


# --- SkipLayerNormalization -------------------------------------------------------------------------


def skip_block(gen, bias=True, sum_used=True, skip_source="MatMul(x, W1)", op="SkipLayerNormalization"):
    """Two linear layers → Skip op(h, a, γ, β, [bias]) → linear → [its sum + that] → LayerNorm."""
    gamma_beta = "g1" if op == "SkipSimplifiedLayerNormalization" else "g1, b1"
    inputs = f"h, a, {gamma_beta}" + (", c1" if bias else "")
    tail = ["s2 = Add(s, u)", "z = LayerNormalization<axis=-1>(s2, g2, b2)"] if sum_used else ["z = Identity(u)"]
    lines = [
        "h = MatMul(x, W0)",
        f"a = {skip_source}",
        f"y, m, v, s = com.microsoft.{op}<epsilon=1e-5>({inputs})",
        "u = MatMul(y, W2)",
    ] + tail
    body = "\n  ".join(lines)
    text = f"""{header()}
agraph (float[B, 4, 6] x, float[B, 4, {D}] r) => (float[B, 4, {D}] z) {{
  {body}
}}"""
    values = dict(
        W0=randn(gen, 6, D),
        W1=randn(gen, 6, D),
        W2=randn(gen, D, D),
        c1=randn(gen, D) + 1,
        g2=1 + randn(gen, D, scale=0.3),
        b2=randn(gen, D),
        **affine(gen),
    )
    used = {name for node in onnx.parser.parse_model(text).graph.node for name in node.input}
    return build(text, **{k: v for k, v in values.items() if k in used})


def test_skip_layer_norm_folds_into_skip_simplified_keeping_bias_and_sum():
    model = skip_block(rng(5))
    plan = inspect_onnx(model)
    skip = next(d for d in plan.decisions if d.op == "SkipLayerNormalization")
    assert skip.foldable, skip.reason
    assert sorted(skip.centred_layers) == ["a", "c1", "h"]  # both operands, and the Skip op's bias
    result = fold_checked(model, 2)
    fused = nodes_of(result.model, "SkipSimplifiedLayerNormalization")
    assert len(fused) == 2 and not nodes_of(result.model, "SkipLayerNormalization")
    node = next(n for n in fused if n.name.startswith("y"))
    assert node.domain == "com.microsoft" and node.input[:2] == ["h", "a"] and len(node.input) == 4
    assert node.output[3] == "s"  # the sum is still read downstream
    values = initializers(result.model)
    np.testing.assert_allclose(values[node.input[3]].mean(), 0, atol=1e-6)  # the bias is centred
    for layer in ("h", "a"):
        weight = next(values[n.input[1]] for n in result.model.graph.node if n.output[0] == layer)
        np.testing.assert_allclose(weight.mean(axis=-1), 0, atol=1e-6)


def test_skip_layer_norm_without_bias_or_sum_in_plain_onnx():
    """The plain-ONNX emission spells the sum out as an Add before the RMS chain."""
    model = skip_block(rng(6), bias=False, sum_used=False)
    result = fold_checked(model, 1, rms_op="decomposed")
    assert not any(n.domain == "com.microsoft" for n in result.model.graph.node)
    fold_checked(model, 1)


def test_skip_layer_norm_with_a_raw_skip_input_needs_an_inserted_centring():
    """Refused naming the graph input without insertions; with them, folds through a centring of it."""
    model = skip_block(rng(7), skip_source="Identity(r)")
    skip = next(d for d in inspect_onnx(model, insert_centering=False).decisions if d.op == "SkipLayerNormalization")
    assert not skip.foldable and "graph input r" in skip.reason
    result = fold_checked(model, 2)
    assert [i.tensor for i in result.plan.insertions] == ["r"]


def test_skip_simplified_is_already_rms_and_refuses_a_shift_into_its_sum():
    """Reported as an RMSNorm. The LayerNorm after its sum output would need h, a and the bias
    centred, which shifts the RMSNorm's input: refused, naming it."""
    model = skip_block(rng(8), op="SkipSimplifiedLayerNormalization")
    decisions = {d.op: d for d in inspect_onnx(model).decisions}
    assert "already an RMSNorm" in decisions["SkipSimplifiedLayerNormalization"].reason
    layer_norm = decisions["LayerNormalization"]
    assert not layer_norm.foldable
    assert "SkipSimplifiedLayerNormalization y does not remove a shift" in layer_norm.reason


# --- recognised, not folded ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["SimplifiedLayerNormalization", "RMSNormalization"])
def test_rms_ops_reported_as_already_rms(op):
    gen = rng(9)
    model = parse_unchecked(
        f"""{header(23)}
agraph (float[N, 6] x) => (float[N, {D}] y) {{
  h = Gemm<transB=1>(x, W, C)
  y = {op}<axis=-1>(h, g1)
}}""",
        W=randn(gen, D, 6),
        C=randn(gen, D),
        g1=affine(gen)["g1"],
    )
    norm = only_decision(model)
    assert norm.op == op and not norm.foldable and "already an RMSNorm" in norm.reason


def torchscript_rms(gen, to: int) -> onnx.ModelProto:
    """Gemm → Llama's RMSNorm as TorchScript exports it, `γ * (h * rsqrt(mean(h²) + ε)).to(dtype)`:
    the norm reads `Cast<to=float>(h)`, rsqrt is `Div(1, ·)`, and x̂ is cast to `to` before γ."""
    dtype, name = (np.float32, "float") if to == onnx.TensorProto.FLOAT else (np.float16, "float16")
    return build(
        f"""{header(17)}
agraph (float[N, 6] x) => ({name}[N, {D}] y) {{
  h = Gemm<transB=1>(x, W, C)
  hc = Cast<to=1>(h)
  h2 = Pow(hc, two)
  ms = ReduceMean<axes=[-1]>(h2)
  me = Add(ms, eps)
  s = Sqrt(me)
  rs = Div(one, s)
  xn = Mul(hc, rs)
  xc = Cast<to={to}>(xn)
  y = Mul(g1, xc)
}}""",
        W=randn(gen, D, 6),
        C=randn(gen, D),
        g1=affine(gen)["g1"].astype(dtype),
        two=np.array(2.0, np.float32),
        eps=np.array(1e-6, np.float32),
        one=np.array(1.0, np.float32),
    )


def test_torchscript_llama_rms_norm_reported_as_already_rms():
    norm = only_decision(torchscript_rms(rng(9), onnx.TensorProto.FLOAT))
    assert norm.op == "decomposed RMSNorm" and not norm.foldable and "already an RMSNorm" in norm.reason


def test_cast_to_another_type_before_gamma_stays_outside_the_norm():
    """x̂ cast to fp16 before γ: the RMS op that would replace the norm keeps its input's type, so
    the Cast and γ are not part of the norm; it is matched without γ."""
    model = torchscript_rms(rng(9), onnx.TensorProto.FLOAT16)
    square = next(n for n in ir.from_proto(model).graph if n.op_type == "Pow")
    _, match = match_decomposed(square, {"y"})
    assert match.gamma is None and match.y.name == "xn"
    assert only_decision(model).op == "decomposed RMSNorm"


def test_embed_layer_normalization_is_listed_with_a_reason():
    gen = rng(10)
    model = parse_unchecked(
        f"""{header(13)}
agraph (int32[B, 4] ids, int32[B, 4] seg) => (float[B, 4, {D}] y) {{
  y, mask = com.microsoft.EmbedLayerNormalization<epsilon=1e-12>(ids, seg, words, positions, segments, g1, b1)
}}""",
        words=randn(gen, 16, D),
        positions=randn(gen, 4, D),
        segments=randn(gen, 2, D),
        **affine(gen),
    )
    norm = only_decision(model)
    assert norm.op == "EmbedLayerNormalization" and not norm.foldable
    assert "sum of embedding lookups" in norm.reason


def test_skip_group_norm_is_listed_with_a_reason():
    gen = rng(11)
    model = parse_unchecked(
        f"""{header(18)}
agraph (float[B, 4, 4, {D}] x, float[B, 4, 4, {D}] k) => (float[B, 4, 4, {D}] y) {{
  y = com.microsoft.SkipGroupNorm<activation=0, epsilon=1e-5, groups=2, channels_last=1>(x, g1, b1, k)
}}""",
        **affine(gen),
    )
    norm = only_decision(model)
    assert norm.op == "SkipGroupNorm" and not norm.foldable and "GroupNorm" in norm.reason


# --- what ORT's optimizer fuses after a norm ---------------------------------------------------------


@pytest.mark.parametrize("activation", ["FastGelu", "BiasGelu"])
def test_affine_migrates_into_a_matmul_whose_bias_a_fused_gelu_adds(activation):
    """LN → MatMul → com.microsoft.FastGelu/BiasGelu(·, bias): γ/β go into W and that bias, so the
    default fold (which keeps a norm whose β has nowhere to go) rewrites it."""
    gen = rng(12)
    model = build(
        f"""{header()}
agraph (float[B, 4, 6] x) => (float[B, 4, 16] y) {{
  h = MatMul(x, W0)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  m = MatMul(n, W1)
  y = com.microsoft.{activation}(m, c1)
}}""",
        W0=randn(gen, 6, D),
        W1=randn(gen, D, 16),
        c1=randn(gen, 16),
        **affine(gen),
    )
    result = fold_checked(model, 1, fold_with_beta_add=False)
    rms = nodes_of(result.model, "SimplifiedLayerNormalization")[0]
    np.testing.assert_array_equal(initializers(result.model)[rms.input[1]], np.ones(D, np.float32))
    assert not nodes_of(result.model, "Add")


def test_beta_moves_into_the_bias_of_a_skip_layer_norm_reading_the_norm():
    """Post-LN (BERT after ORT's optimizer): the embedding LN feeds a linear layer and the skip input
    of a SkipLayerNormalization; its β moves into that op's bias, (n − β) + q + (c + β), so the
    default fold rewrites it without a separate β Add."""
    gen = rng(13)
    model = build(
        f"""{header()}
agraph (float[B, 4, 6] x) => (float[B, 4, {D}] y) {{
  h = MatMul(x, W0)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  q0 = MatMul(n, W1)
  q = Add(q0, c1)
  y, m, v, s = com.microsoft.SkipLayerNormalization<epsilon=1e-5>(q, n, g2, b2, c2)
}}""",
        W0=randn(gen, 6, D),
        W1=randn(gen, D, D),
        c1=randn(gen, D),
        g2=1 + randn(gen, D, scale=0.3),
        b2=randn(gen, D),
        c2=randn(gen, D),
        **affine(gen),
    )
    result = fold_checked(model, 1, fold_with_beta_add=False)
    assert [n.name for n in nodes_of(result.model, "Add")] == ["q"]  # no β Add
    skip = nodes_of(result.model, "SkipLayerNormalization")[0]
    assert skip.input[4] != "c2" and skip.input[1] == "n"
