"""The rotation's rewriter: which tensors of a folded model form each residual stream, and the rewrite
of one stream by an orthogonal Q (the pass around it: `driver.py`).

A residual stream read only by RMSNorms without affine (and residual adds) is invariant under any
orthogonal Q: RMSNorm(xQ) = RMSNorm(x)·Q (DESIGN §2b, `core/rotation.py`). So:

* **Prove** (`plan_streams`: `core/rotation.plan_rotation`) on the folded model's zero-mean graph which
  tensors form each stream, every writer a constant linear map or a constant, every reader an RMSNorm over
  the whole hidden axis, a residual `Add`, or a linear layer (`reader_weight`, below); refuse the others
  with the node and the reason. An RMS op that kept γ gives it up here: its readers absorb it.
* **Rotate** (`Rotator.rotate_stream`) each provable stream by its own Q: writers' output features
  `W → W·Q` (weights, biases, embedding tables, constants added into the stream, LayerScales after a
  layer), readers' input features `W → Qᵀ·diag(γ)·W`, constants after a norm that kept γ `c → (c⊘γ)·Q`,
  that norm's γ → ones. Every changed constant is a new initializer (copy-on-write), shared by every use
  that takes the same map, so weights tied before stay tied where their uses are rotated alike; no op is
  added. The calibrated exact transforms rewrite through it too (`centre_keys`, `smooth`, `rotate_online`).

Readers (`reader_weight`): input 0 of `MatMul` contracted over its last axis (weight: axis −2),
`Gemm` over axis 1 (or 0 with transA; weight: axis 0, or 1 with transB), and `Conv` /
`ConvTranspose` with group 1 over the channel axis 1 (weight axis 1 and 0), each with a constant weight.
`slice` cuts streams through a subclass (`slice/cut.Slicer`).
"""

from __future__ import annotations

from functools import partial
from typing import TypeVar

import numpy as np
import onnx
import onnx_ir as ir

from ...core.algebra import rotate, scale_along
from ...core.graph import ZNode
from ...core.rotation import RotationPlan, Stream, gamma_of, plan_rotation
from ...errors import UnsupportedModelError
from ..fold import FoldResult
from ..fold.rewrite import Rewriter
from ..fold.targets import new_initializer
from ..graph.constants import is_constant
from ..graph.frontend import OnnxGraph, build_zero_mean_graph, load_graph
from ..graph.values import attr, input_at, input_dims, name_of
from .features import FeatureStats
from .keys import KeyPlan
from .online import SUFFIX, OnlinePlan
from .smooth import SmoothPlan, smoothing_scale, weight_rows

STANDARD = ("", "ai.onnx")
R = TypeVar("R", bound="Rotator")


def reader_weight(ctx: OnnxGraph, node: ir.Node, index: int, axis: int) -> tuple[int, int] | None:
    """(weight input, its input-feature axis) if `node` contracts input `index` along `axis` with a constant weight."""
    data, weight = input_at(node, 0), input_at(node, 1)
    if index != 0 or node.domain not in STANDARD or data is None or weight is None or not is_constant(weight):
        return None
    rank, weight_rank = (_rank(ctx, t) for t in (data, weight))
    if node.op_type == "MatMul" and rank and weight_rank and axis == rank - 1:
        return 1, max(weight_rank - 2, 0)
    if node.op_type == "Gemm" and axis == 1 - attr(node, "transA", 0):
        return 1, attr(node, "transB", 0)
    if node.op_type in ("Conv", "ConvTranspose") and attr(node, "group", 1) == 1 and axis == 1:
        return 1, 1 if node.op_type == "Conv" else 0
    return None


def _rank(ctx: OnnxGraph, value: ir.Value) -> int:
    """`value`'s rank (`OnnxGraph.shape_of`); 0: unknown."""
    return len(ctx.shape_of(value) or ())


def _reads(ctx: OnnxGraph, node: ZNode, index: int, axis: int) -> bool:
    return isinstance(node.ref, ir.Node) and reader_weight(ctx, node.ref, index, axis) is not None


def _along(values: np.ndarray, axis: int | None, matrix: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """A writer's constant with its output features rotated; one constant along them (axis None) must be zero."""
    if axis is not None:
        return rotate(values, axis, matrix, scale)
    if np.any(values != 0):  # the proof refuses such constants; a broadcast bias of a centred layer is zero
        raise UnsupportedModelError("a constant that is not zero is broadcast along a rotated stream's axis")
    return values


class Rotator(Rewriter):
    """Rotates the streams of a plan in one graph (see the module docstring); `docs` collects per-node notes."""

    def rotate_stream(self, stream: Stream, matrix: np.ndarray, label: str) -> None:
        """Rotate `stream` by `matrix`; `label` tells this stream's copies from another's.

        A constant's rotated copy is shared by every use that takes the same map (the same axis, no γ): an
        embedding table tied to an LM head that reads it as [vocab, hidden] stays one tensor, E·Q.
        """
        gammas = {
            name: gamma_of(self.zmg, self.zmg.norm_by_name(name)).astype(np.float64) for name in stream.moved_gamma
        }
        for centring, scale in stream.writers.items():
            inverse = None if scale is None else 1.0 / gammas[scale]
            along = partial(_along, matrix=matrix, scale=inverse)
            tag = f"rotated:{label}:{'' if scale is None else '/' + scale}"
            self.map_layer(centring, along, tag, f"rotated along their output features ({stream.name})")
        for reader in stream.readers:
            node = self.zmg.nodes[reader.node].ref
            found = reader_weight(self.ctx, node, reader.index, reader.axis)
            assert found is not None  # the plan's readers are those `reader_weight` found
            index, axis = found
            gamma = None if reader.scale is None else gammas[reader.scale]
            self._replace_input(
                node,
                index,
                f"rotated:{label}:{'' if reader.scale is None else '*' + reader.scale}:{axis}",
                lambda v, a=axis, g=gamma: rotate(v, a, matrix, g),
                f"rotated back along their input features ({stream.name})",
                axis,
            )
            moved = "" if reader.scale is None else f", γ of {reader.scale} absorbed"
            self._note(node.name, f"input features rotated back ({stream.name}){moved}")
        for name in stream.moved_gamma:
            match = self.zmg.norm_by_name(name).ref
            for node in match.nodes:
                for index, value in enumerate(node.inputs):
                    if value is match.gamma:
                        self._replace_input(node, index, "unit", np.ones_like, "replaced by ones")
                        self._note(node.name, f"γ moved into the layers it feeds ({stream.name})")

    def centre_keys(self, plan: KeyPlan, stats: dict[str, FeatureStats]) -> None:
        """Subtract each site's mean key (`features.feature_statistics`) from its key bias (`keys`: exact)."""
        for index, site in enumerate(plan.sites):
            mean = stats[site.keys].mean
            self._replace_input(
                site.add,
                site.bias_index,
                f"keys_centred:{index}",
                lambda v, m=mean: (v - m).astype(v.dtype),
                f"centred on the mean key of {site.softmax}",
            )
            self._note(
                name_of(site.add),
                f"key bias centred (mean key subtracted, largest |mean| {np.abs(mean).max():.3g}); "
                f"{site.softmax} unchanged: softmax ignores a constant per row",
            )

    def smooth(self, plan: SmoothPlan, stats: dict[str, FeatureStats]) -> None:
        """Move each site's scale s from its norm output into its linear readers' weights (`smooth`: exact):
        x·W = (x ⊘ s)·(diag(s)·W), x ⊘ s computed by the norm's γ and β or by one inserted `Mul`."""
        for index, site in enumerate(plan.sites):
            dtype = self._dtype(site.y)
            scale = smoothing_scale(stats[site.tensor].absmax, weight_rows(site), plan.alpha, dtype)
            change = f"smoothed for {site.norm}"
            for reader in site.readers:
                self._replace_input(
                    reader.node,
                    reader.weight,
                    f"smoothed:{index}:{reader.axis}",
                    lambda v, a=reader.axis, s=scale: scale_along(v.astype(np.float64), a, s).astype(v.dtype),
                    change,
                    reader.axis,
                )
                self._note(name_of(reader.node), f"input features scaled up by the smoothing of {site.norm}")
            if site.in_norm:
                for node in self.zmg.norm_by_name(site.norm).ref.nodes:
                    for position, value in enumerate(node.inputs):
                        if value is not None and (value is site.gamma or value is site.beta):
                            self._replace_input(
                                node, position, f"smoothed:{index}", lambda v, s=scale: (v / s).astype(v.dtype), change
                            )
                    self._note(node.name, f"output smoothed (features divided by s, α {plan.alpha:g})")
                continue
            inverse = new_initializer(
                self.ctx.graph, self._unique(f"{site.tensor}.smoothing"), (1.0 / scale).astype(dtype)
            )
            smoothed = self._new_value(f"{site.tensor}.smoothed", dtype)
            smoothed.shape = site.y.shape
            mul = ir.node("Mul", [site.y, inverse], outputs=[smoothed], name=self._unique(f"{site.norm}.smoothing"))
            self._note(name_of(mul), f"inserted smoothing of {site.norm}'s output (÷ s, α {plan.alpha:g})")
            self.ctx.graph.append(mul)
            for reader in site.readers:
                for position, value in enumerate(reader.node.inputs):
                    if value is site.y:
                        reader.node.replace_input_with(position, smoothed)

    def rotate_online(self, plan: OnlinePlan, matrix: np.ndarray) -> None:
        """Each site reads x·blockdiag(H) and its weight becomes blockdiag(H)ᵀ·W (`online`: exact)."""
        graph, shared = self.ctx.graph, {}
        block = plan.block
        for site in plan.sites:
            data = site.node.inputs[0]
            assert data is not None  # a site's MatMul reads its input
            dtype = self._dtype(data)
            if dtype not in shared:
                shared[dtype] = new_initializer(graph, self._unique("online_rotation.matrix"), matrix.astype(dtype))
            leading = [0] * (site.rank - 1)  # Reshape's 0 keeps a dim
            split_dims = np.array([*leading, site.features // block, block], dtype=np.int64)
            merge_dims = np.array([*leading, site.features], dtype=np.int64)
            split = new_initializer(graph, self._unique(f"{site.name}.online_split"), split_dims)
            merge = new_initializer(graph, self._unique(f"{site.name}.online_merge"), merge_dims)
            blocks, turned, rotated = (
                self._new_value(f"{name_of(data)}.{part}", dtype) for part in ("blocks", "turned", "rotated")
            )
            rotated.shape = data.shape
            inserted = self._unique(site.name + SUFFIX)
            nodes = [
                ir.node("Reshape", [data, split], outputs=[blocks], name=self._unique(f"{site.name}.online_split")),
                ir.node("MatMul", [blocks, shared[dtype]], outputs=[turned], name=inserted),
                ir.node("Reshape", [turned, merge], outputs=[rotated], name=self._unique(f"{site.name}.online_merge")),
            ]
            for node in nodes:
                self._note(name_of(node), f"online rotation of {site.name}'s input (blocks of {block}; keep in fp32)")
            graph.extend(nodes)
            site.node.replace_input_with(0, rotated)
            self._replace_input(
                site.node,
                1,
                f"online:{block}:{site.axis}",
                lambda v, a=site.axis: _blocks_turned(v, matrix, a).astype(v.dtype),
                f"rotated back in blocks of {block}",
                site.axis,
            )
            self._note(site.name, f"reads its input rotated online in blocks of {block}; weight rows rotated back")
            plan.keep_fp32.append(inserted)


def _blocks_turned(weight: np.ndarray, matrix: np.ndarray, axis: int) -> np.ndarray:
    """The weight of a layer that now reads x·blockdiag(H): blockdiag(H)ᵀ·W, each block of `len(matrix)`
    input rows times Hᵀ (`axis` 0), or for a weight stored transposed (`axis` 1, a Gemm's transB)
    W·blockdiag(H), each block of input columns times H."""
    block = len(matrix)
    wide = weight.astype(np.float64)
    if axis == 0:
        return np.einsum("ji,gjn->gin", matrix, wide.reshape(-1, block, weight.shape[1])).reshape(weight.shape)
    return np.einsum("ngj,ji->ngi", wide.reshape(weight.shape[0], -1, block), matrix).reshape(weight.shape)


def merged_shapes(original: dict, folded: dict, input_dims: set[str]) -> dict:
    """Shapes for the folded graph: the original's, on which the fold's proofs ran (a tensor keeps its name
    and shape through the fold), with the static dims that inference on the folded graph found where the
    original's are unknown (ONNX Runtime's symbolic inference, which knows its contrib ops, may find more).
    Two static dims that disagree become unknown. Symbols are kept only where they mean the same in both:
    the original's own, and the graph inputs' dim names (`input_dims`); another inference's other symbols
    (`unk__3`) are unknown."""

    def dim(ours, theirs):
        if isinstance(ours, int) and isinstance(theirs, int):
            return ours if ours == theirs else None
        return theirs if isinstance(theirs, int) else ours

    merged = {}
    for tensor, shape in folded.items():
        known = original.get(tensor)
        if shape is None or (known is not None and len(known) != len(shape)):
            merged[tensor] = known
        elif known is None:
            merged[tensor] = tuple(d if isinstance(d, int) or d in input_dims else None for d in shape)
        else:
            merged[tensor] = tuple(dim(ours, theirs) for ours, theirs in zip(known, shape, strict=True))
    return merged | {t: s for t, s in original.items() if t not in folded}


def plan_streams(
    folded: FoldResult, model: ir.Model | onnx.ModelProto, name: str, kind: type[R]
) -> tuple[R, RotationPlan]:
    """A rewriter of `kind` over `model` (the fold's result: an `ir.Model` is rewritten in place, a
    `ModelProto` copy is not) and the residual streams the proof finds in it."""
    ctx = load_graph(model, name)
    ctx.shapes.update(merged_shapes(folded.shapes, ctx.shapes, input_dims(ctx.graph)))
    zmg = build_zero_mean_graph(ctx)
    return kind(ctx, zmg, folded.emitted["rms_op"]), plan_rotation(zmg, partial(_reads, ctx))
