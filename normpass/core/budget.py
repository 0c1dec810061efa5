"""The accuracy budget of the surrogate pass and how a candidate model's outputs are judged (NumPy only).

* **Metrics** (`compare`): per sample, over every float output, the cosine similarity between the
  original's and the candidate's output vectors, the relative error max|a − b| / max|a|, and the
  arg-max agreement (per sample, or per token for [batch, seq, classes] outputs). Tokens whose
  attention mask is 0 are zeroed in both before comparing. A sample whose candidate output is not
  finite has cosine −1 and relative error ∞.
* **Budget**: `cos=` the minimum cosine over samples, `rel=` the maximum relative error, `top1=`
  the arg-max agreement, each given at most once, and printed with every digit it was given.
  `usage` is the share of the allowance used (≤ 1 keeps the budget): for
  `cos=0.999` the allowance is 0.001 of damage 1 − cos.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError

# --- budget -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """How far a candidate's outputs are from the original's, over every sample of a split."""

    cos_min: float
    cos_mean: float
    rel_max: float
    top1: float | None
    samples: int
    cos_samples: np.ndarray | None = field(default=None, repr=False, compare=False)
    rel_samples: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "cos_min": self.cos_min,
            "cos_mean": self.cos_mean,
            "rel_max": self.rel_max,
            "top1": self.top1,
            "samples": self.samples,
        }


def _masked(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if mask is not None and values.ndim >= 3 and values.shape[:2] == mask.shape:
        return values * (mask != 0).reshape(mask.shape + (1,) * (values.ndim - 2))
    return values


def compare(
    references: list[dict[str, np.ndarray]],
    candidates: list[dict[str, np.ndarray]],
    masks: list[np.ndarray | None] | None = None,
) -> Metrics:
    """Per-sample cosine, relative error and arg-max agreement over every float output."""
    cosines, rels, agree, positions = [], [], 0, 0
    masks = masks or [None] * len(references)
    for reference, candidate, mask in zip(references, candidates, masks, strict=False):
        for name, ref in reference.items():
            if ref.dtype.kind != "f":
                continue
            got = candidate[name]
            a = _masked(ref.astype(np.float64), mask)
            b = _masked(got.astype(np.float64), mask)
            if a.ndim == 0:
                a, b = a.reshape(1, 1), b.reshape(1, 1)
            flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
            na, nb = np.linalg.norm(flat_a, axis=1), np.linalg.norm(flat_b, axis=1)
            dot = (flat_a * flat_b).sum(axis=1)
            both_zero = (na == 0) & (nb == 0)
            cos = np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-300))
            cos = np.where(np.isfinite(flat_b).all(axis=1), cos, -1.0)
            cosines.append(cos)
            scale = np.abs(flat_a).max(axis=1)
            diff = np.abs(flat_a - flat_b).max(axis=1)
            rel = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), diff)
            rels.append(np.where(np.isfinite(rel), rel, np.inf))
            if a.ndim >= 2 and a.shape[-1] > 1:
                top_a, top_b = a.argmax(axis=-1), b.argmax(axis=-1)
                keep = np.ones(top_a.shape, dtype=bool)
                if mask is not None and top_a.shape == mask.shape:
                    keep = mask != 0
                agree += int((top_a == top_b)[keep].sum())
                positions += int(keep.sum())
    cos_all = np.concatenate(cosines) if cosines else np.ones(1)
    rel_all = np.concatenate(rels) if rels else np.zeros(1)
    return Metrics(
        float(cos_all.min()),
        float(cos_all.mean()),
        float(rel_all.max()),
        None if positions == 0 else agree / positions,
        int(sum(len(c) for c in cosines)),
        cos_all,
        rel_all,
    )


@dataclass(frozen=True)
class Budget:
    """Accuracy the replaced model must keep; any of the three terms may be left out."""

    cos: float | None = None
    rel: float | None = None
    top1: float | None = None

    @classmethod
    def parse(cls, specs: str | list[str]) -> Budget:
        """`"cos=0.999"`, `"cos=0.999,top1=0.99"` or a list of such strings."""
        if isinstance(specs, str):
            specs = [specs]
        values: dict[str, float] = {}
        for spec in specs:
            for part in filter(None, (p.strip() for p in spec.split(","))):
                key, sep, text = part.partition("=")
                key = key.strip().lower()
                if not sep or key not in ("cos", "rel", "top1"):
                    raise InputError(f"budget {part!r}: expected cos=V, rel=V or top1=V (e.g. cos=0.999)")
                try:
                    value = float(text)
                except ValueError:
                    raise InputError(f"budget {part!r}: {text!r} is not a number") from None
                if (
                    (key in ("cos", "top1") and not 0 < value <= 1)
                    or (key == "rel" and not value >= 0)
                    or not math.isfinite(value)
                ):
                    raise InputError(f"budget {part!r}: {key} must be in {'(0, 1]' if key != 'rel' else '[0, ∞)'}")
                if key in values:
                    raise InputError(
                        f"budget {part!r}: {key} is given twice ({key}={values[key]!r} before); give it once"
                    )
                values[key] = value
        if not values:
            raise InputError("budget: give at least one of cos=, rel=, top1=")
        return cls(**values)

    def usage(self, metrics: Metrics) -> float:
        """The share of the allowance used (≤ 1 keeps the budget); the worst over the terms."""
        used = []
        if self.cos is not None:
            used.append(_share(1 - metrics.cos_min, 1 - self.cos))
        if self.rel is not None:
            used.append(_share(metrics.rel_max, self.rel))
        if self.top1 is not None and metrics.top1 is not None:
            used.append(_share(1 - metrics.top1, 1 - self.top1))
        return max(used) if used else 0.0

    def holds(self, metrics: Metrics, margin: float = 1.0) -> bool:
        return self.usage(metrics) <= margin

    def __str__(self) -> str:
        return ",".join(
            f"{k}={np.format_float_positional(v, trim='-')}"
            for k, v in (("cos", self.cos), ("rel", self.rel), ("top1", self.top1))
            if v is not None
        )


def _share(used: float, allowed: float) -> float:
    if not math.isfinite(used):
        return math.inf
    if allowed <= 0:
        return 0.0 if used <= 0 else math.inf
    return max(used, 0.0) / allowed
