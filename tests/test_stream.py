"""Carrying a linear surrogate's γ along the residual stream (normpass/core/stream.py), on both front ends.

* The algebra: a linear surrogate reading its input divided by D computes the same function.
* ONNX (`Emitter.emit_all`): a two-norm post-LN graph whose norms both become affine surrogates —
  the first emits nothing (its γ in the reader's input rows, the writer's output rows and bias
  divided by it, the second surrogate's γ multiplied by it), the second keeps one `Mul` and `Add`;
  the constants checked against the formulas and the model against the surrogates' composition in
  float64. Where the stream cannot carry γ (a DyT downstream, a γ with a zero, an fp16 model with a
  γ far from 1) the `Mul` stays.
* PyTorch (`emit`): the registry's post-LN BERT with every norm an affine surrogate keeps one
  affine module (the last); its outputs equal those with every term in its module.
* ONNX, pre-LN: the residual writers' biases leave the stream where each norm reading it is an
  affine surrogate; the norms downstream take them into β (one `Add` per site, not two), and where
  a DyT reads the stream or the stream is a graph output they stay.
* `all_norms`: the norms the exact pass folds become candidates too, so that a pre-LN model
  (ViT) and BERT come out without a single norm op, on both front ends.
"""

from __future__ import annotations

import collections
import inspect
import json

import fuzzcheck
import numpy as np
import onnx
import pytest
import torch
from conftest import build, check_structure, initializers, op_counts, randn, run_ort

from normpass import ReplaceOptions, models
from normpass.cli.main import main
from normpass.core.stream import on_scaled_input, scale_limit, stream_scale
from normpass.core.surrogates import Surrogate
from normpass.onnx.graph.frontend import load_graph
from normpass.onnx.replace.driver import replace_onnx
from normpass.onnx.replace.surrogates import Emitter, export_model
from normpass.torch.api import fold
from normpass.torch.replace import apply_surrogates, base
from normpass.torch.rewrite import RMSNormWithBias
from normpass.torch.surrogates import surrogate_modules

D = 8

STREAM = """
<ir_version: 10, opset_import: ["" : 18]>
stream (float[2, 5, 8] x, float[2, 5, 8] h) => (float[2, 5, 8] q, float[2, 5, 8] z) {
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g1, c1)
    qm = MatMul(y, Wq)
    q = Add(qm, bq)
    m3 = MatMul(h, W3)
    l3 = Add(m3, b3)
    s = Add(y, l3)
    z = LayerNormalization<axis = -1, epsilon = 0.00001>(s, g2, c2)
}
"""


def _weights(gen, dtype=np.float32, names=("g1", "c1", "Wq", "bq", "W3", "b3", "g2", "c2")):
    """Seeded constants by name: D×D matrices (W…), vectors near 1 (g…) or near 0 (the rest)."""
    return {
        n: (gen.standard_normal((D, D) if n.startswith("W") else D) * 0.5 + (n[0] == "g")).astype(dtype) for n in names
    }


def _affine(gen, shift=0.0, gamma=None) -> Surrogate:
    gamma = 1 + 0.4 * gen.standard_normal(D) if gamma is None else gamma
    return Surrogate("affine", gamma, 0.3 * gen.standard_normal(D), shift=shift)


def _emit(model, surrogates):
    ctx = load_graph(model)
    emitter = Emitter(ctx)
    emissions = emitter.emit_all(list(zip(["y", "z"], surrogates, strict=True)))
    return export_model(ctx, model, emitter.docs, {}), emissions


@pytest.mark.parametrize("kind", ["affine", "scalebias"])
def test_a_linear_surrogate_reading_its_input_scaled_computes_the_same(gen, kind):
    x = gen.standard_normal((50, D)) * 3
    gamma = np.full(D, 0.7) if kind == "scalebias" else 1 + 0.4 * gen.standard_normal(D)
    surrogate = Surrogate(kind, gamma, gen.standard_normal(D), shift=gen.standard_normal(D), alpha=0.7)
    scale = 0.5 + gen.random(D)
    scaled = on_scaled_input(surrogate, scale)
    assert scaled.kind == "affine"
    np.testing.assert_allclose(scaled(x / scale), surrogate(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError):
        on_scaled_input(Surrogate("dyt", gamma, gamma, alpha=0.5), scale)


def test_the_scale_carried_stays_within_the_dtype_s_range(gen):
    gamma = 1 + 0.4 * gen.standard_normal(D)
    assert np.array_equal(stream_scale(Surrogate("affine", gamma, gamma), D, scale_limit("float32")), gamma)
    assert stream_scale(Surrogate("affine", np.ones(D), gamma), D, 1e4) is None  # nothing to carry
    assert stream_scale(Surrogate("dyt", gamma, gamma, alpha=0.5), D, 1e4) is None  # not linear
    zero = gamma.copy()
    zero[3] = 0.0
    assert stream_scale(Surrogate("affine", zero, gamma), D, 1e4) is None
    assert stream_scale(Surrogate("affine", gamma * 20, gamma), D, scale_limit("float16")) is None
    assert stream_scale(Surrogate("affine", gamma * 20, gamma), D, scale_limit("float32")) is not None


def test_onnx_gamma_is_carried_along_the_stream_into_the_next_surrogate(gen):
    w = _weights(gen)
    model = build(STREAM, **w)
    first, second = _affine(gen, shift=0.2), _affine(gen)
    out, emissions = _emit(model, [first, second])
    check_structure(out)
    onnx.checker.check_model(out)
    assert dict(emissions["y"].ops) == {}  # c into β (linear in x), β into bq and across the Add, γ along
    assert emissions["y"].gamma.startswith("carried along the residual stream into") and "z" in emissions["y"].gamma
    assert dict(emissions["z"].ops) == {"Mul": 1, "Add": 1}  # z is a graph output: one affine at the end
    assert emissions["z"].shift == "none: the bias of l3 went into β"  # the writer's bias Add is gone
    ops = op_counts(out)
    assert ops["LayerNormalization"] == 0 and ops["Mul"] == 1 and ops["Sub"] == 0
    assert ops["Add"] == 3  # q's bias, the residual Add, the last surrogate's β (l3's bias Add went)
    new = initializers(out)
    gamma = first.gamma
    wq = next(v for k, v in new.items() if k.startswith("Wq."))
    np.testing.assert_allclose(wq, gamma[:, None] * w["Wq"], rtol=1e-6)  # readers: input rows × γ
    w3 = next(v for k, v in new.items() if k.startswith("W3."))
    np.testing.assert_allclose(w3, w["W3"] / gamma[None, :], rtol=1e-6)  # writers: output rows ÷ γ
    feeds = {"x": randn(gen, 2, 5, D), "h": randn(gen, 2, 5, D)}
    got = run_ort(out, feeds)
    y = first(feeds["x"].astype(np.float64))
    np.testing.assert_allclose(got["q"], y @ w["Wq"] + w["bq"], rtol=1e-5, atol=1e-5)
    s = y + feeds["h"].astype(np.float64) @ w["W3"] + w["b3"]
    np.testing.assert_allclose(got["z"], second(s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["dyt downstream", "a zero in γ", "float16, γ far from 1"])
def test_onnx_gamma_stays_where_the_stream_cannot_carry_it(gen, case):
    dtype = np.float16 if case.startswith("float16") else np.float32
    text = STREAM.replace("float[", "float16[") if dtype == np.float16 else STREAM
    model = build(text, **_weights(gen, dtype))
    gamma = 1 + 0.4 * gen.standard_normal(D)
    if case == "a zero in γ":
        gamma[2] = 0.0
    first = _affine(gen, gamma=gamma * 40 if dtype == np.float16 else gamma)
    second = Surrogate("dyt", gamma, gamma, alpha=0.5) if case == "dyt downstream" else _affine(gen)
    out, emissions = _emit(model, [first, second])
    assert emissions["y"].ops["Mul"] == 1 and emissions["y"].gamma == "Mul"
    assert "W3" in initializers(out)  # the writer is untouched
    feeds = {"x": randn(gen, 2, 5, D).astype(dtype), "h": randn(gen, 2, 5, D).astype(dtype)}
    s = (
        first(feeds["x"].astype(np.float64))
        + feeds["h"].astype(np.float64) @ model_weight(model, "W3")
        + model_weight(model, "b3")
    )
    tolerance = 2e-2 if dtype == np.float16 else 1e-5
    got = run_ort(out, feeds)["z"].astype(np.float64)
    np.testing.assert_allclose(got, second(s), rtol=tolerance, atol=tolerance * np.abs(second(s)).max())


PRE_LN = """
<ir_version: 10, opset_import: ["" : 18]>
pre_ln (float[2, 5, 8] x0) => (float[2, 5, 8] z, float[2, 5, 8] q) {
    n1 = LayerNormalization<axis = -1, epsilon = 0.00001>(x0, g1, c1)
    qm = MatMul(n1, Wq)
    q = Add(qm, bq)
    om = MatMul(q, Wo)
    r1 = Add(om, bo)
    x1 = Add(x0, r1)
    n2 = LayerNormalization<axis = -1, epsilon = 0.00001>(x1, g2, c2)
    fm = MatMul(n2, Wf)
    f = Add(fm, bf)
    dm = MatMul(f, Wd)
    r2 = Add(dm, bd)
    x2 = Add(x1, r2)
    z = LayerNormalization<axis = -1, epsilon = 0.00001>(x2, g3, c3)
}
"""


@pytest.mark.parametrize("case", ["all affine", "dyt last", "x1 an output"])
def test_onnx_pre_ln_writers_biases_go_along_the_stream(gen, case):
    text = PRE_LN.replace("float[2, 5, 8] q)", "float[2, 5, 8] x1)") if case == "x1 an output" else PRE_LN
    w = _weights(gen, names=("g1", "c1", "Wq", "bq", "Wo", "bo", "g2", "c2", "Wf", "bf", "Wd", "bd", "g3", "c3"))
    model = build(text, **w)
    surrogates = [_affine(gen, shift=0.1), _affine(gen, shift=0.2), _affine(gen)]
    if case == "dyt last":
        surrogates[2] = Surrogate("dyt", surrogates[2].gamma, surrogates[2].beta, alpha=0.5)
    ctx = load_graph(model)
    emitter = Emitter(ctx)
    emissions = emitter.emit_all(list(zip(["n1", "n2", "z"], surrogates, strict=True)))
    out = export_model(ctx, model, emitter.docs, {})
    check_structure(out)
    ops = op_counts(out)
    if case == "all affine":  # bo leaves the stream at n2 (into n2's β and z's), bd at z as before
        assert emissions["n2"].shift == "none: the bias of r1 went into β and along the residual stream into z"
        assert emissions["z"].shift == "none: the bias of r2 went into β"
        assert ops["Add"] == 5 and ops["Mul"] == 1  # q's, f's biases, two residual Adds, z's β; z's γ
    else:  # a DyT cannot take the bias, nor can a graph output: r1's Add stays
        assert emissions["n2"].shift == "none" and "r1" in {n.name for n in out.graph.node}
    feeds = {"x0": randn(gen, 2, 5, D)}
    got = run_ort(out, feeds)
    s1, s2, s3 = surrogates
    x0 = feeds["x0"].astype(np.float64)
    x1 = x0 + (s1(x0) @ w["Wq"] + w["bq"]) @ w["Wo"] + w["bo"]
    x2 = x1 + (s2(x1) @ w["Wf"] + w["bf"]) @ w["Wd"] + w["bd"]
    np.testing.assert_allclose(got["z"], s3(x2), rtol=1e-5, atol=1e-5)
    if case == "x1 an output":
        np.testing.assert_allclose(got["x1"], x1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["dynamo", "torchscript"])
def test_onnx_norm_free_vit_takes_the_writers_biases_off_the_stream(registry_export, form):
    """The registry's pre-LN ViT with every norm an affine surrogate: the residual writers' bias Adds
    leave the stream, and the model computes what the surrogates emitted one at a time compute."""
    from normpass.onnx.calibrate import Runner
    from normpass.onnx.replace.driver import prepare

    model = onnx.load(str(registry_export("vit", form)))
    options = ReplaceOptions(kind="affine", all_norms=True, samples=8, budget="cos=0.01", check=0.0)
    prepared = prepare(model, "synthetic", options)
    bench = prepared.bench
    surrogates = [(n, s) for n, s in _seeded([(n.name, bench.width(n.name)) for n in bench.norms]).items()]
    carried, plain, emissions = fuzzcheck.emitted_both_ways(prepared, surrogates)
    along = [n for n, e in emissions.items() if "along the residual stream" in e.shift]
    assert len(along) == len(surrogates) - 2  # not the first norm (the embeddings'), nor the last (as before)
    assert op_counts(plain)["Add"] - op_counts(carried)["Add"] == len(along)
    for batch in prepared.search.splits.batches["test"][:2]:
        want, got = Runner(plain).run(batch), Runner(carried).run(batch)
        for name, value in want.items():
            assert np.abs(got[name] - value).max() <= 1e-5 * np.abs(value).max(), name


def model_weight(model: onnx.ModelProto, name: str) -> np.ndarray:
    return initializers(model)[name].astype(np.float64)


def _bound(module, inputs) -> dict:
    return dict(inspect.signature(module.forward).bind(*inputs).arguments)


def _seeded(names_widths, kind="affine", seed=0):
    rng = np.random.default_rng(seed)
    return {n: Surrogate(kind, 1 + 0.3 * rng.standard_normal(w), 0.1 * rng.standard_normal(w)) for n, w in names_widths}


@pytest.mark.parametrize("all_norms", [False, True])
def test_torch_bert_with_affine_surrogates_keeps_one_affine_module(all_norms):
    module, inputs = models.get("bert").build_torch()
    options = ReplaceOptions(kind="affine", all_norms=all_norms)
    b = base(module, _bound(module, inputs), options, "bert")
    assert len(b.candidates) == (5 if all_norms else 4)
    surrogates = _seeded([(n.name, b.tg.zmg.shape(n.input)[-1]) for n in b.candidates])
    carried, emissions = apply_surrogates(module, inputs, surrogates, options)
    plain, _ = apply_surrogates(
        module, inputs, surrogates, ReplaceOptions(kind="affine", migrate_affine=False, all_norms=all_norms)
    )
    kept = {name: dict(e.ops) for name, e in emissions.items() if e.ops}
    last = "model.encoder.layer.1.output.LayerNorm"
    assert kept == {last: {"Mul": 1, "Add": 1}}  # addcmul: one kernel
    assert all(e.gamma.startswith("carried along the residual stream") for n, e in emissions.items() if n != last)
    modules = dict(surrogate_modules(carried))
    assert all(m.gamma is None for n, m in modules.items() if n != last)
    other = models.get("bert").make_inputs(3, 11, 5)
    with torch.no_grad():
        a, b_ = plain(*other), carried(*other)
    assert float((a - b_).abs().max() / a.abs().max()) <= 1e-5
    if not all_norms:
        assert type(carried.model.embeddings.LayerNorm) is torch.nn.RMSNorm  # the exact fold stays


def test_torch_vit_with_all_norms_affine_has_no_norm_op_but_the_last():
    """Pre-LN: every norm but the last feeds linear layers only, so γ and β go into them. The last one, a
    graph output the fold left as an `RMSNormWithBias` (its β a bias the same module adds), is replaced
    too: one affine module whose β is the surrogate's plus that bias."""
    module, inputs = models.get("vit").build_torch()
    options = ReplaceOptions(kind="affine", all_norms=True)
    b = base(module, _bound(module, inputs), options, "vit")
    last = "model.layernorm"
    assert [n.name for n in b.candidates][-1] == last and not b.declined
    surrogates = _seeded([(n.name, b.tg.zmg.shape(n.input)[-1]) for n in b.candidates])
    replaced, emissions = apply_surrogates(module, inputs, surrogates, options)
    assert len(emissions) == len(b.candidates) >= 5
    assert {n: dict(e.ops) for n, e in emissions.items() if e.ops} == {last: {"Mul": 1, "Add": 1}}  # one addcmul
    assert not [m for m in replaced.modules() if isinstance(m, torch.nn.RMSNorm | torch.nn.LayerNorm)]
    plain, _ = apply_surrogates(
        module, inputs, surrogates, ReplaceOptions(kind="affine", migrate_affine=False, all_norms=True)
    )
    with torch.no_grad():
        a, b_ = plain(*inputs), replaced(*inputs)
    assert float((a - b_).abs().max() / a.abs().max()) <= 1e-5


@pytest.mark.parametrize("name", ["vit", "swin"])
def test_torch_a_norm_the_fold_left_with_a_bias_is_replaced_with_its_bias(name):
    """Each `RMSNormWithBias` the fold leaves (ViT's last norm; Swin's embedding, last and two mid-model
    norms) replaced alone computes what the fold computes with the surrogate, plus that bias, in its place."""
    module, inputs = models.get(name).build_torch()
    options = ReplaceOptions(kind="affine", all_norms=True)
    b = base(module, _bound(module, inputs), options, name)
    folded = fold(module, inputs, beta_across_residuals=True, name=name)[0]
    kept = [n for n, m in folded.named_modules() if isinstance(m, RMSNormWithBias)]
    assert kept and set(kept) <= {n.name for n in b.candidates}
    surrogates = _seeded([(n, b.tg.zmg.shape(b.tg.zmg.norm_by_name(n).input)[-1]) for n in kept])
    for norm_name, surrogate in surrogates.items():
        replaced, emissions = apply_surrogates(module, inputs, {norm_name: surrogate}, options)
        assert dict(emissions[norm_name].ops) == {"Mul": 1, "Add": 1}  # one addcmul, no reduction
        folded = fold(module, inputs, beta_across_residuals=True, name=name)[0]
        norm = folded.get_submodule(norm_name)
        bias = norm.bias.detach().double().numpy()
        norm.register_forward_hook(
            lambda _m, args, out, s=surrogate, c=bias: torch.as_tensor(s(args[0].double().numpy()) + c, dtype=out.dtype)
        )
        with torch.no_grad():
            want, got = folded(*inputs), replaced(*inputs)
        assert float((want - got).abs().max() / want.abs().max()) <= 1e-5, norm_name


def test_onnx_replace_with_all_norms_reports_folded_norms_as_replaced(registry_export, tmp_path, capsys):
    path = registry_export("bert")
    model = onnx.load(str(path))
    options = ReplaceOptions(kind="affine", budget="cos=0.5", all_norms=True, samples=16, orders=("input",))
    result = replace_onnx(model, "synthetic", options)
    data = result.report.to_json()
    out, report = tmp_path / "norm-free.onnx", tmp_path / "report.json"
    argv = ["replace", str(path), "--with", "affine", "--all-norms", "--calib", "synthetic", "--samples", "16"]
    assert main([*argv, "--budget", "cos=0.5", "-o", str(out), "--report", str(report)]) == 0
    assert "0 of 5 norms folded exactly, 5 replaced" in capsys.readouterr().out
    assert json.loads(report.read_text())["replaced"] == 5 and out.exists()
    assert (data["total"], data["exact"], data["replaced"], data["kept"]) == (5, 0, 5, 0)
    ops = collections.Counter(n.op_type for n in result.model.graph.node)
    assert not {op for op in ops if "Normalization" in op}
    rows = {r["name"]: r for r in data["norms"]}
    carried = [r for r in rows.values() if r["emission"]["gamma"].startswith("carried")]
    assert len(carried) == 4 and all(not r["emission"]["ops"] for r in carried)
    onnx.checker.check_model(result.model)
