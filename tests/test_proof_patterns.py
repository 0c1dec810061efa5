"""Patterns third-party architectures hide norms behind (issue 36): each proven on a small graph that has it,
checked for the fold count and against the original in ONNX Runtime, with a counter-example that must refuse.

* a mean-pooled head (BEiT, EVA-02): a mean over tokens keeps a shift constant along the features;
* a read that carries no values (BART's TorchScript encoder): a Gather whose output only Shape reads;
* where the centring goes (wav2vec2): a centring inserted below a layer that cannot be centred;
* a row re-normalized before it is read (XCiT's class attention): a slice of a concatenation keeps its part's rows;
* shapes known only from shape arithmetic (Twins' TorchScript export): ONNX Runtime's symbolic shape inference;
* a per-feature factor over a concatenation (XCiT's class attention, its norm2): the layer it scales is centred
  weighted by the factor, and only the rows the norm reads need it;
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
import torch
from conftest import assert_equivalent, build, check_structure, randn
from torch import nn

from normpass import FoldOptions, fold_graph, fold_onnx, inspect_onnx
from normpass.core.rules import regroup_axis
from normpass.torch.api import fold as torch_fold
from normpass.torch.api import inspect as torch_inspect


def _fold(model):
    result = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    check_structure(result.model)
    assert_equivalent(model, result.model)
    return result


def _reasons(plan) -> dict[str, str | None]:
    return {d.name: d.reason for d in plan.decisions}


# --- mean-pooled heads -------------------------------------------------------------------------

MEAN_POOLED = """<ir_version: 10, opset_import: ["" : {opset}]>
m (float[2,5,8] x) => (float[2,{out}] y) {{
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n1 = LayerNormalization<axis=-1>(h, g1, be1)
  a0 = MatMul(n1, W1)
  s = Add(h, a0)
  {pool}
  n2 = LayerNormalization<axis=-1>(p, g2, be2)
  y0 = MatMul(n2, W2)
  y = {tail}
}}"""


def _mean_pooled(gen, pool: str, opset: int = 17, out: str = "3", tail: str = "Identity(y0)", **extra):
    text = MEAN_POOLED.format(opset=opset, out=out, pool=pool, tail=tail)
    weights: dict[str, Any] = dict(W0=randn(gen, 8, 8), b0=randn(gen, 8), W1=randn(gen, 8, 8), W2=randn(gen, 8, 3))
    norms: dict[str, Any] = {f"{p}{i}": randn(gen, 8) + (1 if p == "g" else 0) for i in (1, 2) for p in ("g", "be")}
    return build(text, **weights, **norms, **extra)


@pytest.mark.parametrize(
    "opset, pool",
    [
        (17, "p = ReduceMean<axes=[1], keepdims=0>(s)"),  # the axes an attribute
        (18, "p = ReduceMean<keepdims=0>(s, tokens)"),  # the axes an input (opset 18)
        (17, "p1 = ReduceMean<axes=[-2]>(s)\n  p = Squeeze(p1, one)"),  # keepdims, then squeezed
        (17, "p1 = ReduceSum<keepdims=0>(s, tokens)\n  p = Div(p1, five)"),  # a sum scaled
    ],
)
def test_a_mean_over_tokens_keeps_the_stream_provable(gen, opset, pool):
    """mean_tokens(x)'s rows are averages of x's rows: zero-mean stays zero-mean, a shift stays constant along d."""
    model = _mean_pooled(
        gen,
        pool,
        opset,
        tokens=np.array([1], np.int64),
        one=np.array([1], np.int64),
        five=np.array(5.0, np.float32),
    )
    result = _fold(model)
    assert result.folded == 2, _reasons(result.plan)


def test_a_mean_over_the_features_refuses(gen):
    """Averaging along the normalized axis reads the shift: the head sees mean_d(x + c) = mean_d(x) + c."""
    model = _mean_pooled(
        gen,
        "p = Identity(s)\n  f = ReduceMean<axes=[-1], keepdims=0>(s)",
        out="5",
        tail="Identity(f)",
    )
    plan = inspect_onnx(model)
    reasons = _reasons(plan)
    assert len(plan.folded) == 0, reasons
    assert "ReduceMean" in reasons["n1"] and "reduces over the shifted axis" in reasons["n1"]


class MeanPooled(nn.Module):
    """Patch embedding, a pre-LN block, then the mean over tokens normalized by a head norm (BEiT's pooler)."""

    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim
        self.embed, self.ln1, self.mlp = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.ln2, self.head = nn.LayerNorm(8), nn.Linear(8 if dim == 1 else 5, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.mlp(self.ln1(h))
        pooled = h[:, 1:].mean(dim=self.dim)
        return self.head(self.ln2(pooled) if self.dim == 1 else pooled)


def _seeded(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm):
                sub.weight.uniform_(0.5, 1.5)
                sub.bias.normal_()
    return module.eval()


def test_torch_mean_over_tokens_keeps_the_stream_provable():
    torch.manual_seed(0)
    model = _seeded(MeanPooled())
    x = torch.randn(2, 6, 6)
    folded, report = torch_fold(model, x)
    assert len(report.plan.folded) == 2, _reasons(report.plan)
    with torch.no_grad():
        other = 3 * torch.randn(3, 4, 6) + 1
        torch.testing.assert_close(folded(other), model(other), rtol=1e-5, atol=1e-5)


def test_torch_mean_over_features_refuses():
    torch.manual_seed(0)
    plan = torch_inspect(_seeded(MeanPooled(dim=2)), torch.randn(2, 6, 6))
    assert len(plan.folded) == 0
    assert "reduces over the shifted axis" in _reasons(plan)["ln1"]


# --- reads that carry no values ----------------------------------------------------------------

SHAPE_ONLY_GATHER = """<ir_version: 10, opset_import: ["" : 17]>
m (int64[2,5] ids) => (float[2,5,3] y{extra_output}) {{
  e0 = Gather(E, ids)
  e = Mul(e0, scale)
  last = Gather<axis=2>(e, minus1)
  sh = Shape(last)
  seq = Gather(sh, one)
  r = Range(zero, seq, step)
  pos = Gather(P, r)
  h = Add(e, pos)
  n = LayerNormalization<axis=-1>(h, g, be)
  y = MatMul(n, W)
}}"""


def _shape_only_gather(gen, extra_output: str = ""):
    return build(
        SHAPE_ONLY_GATHER.format(extra_output=extra_output),
        E=randn(gen, 11, 8),
        scale=np.array(2.0, np.float32),
        minus1=np.array(-1, np.int64),
        one=np.array(1, np.int64),
        zero=np.array(0, np.int64),
        step=np.array(1, np.int64),
        P=randn(gen, 9, 8),
        g=randn(gen, 8) + 1,
        be=randn(gen, 8),
        W=randn(gen, 8, 3),
    )


def test_a_gather_read_only_for_its_shape_carries_no_shift(gen):
    """BART's TorchScript encoder: `inputs_embeds[:, :, -1]` read by Shape only, for the position ids."""
    result = _fold(_shape_only_gather(gen))
    assert result.folded == 1, _reasons(result.plan)


def test_a_gather_whose_values_are_read_refuses(gen):
    plan = inspect_onnx(_shape_only_gather(gen, extra_output=", float[2,5] last"))
    assert len(plan.folded) == 0
    assert "gathers along the shifted axis" in _reasons(plan)["n"]


# --- where the centring goes -------------------------------------------------------------------

POSITIONAL_CONV = """<ir_version: 10, opset_import: ["" : 17]>
m (float[2,6,4] x) => (float[2,6,3] y{extra_output}) {{
  p0 = MatMul(x, Wp)
  h = Add(p0, bp)
  t = Transpose<perm=[0,2,1]>(h)
  c = Conv<group=2, pads=[1,1], kernel_shape=[3]>(t, Wc, bc)
  r = Tanh(c)
  pos = Transpose<perm=[0,2,1]>(r)
  s = Add(h, pos)
  n1 = LayerNormalization<axis=-1>(s, g1, be1)
  a = MatMul(n1, W1)
  s2 = Add(s, a)
  n2 = LayerNormalization<axis=-1>(s2, g2, be2)
  y = MatMul(n2, W2)
}}"""


def _positional_conv(gen, extra_output: str = ""):
    norms: dict[str, Any] = {f"{p}{i}": randn(gen, 8) + (1 if p == "g" else 0) for i in (1, 2) for p in ("g", "be")}
    return build(
        POSITIONAL_CONV.format(extra_output=extra_output),
        Wp=randn(gen, 4, 8),
        bp=randn(gen, 8),
        Wc=randn(gen, 8, 4, 3),
        bc=randn(gen, 8),
        W1=randn(gen, 8, 8),
        W2=randn(gen, 8, 3),
        **norms,
    )


def test_a_centring_inserted_after_a_positional_conv_add(gen):
    """wav2vec2: the projection feeds the stream and a grouped conv, so it cannot be centred; the sum of both is
    read only by norms and the stream, so centring the sum itself is exact and folds both norms."""
    result = _fold(_positional_conv(gen))
    assert result.folded == 2, _reasons(result.plan)
    assert [(i.tensor, i.axis) for i in result.plan.insertions] == [("s", 2)]
    assert sum(node.op_type == "ReduceMean" for node in result.model.graph.node) == 1


def test_no_centring_is_inserted_where_a_shift_would_survive(gen):
    plan = inspect_onnx(_positional_conv(gen, extra_output=", float[2,6,8] s"))
    reasons = _reasons(plan)
    assert len(plan.folded) == 0 and not plan.insertions
    assert "Conv c" in reasons["n1"] and "unsafe" in reasons["n1"]


# --- shapes known only from shape arithmetic ---------------------------------------------------

RUNTIME_RESHAPE = """<ir_version: 10, opset_import: ["" : 17]>
m (float[B,16,6] x, float[B,3,16,16] img) => (float[B,4,{rest},3] y) {{
  h0 = MatMul(x, W0)
  s = Add(h0, b0)
  n1 = LayerNormalization<axis=-1>(s, g1, be1)
  a = MatMul(n1, W1)
  s2 = Add(s, a)
  shape_s = Shape(s2)
  batch = Gather<axis=0>(shape_s, i0)
  shape_img = Shape(img)
  height = Gather<axis=0>(shape_img, i2)
  rows = Div(height, four)
  width = Gather<axis=0>(shape_img, i3)
  cols = Div(width, four)
  batch1 = Unsqueeze(batch, axis0)
  rows1 = Unsqueeze(rows, axis0)
  cols1 = Unsqueeze(cols, axis0)
  target = Concat<axis=0>(batch1, rows1, {columns})
  r = Reshape(s2, target)
  n2 = LayerNormalization<axis=-1>(r, g2, be2)
  y = MatMul(n2, W2)
}}"""


def _runtime_reshape(gen, columns: str, rest: int, width: int):
    """Twins' `x.reshape(B, *size, -1)`, as TorchScript exports it: the grid size computed from the image's."""
    return build(
        RUNTIME_RESHAPE.format(columns=columns, rest=rest),
        W0=randn(gen, 6, 8),
        b0=randn(gen, 8),
        g1=randn(gen, 8) + 1,
        be1=randn(gen, 8),
        W1=randn(gen, 8, 8),
        g2=randn(gen, width) + 1,
        be2=randn(gen, width),
        W2=randn(gen, width, 3),
        i0=np.array(0, np.int64),
        i2=np.array(2, np.int64),
        i3=np.array(3, np.int64),
        four=np.array(4, np.int64),
        axis0=np.array([0], np.int64),
        minus1=np.array([-1], np.int64),
        split=np.array([-1, 4], np.int64),
    )


def test_a_reshape_to_a_computed_size_keeps_the_axis_intact(gen):
    """[B, 16, 8] → [B, H/4, W/4, -1]: ONNX's inference cannot divide, ONNX Runtime's symbolic inference can."""
    result = _fold(_runtime_reshape(gen, "cols1, minus1", rest=4, width=8))
    assert result.folded == 2, _reasons(result.plan)


def test_a_reshape_that_splits_the_axis_refuses(gen):
    """[B, 16, 8] → [B, H/4, -1, 4] splits each row of 8 features in two: the norm over 4 is not provable, and
    the shift a centring would leave in the stream reaches it."""
    plan = inspect_onnx(_runtime_reshape(gen, "split", rest=8, width=4))
    reasons = _reasons(plan)
    assert len(plan.folded) == 0, reasons
    assert "does not keep the normalized axis intact" in reasons["n2"]
    assert "Reshape r does not keep the shifted axis intact" in reasons["n1"]


def test_a_reshape_of_symbolic_sizes_keeps_an_axis_with_as_many_elements_before_it():
    """A patch grid's reshape [B, d, H·W] → [B, d, H, W] with every size but d symbolic (torch.export's
    `Dim.AUTO`): the elements after d are not static, but those before it are as many (B), so d is intact."""
    assert regroup_axis(("s0", 32, "(s1//7)*(s2//7)"), ("s0", 32, "s1//7", "s2//7"), 1) == 1
    assert regroup_axis(("s0", 32, "s1//7", "s2//7"), ("s0", 32, "(s1//7)*(s2//7)"), 1) == 1
    assert regroup_axis(("s0", 2, 3, 32, "n"), ("s0", 6, 32, "h", "w"), 3) == 2  # static parts multiply alike
    assert regroup_axis(("s0", 32, "n"), ("s3", 32, "h", "w"), 1) is None  # s0 = s3 is not known
    assert regroup_axis(("s0", 2, 32, "n"), ("s0", 32, 2, "n"), 2) is None  # 2·s0 before it, then s0
    assert regroup_axis((None, 32, "n"), (None, 32, "h", "w"), 1) is None  # an unknown size is no name


# --- a row re-normalized before it is read -----------------------------------------------------

CLASS_ATTENTION = """<ir_version: 10, opset_import: ["" : 17]>
m (float[2,4,6] x) => (float[2,4,3] y) {{
  h0 = MatMul(x, W0)
  s = Add(h0, b0)
  n1 = LayerNormalization<axis=-1>(s, g1, be1)
  a = MatMul(n1, W1)
  s1 = Add(s, a)
  first = Slice(s1, i0, i1, axis1)
  others = Slice(s1, i1, end, axis1)
  n2 = LayerNormalization<axis=-1>(first, g2, be2)
  x2 = Concat<axis=1>(n2, others)
  read = Slice(x2, i0, {read_end}, axis1)
  rest = Slice(x2, {read_end}, end, axis1)
  mlp = MatMul(read, W2)
  x3 = Concat<axis=1>(mlp, rest)
  s2 = Add(x2, x3)
  n3 = LayerNormalization<axis=-1>(s2, g3, be3)
  y = MatMul(n3, W3)
}}"""


def _class_attention_constants(gen) -> dict[str, Any]:
    """What both class-attention graphs share: the embedding W0, b0, the head W3, three norms' γ/β, and the
    bounds of their slices along the tokens."""
    norms: dict[str, Any] = {f"{p}{i}": randn(gen, 8) + (1 if p == "g" else 0) for i in (1, 2, 3) for p in ("g", "be")}
    bounds = {f"i{i}": np.array([i], np.int64) for i in range(3)}
    ends = dict(end=np.array([2**62], np.int64), axis1=np.array([1], np.int64))
    return dict(W0=randn(gen, 6, 8), b0=randn(gen, 8), W3=randn(gen, 8, 3), **norms, **bounds, **ends)


def _class_attention(gen, read_end: str):
    constants = _class_attention_constants(gen)
    return build(CLASS_ATTENTION.format(read_end=read_end), W1=randn(gen, 8, 8), W2=randn(gen, 8, 8), **constants)


def test_a_row_normalized_again_before_it_is_read_carries_no_shift(gen):
    """XCiT's class attention: `x = cat([norm2(x[:, :1]), x[:, 1:]])`, then the MLP reads `x[:, :1]`: only rows
    1: carry the stream's shift, and the MLP reads none of them."""
    result = _fold(_class_attention(gen, read_end="i1"))
    reasons = _reasons(result.plan)
    assert sorted(d.name for d in result.plan.folded) == ["n1", "n2"], reasons
    assert "post-LN" in reasons["n3"]


def test_a_read_of_a_shifted_row_refuses(gen):
    """The MLP reads rows 0 and 1; row 1 carries the shift."""
    plan = inspect_onnx(_class_attention(gen, read_end="i2"))
    reasons = _reasons(plan)
    assert len(plan.folded) == 0, reasons
    assert "MatMul mlp would change its output" in reasons["n1"]


class ClassAttention(nn.Module):
    """XCiT's class-attention tail: the class row normalized again, the MLP reads only that row."""

    def __init__(self, read: int = 1):
        super().__init__()
        self.read = read
        self.embed, self.norm1, self.attn = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.norm2, self.mlp = nn.LayerNorm(8), nn.Linear(8, 8)
        self.norm3, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        s = self.embed(x)
        s = s + self.attn(self.norm1(s))
        x2 = torch.cat([self.norm2(s[:, :1]), s[:, 1:]], dim=1)
        x3 = torch.cat([self.mlp(x2[:, : self.read]), x2[:, self.read :]], dim=1)
        return self.head(self.norm3(x2 + x3))


def test_torch_row_normalized_again_before_it_is_read():
    torch.manual_seed(0)
    model = _seeded(ClassAttention())
    folded, report = torch_fold(model, torch.randn(2, 4, 6))
    assert sorted(d.name for d in report.plan.folded) == ["norm1", "norm2"], _reasons(report.plan)
    with torch.no_grad():
        other = 3 * torch.randn(3, 4, 6) + 1
        torch.testing.assert_close(folded(other), model(other), rtol=1e-5, atol=1e-5)


def test_torch_read_of_a_shifted_row_refuses():
    torch.manual_seed(0)
    plan = torch_inspect(_seeded(ClassAttention(read=2)), torch.randn(2, 4, 6))
    assert len(plan.folded) == 0
    assert "would change its output" in _reasons(plan)["norm1"]


# --- a per-feature factor over a concatenation -----------------------------------------------------

LAYER_SCALED_CLASS_ATTENTION = """<ir_version: 10, opset_import: ["" : 17]>
m (float[2,4,6] x) => (float[2,4,3] y{outputs}) {{
  h0 = MatMul(x, W0)
  s = Add(h0, b0)
  n1 = LayerNormalization<axis=-1>(s, g1, be1)
  cls = Slice(n1, i0, i1, axis1)
  others = Slice(n1, i1, end, axis1)
  p0 = MatMul(cls, Wp)
  p = Add(p0, bp)
  c = Concat<axis=1>(p, others)
  scaled = Mul(gamma1, c)
  s1 = Add(s, scaled)
  first = Slice(s1, i0, {read_end}, axis1)
  rest = Slice(s1, {read_end}, end, axis1)
  n2 = LayerNormalization<axis=-1>(first, g2, be2)
  x2 = Concat<axis=1>(n2, rest)
  n3 = LayerNormalization<axis=-1>(x2, g3, be3)
  y = MatMul(n3, W3)
}}"""


def _layer_scaled_class_attention(gen, read_end: str = "i1", gamma1=None, outputs: str = ""):
    constants = _class_attention_constants(gen)
    return build(
        LAYER_SCALED_CLASS_ATTENTION.format(read_end=read_end, outputs=outputs),
        Wp=randn(gen, 8, 8),
        bp=randn(gen, 8),
        gamma1=randn(gen, 8, scale=0.5) + 1 if gamma1 is None else gamma1,
        **constants,
    )


def test_a_layer_scale_over_a_concatenation_centres_its_layer_weighted(gen):
    """XCiT's class attention: norm2 reads row 0 of x + γ₁ ⊙ cat(proj(…), x̂₁[:, 1:]), which is x₀ + γ₁ ⊙ proj(…).
    The projection is centred weighted by γ₁, W' = W − γ₁⁻¹ ⊗ mean(γ₁ ⊙ W); γ₁ ⊙ x̂₁[:, 1:] is never read by it."""
    model = _layer_scaled_class_attention(gen)
    result = _fold(model)
    reasons = _reasons(result.plan)
    assert sorted(d.name for d in result.plan.folded) == ["n1", "n2"], reasons
    assert "the output of LayerNormalization n1" in reasons["n3"]  # row 1 on: γ₁ ⊙ x̂₁, a norm's output
    n2 = next(d for d in result.plan.folded if d.name == "n2")
    weighted = {(c.label, c.weight) for c in n2.centrings if c.weight is not None}
    assert weighted == {("p0", "gamma1"), ("bp", "gamma1")}
    # the rewritten projection: γ₁ ⊙ (x·W' + b') is zero-mean along the features for every x
    values = {i.name: onnx.numpy_helper.to_array(i) for i in result.model.graph.initializer}
    projection = next(n for n in result.model.graph.node if n.name == "p0")
    bias = next(n for n in result.model.graph.node if n.name == "p")
    gamma = values["gamma1"].astype(np.float64)
    assert (projection.input[1], bias.input[1]) != ("Wp", "bp")
    for name in (projection.input[1], bias.input[1]):
        assert np.abs((values[name].astype(np.float64) * gamma).mean(-1)).max() < 1e-6


def test_a_layer_scale_over_a_concatenation_refuses_where_the_norm_reads_the_other_part(gen):
    """norm2 reads rows 0 and 1: row 1 is γ₁ ⊙ x̂₁, a norm's output, which no centring makes zero-mean."""
    plan = inspect_onnx(_layer_scaled_class_attention(gen, read_end="i2"))
    reasons = _reasons(plan)
    assert [d.name for d in plan.folded] == ["n1"], reasons
    assert "the output of LayerNormalization n1 is γ⊙x̂+β" in reasons["n2"]


def test_a_layer_scale_with_a_zero_refuses(gen):
    """A zero γ₁ₖ cannot carry the weighted centring's shift c/γ₁ₖ."""
    gamma1 = randn(gen, 8, scale=0.5) + 1
    gamma1[3] = 0
    plan = inspect_onnx(_layer_scaled_class_attention(gen, gamma1=gamma1))
    reasons = _reasons(plan)
    assert "per-feature factor gamma1 with a zero or non-finite entry" in reasons["n2"], reasons


def test_a_weighted_centring_whose_shift_reaches_another_reader_refuses(gen):
    """The projection's output is also a graph output: the shift c/γ₁ left in it would change it."""
    plan = inspect_onnx(_layer_scaled_class_attention(gen, outputs=", float[2,1,8] p"))
    reasons = _reasons(plan)
    assert reasons["n2"] == "centring bp is unsafe: the shift reaches graph output p", reasons


def test_a_weighted_centring_of_a_layer_whose_bias_is_one_number_refuses(gen):
    """A Gemm's C of one element is added to every feature alike: centred weighted by w it would have to vary
    along the features, so the norm that needs it is refused (and the rest folds)."""
    model = build(
        """<ir_version: 10, opset_import: ["" : 17]>
m (float[4,6] x) => (float[4,8] y) {
  h = Gemm(x, W, C)
  x2 = MatMul(x, W2)
  n0 = LayerNormalization<axis=-1>(x2, g0, b0)
  c = Concat<axis=0>(h, n0)
  scaled = Mul(gamma1, c)
  first = Slice(scaled, i0, i4, axis0)
  y = LayerNormalization<axis=-1>(first, g1, b1)
}""",
        W=randn(gen, 6, 8),
        C=np.array([0.7], np.float32),
        W2=randn(gen, 6, 8),
        gamma1=randn(gen, 8, scale=0.5) + 1,
        i0=np.array([0], np.int64),
        i4=np.array([4], np.int64),
        axis0=np.array([0], np.int64),
        **{f"{p}{i}": randn(gen, 8) + (1 if p == "g" else 0) for i in (0, 1) for p in ("g", "b")},
    )
    result = _fold(model)
    reasons = _reasons(result.plan)
    assert [d.name for d in result.plan.folded] == ["n0"], reasons
    assert "Gemm h's bias is one number for every feature" in reasons["y"]


class LayerScaledClassAttention(nn.Module):
    """XCiT's class-attention block as timm writes it (`tokens_norm` False), with a one-row attention."""

    def __init__(self, read: int = 1):
        super().__init__()
        self.read = read
        self.embed, self.norm1, self.proj = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.gamma1 = nn.Parameter(1 + 0.5 * torch.randn(8))
        self.norm2, self.norm3, self.head = nn.LayerNorm(8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        s = self.embed(x)
        n1 = self.norm1(s)
        s = s + self.gamma1 * torch.cat([self.proj(n1[:, :1]), n1[:, 1:]], dim=1)
        x2 = torch.cat([self.norm2(s[:, : self.read]), s[:, self.read :]], dim=1)
        return self.head(self.norm3(x2))


@pytest.mark.parametrize("rewrite", ["fold", "fold_graph"])
def test_torch_layer_scale_over_a_concatenation(rewrite):
    """The module swap (`fold`) and the graph rewrite (`fold_graph`) both centre proj weighted by gamma1."""
    model = _seeded(LayerScaledClassAttention())
    folded, report = (torch_fold if rewrite == "fold" else fold_graph)(model, torch.randn(2, 4, 6))
    assert sorted(d.name for d in report.plan.folded) == ["norm1", "norm2"], _reasons(report.plan)
    with torch.no_grad():
        other = 3 * torch.randn(2, 4, 6) + 1  # the batch size captured (`fold_graph` without dynamic shapes)
        torch.testing.assert_close(folded(other), model(other), rtol=1e-5, atol=1e-5)


def test_torch_layer_scale_over_a_concatenation_read_elsewhere_refuses():
    plan = torch_inspect(_seeded(LayerScaledClassAttention(read=2)), torch.randn(2, 4, 6))
    assert sorted(d.name for d in plan.folded) == ["norm1"], _reasons(plan)
    assert "is γ⊙x̂+β" in _reasons(plan)["norm2"]
