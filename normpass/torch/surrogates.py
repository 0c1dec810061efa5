"""Surrogate norms as `torch.nn.Module`s: what `normpass.replace` puts where a norm was.

Each computes the core's canonical form (`core/surrogates.py`) y = γ ⊙ core(x − c) + β, with every
term optional: a term that `replace` migrated into an adjacent layer (c into the bias that feeds
x, γ and β into the `nn.Linear`s that read y) is None here, and the module does not compute it.
The terms it keeps are `nn.Parameter`s, so a training loop can tune them.

| module | core | the paper |
|---|---|---|
| `Affine` | u | DaMN's calibrated affine (seed 000 App. C) |
| `ScaleBias` | α u, α a scalar | NoMorelization at inference (seed 004) |
| `DyT` | tanh(α u) | Dynamic Tanh (seed 002) |
| `Derf` | erf(α u) = erf(α x + s), s = −α c | Dynamic erf (seed 001) |
| `ShiftedRMSNorm` | u / sqrt(mean(u²) + ε) | RMSNorm of x − c, c a calibrated scalar |

`SmoothRemoval(norm, surrogate)` blends a norm into its surrogate, α·N(x) + (1 − α)·S(x) (DaMN's
smooth removal), with α a buffer a training schedule sets from 1 to 0; `smooth_removal(student,
norms)` wraps every surrogate of a replaced module so; `surrogate_modules(model)` finds every
surrogate (inside blends too). `ops()` says what `torch.onnx.export` makes of a module
(in ONNX op types, as `core/cost.py` prices them); `to_surrogate()` gives the core's `Surrogate`
back (for emission into ONNX), with the migrated terms as neutral values.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.surrogates import Surrogate
from .rewrite import Permuted


def _parameter(values, dtype=None, device=None) -> nn.Parameter | None:
    if values is None:
        return None
    tensor = torch.as_tensor(np.asarray(values, dtype=np.float64))
    return nn.Parameter(tensor.to(dtype=dtype or torch.float32, device=device))


class SurrogateNorm(nn.Module):
    """y = γ ⊙ core(x − c) + β over the last axis; `shift` (c), `gamma`, `beta` may each be None.

    `migrated` names the fitted terms that live in adjacent layers instead ("shift", "gamma", "beta";
    a `ScaleBias`'s α is its "gamma").
    """

    kind = ""
    core_ops: tuple[str, ...] = ()  # the ONNX ops of the core

    def __init__(self, width: int, shift=None, gamma=None, beta=None, dtype=None, device=None):
        super().__init__()
        self.width = width
        self.migrated: tuple[str, ...] = ()
        self.shift = _parameter(shift, dtype=dtype, device=device)
        self.gamma = _parameter(gamma, dtype=dtype, device=device)
        self.beta = _parameter(beta, dtype=dtype, device=device)

    def core(self, u: torch.Tensor) -> torch.Tensor:
        return u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x if self.shift is None else x - self.shift
        return _scale_shift(self.core(u), self.gamma, self.beta)

    def ops(self) -> collections.Counter:
        """The ONNX ops an export of this module computes (γ inside an RMS op costs nothing extra)."""
        ops = collections.Counter(self.core_ops)
        ops.update(
            op
            for op, term in (("Sub", self.shift), ("Mul", self.gamma), ("Add", self.beta))
            if term is not None and not (op == "Mul" and self.kind == "rms")
        )
        return ops

    def to_surrogate(self) -> Surrogate:
        """The core's form of this module: migrated terms become 0 (c, β) and 1 (γ)."""

        def values(term, neutral: float):
            if term is None:
                return np.full(self.width, neutral)
            return term.detach().cpu().double().numpy().reshape(-1) * np.ones(self.width)

        shift = 0.0 if self.shift is None else self.shift.detach().cpu().double().numpy()
        shift = float(shift) if np.ndim(shift) == 0 or np.size(shift) == 1 else shift
        return Surrogate(
            self.kind,
            values(self.gamma, 1.0),
            values(self.beta, 0.0),
            shift=shift,
            alpha=self._alpha(),
            epsilon=getattr(self, "eps", 0.0),
        )

    def _alpha(self) -> float:
        alpha = getattr(self, "alpha", None)
        return 1.0 if alpha is None else float(alpha.detach())

    def extra_repr(self) -> str:
        def term(name, value):
            if value is None:
                return f"{name}=migrated" if name in self.migrated else None
            if value.numel() == 1:
                return f"{name}={float(value.detach().reshape(-1)[0]):.4g}"
            return f"{name}=[{value.numel()}]"

        parts = [str(self.width)] + self._extra()
        parts += [term(name, getattr(self, name)) for name in ("shift", "gamma", "beta")]
        return ", ".join(p for p in parts if p is not None)

    def _extra(self) -> list[str]:
        return []


def _scale_shift(y: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y ⊙ scale + bias, each term optional; both as one `addcmul` (one kernel in eager mode instead of a Mul
    and an Add, each a pass over the activations; `torch.onnx.export` writes it as Mul and Add)."""
    if scale is not None and bias is not None:
        return torch.addcmul(bias, y, scale)
    if scale is not None:
        return y * scale
    return y if bias is None else y + bias


class Affine(SurrogateNorm):
    """DaMN's calibrated affine: γ ⊙ x + β."""

    kind = "affine"


class ScaleBias(SurrogateNorm):
    """NoMorelization at inference: α·x + β, one α for every feature (None where it migrated)."""

    kind = "scalebias"

    def __init__(self, width: int, alpha=None, shift=None, beta=None, dtype=None, device=None):
        super().__init__(width, shift, None, beta, dtype, device)
        self.alpha = _parameter(alpha, dtype=dtype, device=device)

    def core(self, u: torch.Tensor) -> torch.Tensor:
        return u if self.alpha is None else u * self.alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x if self.shift is None else x - self.shift
        return _scale_shift(u, self.alpha, self.beta)  # α·u + β, one addcmul

    def ops(self) -> collections.Counter:
        ops = super().ops()
        if self.alpha is not None:
            ops["Mul"] += 1
        return ops

    def to_surrogate(self) -> Surrogate:
        surrogate = super().to_surrogate()
        surrogate.gamma = np.full(self.width, surrogate.alpha)
        return surrogate

    def _extra(self) -> list[str]:
        if self.alpha is None:
            return ["α=migrated"] if "gamma" in self.migrated else []
        return [f"α={float(self.alpha.detach()):.4g}"]


class _Pointwise(SurrogateNorm):
    """γ ⊙ f(α (x − c)) + β with a scalar α (a parameter, never migrated)."""

    def __init__(self, width: int, alpha: float, shift=None, gamma=None, beta=None, dtype=None, device=None):
        super().__init__(width, shift, gamma, beta, dtype, device)
        self.alpha = nn.Parameter(torch.tensor(float(alpha), dtype=dtype or torch.float32, device=device))

    def _extra(self) -> list[str]:
        return [f"α={float(self.alpha.detach()):.4g}"]


class DyT(_Pointwise):
    """Dynamic Tanh: γ ⊙ tanh(α (x − c)) + β."""

    kind = "dyt"
    core_ops = ("Mul", "Tanh")

    def core(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * u)


class Derf(_Pointwise):
    """Dynamic erf: γ ⊙ erf(α x + s) + β, computed as erf(α (x − c)) with c = −s/α."""

    kind = "derf"
    core_ops = ("Mul", "Erf")

    def core(self, u: torch.Tensor) -> torch.Tensor:
        return torch.erf(self.alpha * u)

    def _extra(self) -> list[str]:
        if self.shift is None or self.shift.numel() != 1:
            return super()._extra()
        s = -float(self.alpha.detach()) * float(self.shift.detach().reshape(-1)[0])
        return super()._extra() + [f"s={s:.4g}"]


class ShiftedRMSNorm(SurrogateNorm):
    """RMSNorm of x − c: γ ⊙ u / sqrt(mean(u²) + ε) + β, c a calibrated scalar."""

    kind = "rms"
    core_ops = ("RMSNormalization",)

    def __init__(self, width: int, eps: float, shift=None, gamma=None, beta=None, dtype=None, device=None):
        super().__init__(width, shift, gamma, beta, dtype, device)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x if self.shift is None else x - self.shift
        y = F.rms_norm(u, (self.width,), self.gamma, self.eps)  # γ is the RMS op's weight
        return y if self.beta is None else y + self.beta

    def _extra(self) -> list[str]:
        return [f"eps={self.eps:g}"]


MODULES: dict[str, type[SurrogateNorm]] = {m.kind: m for m in (Affine, ScaleBias, DyT, Derf, ShiftedRMSNorm)}


def surrogate_module(
    surrogate: Surrogate,
    width: int,
    keep_shift: bool = True,
    keep_gamma: bool = True,
    keep_beta: bool = True,
    dtype=None,
    device=None,
) -> SurrogateNorm:
    """The module for a fitted `Surrogate`; the terms not kept have migrated elsewhere."""
    has = {
        "shift": surrogate.has_shift,
        "gamma": not np.all(surrogate.gamma == 1),
        "beta": bool(np.any(surrogate.beta != 0)),
    }
    keep = {"shift": keep_shift, "gamma": keep_gamma, "beta": keep_beta}
    shift = surrogate.shift if keep_shift and has["shift"] else None
    gamma = surrogate.gamma if keep_gamma and has["gamma"] else None
    beta = surrogate.beta if keep_beta and has["beta"] else None
    like = {"dtype": dtype, "device": device}
    module: SurrogateNorm
    if surrogate.kind == "scalebias":
        module = ScaleBias(width, None if gamma is None else surrogate.alpha, shift, beta, **like)
    elif surrogate.kind == "rms":
        module = ShiftedRMSNorm(width, surrogate.epsilon, shift, gamma, beta, **like)
    elif surrogate.kind in ("dyt", "derf"):
        module = MODULES[surrogate.kind](width, surrogate.alpha, shift, gamma, beta, **like)
    else:
        module = Affine(width, shift, gamma, beta, **like)
    module.migrated = tuple(term for term in ("shift", "gamma", "beta") if has[term] and not keep[term])
    return module


class SmoothRemoval(nn.Module):
    """DaMN's smooth removal: α·N(x) + (1 − α)·S(x), α a buffer (1: the norm, 0: the surrogate).

    S is a `SurrogateNorm`, or one between the permutes of a channels-first norm (`rewrite.Permuted`).
    """

    alpha: torch.Tensor

    def __init__(self, norm: nn.Module, surrogate: nn.Module, alpha: float = 1.0):
        super().__init__()
        self.norm = norm
        self.surrogate = surrogate
        self.register_buffer("alpha", torch.tensor(float(alpha)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * self.norm(x) + (1 - self.alpha) * self.surrogate(x)


def surrogate_modules(model: nn.Module) -> Iterator[tuple[str, SurrogateNorm]]:
    """Every surrogate module of `model` with its path (those inside a `SmoothRemoval` too)."""
    for path, module in model.named_modules():
        if isinstance(module, SurrogateNorm):
            yield path, module


def surrogate_norm(module: nn.Module) -> SurrogateNorm:
    """The surrogate a blend holds: `module` itself, or the one between a channels-first norm's permutes."""
    held = module.norm if isinstance(module, Permuted) else module
    assert isinstance(held, SurrogateNorm), f"{type(held).__name__} is a surrogate module"
    return held


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def smooth_removal(student: nn.Module, norms: nn.Module, alpha: float = 1.0) -> list[SmoothRemoval]:
    """Wrap every surrogate of `student` (in place) in a `SmoothRemoval` with the norm at the same path of
    `norms` (a copy of it): the module `replace` started from, or the original model. Returns the blends,
    whose `alpha` a training schedule lowers from 1 to 0.

    The surrogates must hold every fitted term (`ReplaceOptions(migrate_affine=False)`): a term migrated
    into an adjacent layer would change what the norm's side of the blend feeds it.
    """
    blends = []
    for path, surrogate in list(surrogate_modules(student)):
        if surrogate.migrated:
            raise ValueError(
                f"{path}: its {', '.join(surrogate.migrated)} migrated into adjacent layers; build the student "
                "with ReplaceOptions(migrate_affine=False) to blend it with its norm"
            )
        parent, _, child = path.rpartition(".")
        held: nn.Module = surrogate
        if not _has_module(norms, path) and isinstance(student.get_submodule(parent), Permuted):
            held, path = student.get_submodule(parent), parent  # a channels-first norm's: both blended permuted
            parent, _, child = path.rpartition(".")
        blend = SmoothRemoval(copy.deepcopy(norms.get_submodule(path)), held, alpha)
        setattr(student.get_submodule(parent), child, blend)
        blends.append(blend)
    return blends
