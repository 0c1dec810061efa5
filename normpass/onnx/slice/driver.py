"""The slice pass for ONNX models (SliceGPT): fold → prove the streams → their principal bases → cut → judge.

`slice_onnx(model, calibration, SliceOptions(ratio=R))` (docs/slice.md, DESIGN §2c):

1. **Fold and prove**, as `rotate` does (`rotate/rotator.plan_streams`): every provable LayerNorm becomes
   an RMS op with its affine moved into the next layers, and each residual stream read only by such ops
   and by linear layers is found, with every writer and reader. The others stay whole, with the reason
   (`SlicePlan`; `normpass inspect --slice`).
2. **Data.** The calibration inputs (`calibration.load_batches`: .npz, .npy directory, text with a
   tokenizer, batches) are split (`split_batches`, seeded) into a fitting part and a held-out part, or
   all fit and `holdout` is held out.
3. **Bases** (`core/pca.py`): per stream, Σ uᵀu over the unit-length tokens u where its RMS ops read it
   (padding excluded where the model has a mask input), streamed over the fitting batches in float64 and
   summed across processes when a `torch.distributed` group is initialized; its eigenvectors, descending.
   `basis="stream"`: one basis per stream, so no change of basis is needed between its layers; `"layer"`:
   one per piece of the stream an RMS op reads (`core/layers.py`: per norm, as SliceGPT), a k×k shortcut
   Q_a,kᵀ·Q_b,k on each residual edge between two pieces, and each piece fitted in graph order on the
   model whose earlier pieces are already cut (`sequential_covariances`, SliceGPT's sequential fit: one
   calibration pass per piece, each through the model only as far as that piece; at k = d the cuts are
   rotations, so one pass on the unsliced model gives the same bases). The bases of `"layer"` depend on k:
   they are fitted again for every ratio tried.
4. **Cut** (`cut.py`): k = (1 − R)·d rounded to a multiple of `round_to`; writers W·Q_k, readers
   Q_kᵀ·W, the RMS ops over k columns with γ·√(d/k) and ε·d/k.
5. **Judge** on the held-out part against the original (`core/budget.compare`): with a `budget`, a model
   that misses it is refused (`BudgetMissed`, its report attached), unless `write_best`, which tries
   R, R − 0.05, … (above 0) and keeps the largest that meets it. At R = 0 (k = d: a rotation into the
   principal basis) the result must equal the original within the dtype's tolerance and is verified as
   every rewrite is (`runtime.verify.checked`); at R > 0 slicing is not exact, and the budget on held-out
   data is its verification, not a tolerance: the report says which applied.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ... import __version__
from ...calibration import Batch, distinct_holdout, find_mask_input, split_batches
from ...core.budget import Budget, Metrics, compare
from ...core.layers import Shortcut, stream_pieces
from ...core.pca import DEFAULT_ROUND_TO, Basis, Covariance, combine, eigenbasis, sliced_width
from ...core.progress import stage
from ...core.replace import BudgetMissed, ReplaceReport
from ...core.rotation import RotationPlan, Stream
from ...core.stats import token_rows
from ...errors import InputError, InternalError
from ...io import in_memory_proto, skeleton, stored_like
from ..calibrate import (
    CalibData,
    batch_size_for,
    captured,
    fixed_batch,
    input_spec,
    load,
    opened,
    reference_runner,
    refuse_scalar_inputs,
)
from ..fold import FoldResult, ModelSource, fold_onnx
from ..graph.constants import constant_values
from ..graph.export import export_model
from ..graph.frontend import graph_values
from ..graphsurgeon import from_graphsurgeon
from ..rotate import RotateOptions
from ..rotate.rotator import plan_streams
from ..runtime import decode, verify
from ..runtime.verify import check_input_shapes, checked
from .cut import Slicer, slice_refusal
from .recover import Recovery, recover

BASES = ("stream", "layer")  # one basis per stream; one per layer with shortcuts between them (SliceGPT's)
HEADS = ("full", "cut")  # the stream's end (final norm → head) left at full width (SliceGPT's default), or cut
TRAIN_LOSSES = ("mse", "kl")  # `torch/slice_train.py`
TRAIN_PARAMS = ("full", "lora")  # `torch/slice_train.py`
LADDER_STEP = 0.05  # `write_best` tries R, R − 0.05, … down to the last ratio above 0


@dataclass
class SliceOptions:
    """Options of the slice pass (the CLI flag is the name with dashes); the fold's are as for `rotate`."""

    ratio: float = 0.25  # R: k = (1 − R)·d columns kept per stream
    round_to: int = DEFAULT_ROUND_TO  # k a multiple of this (`core/pca.sliced_width`)
    basis: str = "layer"  # one principal basis per norm, with shortcuts (SliceGPT's); "stream": one per stream
    head: str = "cut"  # "full": the stream's end — its final norm and the head reading it — keeps all d columns
    budget: Budget | str | None = None  # e.g. "cos=0.99"; None: judged and reported, never refused
    write_best: bool = False  # on a miss, write the largest ratio of the ladder that meets the budget
    split: tuple[float, float] = (0.75, 0.25)  # fitting, held out (with `holdout`: all fits)
    holdout: object = None  # held-out inputs from elsewhere (the calibration data's forms)
    batch_size: int | None = None  # None: the batch the model fixes, else 16 (`calibrate.batch_size_for`)
    tokenizer: str | None = None
    max_length: int = 128
    mask_input: str | None = None  # default: the rank-2 input named *mask* (`calibration.find_mask_input`)
    samples: int = 64  # of "synthetic" calibration data (seeded random inputs: demos and tests only)
    target: str = "ort"  # the fold's options, as for `rotate`
    provider: str = "cuda"
    rms_op: str | None = None
    insert_centering: bool = True
    fuse_skip: bool | None = None
    verify: bool = True  # at R = 0: verified against the original (at R > 0 the budget judges)
    input_shapes: dict = field(default_factory=dict)  # of the verification inputs (and of synthetic data)
    seed: int = 0  # of the split and of the verification inputs
    recover: float = 0.0  # seconds of recovery (`recover.py`: layer-wise refit on the fitting data) per ratio; 0: none
    recover_ridge: float | None = None  # its pull towards the cut (`core/refit.py`); None: validated per layer
    recover_train: float = 0.0  # seconds of training toward the original per ratio (PyTorch modules only)
    train_lr: float = 1e-5  # its learning rate (AdamW, every parameter; 1e-4 overfit IgLM, docs/slice.md)
    train_loss: str = "mse"  # "mse": relative squared error + cosine of the outputs; "kl": KL of their softmax
    train_params: str = "full"  # "full": every parameter trains; "lora": a rank-`train_rank` update of each matrix
    train_rank: int = 8  # with train_params "lora"
    train_hidden: float = 0.0  # weight of the loss on the stream's states (Q_kᵀ·x of the original's); 0: outputs only

    def checked(self) -> Budget | None:
        """The budget, parsed; bad options refused (`InputError` naming the field) before any model is read.
        Numbers are checked as the command line parses them (a NumPy scalar is a number; a bool is not)
        and stored as Python's own, so that the report is plain JSON."""
        self.ratio = _number("ratio", self.ratio)
        if not 0 <= self.ratio < 1:
            raise InputError(f"ratio {self.ratio}: choose a share of the stream to remove, from 0 up to (not) 1")
        for option in ("round_to", "max_length", "samples"):
            setattr(self, option, _whole(option, getattr(self, option)))
        if self.batch_size is not None:  # None: the batch the model fixes, else 16 (`calibrate.batch_size_for`)
            self.batch_size = _whole("batch_size", self.batch_size)
        self.seed = _whole("seed", self.seed, least=0)
        if self.basis not in BASES:
            raise InputError(
                f"basis {self.basis!r}: choose 'stream' (one per residual stream) or 'layer' (one per norm, "
                "with k×k shortcuts on the residual path, as SliceGPT)"
            )
        if self.head not in HEADS:
            raise InputError(
                f"head {self.head!r}: choose 'full' (the final norm and the head read all d columns, as SliceGPT) "
                "or 'cut' (they read the k kept columns)"
            )
        self.recover = _number("recover", self.recover)
        if not 0 <= self.recover < math.inf:
            raise InputError(f"recover {self.recover}: give the seconds recovery may take (0: no recovery)")
        self.recover_train = _number("recover_train", self.recover_train)
        if not 0 <= self.recover_train < math.inf:
            raise InputError(f"recover_train {self.recover_train}: give the seconds training may take (0: none)")
        self.train_lr = _number("train_lr", self.train_lr)
        if not 0 < self.train_lr < math.inf:
            raise InputError(f"train_lr {self.train_lr}: give a positive learning rate, e.g. 1e-5")
        if self.train_loss not in TRAIN_LOSSES:
            raise InputError(f"train_loss {self.train_loss!r}: choose 'mse' (any output) or 'kl' (logits)")
        if self.train_params not in TRAIN_PARAMS:
            raise InputError(
                f"train_params {self.train_params!r}: choose 'full' (every parameter) or 'lora' (a low-rank update "
                "of each matrix)"
            )
        self.train_rank = _whole("train_rank", self.train_rank)
        self.train_hidden = _number("train_hidden", self.train_hidden)
        if not 0 <= self.train_hidden < math.inf:
            raise InputError(f"train_hidden {self.train_hidden}: give the hidden-state loss's weight (0: none)")
        ridge = self.recover_ridge
        ridge = self.recover_ridge = None if ridge is None else _number("recover_ridge", ridge)
        if ridge is not None and not 0 < ridge < math.inf:
            raise InputError(f"recover_ridge {ridge}: give a positive number, or None to choose it per layer")
        if not isinstance(self.split, (tuple, list)) or len(self.split) != 2:
            raise InputError(f"split {self.split!r}: give two fractions FIT,HELD_OUT, e.g. 0.75,0.25")
        self.split = (_number("split", self.split[0]), _number("split", self.split[1]))
        if min(self.split) < 0 or (self.holdout is None and min(self.split) <= 0):
            raise InputError(f"split {self.split}: give two positive fractions FIT,HELD_OUT, e.g. 0.75,0.25")
        if not (self.budget is None or isinstance(self.budget, (Budget, str, list, tuple))):
            raise InputError(f"budget {self.budget!r}: give it as text, e.g. 'cos=0.99,rel=0.05', or a Budget")
        budget = self.budget if self.budget is None or isinstance(self.budget, Budget) else Budget.parse(self.budget)
        if self.write_best and budget is None:
            raise InputError("write_best writes the largest ratio that meets a budget: give one (e.g. cos=0.99)")
        self.rotate_options().fold_options()
        return budget

    def rotate_options(self) -> RotateOptions:
        """The rotation's options for the fold and proof that come first (not verified alone)."""
        return RotateOptions(
            target=self.target,
            provider=self.provider,
            rms_op=self.rms_op,
            insert_centering=self.insert_centering,
            fuse_skip=self.fuse_skip,
            verify=False,
            input_shapes=self.input_shapes,
            seed=self.seed,
        )

    def ladder(self) -> list[float]:
        """The ratios tried, largest first: R alone, or with `write_best` R, R − 0.05, … above 0."""
        if not self.write_best:
            return [self.ratio]
        steps = math.floor(self.ratio / LADDER_STEP + 1e-9)
        ratios = [round(self.ratio - i * LADDER_STEP, 6) for i in range(steps + 1)]
        return [r for r in ratios if r > 0] or [self.ratio]


def _number(option: str, value) -> float:
    """`value` as a Python float: an int, a float or a NumPy scalar of either; else `InputError` naming `option`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{option} {value!r}: give a number")
    if not math.isfinite(value):
        raise InputError(f"{option} {value!r}: give a finite number")
    return float(value)


def _whole(option: str, value, least: int = 1) -> int:
    """`value` as a Python int of at least `least`: an int or a NumPy integer; else `InputError` naming `option`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < least:
        raise InputError(f"{option} {value!r}: choose a whole number of at least {least}")
    return int(value)


@dataclass
class SlicePlan:
    """Every residual stream the fold's proof found: sliceable, or left whole with the reason."""

    streams: list[Stream]
    reasons: dict[str, str]  # stream name → why it stays whole

    @classmethod
    def of(cls, slicer: Slicer, rotation: RotationPlan) -> SlicePlan:
        reasons = {}
        for stream in rotation.streams:
            why = stream.reason if not stream.rotatable else slice_refusal(slicer.zmg, stream)
            if why is not None:
                reasons[stream.name] = why
        return cls(rotation.streams, reasons)

    @property
    def sliceable(self) -> list[Stream]:
        return [s for s in self.streams if s.name not in self.reasons]

    def to_json(self) -> dict:
        streams = []
        for stream in self.streams:
            entry = stream.to_json()
            del entry["rotatable"], entry["gamma_moved_from"], entry["tensors"]
            streams.append(
                {"sliceable": stream.name not in self.reasons, **entry, "reason": self.reasons.get(stream.name)}
            )
        return {"streams": streams, "total": len(self.streams), "sliceable": len(self.sliceable)}

    def cut_json(self, kept: dict[str, int], pieces: dict[str, list[str]], bases: dict, tokens: dict) -> dict:
        """`to_json` with, per stream cut to `kept[stream]` columns, the energy its worst basis keeps (pieces
        left whole have no basis and keep all), the calibration tokens and its pieces' names: both front
        ends' reports."""
        plan = self.to_json()
        for entry in plan["streams"]:
            name = entry["stream"]
            if name in kept and entry["hidden_size"]:
                named = pieces.get(name, [name])
                cut = [p for p in named if p in bases]
                entry["kept"] = kept[name]
                entry["energy_kept"] = min(bases[p].energy_kept(kept[name]) for p in cut) if cut else 1.0
                entry["calibration_tokens"] = sum(tokens.get(p, 0) for p in named)
                entry["bases"] = named
        return plan


@dataclass(frozen=True)
class Trial:
    """One ratio tried: the width kept per stream and the held-out figures."""

    ratio: float
    kept: dict[str, int]
    held_out: Metrics
    budget_met: bool | None  # None: no budget
    parameters: int  # elements of the sliced model's constants
    recovery: Recovery | None = None  # what recovery did before `held_out` was measured; None: not applied

    def to_json(self) -> dict:
        return {
            "ratio": self.ratio,
            "kept": self.kept,
            "held_out": self.held_out.to_json(),
            "budget_met": self.budget_met,
            "parameters": self.parameters,
            "recovery": None if self.recovery is None else self.recovery.to_json(),
        }


@dataclass
class SliceResult(FoldResult):
    """A fold's result (the plan of the fold that came first) with the slicing's: `slicing` which streams
    were cut and why the others were not, `bases` each cut stream's principal basis, `chosen` the ratio
    written and its held-out figures, `tried` every ratio judged."""

    slicing: SlicePlan = field(default_factory=lambda: SlicePlan([], {}))
    bases: dict[str, Basis] = field(default_factory=dict, repr=False)  # by piece (`core/layers.py`): the stream
    pieces: dict[str, list[str]] = field(default_factory=dict)  # stream → its pieces, each with a basis
    tokens: dict[str, int] = field(default_factory=dict)  # calibration tokens per piece's basis
    shortcuts: int = 0  # k×k matrices inserted between pieces
    parameters: int = 0  # elements of the original's constants
    chosen: Trial | None = None
    tried: list[Trial] = field(default_factory=list)
    requested_ratio: float = 0.0
    budget: Budget | None = None
    basis: str = "layer"
    whole: list[str] = field(default_factory=list)  # pieces left at full width (`SliceOptions.head` "full")

    @property
    def ratio(self) -> float:
        return 0.0 if self.chosen is None else self.chosen.ratio

    @property
    def held_out(self) -> Metrics | None:
        return None if self.chosen is None else self.chosen.held_out

    def slice_report(self) -> dict:
        """The slicing's own part of the report (also what a refusal reports)."""
        kept = {} if self.chosen is None else self.chosen.kept
        plan = self.slicing.cut_json(kept, self.pieces, self.bases, self.tokens)
        exact = bool(kept) and all(kept[s.name] == s.width for s in self.slicing.sliceable)
        return {
            "requested_ratio": self.requested_ratio,
            "ratio": self.ratio,
            "basis": self.basis,
            "shortcuts": self.shortcuts,
            "head": "full" if self.whole else "cut",
            "left_whole": self.whole,
            "budget": None if self.budget is None else str(self.budget),
            "wrote_fallback": self.chosen is not None and self.ratio != self.requested_ratio,
            "verification": VERIFIED_EXACT if exact or not kept else VERIFIED_BY_BUDGET,
            "held_out": None if self.held_out is None else self.held_out.to_json(),
            "recovery": None if self.chosen is None or self.chosen.recovery is None else self.chosen.recovery.to_json(),
            "parameters": {
                "original": self.parameters,
                "sliced": None if self.chosen is None else self.chosen.parameters,
            },
            "tried": [t.to_json() for t in self.tried],
            **plan,
        }

    def report(self) -> dict:
        return super().report() | {"slice": self.slice_report()}


VERIFIED_EXACT = (
    "k = d: a rotation into the principal basis, verified against the original within the dtype's tolerance"
)
VERIFIED_BY_BUDGET = (
    "k < d: slicing drops the least energetic directions and is not exact; the held-out figures against the "
    "original (and the budget, where given) are its verification, not a tolerance"
)


# --- data and bases ------------------------------------------------------------------------------


def _data(
    model: onnx.ModelProto, calibration, options: SliceOptions, config: dict | None
) -> tuple[list[Batch], list[Batch]]:
    """(fitting, held-out) batches: a seeded split of `calibration`, or all of it and `options.holdout`;
    `config`: the GenAI config beside the model (`decode.read_config`)."""
    if options.holdout is not None:
        distinct_holdout(calibration, options.holdout)
        return load(calibration, model, options, options.seed, 1, config), load(
            options.holdout, model, options, options.seed + 1, 1, config
        )
    every = load(calibration, model, options, options.seed, 2, config)
    whole = fixed_batch(model) is not None  # a model that fixes its batch takes whole batches only
    fit, held = split_batches(every, tuple(options.split), options.seed, options.batch_size, whole)
    return fit, held


def _read_tensors(slicer: Slicer, stream: Stream) -> list[tuple[str, list[str], np.ndarray | None]]:
    """Per norm of `stream`: its axis, the run-time tensors summed into what it normalizes (x, or a Skip
    op's x and skip), and a constant added to them (a Skip op's bias), in the folded graph."""
    reads: list[tuple[str, list[str], np.ndarray | None]] = []
    for name in stream.norms:
        norm = slicer.zmg.norm_by_name(name)
        match = norm.ref
        if match.skip is None:
            reads.append((norm.input, [norm.input], None))
        else:
            reads.append((norm.input, [match.x.name, match.skip.name], constant_values(match.skip_bias)))
    return reads


def stream_covariances(
    slicer: Slicer,
    streams: list[Stream],
    batches: list[Batch],
    options: SliceOptions,
    mask_input: str | None,
    renamed: dict[str, str] | None = None,
    prune: bool = False,
) -> dict[str, Covariance]:
    """Σ uᵀu per stream over the unit-length tokens where its RMS ops read it (`core/pca.py`), streamed;
    `renamed`: the tensor a norm now reads in place of one of the folded graph (a shortcut's output);
    `prune`: the slicer's graph is cut down to what computes those tensors (`_outputs_only`) before it runs."""
    renamed = renamed or {}
    reads = {
        s.name: [(axis, [renamed.get(t, t) for t in tensors], bias) for axis, tensors, bias in _read_tensors(slicer, s)]
        for s in streams
    }
    axes = {name: slicer.zmg.norm_by_name(name).axis for s in streams for name in s.norms}
    wanted = [t for entries in reads.values() for _, tensors, _ in entries for t in tensors]
    covariances = {s.name: Covariance(s.width or 0) for s in streams}
    if not streams:
        return covariances
    if prune:
        _outputs_only(slicer, wanted)
    data = CalibData(options.batch_size, options.tokenizer, options.max_length)
    for batch, values in captured(slicer.ctx, wanted, batches, data):
        mask = batch.get(mask_input) if mask_input else None
        for stream in streams:
            for norm, (_, tensors, bias) in zip(stream.norms, reads[stream.name], strict=True):
                summed = sum(np.asarray(values[t], dtype=np.float64) for t in tensors)
                if bias is not None:
                    summed = summed + bias
                rows = token_rows(np.moveaxis(np.asarray(summed), axes[norm] or 0, -1), mask)
                covariances[stream.name].add(rows)
    return covariances


# --- the pass ------------------------------------------------------------------------------------


def _plan(folded: FoldResult, name: str) -> tuple[Slicer, SlicePlan]:
    """A `Slicer` over a fresh copy of the folded model (its weights shared, none copied), and the streams it
    finds."""
    slicer, rotation = plan_streams(folded, folded.ir_model.clone(), name, Slicer)
    return slicer, SlicePlan.of(slicer, rotation)


def _pieces(
    slicer: Slicer, plan: SlicePlan, options: SliceOptions
) -> tuple[dict[str, list[Stream]], list[Shortcut], set[str]]:
    """Per sliceable stream the pieces that take a basis each, the shortcuts between them, and the pieces
    left at full width (`core/layers.stream_pieces`: `basis`, and `head` "full" leaving the stream's end)."""
    pieces: dict[str, list[Stream]] = {}
    shortcuts: list[Shortcut] = []
    whole: set[str] = set()

    def rank(tensor: str) -> int | None:
        shape = slicer.ctx.shapes.get(tensor)
        return None if shape is None else len(shape)

    for stream in plan.sliceable:
        found, between, end = stream_pieces(slicer.zmg, stream, options.basis, options.head, rank)
        pieces[stream.name] = found
        shortcuts += between
        whole |= end
    return pieces, shortcuts, whole


def _cut_pieces(
    folded: FoldResult, name: str, options: SliceOptions, bases: dict[str, Basis], kept: dict[str, int]
) -> tuple[Slicer, SlicePlan, dict[str, list[Stream]], list[Shortcut], dict[str, str]]:
    """A `Slicer` over a fresh copy of the folded model in which every piece with a basis in `bases` is cut
    to the first `kept[its stream]` principal directions, and every shortcut between pieces is inserted; a
    piece without a basis (one not fitted yet, or the end `_pieces` leaves whole) stays whole (Q = I, d
    columns: a shortcut into it maps back to the stream's own coordinates); a target shape computed at run
    time from the shape of a piece of another width names its own piece's (`Slicer.pin_widths`). With the
    plan, the pieces, the shortcuts, and the tensor each shortcut's sum now reads."""
    slicer, plan = _plan(folded, name)
    pieces, shortcuts, _ = _pieces(slicer, plan, options)
    columns: dict[str, np.ndarray] = {}  # piece → Q_k; a piece left whole: I
    for stream, found in pieces.items():
        for piece in found:
            whole = np.eye(piece.width or 0)
            columns[piece.name] = bases[piece.name].vectors[:, : kept[stream]] if piece.name in bases else whole
            if piece.name in bases:
                slicer.cut_stream(piece, columns[piece.name], piece.name)
    every = [piece for found in pieces.values() for piece in found]
    slicer.pin_widths(every, {piece.name: columns[piece.name].shape[1] for piece in every})
    renamed = {}
    for shortcut in shortcuts:
        if shortcut.source in bases or shortcut.target in bases:  # between two whole pieces: the identity
            matrix = columns[shortcut.source].T @ columns[shortcut.target]
            renamed[shortcut.tensor] = slicer.add_shortcut(shortcut, matrix)
    RemoveUnusedNodesPass()(slicer.ctx.model)
    slicer.ctx.graph.sort()
    return slicer, plan, pieces, shortcuts, renamed


def _cut(
    folded: FoldResult, name: str, options: SliceOptions, bases: dict[str, Basis], kept: dict[str, int]
) -> ir.Model:
    """The folded model with each stream of `kept` cut to its first `kept[stream]` principal directions."""
    slicer, plan, pieces, shortcuts, _ = _cut_pieces(folded, name, options, bases, kept)
    widths = "; ".join(f"{s.name}: {s.width} → {kept[s.name]}" for s in plan.sliceable)
    metadata = {
        "normpass.version": __version__,
        "normpass.sliced": f"{len(plan.sliceable)} of {len(plan.streams)} residual streams sliced ({widths}), "
        f"{sum(len(p) for p in pieces.values())} bases, {len(shortcuts)} shortcuts",
    }
    return stored_like(export_model(slicer.ctx.model, slicer.docs, metadata), folded.ir_model)


def _in_graph_order(slicer: Slicer, pieces: dict[str, list[Stream]]) -> list[Stream]:
    """Every piece, in the order of its first norm in the (topologically sorted) folded graph."""
    position = {id(node): i for i, node in enumerate(slicer.ctx.graph)}

    def first(piece: Stream) -> int:
        return min(position[id(node)] for norm in piece.norms for node in slicer.zmg.norm_by_name(norm).ref.nodes)

    return sorted((piece for found in pieces.values() for piece in found), key=first)


def _outputs_only(slicer: Slicer, tensors: list[str]) -> None:
    """Make `tensors` the graph's only outputs and drop every node they do not need (a calibration run of the
    model up to where a piece is read, not of all of it; constants read from the graph are gone after it)."""
    graph = slicer.ctx.graph
    values = {value.name: value for value in graph_values(graph)}
    graph.outputs.clear()
    graph.outputs.extend(values[t] for t in sorted(set(tensors)))
    RemoveUnusedNodesPass()(slicer.ctx.model)


def sequential_covariances(
    folded: FoldResult,
    name: str,
    options: SliceOptions,
    slicer: Slicer,
    pieces: dict[str, list[Stream]],
    kept: dict[str, int],
    batches: list[Batch],
    mask_input: str | None,
    whole: frozenset[str] | set[str] = frozenset(),
) -> dict[str, Covariance]:
    """SliceGPT's sequential fit (`rotate.py`, `rotate_and_slice_sequential`): piece by piece in graph
    order, each piece's Σ uᵀu taken on the model whose earlier pieces are already cut to `kept` columns with
    their shortcuts (the piece itself and the later ones whole), so that each basis fits the signal the
    sliced model will give it. One calibration pass per piece; each sum is combined across processes before
    its basis cuts the next pass's model. A piece in `whole` (left at full width) takes no basis."""
    covariances: dict[str, Covariance] = {}
    bases: dict[str, Basis] = {}
    for piece in _in_graph_order(slicer, pieces):
        if piece.name in whole:
            continue
        stage(f"basis of {piece.name}, on the model cut before it")
        current, _, _, _, renamed = _cut_pieces(folded, name, options, bases, kept)
        try:
            fitted = stream_covariances(current, [piece], batches, options, mask_input, renamed, prune=True)
        except InputError as e:  # the unsliced model ran on this data (the first piece): the cut is at fault
            if not bases:
                raise
            raise _not_running(f"{name}: the model sliced before {piece.name}, to fit its basis,", e) from e
        covariance = fitted[piece.name]
        combine([covariance])
        covariances[piece.name], bases[piece.name] = covariance, eigenbasis(covariance)
    return covariances


def _not_running(what: str, error: Exception) -> InternalError:
    """The original ran on this data and the model the cut made of it does not: the cut is at fault (exit 3).
    The runtime's own error is quoted, not the advice on data that came with it."""
    cause = error.__cause__ if isinstance(error, InputError) and error.__cause__ is not None else error
    return InternalError(
        f"{what} does not run ({str(cause).splitlines()[0]}); nothing written; a bug in normpass: slicing "
        "missed something this model computes from the hidden size (report it with the model's op types)"
    )


def _refuse_no_cut(plan: SlicePlan, options: SliceOptions, name: str) -> None:
    """Refuse a ratio above 0 that keeps every column of every stream: k, a multiple of `round_to` of at most d,
    is d itself when `round_to` is d or more, or when the ratio removes less than half a multiple."""
    widths = sorted({s.width or 0 for s in plan.sliceable})
    if options.ratio == 0 or not widths or any(sliced_width(w, options.ratio, options.round_to) < w for w in widths):
        return
    raise InputError(
        f"{name}: ratio {options.ratio:g} with round_to {options.round_to} keeps all {'/'.join(map(str, widths))} "
        "columns of every stream (k is a multiple of round_to, at most d), so nothing would be sliced; choose a "
        "smaller round_to or a larger ratio (ratio 0 rotates only)"
    )


def _parameters(model: ir.Model) -> int:
    """The number of elements of `model`'s constants (initializers)."""
    return sum(v.const_value.size for v in model.graph.initializers.values() if v.const_value is not None)


def inspect_slice(model: ModelSource, options: SliceOptions | None = None, name: str = "model") -> SlicePlan:
    """Which residual streams `slice_onnx` would slice and why the others stay whole (no data read)."""
    options = options or SliceOptions()
    options.checked()
    folded = fold_onnx(from_graphsurgeon(model), options.rotate_options().fold_options(), name)
    return _plan(folded, name)[1]


def slice_onnx(
    model: ModelSource, calibration, options: SliceOptions | None = None, name: str = "model"
) -> SliceResult:
    """Fold `model` (a ModelProto, not modified, an .onnx path, or an onnx-graphsurgeon `Graph`), cut every
    provable residual stream to its principal subspace, and judge the result on held-out data (the module
    docstring). Raises `BudgetMissed` (its `.report`: what was tried) when the budget is missed."""
    options = options or SliceOptions()
    budget = options.checked()
    if options.recover_train:
        raise InputError(
            "recover_train trains the sliced model, which needs its PyTorch module: give the module "
            "(normpass.slice, or normpass slice --torch FACTORY); an ONNX file takes recover (the layer refit)"
        )
    source, original = opened(from_graphsurgeon(model), name)  # a path is read lazily: `original` is its structure
    refuse_scalar_inputs(original, name, "slicing")
    check_input_shapes(original, options.input_shapes)
    batch_size, batch_note = batch_size_for(original, options.batch_size, name)
    options = dataclasses.replace(options, batch_size=batch_size)
    start = time.perf_counter()
    stage("fold")
    folded = fold_onnx(source, options.rotate_options().fold_options(), name)
    slicer, plan = _plan(folded, name)
    _refuse_no_cut(plan, options, name)
    seconds = {"fold": time.perf_counter() - start}

    start = time.perf_counter()
    fit, held = _data(original, calibration, options, decode.read_config(source))
    mask_input = find_mask_input(input_spec(original), options.mask_input, fit + held)
    pieces, shortcuts, whole = _pieces(slicer, plan, options)
    every_piece = [piece for found in pieces.values() for piece in found if piece.name not in whole]
    one_pass: dict[str, Covariance] = {}  # on the unsliced model: the bases of `basis="stream"`, and of any at k = d
    seconds["bases"] = time.perf_counter() - start
    seconds["judge"] = 0.0

    masks = [b.get(mask_input) if mask_input else None for b in held]
    with reference_runner(source, original) as reference:
        references = [reference.run(b) for b in held]
    if budget is not None:
        budget.refuse_unjudgeable(compare(references, references, masks), f"{name}: the held-out data")
    output_names = [o.name for o in original.graph.output]
    tried: list[Trial] = []
    cut, chosen = None, None

    def judged(model: ir.Model, ratio: float) -> Metrics:
        with verify.Runner(model, skeleton(model)) as candidate:  # a large model from a file, its weights mapped
            try:
                runs = [candidate.run(b) for b in held]
            except Exception as e:  # ORT's Fail, InvalidArgument ... derive from Exception only
                raise _not_running(f"{name}: the model sliced at ratio {ratio:g}", e) from e
        outputs = [{output: run[output] for output in output_names} for run in runs]
        return compare(references, outputs, masks)

    for ratio in options.ladder():
        kept = {s.name: sliced_width(s.width or 0, ratio, options.round_to) for s in plan.sliceable}
        if tried and kept == tried[-1].kept:
            continue
        start = time.perf_counter()
        if options.basis == "layer" and any(kept[s.name] < (s.width or 0) for s in plan.sliceable):
            covariances = sequential_covariances(folded, name, options, slicer, pieces, kept, fit, mask_input, whole)
        else:  # one basis per stream, or k = d: every earlier cut is a rotation and changes no piece's signal
            if not one_pass:
                one_pass = stream_covariances(slicer, every_piece, fit, options, mask_input)
                combine(list(one_pass.values()))
            covariances = one_pass
        bases = {piece: eigenbasis(covariance) for piece, covariance in covariances.items()}
        seconds["bases"] += time.perf_counter() - start
        start = time.perf_counter()
        stage(f"slicing at ratio {ratio:g} and judging it on the held-out data")
        cut = _cut(folded, name, options, bases, kept)
        metrics = judged(cut, ratio)
        recovery = None
        if options.recover and any(kept[s.name] < (s.width or 0) for s in plan.sliceable):
            # the same bases at full width: exact, the refit's target (per ratio: the layer bases change with k)
            reference_cut = _cut(folded, name, options, bases, {s.name: s.width or 0 for s in plan.sliceable})
            recovery = recover(cut, reference_cut, fit, mask_input, options.recover, options.recover_ridge)
            recovery.held_out_before, metrics = metrics, judged(cut, ratio)
            recovery.held_out_after = metrics
        met = None if budget is None else budget.holds(metrics)
        tried.append(Trial(ratio, kept, metrics, met, _parameters(cut), recovery))
        seconds["judge"] += time.perf_counter() - start
        if tried[-1].budget_met is not False:
            chosen = tried[-1]
            break
    assert cut is not None  # the ladder has one ratio at least
    result = SliceResult(
        cut,
        folded.plan,
        None,
        folded.affine_notes,
        seconds,
        modified=folded.modified or bool(plan.sliceable),
        emitted=folded.emitted,
        slicing=plan,
        bases=bases,
        pieces={stream: [p.name for p in found] for stream, found in pieces.items()},
        tokens={s: c.tokens for s, c in covariances.items()},
        shortcuts=len(shortcuts),
        parameters=sum(int(np.prod(t.dims)) for t in original.graph.initializer),
        chosen=chosen,
        tried=tried,
        requested_ratio=options.ratio,
        budget=budget,
        basis=options.basis,
        notes=[batch_note] if batch_note else [],
        whole=sorted(whole),
    )
    if chosen is None:
        last = tried[-1].held_out
        raise BudgetMissed(
            ReplaceReport({"output": None, **result.report()}),
            f"{name}: sliced at ratio {tried[-1].ratio:g}, the model misses the budget {budget} on {last.samples} "
            f"held-out samples ({last.describe(mean=False)}); nothing written; "
            + ("no ratio tried meets it" if options.write_best else "try a smaller ratio, or --write-best"),
            cut,
        )
    verb = ("slice", "sliced")
    if options.verify:  # as a user's session runs it: ORT's default optimizations must not fail on it
        seconds["optimized_run"] = verify.runs_optimized(cut, held[0], name, verb)
    if all(chosen.kept[s.name] == s.width for s in plan.sliceable):  # k = d: exact, verified as every rewrite
        done = f"{len(plan.sliceable)} of {len(plan.streams)} residual streams rotated into their principal bases"
        result.comparison = checked(source, cut, original, options, name, done, verb, seconds, result.modified)
    return result


class SlicePass(ir.passes.FunctionalPass):
    """`slice_onnx` as an onnx-ir pass, for `ir.passes.PassManager` pipelines beside `FoldPass`:
    `SlicePass(calibration, SliceOptions(...))(model)` → `PassResult(sliced model, modified)`.

    Functional: the input `ir.Model` is never changed (the pass slices an in-memory copy). `modified` is
    True when a stream was cut or a norm folded. A missed budget raises `BudgetMissed` (a
    `VerificationError`; inside a `PassManager`, its `PassError` with that cause) and returns nothing.
    `result`: the `SliceResult` of the latest call (bases, the ratio chosen, held-out figures, `report()`).
    """

    def __init__(self, calibration, options: SliceOptions | None = None, name: str = "model"):
        super().__init__()
        self.calibration = calibration
        self.options = options or SliceOptions()
        self.options.checked()
        self.name = name
        self.result: SliceResult | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.result = slice_onnx(in_memory_proto(model), self.calibration, self.options, self.name)
        return ir.passes.PassResult(self.result.ir_model, modified=self.result.modified)
