"""The accuracy budget of the surrogate pass and how a candidate model's outputs are judged (NumPy only).

* **Metrics** (`compare`): each output is compared as what it is (`Metrics.measures` says how):
  - a float output, per sample: the cosine similarity between the original's and the candidate's output
    vectors, and the relative error max|a − b| / max|a| (on the output's own scale). An output whose values
    never change sign over the split (probabilities, a sigmoid map, a ReLU's features) is compared by the
    cosine of its **centred** vectors a − mean(a), b − mean(b) (Pearson's correlation): the plain cosine of
    two vectors in one orthant stays near 1 whatever happens to them (0.998 on a 0–1 map whose values all
    moved by 0.15). A sample whose reference is constant has no shape to correlate: its plain cosine.
  - an integer or bool output (ids, e.g. an `ArgMax` head): the share of equal ids. Ids have no cosine
    and no relative error: only `top1` judges them.
  - anything else (strings): not compared; no figure is claimed for it.
  The arg-max agreement `top1` is the share of equal top choices over every position: the arg-max of a
  float output's last axis (per sample, or per token for [batch, seq, classes]), and the ids themselves.
  Tokens whose attention mask is 0 are left out of every figure. A sample whose candidate output is not
  finite has cosine −1 and relative error ∞. A figure no output gives is None, never a default.
* **Budget**: `cos=` the minimum cosine over samples, `rel=` the maximum relative error, `top1=`
  the arg-max (or id) agreement, each given at most once, and printed with every digit it was given.
  `usage` is the share of the allowance used (≤ 1 keeps the budget): for
  `cos=0.999` the allowance is 0.001 of damage 1 − cos. A term the outputs give no figure for cannot be
  judged: `Budget.refuse_unjudgeable` refuses it before any work (`InputError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError

COSINE, CENTRED, IDS = "cosine", "centred cosine (values of one sign)", "ids (agreement)"
FLAT = 1e-6  # a reference sample whose centred norm is below this share of its norm is constant

# --- budget -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """How far a candidate's outputs are from the original's, over every sample of a split; None: no output
    gives that figure (the module docstring). `samples` counts samples, not samples × outputs."""

    cos_min: float | None
    cos_mean: float | None
    rel_max: float | None
    top1: float | None
    samples: int
    measures: dict[str, str] = field(default_factory=dict, compare=False)  # output → how it was compared
    cos_samples: np.ndarray | None = field(default=None, repr=False, compare=False)
    rel_samples: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "cos_min": self.cos_min,
            "cos_mean": self.cos_mean,
            "rel_max": self.rel_max,
            "top1": self.top1,
            "samples": self.samples,
            "measures": self.measures,
        }

    @classmethod
    def from_json(cls, data: dict) -> Metrics:
        """The figures of `to_json` (without the per-sample arrays)."""
        figures = {k: data[k] for k in ("cos_min", "cos_mean", "rel_max", "top1", "samples")}
        return cls(**figures, measures=data.get("measures", {}))

    def describe(self, mean: bool = True) -> str:
        """The figures there are ("cos min …, mean …, rel max …, top1 …"), and the measure of any output not
        compared by its plain cosine."""
        parts = []
        if self.cos_min is not None and self.cos_mean is not None:
            parts.append(f"cos min {self.cos_min:.6f}" + (f", mean {self.cos_mean:.6f}" if mean else ""))
        if self.rel_max is not None:
            parts.append(f"rel max {self.rel_max:.3g}")
        if self.top1 is not None:
            parts.append(f"top1 {self.top1:.4f}")
        other = {name: how for name, how in self.measures.items() if how != COSINE}
        if other:
            parts.append("by " + ", ".join(f"{how}: {name}" for name, how in sorted(other.items())))
        return ", ".join(parts) if parts else "no output could be compared"


def _kept(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Which entries of `values` count: all, or those of the tokens a [batch, seq] mask keeps."""
    if mask is not None and values.ndim >= 2 and values.shape[:2] == mask.shape:
        return np.broadcast_to((mask != 0).reshape(mask.shape + (1,) * (values.ndim - 2)), values.shape)
    return np.ones(values.shape, dtype=bool)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row of two [samples, n] arrays: their cosine (1 where both rows are zero)."""
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    return np.where(both_zero, 1.0, (a * b).sum(axis=1) / np.maximum(na * nb, 1e-300))


def _centred(a: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Each row of `a` ([samples, n]) less its mean over the entries `keep` marks, which alone stay non-zero."""
    counts = np.maximum(keep.sum(axis=1, keepdims=True), 1)
    return (a - a.sum(axis=1, keepdims=True) / counts) * keep


def _one_sign(references: list[dict[str, np.ndarray]]) -> set[str]:
    """The float outputs whose values never change sign over the split (zero counts as either sign)."""
    signs: dict[str, set[bool]] = {}
    for reference in references:
        for name, ref in reference.items():
            if ref.dtype.kind == "f" and ref.size:
                found = signs.setdefault(name, set())
                found.update(({True} if np.nanmax(ref) > 0 else set()) | ({False} if np.nanmin(ref) < 0 else set()))
    return {name for name, found in signs.items() if len(found) < 2}


def compare(
    references: list[dict[str, np.ndarray]],
    candidates: list[dict[str, np.ndarray]],
    masks: list[np.ndarray | None] | None = None,
) -> Metrics:
    """Per-sample cosine and relative error of the float outputs, id and arg-max agreement (module docstring)."""
    cosines, rels, agree, positions, samples = [], [], 0, 0, 0
    measures: dict[str, str] = {}
    one_sign = _one_sign(references)
    masks = masks or [None] * len(references)
    for reference, candidate, mask in zip(references, candidates, masks, strict=False):
        samples += max((ref.shape[0] for ref in reference.values() if ref.ndim), default=1)
        for name, ref in reference.items():
            got = candidate[name]
            if ref.dtype.kind in "iub":  # ids
                measures[name] = IDS
                keep = _kept(ref, mask)
                agree += int((ref == got)[keep].sum())
                positions += int(keep.sum())
                continue
            if ref.dtype.kind != "f":
                measures[name] = f"not compared ({ref.dtype})"
                continue
            measures[name] = CENTRED if name in one_sign else COSINE
            a, b = ref.astype(np.float64), got.astype(np.float64)
            keep = _kept(a, mask)
            a, b = a * keep, b * keep
            if a.ndim == 0:
                a, b, keep = a.reshape(1, 1), b.reshape(1, 1), keep.reshape(1, 1)
            flat_a, flat_b, flat_keep = (
                a.reshape(a.shape[0], -1),
                b.reshape(b.shape[0], -1),
                keep.reshape(a.shape[0], -1),
            )
            cos = _cosines(flat_a, flat_b)
            if name in one_sign:
                centred_a, centred_b = _centred(flat_a, flat_keep), _centred(flat_b, flat_keep)
                shaped = np.linalg.norm(centred_a, axis=1) > FLAT * np.linalg.norm(flat_a, axis=1)
                cos = np.where(shaped, _cosines(centred_a, centred_b), cos)
            cosines.append(np.where(np.isfinite(flat_b).all(axis=1), cos, -1.0))
            scale = np.abs(flat_a).max(axis=1)
            diff = np.abs(flat_a - flat_b).max(axis=1)
            rel = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), diff)
            rels.append(np.where(np.isfinite(rel), rel, np.inf))
            if a.ndim >= 2 and a.shape[-1] > 1:
                top_a, top_b = a.argmax(axis=-1), b.argmax(axis=-1)
                chosen = keep.any(axis=-1)
                agree += int((top_a == top_b)[chosen].sum())
                positions += int(chosen.sum())
    cos_all = np.concatenate(cosines) if cosines else None
    rel_all = np.concatenate(rels) if rels else None
    return Metrics(
        None if cos_all is None else float(cos_all.min()),
        None if cos_all is None else float(cos_all.mean()),
        None if rel_all is None else float(rel_all.max()),
        None if positions == 0 else agree / positions,
        samples,
        measures,
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

    def terms(self, metrics: Metrics) -> list[tuple[str, float, float | None]]:
        """(term, its bound, the figure `metrics` gives for it or None) for each term given."""
        figures = {"cos": metrics.cos_min, "rel": metrics.rel_max, "top1": metrics.top1}
        return [(key, bound, figures[key]) for key, bound in self._given()]

    def refuse_unjudgeable(self, metrics: Metrics, where: str) -> None:
        """`InputError` when a term has no figure in `metrics` (e.g. `cos=` on a model whose outputs are ids):
        a budget judged on nothing would be met by any model."""
        missing = [key for key, _, figure in self.terms(metrics) if figure is None]
        if not missing:
            return
        outputs = ", ".join(f"{name}: {how}" for name, how in sorted(metrics.measures.items())) or "none"
        usable = [
            k for k, f in (("cos", metrics.cos_min), ("rel", metrics.rel_max), ("top1", metrics.top1)) if f is not None
        ]
        raise InputError(
            f"{where}: budget {self}: the model's outputs ({outputs}) give no figure for {', '.join(missing)}, so it "
            "cannot judge them; "
            + (f"budget them with {', '.join(k + '=V' for k in usable)}" if usable else "no budget can judge them")
        )

    def usage(self, metrics: Metrics) -> float:
        """The share of the allowance used (≤ 1 keeps the budget); the worst over the terms. A term without a
        figure (refused before, by `refuse_unjudgeable`) counts as missed."""
        used = []
        for key, bound, figure in self.terms(metrics):
            if figure is None:
                used.append(math.inf)
            elif key == "rel":
                used.append(_share(figure, bound))
            else:
                used.append(_share(1 - figure, 1 - bound))
        return max(used) if used else 0.0

    def holds(self, metrics: Metrics, margin: float = 1.0) -> bool:
        return self.usage(metrics) <= margin

    def _given(self) -> list[tuple[str, float]]:
        return [(k, v) for k, v in (("cos", self.cos), ("rel", self.rel), ("top1", self.top1)) if v is not None]

    def __str__(self) -> str:
        return ",".join(f"{k}={np.format_float_positional(v, trim='-')}" for k, v in self._given())


def _share(used: float, allowed: float) -> float:
    if not math.isfinite(used):
        return math.inf
    if allowed <= 0:
        return 0.0 if used <= 0 else math.inf
    return max(used, 0.0) / allowed
