"""Weight algebra for exact folding (NumPy only).

* Centring (seed 003 §3, CCWT): for y = x·W + b with W of shape [in, out], every output is
  zero-mean for every x iff each row of W and the bias sum to zero along `out`:
  W' = W − mean_out(W), b' = b − mean(b). For any layout, centre along the axis that indexes the
  output features (`axis`); a constant added into the stream is centred the same way.
  Arithmetic is done in float64 and cast back, so the centred weights are exact to one rounding.
* Migration of a norm's affine into a consumer y = (x̂⊙γ + β)·W + b:
  W' = diag(γ)·W and b' = b + β·W, so the norm needs neither γ nor β.
"""

from __future__ import annotations

import numpy as np


def centre(values: np.ndarray, axis: int | None) -> np.ndarray:
    """`values` minus its mean along `axis`; all zeros when `axis` is None (constant along it)."""
    if axis is None:
        return np.zeros_like(values)
    wide = values.astype(np.float64)
    return (wide - wide.mean(axis=axis, keepdims=True)).astype(values.dtype)


def migrate_affine(
    weight: np.ndarray, bias: np.ndarray | None, gamma: np.ndarray | None, beta: np.ndarray | None, in_axis: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Fold y = (x⊙γ + β)·W + b into y = x·W' + b'.

    `in_axis` is the axis of `weight` that indexes input features (0 for [in, out], 1 for
    [out, in]). Returns (W', b'); b' is None only when both `bias` and `beta` are None.
    """
    wide = weight.astype(np.float64)
    to_in = np.moveaxis(wide, in_axis, 0)  # [in, out]
    new_bias = None if bias is None else bias.astype(np.float64)
    if beta is not None:
        shift = beta.astype(np.float64) @ to_in
        new_bias = shift if new_bias is None else new_bias + shift
    if gamma is not None:
        to_in = to_in * gamma.astype(np.float64)[:, None]
    new_weight = np.moveaxis(to_in, 0, in_axis).astype(weight.dtype)
    dtype = weight.dtype if bias is None else bias.dtype
    return new_weight, None if new_bias is None else new_bias.astype(dtype)


def is_uniform(values: np.ndarray) -> bool:
    """True when every element equals the first (an affine γ that scales all features alike)."""
    flat = values.reshape(-1)
    return flat.size == 0 or bool(np.all(flat == flat[0]))


def has_zero_mean(values: np.ndarray) -> bool:
    """True when mean(values) is zero to within the rounding of summing them in float64."""
    wide = values.astype(np.float64).reshape(-1)
    if wide.size == 0:
        return True
    bound = np.finfo(values.dtype).eps * np.abs(wide).sum() if values.dtype.kind == "f" else 0.0
    return abs(wide.sum()) <= bound
