"""Recovery after slicing (`slice --recover SECONDS`): the refit algebra, and the refit on sliced ONNX models."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import build, check_structure, randn, rng
from test_patterns import header
from test_slice import files  # noqa: F401  (a fixture)

from normpass import BudgetMissed, SliceOptions, slice_onnx
from normpass.cli.main import main
from normpass.core.refit import NormalEquations
from normpass.models import get
from normpass.models.reference import entry_feeds
from normpass.onnx.slice import recover as recover_module

# --- the algebra --------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_the_refit_is_lstsq_when_the_ridge_vanishes_and_the_cut_when_it_dominates(bias):
    gen = rng(0)
    x = randn(gen, 300, 6)
    y = x @ randn(gen, 6, 4) + (randn(gen, 4) if bias else 0) + 0.1 * randn(gen, 300, 4)
    eq = NormalEquations(6, 4, bias)
    for chunk_x, chunk_y in zip(np.array_split(x, 4), np.array_split(y, 4), strict=True):
        eq.add(chunk_x.astype(np.float32), chunk_y)  # streamed, any float dtype
    assert eq.rows == 300
    design = np.hstack([x.astype(np.float32), np.ones((300, 1))]) if bias else x.astype(np.float32)
    expected = np.linalg.lstsq(design.astype(np.float64), y, rcond=None)[0]
    start_w, start_b = randn(gen, 6, 4), randn(gen, 4)
    weight, fitted_bias = eq.solve(start_w, start_b if bias else None, ridge=1e-12)
    assert np.allclose(weight, expected[:6], atol=1e-8)
    if bias:
        assert np.allclose(fitted_bias, expected[6], atol=1e-8)
    else:
        assert fitted_bias is None
    weight, fitted_bias = eq.solve(start_w, start_b if bias else None, ridge=1e9)
    assert np.allclose(weight, start_w, atol=1e-5)
    # a ridge in between solves (G + λI)·W = H + λ·W₀ with λ a share of the mean energy per column
    columns = 7 if bias else 6
    strength = 0.5 * np.trace(design.T.astype(np.float64) @ design) / columns
    start = np.vstack([start_w, start_b]) if bias else start_w
    exact = np.linalg.solve(design.T @ design + strength * np.eye(columns), design.T @ y + strength * start)
    weight, _ = eq.solve(start_w, start_b if bias else None, ridge=0.5)
    assert np.allclose(weight, exact[:6], atol=1e-8)


def test_the_validated_ridge_keeps_the_cut_on_noise_and_refits_on_signal():
    """Per layer, λ (or the cut itself) is chosen by two-fold validation on the calibration rows alone."""
    gen = rng(2)
    x, start = randn(gen, 400, 6), randn(gen, 6, 3)
    noise = NormalEquations(6, 3, bias=False)
    signal = NormalEquations(6, 3, bias=False)
    truth = randn(gen, 6, 3)
    for fold, rows in enumerate(np.array_split(np.arange(400), 2)):
        noise.add(x[rows], x[rows] @ start + 2 * randn(gen, len(rows), 3), fold)  # the cut is right: noise only
        signal.add(x[rows], x[rows] @ truth + 0.01 * randn(gen, len(rows), 3), fold)
    weight, bias, ridge = noise.refit(start, None)
    assert ridge is None and weight is start and bias is None  # a fit would follow the noise: the cut stays
    weight, _, ridge = signal.refit(start, None)
    assert ridge is not None and ridge <= 1e-2 and np.allclose(weight, truth, atol=1e-2)
    assert np.allclose(weight, signal.solve(start, None, ridge)[0])  # refit on both folds at the chosen λ
    one_fold = NormalEquations(6, 3, bias=False)
    one_fold.add(x, x @ truth)
    assert one_fold.refit(start, None)[2] is None  # nothing to validate on: the cut stays


# --- on sliced models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(registry_model):
    model = registry_model("gpt2")
    return model, entry_feeds(get("gpt2"), model, batch=64, seq=16)  # 48 fit, 16 held out


# the share of 1 − cos mean that recovery leaves, at most: measured 0.93 (stream, λ validated), 0.87 (stream,
# 10⁻³); 0.92 (layer, 10⁻³) with the one-pass layer fit, 0.98 with the sequential one, whose bases already
# follow the cut (held-out rel max 0.098 → 0.095)
@pytest.mark.parametrize("basis, ridge, left", [("stream", None, 0.95), ("stream", 1e-3, 0.95), ("layer", 1e-3, 0.99)])
def test_recovery_lowers_the_held_out_error_of_a_sliced_model(gpt2, basis, ridge, left):
    model, feeds = gpt2
    plain = slice_onnx(model, feeds, SliceOptions(ratio=0.5, basis=basis), name="gpt2")
    options = SliceOptions(ratio=0.5, basis=basis, recover=600, recover_ridge=ridge)
    result = slice_onnx(model, feeds, options, name="gpt2")
    recovery = result.chosen.recovery
    assert plain.chosen.recovery is None and recovery is not None and recovery.complete
    # every block's QKV (one Gemm), attention output, fc1, fc2 and the head (and the layer basis's shortcuts)
    assert len(recovery.refit) == 2 * 4 + 1 + (4 if basis == "layer" else 0)
    assert recovery.held_out_before == plain.held_out  # the same cut before recovery
    before, after = recovery.held_out_before, result.held_out
    assert after is recovery.held_out_after and after.samples == before.samples
    assert 1 - after.cos_mean < left * (1 - before.cos_mean), (before, after)
    assert after.cos_min > before.cos_min and after.rel_max < before.rel_max
    assert result.chosen.parameters == plain.chosen.parameters  # refit in place: same shapes, no tensor kept twice
    report = result.report()["slice"]["recovery"]
    assert report["refit"] == report["layers"] == len(recovery.refit) and report["complete"]
    assert set(report["ridges"]) == set(recovery.refit) and (ridge is None or set(report["ridges"].values()) == {ridge})
    assert report["tokens"] == 48 * 16  # the fitting split's tokens: 48 of the 64 sequences of 16
    check_structure(result.model)


def test_the_budget_judges_the_recovered_model(gpt2):
    """cos = 0.9987 lies between the cut's worst held-out sample (0.99868) and the recovered one's (0.99873)."""
    model, feeds = gpt2
    with pytest.raises(BudgetMissed):
        slice_onnx(model, feeds, SliceOptions(ratio=0.5, basis="stream", budget="cos=0.9987"), name="gpt2")
    result = slice_onnx(
        model, feeds, SliceOptions(ratio=0.5, basis="stream", budget="cos=0.9987", recover=600), name="gpt2"
    )
    assert result.chosen.budget_met and result.chosen.recovery.held_out_before.cos_min < 0.9987


def test_the_time_limit_stops_recovery_and_the_report_says_so(gpt2):
    model, feeds = gpt2
    result = slice_onnx(model, feeds, SliceOptions(ratio=0.5, basis="stream", recover=1e-9), name="gpt2")
    recovery = result.chosen.recovery
    assert recovery is not None and recovery.refit == [] and not recovery.complete and recovery.layers
    assert result.held_out == recovery.held_out_before  # nothing refit: the cut as it was
    assert "refit 0 of 9 linear layers" in recovery.describe() and "time limit of 1e-09 s" in recovery.describe()


def test_ratio_zero_applies_no_recovery_and_stays_exact(gpt2):
    model, feeds = gpt2
    result = slice_onnx(model, feeds, SliceOptions(ratio=0.0, recover=600), name="gpt2")
    assert result.chosen.recovery is None and result.report()["slice"]["recovery"] is None
    assert result.comparison is not None and result.comparison.passed


def test_layers_that_do_not_read_each_other_are_refit_from_one_run():
    """Two readers of x (as Q, K and V) form one group; a layer reading their sum waits for the next run."""
    gen = rng(1)
    model = build(
        f"""{header()}
agraph (float[2, 4] x) => (float[2, 3] y) {{
  a = MatMul(x, wa)
  b = Gemm(x, wb, cb)
  s = Add(a, b)
  r = Relu(x)
  c = MatMul(r, wc)
  t = Add(s, c)
  y = MatMul(t, wy)
}}""",
        wa=randn(gen, 4, 4),
        wb=randn(gen, 4, 4),
        cb=randn(gen, 4),
        wc=randn(gen, 4, 4),
        wy=randn(gen, 4, 3),
    )
    layers = recover_module.linear_layers(ir.from_proto(model))
    assert set(layers) == {"a", "b", "c", "y"} and layers["b"].bias is not None and layers["a"].bias is None
    groups = recover_module._independent_groups(ir.from_proto(model), {"a", "b", "c", "y"})
    assert groups == [["a", "b", "c"], ["y"]]
    assert recover_module._independent_groups(ir.from_proto(model), {"a", "y"}) == [["a"], ["y"]]


# --- the command line ---------------------------------------------------------------------------


def test_cli_recover_refits_and_reports(files, capsys):  # noqa: F811
    tmp, _, calib = files
    out, report = tmp / "out.onnx", tmp / "report.json"
    argv = [
        "slice",
        str(tmp / "full.onnx"),
        "-o",
        str(out),
        "--calib",
        str(calib),
        "--ratio",
        "0.5",
        "--basis",
        "stream",
    ]
    assert main([*argv, "--recover", "60", "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(report.read_text())["slice"]
    assert data["recovery"]["complete"] and data["recovery"]["refit"] == 3  # fc1, fc2 and the head
    assert "recovery refit 3 of 3 linear layers" in printed
    assert data["recovery"]["held_out_after"]["cos_mean"] > data["recovery"]["held_out_before"]["cos_mean"]
    check_structure(onnx.load(str(out)))


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_cli_recover_refuses_a_bad_limit_with_one_line_and_exit_2(files, capsys, value):  # noqa: F811
    tmp, path, calib = files
    argv = ["slice", str(path), "-o", str(tmp / "out.onnx"), "--calib", str(calib), "--ratio", "0.5"]
    assert main([*argv, "--recover", value]) == 2
    err = capsys.readouterr().err
    assert "--recover" in err and err.count("\n") == 1, err
    assert not (tmp / "out.onnx").exists()
