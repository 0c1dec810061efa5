"""normpass.core.algebra: the NumPy weight maths behind centring and γ/β migration."""

from __future__ import annotations

import numpy as np
import pytest

from normpass.core.algebra import centre, has_zero_mean, is_uniform, migrate_affine


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize(
    "shape,axis", [((7, 5), 0), ((7, 5), 1), ((3, 4, 6), 2), ((3, 4, 6), 0), ((9,), 0), ((2, 5), -1)]
)
def test_centre_zero_sums_along_axis_keeps_shape_and_dtype(shape, axis, dtype):
    values = (np.random.default_rng(1).standard_normal(shape) * 3 + 2).astype(dtype)
    centred = centre(values, axis)
    assert centred.shape == values.shape
    assert centred.dtype == values.dtype
    sums = centred.astype(np.float64).sum(axis=axis)
    bound = np.finfo(dtype).eps * np.abs(values.astype(np.float64)).sum(axis=axis) * 4
    assert np.all(np.abs(sums) <= bound), (sums, bound)
    # it is values minus their mean, not just any zero-mean array
    expected = values.astype(np.float64) - values.astype(np.float64).mean(axis=axis, keepdims=True)
    np.testing.assert_allclose(centred.astype(np.float64), expected, rtol=0, atol=float(np.finfo(dtype).eps) * 16)


def test_centre_does_not_modify_its_input():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    before = values.copy()
    centre(values, 1)
    np.testing.assert_array_equal(values, before)


def test_centre_axis_none_gives_zeros():
    values = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32) + 5
    centred = centre(values, None)
    assert centred.shape == values.shape and centred.dtype == values.dtype
    assert not centred.any()


def test_centre_removes_per_row_offsets_only_along_its_axis():
    base = np.random.default_rng(3).standard_normal((6, 4))
    offsets = np.arange(6, dtype=np.float64)[:, None] * 10
    # a constant along axis 1 disappears when centring along axis 1 ...
    np.testing.assert_allclose(centre(base + offsets, 1), centre(base, 1), atol=1e-12)
    # ... but not when centring along axis 0
    assert np.abs(centre(base + offsets, 0) - centre(base, 0)).max() > 1


def _affine_case(seed, in_features=6, out_features=5, batch=7, with_bias=True, with_gamma=True, with_beta=True):
    gen = np.random.default_rng(seed)
    x = gen.standard_normal((batch, in_features))
    gamma = 1 + 0.3 * gen.standard_normal(in_features) if with_gamma else None
    beta = 0.3 * gen.standard_normal(in_features) if with_beta else None
    weight = gen.standard_normal((in_features, out_features))
    bias = gen.standard_normal(out_features) if with_bias else None
    return x, gamma, beta, weight, bias


def _reference(x, gamma, beta, weight_in_out, bias):
    h = x * (1 if gamma is None else gamma) + (0 if beta is None else beta)
    return h @ weight_in_out + (0 if bias is None else bias)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_gamma,with_beta", [(True, True), (True, False), (False, True)])
def test_migrate_affine_in_out_layout(with_bias, with_gamma, with_beta):
    x, gamma, beta, weight, bias = _affine_case(4, with_bias=with_bias, with_gamma=with_gamma, with_beta=with_beta)
    new_weight, new_bias = migrate_affine(weight, bias, gamma, beta, in_axis=0)
    assert new_weight.shape == weight.shape and new_weight.dtype == weight.dtype
    got = x @ new_weight + (0 if new_bias is None else new_bias)
    np.testing.assert_allclose(got, _reference(x, gamma, beta, weight, bias), rtol=1e-12, atol=1e-12)
    if with_beta or with_bias:
        assert new_bias is not None and new_bias.shape == (weight.shape[1],)


@pytest.mark.parametrize("with_bias", [True, False])
def test_migrate_affine_out_in_layout(with_bias):
    x, gamma, beta, weight, bias = _affine_case(5, with_bias=with_bias)
    weight_out_in = np.ascontiguousarray(weight.T)  # torch.nn.Linear / Gemm transB=1
    new_weight, new_bias = migrate_affine(weight_out_in, bias, gamma, beta, in_axis=1)
    assert new_weight.shape == weight_out_in.shape
    got = x @ new_weight.T + new_bias
    np.testing.assert_allclose(got, _reference(x, gamma, beta, weight, bias), rtol=1e-12, atol=1e-12)


def test_migrate_affine_square_weight_uses_the_right_axis():
    """With a square W, mixing up the layouts is silent; the result must still be exact."""
    x, gamma, beta, weight, bias = _affine_case(6, in_features=5, out_features=5)
    w0, b0 = migrate_affine(weight, bias, gamma, beta, in_axis=0)
    np.testing.assert_allclose(x @ w0 + b0, _reference(x, gamma, beta, weight, bias), rtol=1e-12, atol=1e-12)
    w1, b1 = migrate_affine(weight.T.copy(), bias, gamma, beta, in_axis=1)
    np.testing.assert_allclose(x @ w1.T + b1, _reference(x, gamma, beta, weight, bias), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha,beta_g,with_bias", [(0.5, 1.0, True), (1.0, 2.0, True), (0.5, 0.25, False)])
def test_migrate_affine_into_gemm_with_alpha_beta(alpha, beta_g, with_bias):
    """Gemm: y = α·(x⊙γ + β)·W + β_g·C; the shift β·W enters C scaled by α/β_g."""
    x, gamma, beta, weight, bias = _affine_case(11, with_bias=with_bias)
    new_weight, new_bias = migrate_affine(weight, bias, gamma, beta, 0, shift_scale=alpha / beta_g)
    expected = alpha * ((x * gamma + beta) @ weight) + (beta_g * bias if with_bias else 0)
    got = alpha * (x @ new_weight) + beta_g * new_bias
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_migrate_affine_wide_input_is_exact():
    """More input features than one chunk of the β·W product."""
    x, gamma, beta, weight, bias = _affine_case(12, in_features=2600, out_features=3, batch=4)
    new_weight, new_bias = migrate_affine(weight, bias, gamma, beta, 0)
    np.testing.assert_allclose(x @ new_weight + new_bias, _reference(x, gamma, beta, weight, bias), rtol=1e-10)
    new_weight, new_bias = migrate_affine(weight.T.copy(), bias, gamma, beta, 1)
    np.testing.assert_allclose(x @ new_weight.T + new_bias, _reference(x, gamma, beta, weight, bias), rtol=1e-10)


def test_migrate_affine_nothing_to_migrate():
    _x, _, _, weight, _ = _affine_case(7)
    new_weight, new_bias = migrate_affine(weight, None, None, None, in_axis=0)
    assert new_bias is None
    np.testing.assert_array_equal(new_weight, weight)


def test_migrate_affine_float32_keeps_dtype_and_is_accurate():
    x, gamma, beta, weight, bias = _affine_case(8, in_features=64, out_features=32)
    f32 = [a.astype(np.float32) for a in (weight, bias, gamma, beta)]
    new_weight, new_bias = migrate_affine(*f32, in_axis=0)
    assert new_weight.dtype == np.float32 and new_bias.dtype == np.float32
    ref = _reference(x, gamma, beta, weight, bias)
    got = x @ new_weight.astype(np.float64) + new_bias
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-6


def test_migrate_affine_does_not_modify_inputs():
    _x, gamma, beta, weight, bias = _affine_case(9)
    copies = [a.copy() for a in (weight, bias, gamma, beta)]
    migrate_affine(weight, bias, gamma, beta, in_axis=0)
    for original, copy in zip((weight, bias, gamma, beta), copies, strict=False):
        np.testing.assert_array_equal(original, copy)


@pytest.mark.parametrize(
    "values,expected",
    [
        (np.full(7, 0.3, dtype=np.float32), True),
        (np.ones((2, 3)), True),
        (np.array([], dtype=np.float32), True),
        (np.array([2.0]), True),
        (np.array([1.0, 1.0, 1.0 + 1e-7]), False),
        (np.array([1.0, -1.0]), False),
        (np.array([0.0, -0.0]), True),
    ],
)
def test_is_uniform(values, expected):
    assert is_uniform(values) is expected


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_has_zero_mean(dtype):
    gen = np.random.default_rng(10)
    values = gen.standard_normal(257).astype(dtype) * 5 + 3
    assert not has_zero_mean(values)
    centred = centre(values, 0)
    assert has_zero_mean(centred)
    assert has_zero_mean(np.zeros(5, dtype=dtype))
    assert has_zero_mean(np.array([1.0, -1.0], dtype=dtype))
    assert not has_zero_mean(np.array([1.0, -0.999], dtype=dtype))
    # a tiny but real mean on small values is not rounding
    assert not has_zero_mean(np.array([1e-3, 1e-3, -1e-3], dtype=dtype))


def test_has_zero_mean_integers_and_empty():
    assert has_zero_mean(np.array([3, -1, -2]))
    assert not has_zero_mean(np.array([3, -1, -1]))
    assert has_zero_mean(np.array([], dtype=np.float32))


def test_has_zero_mean_returns_python_bool():
    assert type(has_zero_mean(np.array([1.0, -1.0]))) is bool
    assert type(has_zero_mean(np.array([1.0, 1.0]))) is bool


def test_is_uniform_returns_python_bool():
    assert type(is_uniform(np.array([1.0, 1.0]))) is bool
    assert type(is_uniform(np.array([1.0, 2.0]))) is bool
