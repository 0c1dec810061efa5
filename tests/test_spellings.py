"""Every spelling of a norm that normpass recognises (docs/patterns.md), on small graphs: hand-built,
ONNX Runtime's LayerNorm and SkipLayerNormalization fusion-test graphs (tests/data/ort_fusion), ONNX's
own expansions of LayerNormalization and RMSNormalization (its conformance-case generator), model-local
functions (hand-built and the TorchScript exporter's).

Foldable spellings assert the fold count, the ops of the rewritten graph, `onnx.checker`
(`check_structure`), normpass's own verification and an independent run of both models in ONNX
Runtime (optimizations off). Spellings that cannot fold are listed with their reason, and a norm
seen only in part is listed as not recognised.
"""

from __future__ import annotations

import importlib
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import (
    IR_VERSION,
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
from normpass.onnx.graph.patterns import ALREADY_RMS, UNRECOGNISED, MatchContext, match_decomposed

D = 8
HEADER = '<ir_version: 10, opset_import: ["" : {opset}, "com.microsoft" : 1]>'


def header(opset: int = 18) -> str:
    return HEADER.format(opset=opset)


def affine(gen) -> dict[str, np.ndarray]:
    return dict(g1=1 + randn(gen, D, scale=0.3), b1=randn(gen, D, scale=0.3))


def build_used(text: str, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`build` with those of `values` that the graph reads (a spelling may leave some out)."""
    used = {name for node in onnx.parser.parse_model(text).graph.node for name in node.input}
    return build(text, ir_version=IR_VERSION, **{k: v for k, v in values.items() if k in used})


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
    return build_used(text, values)


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
    return build_used(text, values)


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
    _, match, _ = match_decomposed(square, MatchContext({"y"}))
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


# --- spellings ONNX Runtime's fusion tests write, hand-built --------------------------------------


def plain_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `model` on `feeds`, in a plain ONNX Runtime session (graph optimizations off)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def assert_same_outputs(original: onnx.ModelProto, folded: onnx.ModelProto, rel_tol: float, seed: int = 21) -> None:
    """Both models give the same outputs on random inputs with a non-zero mean per feature, in plain ORT."""
    gen = rng(seed)
    feeds = {}
    for value in original.graph.input:
        tensor = value.type.tensor_type
        shape = [d.dim_value or 3 for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        feeds[value.name] = (1.5 * gen.standard_normal(shape) + gen.uniform(-2, 2, shape[-1:])).astype(dtype)
    expected, got = plain_ort(original, feeds), plain_ort(folded, feeds)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        scale = float(np.abs(value.astype(np.float64)).max())
        error = float(np.abs(value.astype(np.float64) - got[name].astype(np.float64)).max()) / scale
        assert error <= rel_tol, f"{name}: relative error {error:.3g} > {rel_tol}"


def residual_layer_norm(gen, bias: bool, opset: int = 13) -> onnx.ModelProto:
    """Two linear layers summed (with or without a bias Add), then a LayerNorm computing x − mean twice:
    one Sub feeds Pow → ReduceMean, the other the Div (skip_layer_norm_gen.py's spelling)."""
    mean = "ReduceMean<axes=[-1]>({})" if opset < 18 else "ReduceMean({}, ax)"
    first = "ab = Add(a, c1)" if bias else "ab = Identity(a)"
    lines = [
        "a = MatMul(x, W0)",
        "b = MatMul(x, W1)",
        first,
        "s = Add(ab, b)",
        f"mu = {mean.format('s')}",
        "d1 = Sub(s, mu)",
        "d2 = Sub(s, mu)",
        "p = Pow(d2, two)",
        f"v = {mean.format('p')}",
        "ve = Add(v, eps)",
        "r = Sqrt(ve)",
        "xn = Div(d1, r)",
        "xg = Mul(g1, xn)",
        "y = Add(xg, b1)",
    ]
    body = "\n  ".join(lines)
    text = f"""{header(opset)}
agraph (float[B, 4, 6] x) => (float[B, 4, {D}] y) {{
  {body}
}}"""
    values = dict(
        W0=randn(gen, 6, D),
        W1=randn(gen, 6, D),
        c1=randn(gen, D) + 1,
        two=np.array(2.0, np.float32),
        eps=np.array(1e-12, np.float32),
        ax=np.array([-1], np.int64),
        **affine(gen),
    )
    return build_used(text, values)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norm_computing_x_minus_mean_twice_folds_into_skip_simplified(bias, opset):
    """Equal Subs (same inputs) are one value d; the residual Add (and bias) fuse into the Skip RMS op."""
    model = residual_layer_norm(rng(30), bias, opset)
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm" and norm.foldable, norm.reason
    assert sorted(norm.centred_layers) == (["a", "b", "c1"] if bias else ["a", "b"])
    result = fold_checked(model, 1)
    counts = op_counts(result.model)
    assert counts["SkipSimplifiedLayerNormalization"] == 1 and not any(counts[op] for op in DECOMPOSED_OPS), counts
    assert_same_outputs(model, result.model, 1e-5)


def half_precision_layer_norm(gen, identity: bool = True) -> onnx.ModelProto:
    """fp16: x − mean subtracted in fp16, cast to fp32 for the variance and the division, x̂ cast back
    to fp16 before γ and β (ORT's BuildLayerNorm); x reaches the norm through an Identity."""
    text = f"""{header(18)}
agraph (float16[B, 4, 6] x) => (float16[B, 4, {D}] y) {{
  h = MatMul(x, W0)
  hi = {"Identity" if identity else "Neg"}(h)
  mu = ReduceMean(hi, ax)
  d = Sub(hi, mu)
  dc = Cast<to=1>(d)
  p = Pow(dc, two)
  v = ReduceMean(p, ax)
  ve = Add(v, eps)
  r = Sqrt(ve)
  xn = Div(dc, r)
  xh = Cast<to=10>(xn)
  gi = Identity(g1)
  xg = Mul(xh, gi)
  y = Add(xg, b1)
}}"""
    weight = randn(gen, 6, D).astype(np.float16)
    gamma, beta = (v.astype(np.float16) for v in affine(gen).values())
    return build(
        text,
        W0=weight,
        ax=np.array([-1], np.int64),
        two=np.array(2.0, np.float32),
        eps=np.array(1e-5, np.float32),
        g1=gamma,
        b1=beta,
    )


def test_half_precision_layer_norm_with_casts_inside_is_a_layer_norm():
    """Not "already an RMSNorm": the mean is subtracted before the Cast, which is transparent."""
    model = half_precision_layer_norm(rng(31))
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm" and norm.foldable, norm.reason
    assert norm.centred_layers == ["h"]
    result = fold_checked_half(model)
    counts = op_counts(result.model)
    assert counts["SimplifiedLayerNormalization"] == 1 and counts["Cast"] == 0 and counts["Sub"] == 0, counts
    rms = nodes_of(result.model, "SimplifiedLayerNormalization")[0]
    assert rms.input[0] == "hi"  # x is where the mean and the subtraction read it
    assert_same_outputs(model, result.model, 1e-2)


def test_half_precision_layer_norm_without_its_cast_back_is_declined():
    """x̂ (fp32, before its Cast back to fp16) is also a graph output: the norm ends there, so it maps fp16
    to fp32, which no RMS op does; listed and declined, nothing rewritten."""
    model = half_precision_layer_norm(rng(31))
    model.graph.output.append(onnx.helper.make_tensor_value_info("xn", onnx.TensorProto.FLOAT, ["B", 4, D]))
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm" and not norm.foldable
    assert norm.reason.startswith("it maps hi (float16) to xn (float) with no Cast back before its output")
    assert fold_onnx(model).folded == 0


def fold_checked_half(model: onnx.ModelProto):
    result = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    assert result.folded == 1 and result.comparison is not None and result.comparison.passed, result.plan.to_json()
    check_structure(result.model)
    return result


def divided_by_root(gen, square: str, mean_axes: list[int], variance_axes: list[int]) -> onnx.ModelProto:
    """h = x·W; d = h − ReduceMean(h) over `mean_axes`; y = d / Sqrt(ReduceMean(`square`) over `variance_axes` + ε)."""
    return build(
        f"""{header(18)}
agraph (float[B, 4, 6] x) => (float[B, 4, {D}] y) {{
  h = MatMul(x, W0)
  mu = ReduceMean(h, mean_axes)
  d = Sub(h, mu)
  p = {square}
  v = ReduceMean(p, variance_axes)
  ve = Add(v, eps)
  r = Sqrt(ve)
  y = Div(d, r)
}}""",
        W0=randn(gen, 6, D),
        mean_axes=np.array(mean_axes, np.int64),
        variance_axes=np.array(variance_axes, np.int64),
        eps=np.array(1e-5, np.float32),
    )


def test_a_norm_seen_in_part_is_listed_as_not_recognised():
    """x − ReduceMean(x) over the last axis divided by a square root whose variance is over another
    axis: listed with what was seen and where matching stopped; nothing rewritten."""
    model = divided_by_root(rng(32), "Mul(d, d)", [-1], [1])
    norm = only_decision(model)
    assert norm.op == UNRECOGNISED and not norm.foldable
    assert norm.reason == (
        "not recognised as a LayerNorm: h − ReduceMean mu over axes [-1] (Sub d) is divided by a square root "
        "(Div y); the mean is over axes [-1] but the variance over axes [1]"
    )
    result = fold_onnx(model)
    assert result.folded == 0 and op_counts(result.model) == op_counts(model)


def test_a_norm_of_the_uncentred_input_is_listed_as_not_recognised():
    """d / Sqrt(ReduceMean(h²)): x − mean over the root of the mean square of x itself, which no norm computes."""
    norm = only_decision(divided_by_root(rng(33), "Mul(h, h)", [-1], [-1]))
    assert norm.op == UNRECOGNISED and "not recognised as a LayerNorm" in norm.reason
    assert "(Div y)" in norm.reason and "mean²" in norm.reason


def test_keras_layer_norm_is_listed_as_not_recognised():
    """tf2onnx's Keras LayerNorm (ONNX Runtime's `FusionLayerNormalizationTF` fuses it): x·(γ/σ) + (β − μ·γ/σ),
    σ the root of the mean of (x − μ)²; x − μ is never divided, so it is no spelling normpass rewrites,
    but it is listed, naming the standard deviation it computes."""
    gen = rng(37)
    model = build(
        f"""{header(13)}
agraph (float[B, 4, 6] x) => (float[B, 4, {D}] y) {{
  h = MatMul(x, W0)
  mu = ReduceMean<axes=[-1]>(h)
  d = Sub(h, mu)
  p = Mul(d, d)
  v = ReduceMean<axes=[-1]>(p)
  ve = Add(v, eps)
  r = Sqrt(ve)
  inv = Reciprocal(r)
  scale = Mul(inv, g1)
  hs = Mul(h, scale)
  ms = Mul(mu, scale)
  shift = Sub(b1, ms)
  y = Add(hs, shift)
}}""",
        W0=randn(gen, 6, D),
        eps=np.array(1e-3, np.float32),
        **affine(gen),
    )
    norm = only_decision(model)
    assert norm.op == UNRECOGNISED and not norm.foldable
    assert norm.reason == (
        "not recognised as a LayerNorm: h − ReduceMean mu over axes [-1] (Sub d) has its standard deviation "
        "computed (Sqrt r); x − mean is not divided by the square root"
    )


def test_decomposed_ln_over_one_inner_axis_is_refused_for_it():
    """ReduceMean over axis 1 of a rank-3 tensor: one axis, not the last, which the RMS ops cannot normalize."""
    norm = only_decision(divided_by_root(rng(24), "Mul(d, d)", [1], [1]))
    assert norm.op == "decomposed LayerNorm"
    assert norm.reason == "normalizes over axis 1, not the last one: the RMS ops normalize over the last axes"


def test_statistics_pooling_is_no_norm():
    """Mean and standard deviation over time, concatenated (x-vector statistics pooling): nothing is normalized."""
    gen = rng(38)
    model = build(
        f"""{header(13)}
agraph (float[B, 10, 6] x) => (float[B, 1, {2 * D}] y) {{
  h = MatMul(x, W0)
  mu = ReduceMean<axes=[1]>(h)
  d = Sub(h, mu)
  p = Mul(d, d)
  v = ReduceMean<axes=[1]>(p)
  ve = Add(v, eps)
  s = Sqrt(ve)
  y = Concat<axis=-1>(mu, s)
}}""",
        W0=randn(gen, 6, D),
        eps=np.array(1e-5, np.float32),
    )
    assert inspect_onnx(model).total == 0


def test_an_explicit_centring_is_no_norm():
    """x − ReduceMean(x) with no division by a square root is a centring (normpass inserts them): no norm."""
    gen = rng(34)
    model = build(
        f"""{header(18)}
agraph (float[B, 4, 6] x) => (float[B, 4, {D}] y) {{
  h = MatMul(x, W0)
  mu = ReduceMean(h, ax)
  y = Sub(h, mu)
}}""",
        W0=randn(gen, 6, D),
        ax=np.array([-1], np.int64),
    )
    assert inspect_onnx(model).total == 0


# --- model-local functions -------------------------------------------------------------------------

FUNCTION_LN = """
<domain: "blocks", opset_import: ["" : 18]>
LN (t, g, b) => (out) {{
  ax = Constant<value = int64[1] {{-1}}>()
  mu = ReduceMean(t, ax)
  d = Sub(t, mu)
  two = Constant<value = float {{2.0}}>()
  p = Pow(d, two)
  v = ReduceMean(p, ax)
  eps = Constant<value = float {{1e-5}}>()
  ve = Add(v, eps)
  r = Sqrt(ve)
  xn = Div(d, r)
  xg = Mul(xn, g)
  out = Add(xg, b)
}}
<domain: "blocks", opset_import: ["" : {opset}]>
Block (h, g, b, w) => (out) {{
  n = LayerNormalization<axis=-1>(h, g, b)
  m = MatMul(n, w)
  out = Add(h, m)
}}"""


def function_model(gen, block_opset: int = 18) -> onnx.ModelProto:
    """A decomposed LayerNorm in function LN called twice, a LayerNormalization in function Block
    (γ, β and weights passed in from initializers, as the TorchScript exporter's
    `export_modules_as_functions` writes them)."""
    text = f"""<ir_version: 10, opset_import: ["" : 18, "blocks" : 1]>
agraph (float[B, 4, 6] x) => (float[B, 4, {D}] y) {{
  h = MatMul(x, W0)
  h1 = blocks.Block(h, g0, b0, W1)
  n1 = blocks.LN(h1, g1, b1)
  m = MatMul(n1, W2)
  h2 = Add(h1, m)
  y = blocks.LN(h2, g2, b2)
}}{FUNCTION_LN.format(opset=block_opset)}"""
    model = onnx.parser.parse_model(text)
    model.ir_version = 10
    for index, node in enumerate(model.graph.node):
        node.name = f"call{index}" if node.domain == "blocks" else node.output[0]
    values = dict(W0=randn(gen, 6, D), W1=randn(gen, D, D), W2=randn(gen, D, D))
    for i in range(3):
        values.update({f"g{i}": 1 + randn(gen, D, scale=0.3), f"b{i}": randn(gen, D, scale=0.3)})
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in values.items())
    onnx.checker.check_model(model, full_check=True)
    return model


def test_norms_inside_model_local_functions_are_inlined_and_fold():
    """Every call is inlined (a body shared by several calls cannot be rewritten for one), its nodes named
    after the call; the folded model has no functions left and matches the original."""
    model = function_model(rng(35))
    plan = inspect_onnx(model)
    assert [(d.name, d.op, d.foldable) for d in plan.decisions] == [
        ("call1/n", "LayerNormalization", True),
        ("call2/mu", "decomposed LayerNorm", True),
        ("call5/mu_2", "decomposed LayerNorm", True),
    ], plan.to_json()
    result = fold_checked(model, 3)
    assert not result.model.functions and not any(n.domain == "blocks" for n in result.model.graph.node)
    assert op_counts(result.model)["SkipSimplifiedLayerNormalization"] == 2
    assert_same_outputs(model, result.model, 1e-5)
    assert len(model.functions) == 2 and [n.op_type for n in model.graph.node].count("LN") == 2  # input untouched


def test_a_function_that_cannot_be_inlined_has_its_norms_listed():
    """Block imports opset 17 in an opset-18 model: the inliner refuses it, so it stays a call, opaque to
    the analysis, and its LayerNormalization is listed, declined with why."""
    model = function_model(rng(36), block_opset=17)
    decisions = {d.name: d for d in inspect_onnx(model).decisions}
    inside = decisions["Block/n"]
    assert inside.op == "LayerNormalization" and not inside.foldable
    assert inside.reason == (
        "inside model-local function Block: not rewritten: the function is not inlined "
        "(its opset import ai.onnx 17 differs from the model's 18)"
    )
    assert {d.op for d in decisions.values()} == {"LayerNormalization", "decomposed LayerNorm"}
    assert len(decisions) == 3
    result = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    assert result.comparison.passed and [n.op_type for n in result.model.graph.node].count("Block") == 1


def test_torchscript_export_of_modules_as_functions_folds():
    """The TorchScript exporter's `export_modules_as_functions`: each block a function whose body holds a
    decomposed LayerNorm (opset 15), γ/β and weights passed in from the graph's initializers."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up = torch.nn.LayerNorm(D), torch.nn.Linear(D, D)

        def forward(self, h):
            return h + self.up(self.norm(h))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.blocks, self.norm = (
                torch.nn.Linear(6, D),
                torch.nn.Sequential(Block(), Block()),
                torch.nn.LayerNorm(D),
            )

        def forward(self, x):
            return self.norm(self.blocks(self.embed(x)))

    torch.manual_seed(0)
    net = Net().eval()
    for module in net.modules():
        if isinstance(module, torch.nn.LayerNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
            torch.nn.init.normal_(module.bias, 0.0, 0.3)
    buffer = io.BytesIO()
    torch.onnx.export(
        net, (torch.randn(2, 3, 6),), buffer, dynamo=False, opset_version=15, export_modules_as_functions={Block}
    )
    model = onnx.load_from_string(buffer.getvalue())
    assert [f.name for f in model.functions] == ["Block"]
    plan = inspect_onnx(model)
    assert plan.total == 3 and len(plan.folded) == 3, plan.to_json()
    names = [d.name for d in plan.decisions]
    assert names[0].startswith("/blocks/blocks.0/") and names[1].startswith("/blocks/blocks.1/"), names
    result = fold_checked(model, 3)
    assert_same_outputs(model, result.model, 1e-5)


# --- ONNX's own expansions of LayerNormalization and RMSNormalization ------------------------------


def onnx_expansion(op: str, shape: list[int], axis: int, form: int, bias: bool = True, stats: bool = False):
    """Linear layer → `op` over [axis, rank) written as ONNX's function body, inlined as ONNX's conformance
    tests write their `_expanded` cases (`onnx.backend.test.case.node.function_testcase_helper`); form 0
    is LayerNormalization's opset-17 body (ReduceMean axes as an attribute), form 1 its opset-18 body.
    `stats`: the Mean and InvStdDev outputs are graph outputs too, as in the conformance tests."""
    from onnx.backend.test.case.node import function_testcase_helper

    gen = rng(40 + len(shape) + axis)
    normalized = shape[axis % len(shape) :]
    inputs = ["X", "W", "B"][: 3 if bias and op == "LayerNormalization" else 2]
    outputs = ["Y", "Mean", "InvStdDev"] if stats else ["Y"]
    node = onnx.helper.make_node(op, inputs, outputs, axis=axis, epsilon=1e-3)
    types = [onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, s) for s in (shape, normalized, normalized)]
    opset = onnx.helper.make_opsetid("", 23 if op == "RMSNormalization" else 17)
    expansions, _ = function_testcase_helper(node, types[: len(inputs)], "spelling", [opset])
    nodes, opsets = expansions[form]
    reduced = shape[: axis % len(shape)] + [1] * len(normalized)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "Wx"], ["X"], name="X"), *nodes],
        "expanded",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [*shape[:-1], 6])],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, shape)]
        + [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, reduced) for name in outputs[1:]],
        [
            numpy_helper.from_array(randn(gen, 6, shape[-1]), "Wx"),
            numpy_helper.from_array(1 + randn(gen, *normalized, scale=0.3), "W"),
            numpy_helper.from_array(randn(gen, *normalized, scale=0.3), "B"),
        ][: len(inputs)],
    )
    model = onnx.helper.make_model(graph, opset_imports=list(opsets), ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


EXPANSION_CASES = [
    (shape, axis, form)
    for form in (0, 1)
    for shape in ([3, 4], [2, 3, 5], [2, 3, 4, 5])
    for axis in range(-len(shape), len(shape))
]


@pytest.mark.parametrize(
    "shape,axis,form", EXPANSION_CASES, ids=[f"rank{len(s)}-axis{a}-opset{17 + f}" for s, a, f in EXPANSION_CASES]
)
def test_onnx_layer_normalization_expansion_is_listed_and_folds_over_the_last_axis(shape, axis, form):
    """Flatten to 2-D at axis, moments variance, Div, γ and β flattened alike, Reshape back to Shape(x)."""
    model = onnx_expansion("LayerNormalization", shape, axis, form)
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm"
    rank, start = len(shape), axis % len(shape)
    if start != rank - 1:
        assert not norm.foldable
        assert norm.reason == (
            f"normalizes over axes {start}..{rank - 1}: zero mean along one axis does not make a multi-axis "
            "LayerNorm an RMSNorm"
        )
        return
    assert norm.foldable and norm.centred_layers == ["X"], norm.reason
    result = fold_checked(model, 1)
    counts = op_counts(result.model)
    assert counts["SimplifiedLayerNormalization"] == 1 and set(counts) == {
        "MatMul",
        "SimplifiedLayerNormalization",
        "Add",
    }
    assert_same_outputs(model, result.model, 1e-5)


def test_onnx_layer_normalization_expansion_without_bias_and_as_opset_23_rms():
    model = onnx_expansion("LayerNormalization", [2, 3, 5], -1, 1, bias=False)
    assert only_decision(model).foldable
    fold_checked(model, 1, rms_op="decomposed")
    rms = fold_checked(onnx_expansion("LayerNormalization", [2, 3, 5], -1, 1), 1, target="onnx", rms_op="onnx")
    assert op_counts(rms.model)["RMSNormalization"] == 1


def test_onnx_layer_normalization_expansion_with_a_run_time_scale_is_declined_for_it():
    """γ a graph input (as in the conformance cases): the Flatten of it is no constant."""
    model = onnx_expansion("LayerNormalization", [2, 3, 5], -1, 1)
    weight = next(i for i in model.graph.initializer if i.name == "W")
    model.graph.input.append(onnx.helper.make_tensor_value_info("W", weight.data_type, list(weight.dims)))
    model.graph.initializer.remove(weight)
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm" and norm.reason == "its γ or β is computed at run time, not a constant"


def test_onnx_layer_normalization_expansion_with_its_statistics_used_is_listed():
    """The conformance cases also output Mean and InvStdDev: the norm is listed, not rewritten."""
    model = onnx_expansion("LayerNormalization", [2, 3, 5], -1, 1, stats=True)
    norm = only_decision(model)
    assert norm.op == "decomposed LayerNorm" and not norm.foldable
    assert norm.reason.startswith("not rewritten: its mean ") and "is also read by Reshape" in norm.reason


@pytest.mark.parametrize("shape", [[3, 4], [2, 3, 5], [2, 3, 4, 5]], ids=lambda s: f"rank{len(s)}")
def test_onnx_rms_normalization_expansion_is_listed_as_rms(shape):
    """Opset 23's body: the axes a Range over Size(Shape(x)), no mean subtracted."""
    for axis in range(-len(shape), len(shape)):
        norm = only_decision(onnx_expansion("RMSNormalization", shape, axis, 0))
        assert norm.op == "decomposed RMSNorm" and norm.reason == ALREADY_RMS


def test_every_onnx_conformance_expansion_is_listed():
    """ONNX's own `_expanded` conformance cases of both ops, as its case generator writes them: one norm
    each, declined for what it is (their inputs are graph inputs; their Mean/InvStdDev are outputs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ("layernormalization", "rmsnormalization"):  # importing a case module writes its cases
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
    from onnx.backend.test.case.node import _NodeTestCases

    prefixes = ("test_layer_normalization", "test_rms_normalization")
    expanded = {c.name: c for c in _NodeTestCases if c.name.startswith(prefixes) and "_expanded" in c.name}.values()
    assert len(expanded) == 2 * 19 + 19, sorted(c.name for c in expanded)
    for case in expanded:
        norm = only_decision(case.model)
        if case.name.startswith("test_rms"):
            assert (norm.op, norm.reason) == ("decomposed RMSNorm", ALREADY_RMS), case.name
        else:
            assert norm.op == "decomposed LayerNorm" and norm.reason.startswith("not rewritten: its mean "), case.name


# --- ONNX Runtime's LayerNorm and SkipLayerNormalization fusion-test graphs (tests/data/ort_fusion) ----

ORT_FUSION = Path(__file__).parent / "data" / "ort_fusion"
LN = "decomposed LayerNorm"
GRAPH_INPUT = "input not provably zero-mean: graph input"
MULTI_AXIS = "normalizes over axes 2..3: zero mean along one axis does not make a multi-axis LayerNorm an RMSNorm"
AXES_DIFFER = "not recognised as a LayerNorm: X − ReduceMean ReduceMean_0 over axes"
# graph → what `inspect` says of each norm as ONNX Runtime's test writes it (its norms read graph inputs), and how
# many norms fold once each float graph input is the output of a linear layer
ORT_GRAPHS = {
    **{
        f"skip_layer_norm_format{fmt}{variant}{cast}": (
            [(LN, "centring bias is unsafe: the shift reaches graph output add3_out" if unsafe else GRAPH_INPUT)],
            0 if variant == "_graph_output" else 1,
        )
        for fmt in (1, 2, 3)
        for variant in ("", "_no_fusion" if fmt == 3 else "_partial", "_graph_output")
        for cast in ("", "_with_cast")
        for unsafe in [variant == "_graph_output" and fmt != 3]
    },
    "layer_norm": ([(LN, GRAPH_INPUT)], 1),
    "layer_norm_fp16": ([(LN, GRAPH_INPUT)], 1),  # γ, β graph inputs: outside the norm, which ends at the Div
    "layer_norm_without_scale_bias": ([(LN, GRAPH_INPUT)], 1),
    "layer_norm_shared_input": ([(LN, None), (LN, None)], 2),  # one centring inserted for both
    "layer_norm_with_cast_2": ([(LN, GRAPH_INPUT)], 1),
    "layer_norm_with_cast_3": ([(LN, GRAPH_INPUT)], 1),
    "layer_norm_fusion_scale_bias": ([(LN, GRAPH_INPUT)], 1),
    "layer_norm_t5": ([("decomposed RMSNorm", ALREADY_RMS)], 0),
    "simplified_layer_norm_with_casts": ([("decomposed RMSNorm", ALREADY_RMS)], 0),
    "build_layer_norm_axes_m1__m1": ([(LN, GRAPH_INPUT)], 1),
    "build_layer_norm_axes_m2__m1": ([(UNRECOGNISED, AXES_DIFFER)], 0),
    "build_layer_norm_axes_m3_m2_m1__m1_m2": ([(UNRECOGNISED, AXES_DIFFER)], 0),
    "build_layer_norm_axes_m2_m1__m1_m2": ([(LN, MULTI_AXIS)], 0),
    "build_layer_norm_axes_2_m1__m1_m2": ([(LN, MULTI_AXIS)], 0),
}


def test_every_ort_fusion_graph_is_covered():
    assert sorted(ORT_GRAPHS) == sorted(p.stem for p in ORT_FUSION.glob("*.onnx"))


@pytest.mark.parametrize("name", sorted(ORT_GRAPHS))
def test_ort_fusion_graph_norms_are_listed_for_what_they_are(name):
    plan = inspect_onnx(str(ORT_FUSION / f"{name}.onnx"))
    listed = [(d.op, d.reason) for d in plan.decisions]
    expected = ORT_GRAPHS[name][0]
    assert len(listed) == len(expected), plan.to_json()
    for (op, reason), (want_op, want_reason) in zip(listed, expected, strict=True):
        assert op == want_op and (reason is None if want_reason is None else reason.startswith(want_reason)), listed


def behind_linear_layers(model: onnx.ModelProto, gen) -> onnx.ModelProto:
    """`model` with each float graph input of rank ≥ 2 made the output of a linear layer (MatMul from a new input)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    inputs, layers = [], []
    for value in model.graph.input:
        tensor = value.type.tensor_type
        dims = [d.dim_value or 4 for d in tensor.shape.dim]
        if len(dims) < 2:
            inputs.append(value)
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        result.graph.initializer.append(
            numpy_helper.from_array(randn(gen, 6, dims[-1]).astype(dtype), f"{value.name}.W")
        )
        inputs.append(onnx.helper.make_tensor_value_info(f"{value.name}.x", tensor.elem_type, [*dims[:-1], 6]))
        layers.append(
            onnx.helper.make_node("MatMul", [f"{value.name}.x", f"{value.name}.W"], [value.name], name=value.name)
        )
    del result.graph.input[:], result.graph.node[:]
    result.graph.input.extend(inputs)
    result.graph.node.extend(layers + list(model.graph.node))
    for value in result.graph.input:  # static shapes: the fp16 graph declares γ and β of width N
        for dim in value.type.tensor_type.shape.dim:
            dim.dim_value = dim.dim_value or 4
    onnx.checker.check_model(result, full_check=True)
    return result


@pytest.mark.parametrize("name", sorted(ORT_GRAPHS))
def test_ort_fusion_graph_norms_fold_where_provable(name):
    """Behind linear layers, the norms fold where the proof holds; the folded model matches the original
    in plain ONNX Runtime within the tolerance of the lowest precision it computes in. Normpass's own
    verification runs where the model's outputs have that precision (an fp16 sum normalized in fp32
    is compared at fp32 tolerance there, which fp16 rounding of the centred layers exceeds)."""
    model = behind_linear_layers(onnx.load(str(ORT_FUSION / f"{name}.onnx")), rng(50))
    types = {v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    half = onnx.TensorProto.FLOAT16 in types
    result = fold_onnx(
        model, FoldOptions(fold_with_beta_add=True, verify=types == {onnx.TensorProto.FLOAT16} or not half)
    )
    assert result.folded == ORT_GRAPHS[name][1], result.plan.to_json()
    assert result.comparison is None or result.comparison.passed
    check_structure(result.model)
    if result.folded:
        counts = op_counts(result.model)
        assert not counts["Sub"] and not counts["Pow"] and not counts["ReduceMean"], counts
    assert_same_outputs(model, result.model, 1e-2 if half else 1e-5)
