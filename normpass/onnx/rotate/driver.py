"""The rotation pass for ONNX models: fold → prove which residual streams rotate → rotate them → verify.

With calibration inputs (`RotateOptions.calib`), attention's key biases are centred too before the check
(`onnx/rotate/keys.py`: exact, softmax ignores a constant per row), so that a quantizer sees narrower scores;
with `RotateOptions.smooth` too, the outputs of the norms no rotation reached are smoothed
(`onnx/rotate/smooth.py`: a calibrated per-feature scale moved into the linear layers that read them).

A residual stream read only by RMSNorms without affine (and residual adds) is invariant under any
orthogonal Q: RMSNorm(xQ) = RMSNorm(x)·Q (DESIGN §2b, `core/rotation.py`). So:

1. **Fold** (`fold_onnx`): every provable LayerNorm becomes an RMS op with γ and β migrated into the
   linear layers it feeds; a norm whose β can go nowhere is folded too (`fold_with_beta_add`: a
   LayerNorm would block the rotation), keeping γ in the RMS op and β as an `Add`.
2. **Prove** (`core/rotation.plan_rotation`) on the folded model's zero-mean graph which tensors form
   each stream, every writer a constant linear map or a constant, every reader an RMSNorm over the
   whole hidden axis, a residual `Add`, or a linear layer (`reader_weight`, below); refuse the others
   with the node and the reason. An RMS op that kept γ gives it up here: its readers absorb it.
3. **Rotate** each provable stream by its own Q (`core/orthogonal.rotation_matrix`: a seeded
   randomised Hadamard matrix by default): writers' output features `W → W·Q` (weights, biases,
   embedding tables, constants added into the stream, LayerScales after a layer), readers' input
   features `W → Qᵀ·diag(γ)·W`, constants after a norm that kept γ `c → (c⊘γ)·Q`, that norm's γ → ones.
   Every changed constant is a new initializer (copy-on-write), shared by every use that takes the
   same map, so weights tied before stay tied where their uses are rotated alike; no op is added.
4. **Verify** against the original model, as `fold` does.

Readers (`reader_weight`): input 0 of `MatMul` contracted over its last axis (weight: axis −2),
`Gemm` over axis 1 (or 0 with transA; weight: axis 0, or 1 with transB), and `Conv` /
`ConvTranspose` with group 1 over the channel axis 1 (weight axis 1 and 0), each with a constant weight.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ... import __version__
from ...core.algebra import rotate, scale_along
from ...core.graph import ZNode
from ...core.orthogonal import KINDS, rotation_matrix
from ...core.plan import FoldPlan
from ...core.rotation import RotationPlan, Stream, gamma_of, plan_rotation
from ...errors import InputError, UnsupportedModelError
from ..fold.driver import FoldOptions, FoldResult, ModelSource, checked, fold_onnx
from ..fold.rewrite import Rewriter
from ..fold.targets import new_initializer
from ..graph.constants import is_constant
from ..graph.export import export_model
from ..graph.frontend import OnnxGraph, build_zero_mean_graph, load_graph
from ..graph.values import attr, input_at, input_dims, name_of
from ..graphsurgeon import from_graphsurgeon
from ..runtime.verify import structure
from .features import CalibData, FeatureStats, feature_statistics
from .keys import KeyPlan, find_sites
from .online import DEFAULT_BLOCK, SEED_OFFSET, SUFFIX, OnlinePlan
from .online import METADATA_KEY as KEEP_FP32
from .online import find_sites as find_online_sites
from .smooth import DEFAULT_ALPHA, SmoothPlan, smoothing_scale, weight_rows
from .smooth import find_sites as find_smooth_sites

STANDARD = ("", "ai.onnx")
R = TypeVar("R", bound="Rotator")


@dataclass
class RotateOptions:
    rotation: str = "hadamard"  # "hadamard": randomised Hadamard where the size allows, else random orthogonal
    rotation_seed: int = 0  # stream i is rotated by the matrix of seed rotation_seed + i
    target: str = "ort"  # the fold's options (FoldOptions)
    provider: str = "cuda"
    rms_op: str | None = None
    insert_centering: bool = True
    fuse_skip: bool | None = None
    verify: bool = True
    input_shapes: dict = field(default_factory=dict)
    seed: int = 0  # of the verification inputs
    calib: object = None  # calibration inputs (`features.feature_statistics`): with them, keys are centred too
    calib_data: CalibData = field(default_factory=CalibData)
    smooth: float | None = None  # SmoothQuant's α (`smooth.py`; needs `calib`): smooth the unrotated norm outputs
    online_block: int | None = None  # MLP down projections read their input rotated online in blocks (`online.py`)

    def fold_options(self) -> FoldOptions:
        """The fold that prepares the rotation: affine migrated, every provable norm folded, not verified alone."""
        if self.rotation not in KINDS:
            raise InputError(f"rotation {self.rotation!r}: choose one of {', '.join(KINDS)}")
        if self.smooth is not None and self.calib is None:
            raise InputError("smoothing needs calibration inputs: pass them too (--calib DATA)")
        if self.smooth is not None and not 0.0 <= self.smooth <= 1.0:
            raise InputError(f"smoothing α {self.smooth}: choose a value from 0 to 1 (0.5 balances)")
        if self.online_block is not None and self.online_block < 2:
            raise InputError(f"online rotation block {self.online_block}: choose a size of 2 or more (64 by default)")
        return FoldOptions(
            target=self.target,
            provider=self.provider,
            rms_op=self.rms_op,
            insert_centering=self.insert_centering,
            migrate_affine=True,
            fold_with_beta_add=True,
            fuse_skip=self.fuse_skip,
            verify=False,
            input_shapes=self.input_shapes,
            seed=self.seed,
        )


@dataclass
class RotateResult(FoldResult):
    """A fold's result (the plan of the fold that came first) with the rotation's: `rotation` says which
    streams were rotated and why the others were not, `matrices` what rotated each (by stream name)."""

    rotation: RotationPlan = field(default_factory=lambda: RotationPlan([]))
    matrices: dict[str, str] = field(default_factory=dict)
    keys: KeyPlan | None = None  # with calibration inputs: whose key biases were centred, why not the others
    smoothing: SmoothPlan | None = None  # with `smooth`: which norm outputs were smoothed, and how
    online: OnlinePlan | None = None  # with `online_block`: which down projections read their input rotated

    @property
    def rotated(self) -> int:
        return len(self.rotation.rotatable)

    def report(self) -> dict:
        rotation = self.rotation.to_json()
        for stream in rotation["streams"]:
            stream["matrix"] = self.matrices.get(stream["stream"])
        keys = {} if self.keys is None else {"keys": self.keys.to_json()}
        smoothing = {} if self.smoothing is None else {"smoothing": self.smoothing.to_json()}
        online = {} if self.online is None else {"online_rotation": self.online.to_json()}
        return super().report() | {"rotation": rotation} | keys | smoothing | online


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


def _fold_and_plan(model, options: RotateOptions, name: str) -> tuple[FoldResult, Rotator, RotationPlan]:
    folded = fold_onnx(model, options.fold_options(), name)
    return (folded, *plan_streams(folded, folded.ir_model, name, Rotator))


def _smoothing(rotator: Rotator, rotation: RotationPlan, alpha: float) -> SmoothPlan:
    on_rotated = {norm for stream in rotation.rotatable for norm in stream.norms}
    return find_smooth_sites(rotator.ctx, rotator.zmg, on_rotated, reader_weight, alpha)


def inspect_rotation(
    model: ModelSource, options: RotateOptions | None = None, name: str = "model"
) -> tuple[FoldPlan, RotationPlan, KeyPlan, SmoothPlan, OnlinePlan]:
    """What `rotate_onnx` would fold, which streams it could rotate, with calibration data whose keys it
    could centre and which norm outputs it could smooth, and which down projections it could rotate online,
    and why the others not (nothing verified, no data read)."""
    options = options or RotateOptions()
    folded, rotator, rotation = _fold_and_plan(from_graphsurgeon(model), options, name)
    RemoveUnusedNodesPass()(rotator.ctx.model)  # readers left over by the fold are not readers
    smoothing = _smoothing(rotator, rotation, DEFAULT_ALPHA if options.smooth is None else options.smooth)
    online = find_online_sites(rotator.ctx, rotator.zmg, options.online_block or DEFAULT_BLOCK)
    return folded.plan, rotation, find_sites(rotator.ctx), smoothing, online


def rotate_onnx(model: ModelSource, options: RotateOptions | None = None, name: str = "model") -> RotateResult:
    """Fold `model` (a ModelProto, not modified, an .onnx path, or an onnx-graphsurgeon `Graph`), rotate every
    provable residual stream, and verify the result against `model` unless told not to."""
    options = options or RotateOptions()
    options.fold_options()  # bad options are refused before the model is read
    model = from_graphsurgeon(model)
    start = time.perf_counter()
    folded, rotator, rotation = _fold_and_plan(model, options, name)
    seconds = {"fold": time.perf_counter() - start}
    start = time.perf_counter()
    matrices = {}
    for index, stream in enumerate(rotation.rotatable):
        assert stream.width is not None  # a stream without a static width is refused
        matrix, matrices[stream.name] = rotation_matrix(stream.width, options.rotation, options.rotation_seed + index)
        rotator.rotate_stream(stream, matrix, str(index))
    RemoveUnusedNodesPass()(rotator.ctx.model)
    keys = smoothing = None
    # found before smoothing rewires the readers of norm outputs, applied after it
    online = None if options.online_block is None else find_online_sites(rotator.ctx, rotator.zmg, options.online_block)
    if options.calib is not None:
        keys = find_sites(rotator.ctx)
        if options.smooth is not None:
            smoothing = _smoothing(rotator, rotation, options.smooth)
        wanted = [site.keys for site in keys.sites] + [site.tensor for site in (smoothing.sites if smoothing else [])]
        stats = feature_statistics(rotator.ctx, wanted, options.calib, options.calib_data)  # checked even if unused
        rotator.centre_keys(keys, stats)
        if smoothing is not None:
            rotator.smooth(smoothing, stats)
        RemoveUnusedNodesPass()(rotator.ctx.model)
    if online is not None and online.sites:
        matrix, online.matrix = rotation_matrix(online.block, options.rotation, options.rotation_seed + SEED_OFFSET)
        rotator.rotate_online(online, np.asarray(matrix, dtype=np.float64))
        RemoveUnusedNodesPass()(rotator.ctx.model)  # the weights the rotated-back ones replaced
    rotator.ctx.graph.sort()
    metadata = {
        "normpass.version": __version__,
        "normpass.rotated": f"{len(rotation.rotatable)} of {len(rotation.streams)} residual streams rotated",
        "normpass.rotations": "; ".join(f"{stream}: {what}" for stream, what in matrices.items()),
    }
    if keys is not None:
        metadata["normpass.keys_centred"] = f"{len(keys.sites)} of {keys.total} attentions"
    if smoothing is not None:
        metadata["normpass.smoothed"] = smoothing.summary
    if online is not None:
        metadata["normpass.online_rotation"] = f"{online.summary}: {online.matrix or 'none'}"
        metadata[KEEP_FP32] = ",".join(online.keep_fp32)
    rotated = export_model(rotator.ctx.model, rotator.docs, metadata)
    changed = folded.modified or bool(
        rotation.rotatable or (keys and keys.sites) or (smoothing and smoothing.sites) or (online and online.sites)
    )
    seconds["rotate"] = time.perf_counter() - start
    done = f"{len(rotation.rotatable)} of {len(rotation.streams)} residual streams rotated"
    before = structure(Path(model) if isinstance(model, (str, os.PathLike)) else model)
    comparison = checked(model, rotated, before, options, name, done, ("rotate", "rotated"), seconds, changed)
    return RotateResult(
        rotated,
        folded.plan,
        comparison,
        folded.affine_notes,
        seconds,
        modified=changed,
        emitted=folded.emitted,
        rotation=rotation,
        matrices=matrices,
        keys=keys,
        smoothing=smoothing,
        online=online,
    )
