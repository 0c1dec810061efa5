"""Surrogates for normalization layers, and how to fit them (NumPy only, float64 throughout).

Every surrogate has one canonical form, with per-feature `γ`, `β` (vectors of the normalized
width d) and a shift `c` (a scalar or a d-vector) subtracted from the input first::

    rms        y = γ ⊙ u / sqrt(mean(u²) + ε) + β      u = x − c, c a calibrated scalar
    affine     y = γ ⊙ x + β                             (DaMN, seed 000 App. C; c = 0)
    scalebias  y = α x + β                               (NoMorelization, seed 004: α a scalar;
                                                          γ = α·1 so every γ rule applies)
    dyt        y = γ ⊙ tanh(α u) + β                     (seed 002; α a scalar)
    derf       y = γ ⊙ erf(α u) + β                      (seed 001: erf(α x + s) = erf(α (x − c)),
                                                          c = −s/α; `s` is reported, `c` is emitted)

Fitting, against the original norm's outputs `y = N(x)` on calibration tokens (`core/stats.py`
collects them):

* **affine (DaMN)**: per-feature mean m and std s of x and of N(x) (Welford, float64);
  γ = s_N / s_x, β = m_N − γ ⊙ m_x.
* **scalebias**: least squares with one α for every feature and a per-feature β:
  α = Σ_j cov(x_j, y_j) / Σ_j var(x_j), β_j = mean(y_j) − α·mean(x_j).
* **rms**: c = the calibration mean of x over tokens and features (exact when the per-token mean
  of x is constant: then RMSNorm(x − c) = LayerNorm(x)). γ, β are either the norm's own or, with
  `refit`, the per-feature least-squares solution against N(x) (never worse on the fit data).
* **dyt / derf**: for fixed α (and shift) the best γ, β are a per-feature least-squares fit
  (closed form); α (and s) are found by a log-spaced grid search followed by golden-section
  refinement, minimising the total squared error. With `shift="feature"` the input is first
  centred per feature with its calibration mean (free when the shift migrates into a bias).

Least squares per feature j for y_j ≈ g_j u_j + h_j: g = cov(u_j, y_j) / var(u_j),
h = mean(y_j) − g·mean(u_j); residual n·(var(y_j) − cov²/var(u_j)).

`why_not` says which norms a kind cannot replace; the front ends add what only they can see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .graph import ALREADY_RMS, NormInfo, NormType
from .stats import NormStats, Welford

KINDS = ("rms", "affine", "scalebias", "dyt", "derf")
TINY = 1e-30


def erf(values: np.ndarray) -> np.ndarray:
    """The error function, elementwise, in float64: SciPy's (exact to rounding; imported when first
    needed, as it takes longer to import than the CLI to start) or, without SciPy, a rational
    approximation (|error| < 1.5e-7)."""
    values = np.asarray(values, dtype=np.float64)
    try:
        from scipy.special import erf as scipy_erf
    except ImportError:  # pragma: no cover - depends on the environment
        scipy_erf = None
    if scipy_erf is not None:
        return scipy_erf(values)
    # Abramowitz & Stegun 7.1.26
    sign = np.sign(values)
    a = np.abs(values)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return sign * (1.0 - poly * np.exp(-a * a))


# --- the original norms ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NormSpec:
    """What a norm computes, for evaluating its exact output in NumPy: LN or RMS over the last axis."""

    layer: bool  # True: LayerNorm (subtracts the mean); False: RMSNorm
    epsilon: float
    gamma: np.ndarray | None = None
    beta: np.ndarray | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if self.layer:
            x = x - x.mean(axis=-1, keepdims=True)
        y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.epsilon)
        if self.gamma is not None:
            y = y * self.gamma.astype(np.float64)
        if self.beta is not None:
            y = y + self.beta.astype(np.float64)
        return y


# --- surrogates ---------------------------------------------------------------------------------


@dataclass
class Surrogate:
    """A fitted replacement: y = γ ⊙ core(x − shift) + β (see the module docstring)."""

    kind: str
    gamma: np.ndarray
    beta: np.ndarray
    shift: np.ndarray | float = 0.0
    alpha: float = 1.0
    epsilon: float = 0.0
    variant: str = ""
    fit_error: float | None = None  # relative RMS error against N(x) on the fit sample
    extra: dict = field(default_factory=dict)  # reported parameters (e.g. Derf's s)

    def core(self, u: np.ndarray) -> np.ndarray:
        if self.kind == "rms":
            return u / np.sqrt((u * u).mean(axis=-1, keepdims=True) + self.epsilon)
        if self.kind in ("affine", "scalebias"):
            return u
        if self.kind == "dyt":
            return np.tanh(self.alpha * u)
        if self.kind == "derf":
            return erf(self.alpha * u)
        raise ValueError(f"unknown surrogate kind {self.kind!r}")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        u = np.asarray(x, dtype=np.float64) - np.asarray(self.shift, dtype=np.float64)
        return self.gamma * self.core(u) + self.beta

    @property
    def has_shift(self) -> bool:
        return bool(np.any(np.asarray(self.shift) != 0))

    def describe(self) -> dict:
        """Parameters for the report: scalars in full, vectors summarised."""

        def summary(v):
            v = np.asarray(v, dtype=np.float64)
            if v.ndim == 0:
                return float(v)
            return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}

        out = {"kind": self.kind, "variant": self.variant, "gamma": summary(self.gamma), "beta": summary(self.beta)}
        if self.kind in ("dyt", "derf", "scalebias"):
            out["alpha"] = float(self.alpha)
        if self.kind == "rms":
            out["epsilon"] = float(self.epsilon)
        out["shift"] = summary(self.shift)
        out.update(self.extra)
        if self.fit_error is not None:
            out["fit_error"] = float(self.fit_error)
        return out


def relative_error(approx: np.ndarray, exact: np.ndarray) -> float:
    """‖approx − exact‖ / ‖exact − per-feature mean(exact)‖ over a sample (0 for a perfect fit)."""
    exact = np.asarray(exact, dtype=np.float64)
    spread = float(((exact - exact.mean(axis=0)) ** 2).sum())
    return math.sqrt(float(((np.asarray(approx, dtype=np.float64) - exact) ** 2).sum()) / max(spread, TINY))


def least_squares(u: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-feature (g, h) minimising Σ (g_j u_j + h_j − y_j)², and the total squared residual."""
    u = np.asarray(u, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    mean_u, mean_y = u.mean(axis=0), y.mean(axis=0)
    du, dy = u - mean_u, y - mean_y
    var_u = (du * du).mean(axis=0)
    cov = (du * dy).mean(axis=0)
    var_y = (dy * dy).mean(axis=0)
    safe = var_u > TINY * np.maximum(var_y, 1.0)
    g = np.where(safe, cov / np.where(safe, var_u, 1.0), 0.0)
    h = mean_y - g * mean_u
    residual = u.shape[0] * float(np.sum(var_y - np.where(safe, cov * g, 0.0)))
    return g, h, max(residual, 0.0)


def fit_affine(stats_x: Welford, stats_y: Welford) -> Surrogate:
    """DaMN: γ = s_N / s_x, β = m_N − γ ⊙ m_x (a constant feature gets γ = 0, β = m_N)."""
    sx, sy = stats_x.std, stats_y.std
    safe = sx > TINY
    gamma = np.where(safe, sy / np.where(safe, sx, 1.0), 0.0)
    beta = stats_y.mean - gamma * stats_x.mean
    return Surrogate("affine", gamma, beta, variant="damn")


def fit_rms(
    x: np.ndarray, y: np.ndarray, stats_x: Welford, epsilon: float, norm: NormSpec, refit: bool = True
) -> Surrogate:
    """Calibrated RMS: c = mean of x over tokens and features; γ, β the norm's own or refitted."""
    shift = float(stats_x.mean.mean())
    width = stats_x.mean.shape[0]
    probe = Surrogate("rms", np.ones(width), np.zeros(width), shift=shift, epsilon=epsilon)
    x = np.asarray(x, np.float64)
    if refit:
        # c too: the scalar minimising the least-squares residual, searched around the mean
        # (a grid over ±0.5 std, then golden section); the mean itself when it is exact
        rows = _subsample(np.random.default_rng(0), x.shape[0], 4096)
        xs, ys = x[rows], np.asarray(y, np.float64)[rows]

        def loss(c: float) -> float:
            return least_squares(probe.core(xs - c), ys)[2]

        spread = 0.5 * float(np.sqrt(stats_x.var.mean() + (stats_x.mean**2).mean() - shift**2))
        grid = shift + np.linspace(-spread, spread, 21)
        best = int(np.argmin([loss(c) for c in grid]))
        step = grid[1] - grid[0] if spread > 0 else 0.0
        if step > 0:
            candidate = _golden(loss, grid[best] - step, grid[best] + step)
            shift = min((shift, candidate, grid[best]), key=loss)
        gamma, beta, _ = least_squares(probe.core(x - shift), y)
        variant = "searched scalar shift, refitted γ/β"
    else:
        gamma = np.ones(width) if norm.gamma is None else norm.gamma.astype(np.float64).reshape(-1)
        beta = np.zeros(width) if norm.beta is None else norm.beta.astype(np.float64).reshape(-1)
        variant = "scalar shift, original γ/β"
    return Surrogate("rms", gamma, beta, shift=float(shift), epsilon=epsilon, variant=variant)


def fit_scalebias(x: np.ndarray, y: np.ndarray) -> Surrogate:
    """NoMorelization's inference form α·x + β: one α for all features, β per feature (least squares)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    mean_x, mean_y = x.mean(axis=0), y.mean(axis=0)
    dx = x - mean_x
    var = float((dx * dx).sum())
    alpha = float((dx * (y - mean_y)).sum()) / var if var > TINY else 0.0
    width = x.shape[1]
    return Surrogate("scalebias", np.full(width, alpha), mean_y - alpha * mean_x, alpha=alpha, variant="least squares")


def _golden(f, lo: float, hi: float, iterations: int = 24) -> float:
    """Minimum of a unimodal f on [lo, hi] by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def _subsample(rng: np.random.Generator, rows: int, limit: int) -> np.ndarray:
    return np.arange(rows) if rows <= limit else np.sort(rng.choice(rows, limit, replace=False))


def fit_pointwise(
    kind: str,
    x: np.ndarray,
    y: np.ndarray,
    stats_x: Welford,
    shift: str = "none",
    search_rows: int = 1024,
    seed: int = 0,
) -> Surrogate:
    """Fit DyT (`kind="dyt"`) or Derf (`"derf"`) to y ≈ γ ⊙ f(α(x − c)) + β.

    `shift="none"`: c = 0 for DyT (the paper's form); for Derf, c = −s/α with the scalar s
    searched. `shift="feature"`: c is the per-feature calibration mean of x (and Derf searches s
    on top of it). α is searched on log scale around 1/std(x − c).
    """
    if kind not in ("dyt", "derf"):
        raise ValueError(kind)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    base = stats_x.mean.copy() if shift == "feature" else np.zeros(x.shape[1])
    rng = np.random.default_rng(seed)
    rows = _subsample(rng, x.shape[0], search_rows)
    u_s, y_s = x[rows] - base, y[rows]
    scale = 1.0 / max(float(np.sqrt((u_s * u_s).mean())), TINY)
    func = np.tanh if kind == "dyt" else erf

    def loss(log_alpha: float, s: float = 0.0) -> float:
        return least_squares(func(math.exp(log_alpha) * u_s + s), y_s)[2]

    grid = np.log(scale) + np.linspace(math.log(0.02), math.log(20.0), 19)
    step = grid[1] - grid[0]
    if kind == "dyt":
        losses = [loss(a) for a in grid]
        best = int(np.argmin(losses))
        log_alpha = _golden(loss, grid[best] - step, grid[best] + step)
        s = 0.0
    else:
        s_grid = np.linspace(-1.5, 1.5, 7)
        table = np.array([[loss(a, s) for s in s_grid] for a in grid])
        i, j = np.unravel_index(int(np.argmin(table)), table.shape)
        log_alpha, s = grid[i], s_grid[j]
        s_step = s_grid[1] - s_grid[0]
        for _ in range(5):  # coordinate refinement
            log_alpha = _golden(lambda a, s=s: loss(a, s), log_alpha - step, log_alpha + step, 16)
            s = _golden(lambda t, a=log_alpha: loss(a, t), s - s_step, s + s_step, 16)
            step, s_step = step / 2, s_step / 2
    alpha = math.exp(log_alpha)
    gamma, beta, _ = least_squares(func(alpha * (x - base) + s), y)
    shift_value: np.ndarray | float = base - s / alpha
    if shift == "none" and kind == "dyt":
        shift_value = 0.0
    elif shift == "none":
        shift_value = float(-s / alpha)
    extra = {"s": float(s)} if kind == "derf" else {}
    variant = "per-feature shift" if shift == "feature" else "plain"
    return Surrogate(kind, gamma, beta, shift=shift_value, alpha=alpha, variant=variant, extra=extra)


def with_fit_error(surrogate: Surrogate, x: np.ndarray, y: np.ndarray) -> Surrogate:
    surrogate.fit_error = relative_error(surrogate(x), y)
    return surrogate


def fit_surrogate(
    kind: str,
    stats: NormStats,
    spec: NormSpec,
    epsilon: float,
    target: np.ndarray | None = None,
    refit: bool = True,
    seed: int = 0,
) -> Surrogate:
    """Fit one kind of surrogate to the collected statistics of a norm.

    `target`: the original model's outputs of this norm on the same sample of tokens (least-squares
    fits then also absorb the systematic part of upstream replacements' errors); default N(x).
    """
    x = stats.sample.astype(np.float64)
    y = spec(x) if target is None or target.shape != x.shape else target
    if kind == "affine":
        surrogate = fit_affine(stats.x, stats.y)
    elif kind == "scalebias":
        surrogate = fit_scalebias(x, y)
    elif kind == "rms":
        surrogate = fit_rms(x, y, stats.x, epsilon, spec, refit=refit)
    elif kind in ("dyt", "derf"):
        fits = [
            with_fit_error(fit_pointwise(kind, x, y, stats.x, shift, seed=seed), x, y) for shift in ("none", "feature")
        ]
        return min(fits, key=lambda s: math.inf if s.fit_error is None else s.fit_error)
    else:
        raise ValueError(f"unknown surrogate kind {kind!r}")
    return with_fit_error(surrogate, x, y)


def why_not(norm: NormInfo, width: int | None, kind: str, front_end_reason: str | None = None) -> str | None:
    """Why no surrogate of `kind` can replace `norm`, or None.

    The front end's reason for never folding it (`NormInfo.unsupported`: its axes, used statistics,
    run-time γ, β or ε, a control-flow body) rules a LayerNorm out; an RMSNorm, which it declines
    for being one, is ruled out for the rms kind only. `front_end_reason` is what only the front end
    can see (a fused Skip op, a norm it cannot swap); grouped norms and an unknown width are what the
    surrogates do not implement.
    """
    if norm.norm_type is NormType.GROUP:
        return "GroupNorm: surrogates for grouped norms are not implemented"
    if norm.norm_type is NormType.RMS and norm.unsupported == ALREADY_RMS:
        if kind == "rms":
            return "already an RMSNorm"
        if norm.axis is None:
            return "does not normalize over one (last) axis"
    elif norm.unsupported:
        return norm.unsupported
    if front_end_reason:
        return front_end_reason
    if width is None:
        return "the normalized width is unknown"
    return None
