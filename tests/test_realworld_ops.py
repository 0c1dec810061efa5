"""The analysis on graphs as real exporters write them: run-time initializers, shape readers,
constant subgraphs, more zero-mean-preserving ops, and handlers that never raise."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import assert_equivalent, build, check_structure, randn, run_ort
from normpass import FoldOptions, fold_onnx, inspect_onnx

OPSET = '<ir_version: 10, opset_import: ["" : 17]>'


def _fold(model, **options):
    return fold_onnx(model, FoldOptions(fold_with_beta_add=True, **options))


def _decision(plan, name):
    return next(d for d in plan.decisions if d.name == name)


# --- overridable initializers --------------------------------------------------------------------

PRE_LN = OPSET + """
m (float[2,4,8] x, float[8,8] W0) => (float[2,4,8] y) {
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n = LayerNormalization<axis=-1>(h, g, be)
  y0 = MatMul(n, W1)
  y = Add(y0, b1)
}"""


def _pre_ln(gen, **extra):
    return build(PRE_LN, W0=randn(gen, 8, 8), b0=randn(gen, 8), g=randn(gen, 8), be=randn(gen, 8),
                 W1=randn(gen, 8, 8), b1=randn(gen, 8), **extra)


def test_initializer_listed_as_input_is_a_runtime_input(gen):
    model = _pre_ln(gen)
    result = _fold(model)
    assert result.folded == 0
    assert "W0" in _decision(result.plan, "n").reason
    assert [i.name for i in result.model.graph.input] == ["x", "W0"]
    assert [i.type for i in result.model.graph.input] == [i.type for i in model.graph.input]
    check_structure(result.model)
    feeds = {"x": randn(gen, 2, 4, 8, scale=3.0), "W0": randn(gen, 8, 8) + 1.0}  # an override
    expected, got = run_ort(model, feeds), run_ort(result.model, feeds)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-5)
    assert_equivalent(model, result.model)  # the defaults, as the model runs without an override


def test_overridable_consumer_weight_is_no_migration_target(gen):
    """W1 can be overridden: γ/β must stay out of it, and the folded model must still take it."""
    model = build(PRE_LN.replace("float[8,8] W0)", "float[8,8] W1)"), W0=randn(gen, 8, 8), b0=randn(gen, 8),
                  g=randn(gen, 8), be=randn(gen, 8), W1=randn(gen, 8, 8), b1=randn(gen, 8))
    result = _fold(model)
    assert result.folded == 1
    assert "migrated" not in (result.affine_notes["n"] or "")
    assert [i.name for i in result.model.graph.input] == ["x", "W1"]
    feeds = {"x": randn(gen, 2, 4, 8, scale=3.0), "W1": randn(gen, 8, 8) + 1.0}
    expected, got = run_ort(model, feeds), run_ort(result.model, feeds)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-4, atol=1e-4)


def test_overridable_gamma_declines_the_norm(gen):
    model = build(PRE_LN.replace("float[8,8] W0)", "float[8] g)"), W0=randn(gen, 8, 8), b0=randn(gen, 8),
                  g=randn(gen, 8), be=randn(gen, 8), W1=randn(gen, 8, 8), b1=randn(gen, 8))
    result = _fold(model)
    assert result.folded == 0
    assert "run time" in _decision(result.plan, "n").reason
    assert [i.name for i in result.model.graph.input] == ["x", "g"]
