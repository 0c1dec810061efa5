"""Carrying a surrogate's γ along the residual stream (front-end neutral algebra; no ONNX, no torch).

In a post-LN model each norm's output y feeds linear layers (the next sublayer's Q/K/V or FFN
input) *and* a residual add, whose sum feeds the next norm. An affine surrogate
y = γ ⊙ (x − c) + β there keeps a `Mul` by γ: β and c migrate into biases, γ cannot go into the
linear layers alone, because the residual add reads y too. It can go along the stream instead.
Write the stream between this norm and the next ones as v = D ⊙ v', with D = γ (per feature),
and keep v' in the model:

* a linear reader takes D into its input rows:   W·v + b = (W·diag(D))·v' + b;
* a residual add `v + r` whose other summand r = W_o·z + b_o is a linear layer's private output
  (its *writer*) stays on the stream:  v + r = D ⊙ (v' + r'),  r' = diag(1/D)·W_o·z + b_o / D;
* a linear surrogate reading the stream (`STREAM_KINDS`: an affine or a scalebias) takes D:
  γ_m ⊙ (x − c_m) + β_m = (γ_m ⊙ D) ⊙ (x/D − c_m/D) + β_m (`on_scaled_input`); its own γ_m ⊙ D
  then travels on in the same way.

Nothing is computed for γ any more: a post-LN encoder whose norms are all affine surrogates keeps
one `Mul` (with its `Add`) at the model's output. Anything else reading the stream (another kind of
norm, a graph output, an op that is not linear along the features) stops the migration, and the
norm keeps its `Mul`.

The stored stream v' = v / D grows where |D| < 1: D composes along the chain (the next norm's γ
times this D), so the migration stops, and the norm keeps its `Mul`, where a factor leaves
`[1/limit, limit]` for the model's float type (`scale_limit`), resetting the chain to D = 1.
"""

from __future__ import annotations

import numpy as np

from .surrogates import Surrogate

# The surrogates that are linear in their input, so that a per-feature scale of it passes through.
STREAM_KINDS = ("affine", "scalebias")

# How far from 1 a carried scale may be, by the float type the model computes in: the stored
# stream is the real one divided by D, so fp16 (largest finite 65504) gets a small range.
SCALE_LIMITS = {"float16": 16.0, "bfloat16": 1e4, "float32": 1e4, "float64": 1e8}


def scale_limit(dtype_name: str) -> float:
    """The largest |D| (and 1/|D|) carried along a stream of this float type (`SCALE_LIMITS`)."""
    return SCALE_LIMITS.get(dtype_name, SCALE_LIMITS["float16"])


def stream_scale(surrogate: Surrogate, width: int, limit: float) -> np.ndarray | None:
    """The per-feature γ a surrogate could carry along the stream, or None: not a linear kind, γ all
    ones already, or a factor outside [1/limit, limit] (zero, or far enough from 1 to overflow)."""
    if surrogate.kind not in STREAM_KINDS:
        return None
    gamma = np.broadcast_to(np.asarray(surrogate.gamma, dtype=np.float64), (width,))
    if np.all(gamma == 1):
        return None
    magnitude = np.abs(gamma)
    if not np.all(np.isfinite(gamma)) or magnitude.min() < 1.0 / limit or magnitude.max() > limit:
        return None
    return gamma.copy()


def on_scaled_input(surrogate: Surrogate, scale: np.ndarray) -> Surrogate:
    """The same function of x for a linear surrogate that now reads x / scale:
    γ ⊙ (x − c) + β = (γ ⊙ D) ⊙ (x/D − c/D) + β. A scalebias, whose α becomes per feature, is
    returned as an affine."""
    assert surrogate.kind in STREAM_KINDS, f"a {surrogate.kind} surrogate is not linear in its input"
    gamma = np.asarray(surrogate.gamma, dtype=np.float64) * scale
    shift = np.asarray(surrogate.shift, dtype=np.float64) / scale if surrogate.has_shift else 0.0
    variant = f"{surrogate.variant}, reads the stream scaled".lstrip(", ")
    return Surrogate(
        "affine",
        gamma,
        np.asarray(surrogate.beta, dtype=np.float64).copy(),
        shift=shift,
        variant=variant,
        fit_error=surrogate.fit_error,
        extra=dict(surrogate.extra),
    )
