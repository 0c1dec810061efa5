"""Weight algebra for exact folding (NumPy only).

* Centring (seed 003 §3, CCWT): for y = x·W + b with W of shape [in, out], every output is
  zero-mean for every x iff each row of W and the bias sum to zero along `out`:
  W' = W − mean_out(W), b' = b − mean(b). For any layout, centre along the axis that indexes the
  output features (`axis`); a constant added into the stream is centred the same way.
  The mean is accumulated in float64 and rounded once; the subtraction is one rounding in the
  weights' dtype, so no float64 copy of a large weight is made.
* Migration of a norm's affine into a consumer y = (x̂⊙γ + β)·W + b:
  W' = diag(γ)·W and b' = b + β·W, so the norm needs neither γ nor β. β·W is a matrix-vector
  product computed in the weights' precision (at least float32), like the layer's own.
* Rotation (DESIGN §2b): a map of the features along one axis by a matrix M on the right,
  v'[…, j, …] = Σᵢ v[…, i, …]·sᵢ·M[i, j], optionally after a per-feature scale s. A writer of a
  rotated stream takes M = Q on its output features, a reader M = Q on its input features after
  s = γ (W' = Qᵀ·diag(γ)·W in [in, out] layout), a constant added after a norm whose γ moved
  s = 1/γ. Computed in the weights' precision (at least float32), rounded once to their dtype.
"""

from __future__ import annotations

import numpy as np


def centre(values: np.ndarray, axis: int | None, weight: np.ndarray | None = None) -> np.ndarray:
    """`values` minus its mean along `axis`; all zeros when `axis` is None (constant along it).

    With `weight` w (one nonzero factor per index of `axis`): v − w⁻¹ ⊗ mean_k(w ⊙ v), so that
    w ⊙ v' = centre(w ⊙ v) is zero-mean along `axis` (a layer whose output a per-channel
    LayerScale multiplies before the norm reads it). The weighted mean is taken in float64.
    """
    if axis is None:
        return np.zeros_like(values)
    if weight is None:
        mean = values.mean(axis=axis, keepdims=True, dtype=np.float64)
        return values - mean.astype(values.dtype)
    shape = [1] * values.ndim
    shape[axis] = -1
    w = np.asarray(weight, dtype=np.float64).reshape(shape)
    mean = (values.astype(np.float64) * w).mean(axis=axis, keepdims=True)
    return values - (mean / w).astype(values.dtype)


def migrate_affine(
    weight: np.ndarray,
    bias: np.ndarray | None,
    gamma: np.ndarray | None,
    beta: np.ndarray | None,
    in_axis: int,
    shift_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Fold y = (x⊙γ + β)·W + b into y = x·W' + b', with b' = b + shift_scale·(β·W).

    `in_axis` is the axis of `weight` that indexes input features (0 for [in, out], 1 for
    [out, in]). `shift_scale` is α/β_g for a Gemm (y = α·A·B + β_g·C). Returns (W', b'); b' is
    None only when both `bias` and `beta` are None.
    """
    to_in = np.moveaxis(weight, in_axis, 0)  # [in, out] view
    new_bias = None if bias is None else bias.astype(np.float64)
    if beta is not None:
        # β·W in the weights' own precision (at least float32), as the model's matmuls compute it.
        work = np.promote_types(weight.dtype, np.float32)
        shift = (beta.astype(work) @ to_in.astype(work, copy=False)).astype(np.float64) * shift_scale
        new_bias = shift if new_bias is None else new_bias + shift
    # diag(γ)·W: one correctly rounded product per element, in the weights' dtype.
    new_weight = (
        weight.copy() if gamma is None else np.moveaxis(to_in * gamma.astype(weight.dtype)[:, None], 0, in_axis)
    )
    dtype = weight.dtype if bias is None else bias.dtype
    return np.ascontiguousarray(new_weight), None if new_bias is None else new_bias.astype(dtype)


def scale_along(values: np.ndarray, axis: int, factors: np.ndarray) -> np.ndarray:
    """`values` with its slices along `axis` multiplied by `factors` (one per index of that axis)."""
    shape = [1] * values.ndim
    shape[axis] = -1
    return values * np.asarray(factors, dtype=values.dtype).reshape(shape)


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
    return bool(abs(wide.sum()) <= bound)


def rotate(values: np.ndarray, axis: int, matrix: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """`values`, its features along `axis` scaled by `scale` (if given), times `matrix` on the right."""
    work = np.promote_types(values.dtype, np.float32)
    moved = np.moveaxis(values, axis, -1).astype(work)
    if scale is not None:
        moved = moved * np.asarray(scale, dtype=work)
    product = moved @ np.asarray(matrix, dtype=work)
    return np.ascontiguousarray(np.moveaxis(product, -1, axis).astype(values.dtype))
