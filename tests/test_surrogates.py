"""Surrogate maths (normpass/core/surrogates.py, core/stats.py, core/budget.py) and their ONNX emission
(normpass/onnx/replace/surrogates.py).

The emission tests build small post-LN-shaped graphs with `onnx.parser`, emit a surrogate with
hand-set parameters, and check exactly (in float64 arithmetic, to float32 rounding) the new
constants against the formulas — shift c into the producing bias, β·W into consumer biases, β
across a residual Add, diag(γ)·W — the op structure, `onnx.checker`, and the numerics in ONNX
Runtime against `Surrogate.__call__`.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from conftest import build, check_structure, initializers, op_counts, randn, rng, run_ort

from normpass.core.analysis import prove, safe_centrings
from normpass.core.budget import Budget, Metrics, compare
from normpass.core.cost import CPU_COST
from normpass.core.plan import Centring
from normpass.core.stats import Reservoir, Welford, token_rows
from normpass.core.surrogates import (
    NormSpec,
    Surrogate,
    erf,
    fit_affine,
    fit_pointwise,
    fit_rms,
    least_squares,
    relative_error,
)
from normpass.errors import InputError
from normpass.onnx.calibrate import Runner
from normpass.onnx.graph.frontend import build_zero_mean_graph, load_graph
from normpass.onnx.replace.surrogates import Emitter, export_model, light_model, working_graph

D = 8

# --- maths ---------------------------------------------------------------------------------------


def test_welford_batched_merge_matches_float64_and_survives_a_large_offset(gen):
    data = (1e4 + gen.standard_normal((1000, D)) * 1e-2).astype(np.float32)  # mean ≫ std
    stats = Welford(D)
    for start in range(0, 1000, 37):  # uneven batches
        stats.update(data[start : start + 37])
    wide = data.astype(np.float64)
    assert stats.count == 1000
    np.testing.assert_allclose(stats.mean, wide.mean(0), rtol=1e-14)
    np.testing.assert_allclose(stats.var, wide.var(0), rtol=1e-9)
    # the two-moment estimator in float32 cancels catastrophically here (DaMN App. C)
    naive = (data * data).mean(0, dtype=np.float32) - data.mean(0, dtype=np.float32) ** 2
    assert np.abs(naive - wide.var(0)).max() > 100 * np.abs(stats.var - wide.var(0)).max()


def test_reservoir_keeps_everything_under_capacity_and_a_seeded_subset_over_it(gen):
    rows = np.arange(50 * D, dtype=np.float32).reshape(50, D)
    small = Reservoir(64, D)
    small.add(rows[:20])
    small.add(rows[20:])
    np.testing.assert_array_equal(small.sample, rows)
    picks = []
    for _ in range(2):
        big = Reservoir(10, D, seed=3)
        for start in range(0, 50, 7):
            big.add(rows[start : start + 7])
        picks.append(big.sample.copy())
    assert picks[0].shape == (10, D) and big.seen == 50
    np.testing.assert_array_equal(picks[0], picks[1])  # deterministic (aligned across passes)
    assert {tuple(r) for r in picks[0]} <= {tuple(r) for r in rows}


def test_least_squares_is_the_per_feature_regression(gen):
    u = gen.standard_normal((200, D))
    y = 1.5 * u - 0.3 + 0.01 * gen.standard_normal((200, D))
    g, h, residual = least_squares(u, y)
    for j in range(D):
        (gj, hj), _res, *_ = np.linalg.lstsq(np.stack([u[:, j], np.ones(200)], 1), y[:, j], rcond=None)
        assert g[j] == pytest.approx(gj, rel=1e-10) and h[j] == pytest.approx(hj, abs=1e-10)
    assert residual == pytest.approx(float(((g * u + h - y) ** 2).sum()), rel=1e-8)


def test_fit_affine_is_damn(gen):
    x = gen.standard_normal((300, D)) * 2 + 1
    spec = NormSpec(True, 1e-5, gen.standard_normal(D), gen.standard_normal(D))
    y = spec(x)
    sx, sy = Welford(D), Welford(D)
    sx.update(x)
    sy.update(y)
    surrogate = fit_affine(sx, sy)
    gamma = y.std(0) / x.std(0)
    np.testing.assert_allclose(surrogate.gamma, gamma, rtol=1e-12)
    np.testing.assert_allclose(surrogate.beta, y.mean(0) - gamma * x.mean(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(surrogate(x), gamma * x + surrogate.beta, rtol=1e-12)


def test_calibrated_rms_is_exact_when_the_token_mean_is_constant(gen):
    u = gen.standard_normal((400, D))
    x = u - u.mean(1, keepdims=True) + 0.75  # every token has mean 0.75
    spec = NormSpec(True, 1e-6, 1 + 0.2 * gen.standard_normal(D), 0.1 * gen.standard_normal(D))
    stats = Welford(D)
    stats.update(x)
    plain = fit_rms(x, spec(x), stats, 1e-6, spec, refit=False)
    assert plain.shift == pytest.approx(0.75, abs=1e-12)
    np.testing.assert_allclose(plain(x), spec(x), atol=1e-10)
    refit = fit_rms(x, spec(x), stats, 1e-6, spec, refit=True)
    np.testing.assert_allclose(refit(x), spec(x), atol=1e-8)
    assert relative_error(refit(x), spec(x)) < 1e-7


def test_refitted_rms_is_no_worse_than_the_mean_shift(gen):
    x = gen.standard_normal((500, D)) + gen.standard_normal((500, 1)) * 0.3 + 2.0  # token means vary
    spec = NormSpec(True, 1e-5, 1 + 0.3 * gen.standard_normal(D), 0.2 * gen.standard_normal(D))
    stats = Welford(D)
    stats.update(x)
    y = spec(x)
    assert relative_error(fit_rms(x, y, stats, 1e-5, spec, True)(x), y) <= relative_error(
        fit_rms(x, y, stats, 1e-5, spec, False)(x), y
    )


@pytest.mark.parametrize("kind", ["dyt", "derf"])
def test_pointwise_fit_recovers_known_parameters(gen, kind):
    x = gen.standard_normal((2000, D)) * 1.7
    gamma, beta = 1 + 0.5 * gen.standard_normal(D), 0.3 * gen.standard_normal(D)
    alpha, s = 0.6, (0.4 if kind == "derf" else 0.0)
    func = np.tanh if kind == "dyt" else erf
    y = gamma * func(alpha * x + s) + beta
    stats = Welford(D)
    stats.update(x)
    fitted = fit_pointwise(kind, x, y, stats)
    assert fitted.alpha == pytest.approx(alpha, rel=2e-3)
    np.testing.assert_allclose(fitted.gamma, gamma, rtol=5e-3)
    np.testing.assert_allclose(fitted(x), y, atol=2e-3)
    if kind == "derf":
        assert fitted.extra["s"] == pytest.approx(s, abs=5e-3)
        assert fitted.shift == pytest.approx(-fitted.extra["s"] / fitted.alpha)


def test_erf_matches_math_erf():
    grid = np.linspace(-4, 4, 801)
    np.testing.assert_allclose(erf(grid), [math.erf(v) for v in grid], atol=2e-7)


def test_token_rows_drop_masked_tokens():
    values = np.arange(2 * 3 * D, dtype=np.float32).reshape(2, 3, D)
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    rows = token_rows(values, mask)
    np.testing.assert_array_equal(rows, values.reshape(6, D)[[0, 1, 3]])
    np.testing.assert_array_equal(token_rows(values, None), values.reshape(6, D))


def test_budget_parse_and_usage():
    budget = Budget.parse(["cos=0.99,rel=0.1", "top1=0.9"])
    assert (budget.cos, budget.rel, budget.top1) == (0.99, 0.1, 0.9)
    metrics = Metrics(cos_min=0.995, cos_mean=0.999, rel_max=0.02, top1=0.95, samples=4)
    assert budget.usage(metrics) == pytest.approx(0.5)
    assert budget.holds(metrics) and not budget.holds(metrics, margin=0.4)
    for bad in ("cos", "cos=2", "acc=0.9", "rel=-1", "cos=x"):
        with pytest.raises(Exception, match=r"^budget "):
            Budget.parse(bad)


def test_compare_is_per_sample_and_masks_tokens():
    ref = {"y": np.array([[1.0, -1.0], [-1.0, 1.0]], dtype=np.float32)}
    got = {"y": np.array([[1.0, -1.0], [0.0, 1.0]], dtype=np.float32)}
    metrics = compare([ref], [got])
    assert metrics.cos_min == pytest.approx(1 / math.sqrt(2)) and metrics.samples == 2
    assert metrics.top1 == 1.0 and metrics.measures == {"y": "cosine"}
    tokens = {"h": np.ones((1, 2, 3), np.float32)}
    bad = {"h": np.concatenate([np.ones((1, 1, 3)), -np.ones((1, 1, 3))], 1).astype(np.float32)}
    assert compare([tokens], [bad], [np.array([[1, 0]])]).cos_min == pytest.approx(1.0)


def test_outputs_of_one_sign_are_compared_centred_so_a_shift_shows():
    """A 0–1 map whose values all move by 0.15: its plain cosine stays near 1, its centred one does not."""
    gen = rng(3)
    smooth = 0.5 + 0.2 * np.sin(np.linspace(0, 3, 64))  # values in [0.3, 0.7]
    maps = np.stack([smooth + 0.02 * randn(gen, 64) for _ in range(4)]).astype(np.float32)
    moved = np.clip(maps + 0.15 * np.linspace(-1, 1, 64), 0, 1).astype(np.float32)  # tilted by ±0.15
    plain = (maps * moved).sum(1) / np.linalg.norm(maps, axis=1) / np.linalg.norm(moved, axis=1)
    assert plain.min() > 0.97  # what the plain cosine would claim
    metrics = compare([{"map": maps}], [{"map": moved}])
    assert metrics.measures == {"map": "centred cosine (values of one sign)"}
    centred = [np.corrcoef(a, b)[0, 1] for a, b in zip(maps, moved, strict=True)]
    assert metrics.cos_min == pytest.approx(min(centred)) and metrics.cos_min < 0.9
    assert metrics.rel_max == pytest.approx((np.abs(maps - moved).max(1) / maps.max(1)).max())
    assert "centred cosine (values of one sign): map" in metrics.describe()
    assert compare([{"map": maps}], [{"map": maps}]).cos_min == pytest.approx(1.0)
    flat = np.full((2, 8), 0.5, np.float32)  # a constant sample has no shape to correlate: its plain cosine
    assert compare([{"p": flat}], [{"p": flat * 1.01}]).cos_min == pytest.approx(1.0)


def test_ids_are_compared_by_agreement_and_claim_no_cosine():
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int64)
    got = np.array([[1, 2, 0, 4], [5, 0, 0, 0]], np.int64)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    metrics = compare([{"ids": ids}], [{"ids": got}], [mask])
    assert metrics.top1 == pytest.approx(3 / 5)  # padding is no position
    assert (metrics.cos_min, metrics.cos_mean, metrics.rel_max) == (None, None, None) and metrics.samples == 2
    assert metrics.describe() == "top1 0.6000, by ids (agreement): ids"
    for budget, judged in (("top1=0.5", True), ("cos=0.99", False), ("top1=0.9,rel=0.1", False)):
        parsed = Budget.parse(budget)
        if judged:
            parsed.refuse_unjudgeable(metrics, "m")
            assert parsed.holds(metrics)
            continue
        with pytest.raises(InputError, match=r"give no figure for (cos|rel).*budget them with top1=V"):
            parsed.refuse_unjudgeable(metrics, "m")
        assert not parsed.holds(metrics)  # a term without a figure is never met


def test_samples_are_counted_once_whatever_the_number_of_outputs():
    outputs = {name: np.ones((3, 4), np.float32) * i for i, name in enumerate("abcde", 1)}
    assert compare([outputs, outputs], [outputs, outputs]).samples == 6


# --- emission ------------------------------------------------------------------------------------

BLOCK = """
<ir_version: 10, opset_import: ["" : 18]>
block (float[2, 5, 8] a, float[2, 5, 8] r, float[2, 5, 8] h) => (float[2, 5, 8] q, float[2, 5, 8] s) {
    m1 = MatMul(a, W1)
    l1 = Add(m1, b1)
    x = Add(l1, r)
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g, bb)
    qm = MatMul(y, Wq)
    q = Add(qm, bq)
    m3 = MatMul(h, W3)
    l3 = Add(m3, b3)
    s = Add(y, l3)
}
"""

LINEAR_ONLY = """
<ir_version: 10, opset_import: ["" : 18]>
lin (float[2, 5, 8] a, float[2, 5, 8] r) => (float[2, 5, 8] q, float[2, 5, 8] k) {
    m1 = MatMul(a, W1)
    l1 = Add(m1, b1)
    x = Add(l1, r)
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g, bb)
    qm = MatMul(y, Wq)
    q = Add(qm, bq)
    km = MatMul(y, Wk)
    k = Add(km, bk)
}
"""

SHARED_INPUT = """
<ir_version: 10, opset_import: ["" : 18]>
shared (float[2, 5, 8] a, float[2, 5, 8] r) => (float[2, 5, 8] y, float[2, 5, 8] x) {
    m1 = MatMul(a, W1)
    l1 = Add(m1, b1)
    x = Add(l1, r)
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g, bb)
}
"""


def _weights(gen, *names):
    values = {}
    for name in names:
        if name.startswith("W"):
            values[name] = randn(gen, D, D, scale=0.5)
        elif name == "g":
            values[name] = (1 + 0.3 * gen.standard_normal(D)).astype(np.float32)
        else:
            values[name] = randn(gen, D, scale=0.3)
    return values


def _surrogate(kind, gen) -> Surrogate:
    gamma, beta = 1 + 0.4 * gen.standard_normal(D), 0.3 * gen.standard_normal(D)
    if kind == "rms":
        return Surrogate("rms", gamma, beta, shift=0.37, epsilon=1e-5)
    if kind == "affine":
        return Surrogate("affine", gamma, beta)
    if kind == "dyt":
        return Surrogate("dyt", gamma, beta, shift=0.2 * gen.standard_normal(D), alpha=0.8)
    return Surrogate("derf", gamma, beta, shift=-0.25, alpha=0.6, extra={"s": 0.15})


def _emit(model, kind, gen, rms_op="simplified", provider="cpu"):
    ctx = load_graph(model)
    emitter = Emitter(ctx, rms_op, provider)
    norm = next(iter(emitter.norms.values()))
    surrogate = _surrogate(kind, gen)
    emission = emitter.emit(norm, surrogate)
    return export_model(ctx, model, emitter.docs, {}), surrogate, emission


def _feeds(gen, *names):
    return {n: randn(gen, 2, 5, D) for n in names}


def _close(a, b, rtol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(a - b).max() <= rtol * max(1.0, np.abs(b).max()), np.abs(a - b).max()


@pytest.mark.parametrize("kind", ["rms", "affine", "dyt", "derf"])
def test_emission_in_a_post_ln_block_is_exact(gen, kind):
    w = _weights(gen, "W1", "b1", "g", "bb", "Wq", "bq", "W3", "b3")
    model = build(BLOCK, **w)
    out, surrogate, emission = _emit(model, kind, gen)
    check_structure(out)
    new = initializers(out)
    ops = op_counts(out)
    assert ops["LayerNormalization"] == 0
    # shift c → the producing bias b1 (x feeds only the norm): b1' = b1 − c
    if surrogate.has_shift:
        assert emission.shift.startswith("migrated") and ops["Sub"] == 0
        b1 = next(v for k, v in new.items() if k.startswith("b1."))
        np.testing.assert_array_equal(b1, (w["b1"].astype(np.float64) - surrogate.shift).astype(np.float32))
    # affine (linear in x): x's bias b1 and c go into β instead, β' = β + γ ⊙ (b1 − c), and b1's Add goes
    linear = kind == "affine"
    beta = surrogate.beta + (surrogate.gamma * (w["b1"] - surrogate.shift) if linear else 0.0)
    if linear:
        assert emission.shift == "none: the bias of l1 went into β" and not any(k.startswith("b1") for k in new)
    # β → bq' = bq + β·Wq (γ stays: the residual Add cannot take it) and across the residual Add into b3
    bq = next(v for k, v in new.items() if k.startswith("bq."))
    # (β·W is computed in the weights' precision, as the layer computes its own products)
    np.testing.assert_allclose(bq, w["bq"] + beta @ w["Wq"].astype(np.float64), rtol=1e-6, atol=1e-6)
    b3 = next(v for k, v in new.items() if k.startswith("b3."))
    np.testing.assert_allclose(b3, (w["b3"].astype(np.float64) + beta).astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(new["Wq"], w["Wq"])  # γ stays, so Wq is not copied
    assert ops["Add"] == (4 if linear else 5)  # the model's own five (b1's went into β); no Add for β
    # ORT ran the residual and bias Adds inside the norm's SkipLayerNormalization: they are priced in,
    # except for rms, whose final export fuses them into SkipSimplifiedLayerNormalization again
    expected = {
        "rms": {"SkipSimplifiedLayerNormalization": 1},
        "affine": {"Mul": 1, "Add": 1},  # b1's Add went into β: the residual Add is left
        "dyt": {"Mul": 2, "Tanh": 1, "Add": 2},
        "derf": {"Mul": 2, "Erf": 1, "Add": 2},
    }[kind]
    assert dict(emission.ops) == expected and emission.unfused_adds == {"rms": 0, "affine": 1}.get(kind, 2)
    assert emission.cost < CPU_COST["SkipLayerNormalization"]
    alone = _emit(model, kind, np.random.default_rng(0), provider=None)[2]  # no provider: ops priced alone
    assert (
        dict(alone.ops)
        == {
            "rms": {"SimplifiedLayerNormalization": 1},
            "affine": {"Mul": 1},
            "dyt": {"Mul": 2, "Tanh": 1},
            "derf": {"Mul": 2, "Erf": 1},
        }[kind]
    )
    if kind == "rms":
        rms = next(n for n in out.graph.node if n.op_type == "SimplifiedLayerNormalization")
        np.testing.assert_array_equal(new[rms.input[1]], surrogate.gamma.astype(np.float32))
    # numerics: the model computes the surrogate formula
    feeds = _feeds(gen, "a", "r", "h")
    got = run_ort(out, feeds)
    x = feeds["a"].astype(np.float64) @ w["W1"] + w["b1"] + feeds["r"]
    y = surrogate(x)
    _close(got["q"], y @ w["Wq"] + w["bq"])
    _close(got["s"], y + feeds["h"].astype(np.float64) @ w["W3"] + w["b3"])


def test_affine_fully_migrates_into_linear_consumers(gen):
    w = _weights(gen, "W1", "b1", "g", "bb", "Wq", "bq", "Wk", "bk")
    model = build(LINEAR_ONLY, **w)
    out, surrogate, emission = _emit(model, "affine", gen)
    check_structure(out)
    # nothing is emitted: b1's Add went into β, what is left is the residual Add ORT fused into the norm
    assert dict(emission.ops) == {"Add": 1} and emission.unfused_adds == 1 and emission.cost == CPU_COST["Add"]
    assert collections.Counter(n.op_type for n in out.graph.node) == collections.Counter({"MatMul": 3, "Add": 3})
    new = initializers(out)
    beta = surrogate.beta + surrogate.gamma * w["b1"]  # γ ⊙ (x' + b1) + β
    for name in ("q", "k"):
        weight = next(v for k, v in new.items() if k.startswith(f"W{name}."))
        bias = next(v for k, v in new.items() if k.startswith(f"b{name}."))
        wide = w[f"W{name}"].astype(np.float64)
        np.testing.assert_allclose(weight, surrogate.gamma[:, None] * wide, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(bias, w[f"b{name}"] + beta @ wide, rtol=1e-6, atol=1e-6)
    feeds = _feeds(gen, "a", "r")
    got = run_ort(out, feeds)
    y = surrogate(feeds["a"].astype(np.float64) @ w["W1"] + w["b1"] + feeds["r"])
    _close(got["q"], y @ w["Wq"] + w["bq"])
    _close(got["k"], y @ w["Wk"] + w["bk"])


def test_shift_is_a_sub_and_affine_stays_when_tensors_are_shared(gen):
    w = _weights(gen, "W1", "b1", "g", "bb")
    model = build(SHARED_INPUT, **w)  # x is a graph output, y too
    out, surrogate, emission = _emit(model, "rms", gen)
    check_structure(out)
    assert emission.shift == "Sub" and emission.beta == "Add"
    assert dict(emission.ops) == {"Sub": 1, "SimplifiedLayerNormalization": 1, "Add": 1}
    np.testing.assert_array_equal(initializers(out)["b1"], w["b1"])  # untouched
    feeds = _feeds(gen, "a", "r")
    got = run_ort(out, feeds)
    x = feeds["a"].astype(np.float64) @ w["W1"] + w["b1"] + feeds["r"]
    _close(got["x"], x)
    _close(got["y"], surrogate(x))


def test_input_centring_is_exact_and_removes_the_linear_mean(gen):
    w = _weights(gen, "W1", "b1", "g", "bb", "Wq", "bq", "W3", "b3")
    model = build(BLOCK, **w)
    ctx = load_graph(model)
    emitter = Emitter(ctx)
    norm = next(iter(emitter.norms.values()))
    assert sorted(emitter.centre_inputs(norm)) == ["l1", "m1"]
    out = export_model(ctx, model, emitter.docs, {})
    new = initializers(out)
    w1 = next(v for k, v in new.items() if k.startswith("W1."))
    b1 = next(v for k, v in new.items() if k.startswith("b1."))
    np.testing.assert_allclose(w1.astype(np.float64).mean(1), 0, atol=1e-7)
    assert abs(b1.astype(np.float64).mean()) < 1e-7
    feeds = _feeds(gen, "a", "r", "h")
    before, after = run_ort(model, feeds), run_ort(out, feeds)
    for name in before:
        _close(after[name], before[name], rtol=1e-5)


@pytest.mark.parametrize(
    "text, ops",
    [
        # γ stays: the chain's last Mul (and the Adds ORT fused into the norm run alone)
        (BLOCK, {"Mul": 2, "ReduceMean": 1, "Add(ε)": 1, "Sqrt": 1, "Div": 1, "Add": 2}),
        # γ/β migrate: it ends at the Div
        (LINEAR_ONLY, {"Mul": 1, "ReduceMean": 1, "Add(ε)": 1, "Sqrt": 1, "Div": 1, "Add": 2}),
    ],
)
def test_decomposed_rms_core_is_the_exact_pass_chain(gen, text, ops):
    w = _weights(gen, "W1", "b1", "g", "bb", "Wq", "bq", "Wk", "bk", "W3", "b3")
    model = build(text, **{k: v for k, v in w.items() if k in text})
    out, surrogate, emission = _emit(model, "rms", gen, rms_op="decomposed")
    check_structure(out)
    assert dict(emission.ops) == ops and op_counts(out)["ReduceMean"] == 1
    feeds = _feeds(gen, "a", "r", "h")
    got = run_ort(out, {k: v for k, v in feeds.items() if k in text.split("=>")[0]})
    y = surrogate(feeds["a"].astype(np.float64) @ w["W1"] + w["b1"] + feeds["r"])
    _close(got["q"], y @ w["Wq"] + w["bq"])


# l1 is also read by a Relu: centring W1 or b1 would change o. m2 is summed in privately, and the
# graph input r blocks the proof: the analysis still finds m2 safe to centre.
PARTIAL = """
<ir_version: 10, opset_import: ["" : 18]>
partial (float[2, 5, 8] a, float[2, 5, 8] h, float[2, 5, 8] r) => (float[2, 5, 8] y, float[2, 5, 8] o) {
    m1 = MatMul(a, W1)
    l1 = Add(m1, b1)
    o = Relu(l1)
    m2 = MatMul(h, W2)
    s = Add(l1, m2)
    x = Add(s, r)
    y = LayerNormalization<axis = -1, epsilon = 0.00001>(x, g, bb)
}
"""


def test_safe_centrings_of_an_unprovable_norm_leave_out_the_unsafe_ones(gen):
    w = _weights(gen, "W1", "b1", "W2", "g", "bb")
    model = build(PARTIAL, **w)
    ctx = load_graph(model)
    zmg = build_zero_mean_graph(ctx)
    (norm,) = zmg.norms
    proof = prove(zmg, norm)
    assert proof.blockers and {c.node for c in proof.centrings} == {"m1", "l1", "m2"}
    assert safe_centrings(zmg, norm) == [Centring("m2", 2)]
    emitter = Emitter(ctx)
    assert emitter.centre_inputs(emitter.norms["y"]) == ["m2"]
    out = export_model(ctx, model, emitter.docs, {})
    new = initializers(out)
    assert "W1" in new and "b1" in new and not any(k.startswith(("W1.", "b1.")) for k in new)
    np.testing.assert_array_equal(new["W1"], w["W1"])
    w2 = next(v for k, v in new.items() if k.startswith("W2."))
    np.testing.assert_allclose(w2.astype(np.float64).mean(1), 0, atol=1e-7)
    feeds = _feeds(gen, "a", "h", "r")
    before, after = run_ort(model, feeds), run_ort(out, feeds)
    for name in before:
        _close(after[name], before[name], rtol=1e-5)


def test_light_model_runs_like_the_full_one(gen):
    w = _weights(gen, "W1", "b1", "g", "bb", "Wq", "bq", "W3", "b3")
    w["W1"] = randn(gen, D, D)  # 64 elements: make it "large" with a small limit
    model = build(BLOCK, **w)
    ctx = load_graph(model)
    light, feeds = light_model(working_graph(model, ctx.shapes), model, {"x": np.float32}, {}, limit=16)
    assert "W1" in feeds and "W1" not in {i.name for i in light.graph.initializer}
    inputs = _feeds(gen, "a", "r", "h")
    got = Runner(light, feeds).run(inputs)
    expected = run_ort(model, inputs)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
    np.testing.assert_allclose(got["x"], inputs["a"] @ w["W1"] + w["b1"] + inputs["r"], rtol=1e-5, atol=1e-5)


def test_light_models_sharing_a_cache_take_each_trial_s_own_migrated_weights(gen):
    """γ migrated into a 1 MiB weight is computed when written (a lazy tensor, named alike in
    every trial): the cache of source weights must not hand one trial's weight to the next."""
    width = 512  # Wq: 512 × 512 float32 = 1 MiB
    text = LINEAR_ONLY.replace("2, 5, 8", f"2, 5, {width}")
    w = {n: randn(gen, width, width, scale=0.05) for n in ("W1", "Wq", "Wk")}
    w |= {n: randn(gen, width, scale=0.3) for n in ("b1", "bq", "bk", "bb")} | {"g": 1 + randn(gen, width, scale=0.3)}
    model = build(text, **w)
    ctx = load_graph(model)
    cache: dict = {}
    inputs = {n: randn(gen, 2, 5, width) for n in ("a", "r")}
    x = inputs["a"].astype(np.float64) @ w["W1"] + w["b1"] + inputs["r"]
    for scale in (1.5, 0.5):
        working = working_graph(model, ctx.shapes, dtypes=ctx.dtypes)
        emitter = Emitter(working)
        surrogate = Surrogate("affine", np.full(width, scale), np.zeros(width))
        emitter.emit(emitter.norms["y"], surrogate)
        light, feeds = light_model(working, model, None, cache)
        got = Runner(light, feeds).run(inputs)
        _close(got["q"], surrogate(x) @ w["Wq"] + w["bq"], rtol=1e-4)
