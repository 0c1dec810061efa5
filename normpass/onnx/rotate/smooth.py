"""Smoothing: a calibrated per-feature scale moved from a norm's output into the linear layers that read it.

A linear layer contracts its input x over the last axis (the features) with the input rows of a
constant weight W: x·W. For any s > 0 per feature, x·W = (x ⊘ s)·(diag(s)·W), so the pair
(x ⊘ s, diag(s)·W) computes the same thing, and a quantizer that sees x per tensor and W per output
channel sees a feature of x that is s_j times larger than the others shrunk by s_j, its weight row
grown by s_j. SmoothQuant (Xiao et al., 2023) picks, over calibration data,

    s_j = max|x_j|^α / max|W_j|^(1−α)        (max|W_j|: the largest |weight| in row j of every reader)

with α = 0.5 balancing the two sides. A norm's output is where transformers keep their outlier
features (γ writes them), and in a post-LN model no rotation reaches it (docs/rotation.md): on
all-MiniLM-L6-v2 under dynamic INT8 the held-out worst sentence goes from cosine 0.978–0.984 to
0.985–0.992, and with the MLP down projections kept in fp32 to 0.993 and more (docs/BENCHMARKS.md).

Sites (`find_sites`): the output y of every norm (one op or a matched pattern; after the fold the RMS
ops it emitted) that at least one linear layer reads along y's last axis with a constant weight
(`rotator.reader_weight`: `MatMul`, `Gemm`, `Conv`), except

* a norm on a rotated stream: the rotation has already spread its features' outliers evenly, and on
  DINOv2-S smoothing the rotated model raised its error under static INT8;
* y of unknown width (refused, with the reason).

Every linear reader takes diag(s) into its weight's input rows (a new initializer; a weight that some
other node reads too keeps its values there). x ⊘ s is then computed

* **in the norm**, free, where y has no other reader and is no graph output, and the norm's γ (and β,
  if any) are constants of y's width: γ ⊘ s and β ⊘ s (a pre-LN model's norms, read by linear layers
  only);
* **by one `Mul`** by 1/s in front of the linear readers, the others reading y as it was (a post-LN
  model, whose residual `Add` reads y too): one elementwise op per site.

s is kept within [1/limit, limit] for the model's float type (`core.stream.scale_limit`: 16 in
float16), a feature never seen nonzero gets s at that bound's low end, so no value overflows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from ...core.graph import ZeroMeanGraph
from ...core.stream import scale_limit
from ..fold.targets import value_readers
from ..graph.constants import constant_values, is_constant
from ..graph.frontend import OnnxGraph
from ..graph.values import name_of

EPSILON = 1e-5  # the floor of either maximum, as SmoothQuant's reference code has it
DEFAULT_ALPHA = 0.5


@dataclass(frozen=True)
class LinearReader:
    """A layer contracting y's features with the constant input `weight` along that weight's `axis`."""

    node: ir.Node
    weight: int
    axis: int


@dataclass(frozen=True)
class SmoothSite:
    """A norm output `y` and its linear readers; `in_norm`: x ⊘ s goes into the norm's γ and β, else a `Mul`."""

    norm: str
    y: ir.Value
    readers: tuple[LinearReader, ...]
    in_norm: bool
    gamma: ir.Value | None = None
    beta: ir.Value | None = None

    @property
    def tensor(self) -> str:
        return name_of(self.y)

    def to_json(self) -> dict:
        return {
            "norm": self.norm,
            "tensor": self.tensor,
            "readers": [name_of(r.node) for r in self.readers],
            "placement": "norm" if self.in_norm else "mul",
        }


@dataclass
class SmoothPlan:
    """The norm outputs that smooth (`sites`), the others with why not (`refused`: norm → reason), and the norms
    left alone because their stream rotates (`rotated`)."""

    sites: list[SmoothSite]
    refused: dict[str, str] = field(default_factory=dict)
    rotated: list[str] = field(default_factory=list)
    alpha: float = DEFAULT_ALPHA

    @property
    def muls(self) -> int:
        return sum(not site.in_norm for site in self.sites)

    @property
    def summary(self) -> str:
        rotated = f"; {len(self.rotated)} on rotated streams left alone" if self.rotated else ""
        return (
            f"{len(self.sites)} norm outputs smoothed (α {self.alpha:g}), {self.muls} of them by an inserted Mul"
            f"{rotated}"
        )

    def to_json(self) -> dict:
        return {
            "alpha": self.alpha,
            "smoothed": [site.to_json() for site in self.sites],
            "refused": [{"norm": name, "reason": reason} for name, reason in self.refused.items()],
            "on_rotated_streams": list(self.rotated),
        }


def _may_be_linear(node: ir.Node, y: ir.Value) -> bool:
    """Whether `node` could be a linear reader of `y` if y's shape were known: a MatMul, Gemm or Conv reading y
    first, with a constant second input."""
    inputs = list(node.inputs)
    weight = inputs[1] if len(inputs) > 1 else None
    return node.op_type in ("MatMul", "Gemm", "Conv") and inputs[0] is y and weight is not None and is_constant(weight)


def _feature_constant(value: ir.Value | None, width: int) -> bool:
    values = constant_values(value) if value is not None and is_constant(value) else None
    return values is not None and values.size == width and values.shape[-1] == width


def find_sites(ctx: OnnxGraph, zmg: ZeroMeanGraph, rotated: set[str], reader_weight, alpha: float) -> SmoothPlan:
    """Which norm outputs smooth, and how (see the module docstring). `reader_weight(ctx, node, index, axis)`
    names a linear layer's weight input and its input-feature axis (`rotator.reader_weight`)."""
    plan = SmoothPlan([], alpha=alpha)
    for norm in zmg.norms:
        match = norm.ref
        y = match.y
        shape = ctx.shapes.get(name_of(y))
        readers = value_readers(y)
        linear = []
        for node in readers:
            indices = [i for i, value in enumerate(node.inputs) if value is y]
            found = reader_weight(ctx, node, indices[0], len(shape) - 1) if shape and len(indices) == 1 else None
            if found is not None:
                linear.append(LinearReader(node, *found))
        if not linear and (shape or not any(_may_be_linear(node, y) for node in readers)):
            continue  # nothing to smooth into
        if norm.name in rotated:
            plan.rotated.append(norm.name)
            continue
        width = shape[-1] if shape else None
        if not isinstance(width, int):
            plan.refused[norm.name] = f"{name_of(y)} has no static width; its features cannot be scaled"
            continue
        in_norm = (
            len(linear) == len(readers)
            and not y.is_graph_output()
            and _feature_constant(match.gamma, width)
            and (match.beta is None or _feature_constant(match.beta, width))
        )
        gamma, beta = (match.gamma, match.beta) if in_norm else (None, None)
        plan.sites.append(SmoothSite(norm.name, y, tuple(linear), in_norm, gamma, beta))
    return plan


def _weight(reader: LinearReader) -> np.ndarray:
    values = constant_values(reader.node.inputs[reader.weight])
    assert values is not None  # `reader_weight` found a constant weight
    return values


def _rows(values: np.ndarray, axis: int) -> np.ndarray:
    """The largest |value| of each index along `axis`."""
    others = tuple(a for a in range(values.ndim) if a != axis % values.ndim)
    return np.abs(values.astype(np.float64)).max(axis=others) if others else np.abs(values.astype(np.float64))


def weight_rows(site: SmoothSite) -> np.ndarray:
    """max|W_j|: the largest |weight| of each input feature j over every linear reader of the site."""
    return np.max([_rows(_weight(reader), reader.axis) for reader in site.readers], axis=0)


def smoothing_scale(absmax: np.ndarray, rows: np.ndarray, alpha: float, dtype: np.dtype) -> np.ndarray:
    """s_j = max|x_j|^α / max|W_j|^(1−α), both maxima floored at `EPSILON`, kept within the float type's
    `scale_limit`."""
    scale = np.maximum(absmax, EPSILON) ** alpha / np.maximum(rows, EPSILON) ** (1.0 - alpha)
    limit = scale_limit(np.dtype(dtype).name)
    return np.clip(scale, 1.0 / limit, limit)
