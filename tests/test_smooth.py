"""Smoothing (`normpass/onnx/rotate/smooth.py`, `normpass rotate --calib DATA --smooth`): a calibrated per-feature
scale moves from a norm's output into the linear layers that read it, exactly; x ⊘ s is computed by the
norm's γ and β where nothing else reads its output, else by one inserted `Mul`; the norms of rotated
streams are left alone.

Each smoothed model is checked by `rotate_onnx`'s own verification and by an ONNX Runtime run on other
inputs (`assert_equivalent`); what the scale does is read off the model run on the calibration data.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import assert_equivalent, build, check_structure, initializers, op_counts, randn, rng, run_ort
from test_patterns import beta, gamma, header

from normpass import RotateOptions, rotate_onnx
from normpass.errors import InputError
from normpass.onnx.calibrate import synthetic_batches
from normpass.onnx.rotate.smooth import smoothing_scale

D, T, F = 8, 5, 16  # width, tokens, MLP width
OUTLIER = 3  # the feature whose γ is large: the norm's output has an outlier channel there


def post_ln_model() -> onnx.ModelProto:
    """A post-LN MLP block: the first norm's output feeds the MLP and the residual `Add`; the MLP's first
    weight is read by a second layer too (a tied weight)."""
    gen = rng(3)
    g1 = gamma(gen, D)
    g1[OUTLIER] = 40.0
    return build(
        f"""{header()}
agraph (float[B, {T}, {D}] x) => (float[B, {T}, {D}] y, float[B, {T}, {F}] t) {{
  n = LayerNormalization<axis=-1>(x, g1, b1)
  h = MatMul(n, w1)
  hb = Add(h, c1)
  r = Relu(hb)
  m = MatMul(r, w2)
  s = Add(n, m)
  y = LayerNormalization<axis=-1>(s, g2, b2)
  t = MatMul(x, w1)
}}""",
        g1=g1,
        b1=beta(gen, D),
        w1=randn(gen, D, F),
        c1=randn(gen, F),
        w2=randn(gen, F, D),
        g2=gamma(gen, D),
        b2=beta(gen, D),
    )


def pre_ln_model() -> onnx.ModelProto:
    """A pre-LN block whose stream does not rotate (a `Relu` reads it), its norm read by two linear layers."""
    gen = rng(5)
    g = gamma(gen, D)
    g[OUTLIER] = 40.0
    return build(
        f"""{header()}
agraph (float[B, {T}, {D}] x) => (float[B, {T}, {D}] y, float[B, {T}, {D}] z) {{
  n = LayerNormalization<axis=-1>(x, g, b)
  a = MatMul(n, wa)
  c = MatMul(n, wc)
  ac = Add(a, c)
  y = Add(x, ac)
  z = Relu(y)
}}""",
        g=g,
        b=beta(gen, D),
        wa=randn(gen, D, D),
        wc=randn(gen, D, D),
    )


def calibration(names=("x",), samples: int = 16) -> list[dict]:
    gen = rng(7)
    return [{name: randn(gen, samples, T, D).astype(np.float32) for name in names}]


def smoothed(model: onnx.ModelProto, alpha: float = 0.5):
    before = model.SerializeToString()
    result = rotate_onnx(model, RotateOptions(calib=calibration(), smooth=alpha))
    assert model.SerializeToString() == before, "rotate_onnx modified its input model"
    assert result.comparison is not None and result.comparison.passed, result.comparison
    check_structure(result.model)
    assert_equivalent(model, result.model)
    return result


def probe(model: onnx.ModelProto, tensors: list[str]) -> dict[str, np.ndarray]:
    """The model's `tensors` on the calibration data."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name in tensors:
        copy.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return run_ort(copy, calibration()[0])


def feature_max(values: np.ndarray) -> np.ndarray:
    return np.abs(values).reshape(-1, values.shape[-1]).max(0)


def test_post_ln_norm_output_is_smoothed_by_one_mul_and_balanced_with_the_weight():
    model = post_ln_model()
    result = smoothed(model)
    plan = result.smoothing
    assert [(s.norm, s.in_norm) for s in plan.sites] == [(plan.sites[0].norm, False)] and not plan.refused
    assert op_counts(result.model)["Mul"] == op_counts(model)["Mul"] + 1
    mul = next(n for n in result.model.graph.node if n.op_type == "Mul")
    assert "inserted smoothing" in mul.doc_string
    # the MatMul reads x ⊘ s; the residual Add still reads the norm's output itself
    matmul = next(n for n in result.model.graph.node if n.op_type == "MatMul" and mul.output[0] in n.input)
    residual = next(n for n in result.model.graph.node if n.op_type == "Add" and mul.input[0] in n.input)
    assert residual.output[0] not in mul.output
    before = feature_max(probe(model, ["n"])["n"])
    after = feature_max(probe(result.model, [mul.output[0]])[mul.output[0]])
    weight = initializers(result.model)[matmul.input[1]]
    # α = 0.5: each feature's largest |x ⊘ s| equals its weight row's largest |diag(s)·W|, sqrt(max|x|·max|W|)
    np.testing.assert_allclose(after, np.abs(weight).max(1), rtol=1e-4)
    np.testing.assert_allclose(after, np.sqrt(before * np.abs(initializers(model)["w1"]).max(1)), rtol=1e-4)
    assert after.max() / after.min() < before.max() / before.min() / 2  # the outlier channel shrank
    # the tied weight keeps its values in the other layer
    tied = next(n for n in result.model.graph.node if n.op_type == "MatMul" and "x" in n.input)
    np.testing.assert_array_equal(initializers(result.model)[tied.input[1]], initializers(model)["w1"])
    assert result.report()["smoothing"]["smoothed"][0]["placement"] == "mul"
    assert result.model.metadata_props and any(p.key == "normpass.smoothed" for p in result.model.metadata_props)


def test_a_norm_read_only_by_linear_layers_takes_the_scale_into_its_gamma_and_beta():
    model = pre_ln_model()
    result = smoothed(model)
    assert [s.in_norm for s in result.smoothing.sites] == [True] and not result.smoothing.rotated
    plain = rotate_onnx(model, RotateOptions())
    assert not plain.rotation.rotatable  # the Relu keeps the stream from rotating
    assert op_counts(result.model) == op_counts(plain.model)  # no op added
    norm = next(n for n in result.model.graph.node if "smoothed" in n.doc_string and "norm" in n.op_type.lower())
    assert norm is not None
    readers = [n for n in result.model.graph.node if n.op_type == "MatMul"]
    weights = initializers(result.model)
    rows = np.max([np.abs(weights[n.input[1]]).max(1) for n in readers], axis=0)
    after = feature_max(probe(result.model, [readers[0].input[0]])[readers[0].input[0]])
    np.testing.assert_allclose(after, rows, rtol=1e-4)  # balanced against both readers' rows


def test_norms_on_a_rotated_stream_are_left_alone(registry_model):
    model = registry_model("gpt2")
    result = rotate_onnx(model, RotateOptions(calib=synthetic_batches(model, 16, 8), smooth=0.5), name="gpt2")
    assert result.comparison.passed and result.rotation.rotatable
    # the 2 layers' 2 norms each (the final norm's β Add stands between it and the LM head: no linear reader)
    assert not result.smoothing.sites and len(result.smoothing.rotated) == 4
    assert "4 on rotated streams left alone" in result.smoothing.summary


def test_a_pre_ln_encoder_whose_stream_does_not_rotate_is_smoothed_in_its_norms(registry_model):
    model = registry_model("vit", "torchscript")
    result = rotate_onnx(model, RotateOptions(calib=synthetic_batches(model, 16, 8), smooth=0.5), name="vit")
    plain = rotate_onnx(model, RotateOptions(calib=synthetic_batches(model, 16, 8)), name="vit")
    assert result.comparison.passed and not result.rotation.rotatable  # the stream is a graph output
    # each layer's two norms feed Q/K/V and the MLP alone: their γ and β take the scale, no op is added
    layers = sum(n.op_type == "Softmax" for n in model.graph.node)
    assert len(result.smoothing.sites) == 2 * layers and result.smoothing.muls == 0
    assert op_counts(result.model) == op_counts(plain.model)
    assert_equivalent(model, result.model)


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_post_ln_bert_smooths_every_norm_output_that_a_linear_layer_reads(registry_model, form):
    model = registry_model("bert", form)
    result = rotate_onnx(model, RotateOptions(calib=synthetic_batches(model, 16, 8), smooth=0.5), name="bert")
    assert result.comparison.passed and not result.rotation.rotatable
    # the embedding norm and each layer's two norms but the last: Q/K/V or the MLP read them
    layers = sum(n.op_type in ("Softmax",) for n in model.graph.node)
    assert len(result.smoothing.sites) == 2 * layers and not result.smoothing.refused
    assert result.smoothing.muls == len(result.smoothing.sites)  # the residual reads each of them too
    assert_equivalent(model, result.model)


def test_the_scale_stays_within_the_float_type_range():
    absmax = np.array([0.0, 1e-9, 1.0, 1e6, 1e12])  # a feature never seen nonzero, and huge outliers
    rows = np.array([1.0, 1.0, 1.0, 1e-3, 0.0])  # a weight row of zeros
    for dtype, limit in ((np.float16, 16.0), (np.float32, 1e4)):
        scale = smoothing_scale(absmax, rows, 0.5, np.dtype(dtype))
        assert np.all(np.isfinite(scale)) and scale.min() >= 1 / limit and scale.max() <= limit
    np.testing.assert_allclose(smoothing_scale(np.array([4.0]), np.array([1.0]), 0.5, np.dtype(np.float32)), [2.0])
    np.testing.assert_allclose(smoothing_scale(np.array([4.0]), np.array([9.0]), 1.0, np.dtype(np.float32)), [4.0])


def test_one_calibration_sample_is_enough():
    model = post_ln_model()
    result = rotate_onnx(model, RotateOptions(calib=calibration(samples=1), smooth=0.5))
    assert result.comparison.passed and len(result.smoothing.sites) == 1 and result.keys is not None


def test_options_are_checked_before_the_model_is_read():
    with pytest.raises(InputError, match="calibration inputs"):
        rotate_onnx("no-such-file.onnx", RotateOptions(smooth=0.5))
    with pytest.raises(InputError, match="from 0 to 1"):
        rotate_onnx("no-such-file.onnx", RotateOptions(calib=calibration(), smooth=1.5))


def test_cli_rotate_smooth_reports_it_and_refuses_it_without_data(tmp_path, capsys):
    from normpass.cli.main import main

    source, data = tmp_path / "model.onnx", tmp_path / "calib.npz"
    onnx.save(post_ln_model(), str(source))
    np.savez(data, **calibration()[0])
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    argv = ["rotate", str(source), "-o", str(out), "--calib", str(data), "--report", str(report), "--smooth"]
    assert main(argv) == 0
    assert "1 norm outputs smoothed (α 0.5), 1 of them by an inserted Mul" in capsys.readouterr().out
    found = json.loads(report.read_text())
    assert found["verified"] and found["smoothing"]["alpha"] == 0.5 and len(found["smoothing"]["smoothed"]) == 1
    assert main(["rotate", str(source), "-o", str(tmp_path / "other.onnx"), "--smooth", "0.5"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calib" in err[0]
    assert not (tmp_path / "other.onnx").exists()


@pytest.mark.parametrize("option, what", [("--smooth", "a number"), ("--online-rotation", "a whole block size")])
def test_cli_an_optional_value_that_is_a_path_is_refused_with_what_to_do(tmp_path, capsys, option, what):
    from normpass.cli.main import main

    source, data = tmp_path / "model.onnx", tmp_path / "calib.npz"
    onnx.save(post_ln_model(), str(source))
    np.savez(data, **calibration()[0])
    with pytest.raises(SystemExit) as exited:
        main(["rotate", option, str(source), "-o", str(tmp_path / "out.onnx")])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{option}: '{source}' is not {what}" in last and "after the model path" in last
    assert main(["rotate", str(source), option, "-o", str(tmp_path / "out.onnx"), "--calib", str(data)]) == 0
    assert (tmp_path / "out.onnx").exists()


def test_inspect_rotation_says_which_norm_outputs_would_smooth_without_data(tmp_path, capsys):
    from normpass.cli.main import main

    source = tmp_path / "model.onnx"
    onnx.save(post_ln_model(), str(source))
    assert main(["inspect", str(source), "--rotation", "--json"]) == 0
    smoothing = json.loads(capsys.readouterr().out)["smoothing"]
    assert [s["placement"] for s in smoothing["smoothed"]] == ["mul"] and smoothing["alpha"] == 0.5
    assert main(["inspect", str(source), "--rotation"]) == 0
    assert "smoothing (rotate --calib --smooth): 1 norm outputs smoothed" in capsys.readouterr().out


@pytest.mark.parametrize("reader, refused", [("Relu", False), ("MatMul", True)])
def test_a_norm_output_of_unknown_shape_is_refused_only_where_a_linear_layer_may_read_it(reader, refused):
    from normpass.onnx.rotate.driver import inspect_rotation

    helper = onnx.helper
    values = {"g": np.ones(D, np.float32), "b": np.zeros(D, np.float32), "w": np.ones((D, 4), np.float32)}
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1, name="ln"),
        helper.make_node(reader, ["n", "w"] if reader == "MatMul" else ["n"], ["r"]),
    ]
    unknown = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in ("x", "r")]  # no rank
    constants = [onnx.numpy_helper.from_array(v, k) for k, v in values.items()]
    graph = helper.make_graph(nodes, "g", unknown[:1], unknown[1:], constants)
    *_, smoothing, _ = inspect_rotation(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert not smoothing.sites
    assert smoothing.refused == ({"ln": "n has no static width; its features cannot be scaled"} if refused else {})
