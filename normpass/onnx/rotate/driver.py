"""The rotation pass for ONNX models: fold → prove which residual streams rotate → rotate them → verify.

With calibration inputs (`RotateOptions.calib`), attention's key biases are centred too before the check
(`onnx/rotate/keys.py`: exact, softmax ignores a constant per row), so that a quantizer sees narrower scores;
with `RotateOptions.smooth` too, the outputs of the norms no rotation reached are smoothed
(`onnx/rotate/smooth.py`: a calibrated per-feature scale moved into the linear layers that read them).

1. **Fold** (`fold_onnx`): every provable LayerNorm becomes an RMS op with γ and β migrated into the
   linear layers it feeds; a norm whose β can go nowhere is folded too (`fold_with_beta_add`: a
   LayerNorm would block the rotation), keeping γ in the RMS op and β as an `Add`.
2. **Prove** which tensors form each residual stream and refuse the others with the node and the reason
   (`rotator.plan_streams`).
3. **Rotate** each provable stream by its own Q (`core/orthogonal.rotation_matrix`: a seeded randomised
   Hadamard matrix by default) through `rotator.Rotator`: writers' output features `W → W·Q`, readers'
   input features `W → Qᵀ·diag(γ)·W`; no op is added.
4. **Verify** against the original model, as `fold` does.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ... import __version__
from ...core.orthogonal import KINDS, rotation_matrix
from ...core.plan import FoldPlan
from ...core.rotation import RotationPlan
from ...errors import InputError
from ..calibrate import CalibData, batch_size_for
from ..fold import FoldOptions, FoldResult, ModelSource, fold_onnx
from ..graph.export import export_model
from ..graphsurgeon import from_graphsurgeon
from ..runtime import decode
from ..runtime.verify import checked, structure
from .features import feature_statistics
from .keys import KeyPlan, find_sites
from .online import DEFAULT_BLOCK, SEED_OFFSET, OnlinePlan
from .online import METADATA_KEY as KEEP_FP32
from .online import find_sites as find_online_sites
from .rotator import Rotator, plan_streams, reader_weight
from .smooth import DEFAULT_ALPHA, SmoothPlan
from .smooth import find_sites as find_smooth_sites


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
    notes = []
    # found before smoothing rewires the readers of norm outputs, applied after it
    online = None if options.online_block is None else find_online_sites(rotator.ctx, rotator.zmg, options.online_block)
    if options.calib is not None:
        keys = find_sites(rotator.ctx)
        if options.smooth is not None:
            smoothing = _smoothing(rotator, rotation, options.smooth)
        wanted = [site.keys for site in keys.sites] + [site.tensor for site in (smoothing.sites if smoothing else [])]
        size, note = batch_size_for(rotator.ctx.structure, options.calib_data.batch_size, name)
        notes += [note] if note else []
        config = options.calib_data.config or decode.read_config(model)  # a GenAI folder's decoder
        data = dataclasses.replace(options.calib_data, batch_size=size, config=config)
        stats = feature_statistics(rotator.ctx, wanted, options.calib, data)  # checked even if unused
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
        notes=notes,
        rotation=rotation,
        matrices=matrices,
        keys=keys,
        smoothing=smoothing,
        online=online,
    )
