"""Online rotation: a block-diagonal orthogonal matrix computed at run time in front of the MLP's down projections.

A linear layer contracts its input x over the features with its weight W: x·W. For any orthogonal
R, x·W = (x·R)·(Rᵀ·W), so the layer may read x·R if its weight becomes Rᵀ·W. Offline, R would have
to go into whatever writes x; the input of an MLP's second layer is written by an elementwise
nonlinearity (GELU, ReLU, SiLU ⊙ gate), which no matrix passes, so R is computed online: QuaRot's
online Hadamard. Here R = blockdiag(H, …, H), H a seeded randomised Hadamard matrix of order b
(`core/orthogonal.rotation_matrix`), computed as

    Reshape(x, [..., K/b, b]) → MatMul(·, H) → Reshape(·, [..., K])      (b·K multiply-adds per row)

and the layer's weight rows, block g, become Hᵀ·W_g (a `Gemm` with transB: its columns, W_g·H). The
outlier features of x (29–92× their RMS after MiniLM's GELU) are spread over their block, so a
per-tensor INT8 quantizer of x·R sees a range set by many features instead of one. The inserted
`MatMul` must stay in floating point: quantized, it would see x itself. Its nodes are named
`<layer>.online_rotation` and listed in the model's metadata (`normpass.keep_fp32`), to pass to a
quantizer's `nodes_to_exclude`.

Sites (`find_sites`): every `MatMul` (or `Gemm` without transA) with a constant two-dimensional weight
mapping K input features to N < K (an MLP's second layer, d_ff → d) that does not read a norm's
output (grouped-query K/V projections also map more features to fewer; their input is a norm's, which
a rotation of the stream or smoothing reaches offline), whose input has a known rank and K divisible
by b; the others among them are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from ...core.graph import ZeroMeanGraph
from ..graph.constants import constant_values, is_constant
from ..graph.frontend import OnnxGraph
from ..graph.values import attr, name_of

DEFAULT_BLOCK = 64
SEED_OFFSET = 1000  # H is seeded `RotateOptions.rotation_seed` + this, apart from the streams' matrices
SUFFIX = ".online_rotation"  # the inserted MatMuls' names end so
METADATA_KEY = "normpass.keep_fp32"  # the nodes a quantizer must leave in floating point, comma-separated


@dataclass(frozen=True)
class OnlineSite:
    """A down projection `node` that will read its input rotated in blocks; its weight's input features lie
    along `axis` (0: a MatMul's or an untransposed Gemm's rows; 1: a Gemm's with transB)."""

    node: ir.Node
    features: int  # K, the input features
    rank: int  # of the input
    axis: int = 0

    @property
    def name(self) -> str:
        return name_of(self.node)


@dataclass
class OnlinePlan:
    """The down projections that read their input rotated online (`sites`), and the others with why not."""

    block: int
    sites: list[OnlineSite]
    refused: dict[str, str] = field(default_factory=dict)
    matrix: str = ""  # what H is (set when applied)
    keep_fp32: list[str] = field(default_factory=list)  # the inserted MatMuls (set when applied)

    @property
    def summary(self) -> str:
        return f"{len(self.sites)} down projections read their input rotated online (blocks of {self.block})"

    def to_json(self) -> dict:
        return {
            "block": self.block,
            "matrix": self.matrix,
            "rotated": [site.name for site in self.sites],
            "keep_fp32": list(self.keep_fp32),
            "refused": [{"node": name, "reason": reason} for name, reason in self.refused.items()],
        }


def _weight_axis(node: ir.Node) -> int | None:
    """The input-feature axis of a linear layer's weight (input 1): a MatMul's rows, a Gemm's rows or (transB)
    columns; None for anything else (a Gemm with transA, another op)."""
    if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    if node.op_type == "MatMul" and len(node.inputs) == 2:
        return 0
    if node.op_type == "Gemm" and not attr(node, "transA", 0):
        return int(attr(node, "transB", 0))
    return None


def find_sites(ctx: OnnxGraph, zmg: ZeroMeanGraph, block: int) -> OnlinePlan:
    """The down projections of `ctx` whose input can be rotated online in blocks of `block` (module docstring)."""
    plan = OnlinePlan(block, [])
    norm_outputs = {id(norm.ref.y) for norm in zmg.norms}
    for node in ctx.graph:
        axis = _weight_axis(node)
        if axis is None:
            continue
        data, weight = node.inputs[0], node.inputs[1]
        values = constant_values(weight) if weight is not None and is_constant(weight) else None
        if data is None or values is None or values.ndim != 2 or values.shape[axis] <= values.shape[1 - axis]:
            continue
        if id(data) in norm_outputs:
            continue
        features = int(values.shape[axis])
        shape = ctx.shape_of(data)
        if not shape or shape[-1] != features:
            plan.refused[name_of(node)] = f"the rank or the width of its input {name_of(data)} is unknown"
        elif features % block:
            plan.refused[name_of(node)] = f"its {features} input features are not a multiple of the block {block}"
        else:
            plan.sites.append(OnlineSite(node, features, len(shape), axis))
    return plan
