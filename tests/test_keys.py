"""Key centring (`normpass/onnx/rotate/keys.py`, `normpass rotate --calib`): attention's key bias moves by the
mean key, exactly (softmax ignores a constant per row), where the proof holds; refused with the node
and the reason where it does not.

Each centred model is checked by `rotate_onnx`'s own verification and by an ONNX Runtime run on other
inputs (`assert_equivalent`); that the keys are centred is read off the model run with the keys as an
extra output.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import assert_equivalent, build, check_structure, randn, rng, run_ort
from test_patterns import beta, gamma, header

from normpass import RotateOptions, rotate_onnx
from normpass.onnx.calibrate import synthetic_batches

D, T, H = 8, 5, 2  # width, tokens, heads (of D // H features each)

BLOCK = """
  n = LayerNormalization<axis=-1>(x, g, b)
  qm = MatMul(n, wq)
  q = Add(qm, bq)
  km = MatMul(n, wk)
  k = {key}
  vm = MatMul(n, wv)
  v = Add(vm, bv)
  qh = Reshape(q, split)
  kh = Reshape(k, split)
  vh = Reshape(v, split)
  qt = Transpose<perm=[0, 2, 1, 3]>(qh)
  kt = Transpose<perm={kperm}>(kh)
  vt = Transpose<perm=[0, 2, 1, 3]>(vh)
  s = MatMul({scores})
  ss = Mul(s, scale)
  sm = {masked}
  p = Softmax<axis={axis}>(sm)
  o = MatMul({pv})
  ot = Transpose<perm=[0, 2, 1, 3]>(o)
  om = Reshape(ot, merge)
  a = MatMul(om, wo)
  ab = Add(a, bo)
  y = Add(x, ab)
"""


def attention_model(
    key="Add(km, bk)",
    kperm="[0, 2, 3, 1]",
    scores="qt, kt",
    masked="Add(ss, mask)",
    axis=-1,
    pv="p, vt",
    outputs="",
    inputs="",
) -> onnx.ModelProto:
    """A pre-LN attention block over a D-wide stream, heads split by `Reshape`, an additive mask.

    The keyword arguments replace one piece each, to break one step of the proof."""
    gen = rng(4)
    values = dict(
        g=gamma(gen, D),
        b=beta(gen, D),
        **{f"w{n}": randn(gen, D, D) for n in "qkvo"},
        **{f"b{n}": randn(gen, D) for n in "qkvo"},
        split=np.array([0, 0, H, D // H], dtype=np.int64),
        merge=np.array([0, 0, D], dtype=np.int64),
        scale=np.array(0.5, dtype=np.float32),
    )
    body = BLOCK.format(key=key, kperm=kperm, scores=scores, masked=masked, axis=axis, pv=pv)
    return build(
        f"""{header()}
agraph (float[B, {T}, {D}] x, float[B, 1, 1, {T}] mask{inputs}) => (float[B, {T}, {D}] y{outputs}) {{
{body}
}}""",
        **values,
    )


def calibration(samples: int = 16, offset: float = 2.0) -> list[dict]:
    """Inputs whose features have a common offset, so that the keys have a mean far from zero."""
    gen = rng(7)
    x = randn(gen, samples, T, D) + offset * randn(gen, D)
    return [{"x": x.astype(np.float32), "mask": np.zeros((samples, 1, 1, T), np.float32)}]


def mean_key(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """The keys' mean per feature over `feeds` (the model run with `k` as an extra output)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info("k", onnx.TensorProto.FLOAT, None))
    return run_ort(probe, feeds)["k"].reshape(-1, D).mean(0)


def centred(model: onnx.ModelProto, data=None):
    before = model.SerializeToString()
    result = rotate_onnx(model, RotateOptions(calib=data or calibration()))
    assert model.SerializeToString() == before, "rotate_onnx modified its input model"
    assert result.comparison is not None and result.comparison.passed, result.comparison
    check_structure(result.model)
    assert_equivalent(model, result.model)
    return result


def test_the_key_bias_takes_the_mean_key_and_the_attention_is_unchanged():
    model = attention_model()
    result = centred(model)
    assert len(result.keys.sites) == 1 and not result.keys.refused
    feeds = calibration()[0]
    assert np.abs(mean_key(model, feeds)).max() > 1.0  # the original's keys are far from centred
    assert np.abs(mean_key(result.model, feeds)).max() < 1e-4  # on the calibration data, centred
    assert "key bias centred" in next(n.doc_string for n in result.model.graph.node if "k" in n.output)
    assert result.report()["keys"]["centred"][0]["bias_add"]
    # no op is added: the same node types as without calibration data
    plain = rotate_onnx(model, RotateOptions())
    assert sorted(n.op_type for n in plain.model.graph.node) == sorted(n.op_type for n in result.model.graph.node)
    assert plain.keys is None and "keys" not in plain.report()


def test_a_bias_shared_with_another_layer_keeps_its_values_there():
    # bk is also the query's bias: the key gets a centred copy, the query keeps bk
    model = attention_model(key="Add(km, bq)")
    result = centred(model)
    assert len(result.keys.sites) == 1
    names = {n.output[0]: list(n.input) for n in result.model.graph.node}
    assert names["q"][1] != names["k"][1]


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(outputs=", float[B, 5, 8] k"), "k is a graph output"),
        (dict(axis=2), "does not normalise the last axis"),
        (dict(masked="Tanh(ss)"), "(Tanh) stands between the scores and the Softmax"),
        (dict(key="Identity(km)"), "(Identity) stands between the keys and the scores"),
        (dict(key="MatMul(n, wk)"), "have no bias Add to take the shift"),
        (dict(key="Add(km, bias)", inputs=", float[B, 1, 8] bias"), "adds no constant bias to the keys"),
        (dict(masked="Add(ss, ss)"), "ss is also read by"),
        # the keys with their features last: a Softmax over them would see the shift
        (
            dict(
                kperm="[0, 2, 1, 3]",
                scores="probs, kt",
                masked="Mul(ss, scale)",
                pv="p, square",
                inputs=", float[B, 2, 5, 5] probs, float[B, 2, 4, 4] square",
            ),
            "the keys' features reach the last axis",
        ),
    ],
)
def test_attention_that_the_proof_does_not_cover_is_refused_with_the_reason(change, reason):
    model = attention_model(**change)
    data = calibration()
    if "inputs" in change:
        data = [data[0] | {k: v for k, v in synthetic_batches(model, 16, 16)[0].items() if k not in data[0]}]
    result = centred(model, data)
    assert not result.keys.sites
    assert any(reason in r for r in result.keys.refused.values()), result.keys.refused


@pytest.mark.parametrize(
    "name, form, sites",
    [
        ("vit", "torchscript", 2),
        ("vit", "dynamo", 2),  # the heads merged into the batch by a Reshape
        ("bert", "torchscript", 2),
        ("bert", "dynamo", 2),
        ("swin", "dynamo", 4),  # a relative position bias and a window mask added to the scores
    ],
)
def test_registry_encoders_centre_every_attention(registry_model, name, form, sites):
    model = registry_model(name, form)
    result = rotate_onnx(model, RotateOptions(calib=synthetic_batches(model, 16, 8)), name=name)
    assert result.comparison.passed and len(result.keys.sites) == sites and not result.keys.refused


@pytest.mark.parametrize(
    "name, form, reason",
    [
        ("gpt2", "torchscript", "is also read by"),  # the keys are also returned (the cache)
        ("gpt2", "dynamo", "(Split) stands between the keys and the scores"),  # one fused QKV layer
        ("llama", "dynamo", "(Expand) stands between the keys and the scores"),  # grouped-query heads
    ],
)
def test_registry_decoders_are_refused_with_the_reason(registry_model, name, form, reason):
    model = registry_model(name, form)
    result = rotate_onnx(model, RotateOptions(calib=synthetic_batches(model, 16, 8)), name=name)
    assert result.comparison.passed and not result.keys.sites
    assert all(reason in r for r in result.keys.refused.values()), result.keys.refused


def test_cli_rotate_calib_centres_keys_and_reports_it(tmp_path, capsys):
    from normpass.cli.main import main

    source, data = tmp_path / "model.onnx", tmp_path / "calib.npz"
    onnx.save(attention_model(), str(source))
    np.savez(data, **calibration()[0])
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main(["rotate", str(source), "-o", str(out), "--calib", str(data), "--report", str(report)]) == 0
    assert "keys centred in 1 of 1 attentions" in capsys.readouterr().out
    found = json.loads(report.read_text())
    assert found["verified"] and len(found["keys"]["centred"]) == 1 and not found["keys"]["refused"]
    assert np.abs(mean_key(onnx.load(str(out)), calibration()[0])).max() < 1e-4


def test_cli_rotate_refuses_calibration_data_that_does_not_fit(tmp_path, capsys):
    from normpass.cli.main import main

    source, data = tmp_path / "model.onnx", tmp_path / "calib.npz"
    onnx.save(attention_model(), str(source))
    np.savez(data, x=np.zeros((16, T, D + 1), np.float32), mask=np.zeros((16, 1, 1, T), np.float32))
    assert main(["rotate", str(source), "-o", str(tmp_path / "out.onnx"), "--calib", str(data)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration batch 0" in err[0]
    assert not (tmp_path / "out.onnx").exists()


def test_inspect_rotation_says_whose_keys_would_centre_without_data(tmp_path, capsys):
    from normpass.cli.main import main

    for name, model, centred in (
        ("ok", attention_model(), 1),
        ("graph-output", attention_model(outputs=", float[B, 5, 8] k"), 0),
    ):
        source = tmp_path / f"{name}.onnx"
        onnx.save(model, str(source))
        assert main(["inspect", str(source), "--rotation", "--json"]) == 0
        keys = json.loads(capsys.readouterr().out)["keys"]
        assert len(keys["centred"]) == centred and len(keys["refused"]) == 1 - centred
        assert main(["inspect", str(source), "--rotation"]) == 0
        printed = capsys.readouterr().out
        assert f"key centring (rotate --calib): {centred} of 1 attentions" in printed
        assert ("k is a graph output" in printed) == (not centred)
