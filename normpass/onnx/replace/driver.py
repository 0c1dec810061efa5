"""The surrogate pass for ONNX models: capture and emission around the shared core (`core/replace.py`).

`replace_onnx(model, calibration, ReplaceOptions(...))` (docs/surrogates.md):

1. **Exact first.** `fold_onnx` folds every provable LayerNorm (verified); only the others are
   candidates, unless `why_not` (core) or this front end (a norm fused with its residual `Add`,
   an RMSNorm whose γ is computed at run time) rules them out. LayerNorms among them get *input
   centring* (exact, `onnx/replace/surrogates.py`), checked numerically against the folded model.
2. **Data.** `calibration.load_batches` against the graph inputs (or seeded `"synthetic"`
   inputs, for tests and demos), split into the core's roles.
3. **Capture.** A `Runner` is an ONNX Runtime session (CPU, optimizations off) of a working graph
   whose large weights are fed as inputs (`light_model`), so a session per trial model costs
   milliseconds; the norms' inputs are extra graph outputs while calibrating.
4. **Emission** (`Emitter.emit`) removes the norm and emits the surrogate with c, γ and β moved
   into adjacent layers where exact; what it leaves prices the candidate.

The core selects; `conclude` builds the final model with every weight inside, judges it on the
test split and writes the report.

**Memory.** A model given by its path is never read whole: the fold maps its weights from the file
(`io.load_ir`), the checks read its structure (`io.skeleton`), and the original runs from its file for
the reference outputs, its session released once they are computed. What holds weights after that is
the centred base (a ModelProto), the arrays of its large weights that every session is fed
(`OnnxBench.weights`, converted once: `light_model`), and at the end the final model; no session (a trial,
the centring check, the final judgement) copies them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir

from ... import __version__
from ...calibration import MIN_SAMPLES, Batch, InputSpec, find_mask_input, load_batches, longest_batch, source_label
from ...core.budget import compare
from ...core.cost import Emission
from ...core.graph import NormInfo
from ...core.progress import progress
from ...core.replace import (
    Frame,
    ReplaceOptions,
    ReplaceReport,
    Search,
    Selection,
    conclude,
    eligible,
    select,
    split_roles,
)
from ...core.stats import StatsCollector, token_rows
from ...core.surrogates import NormSpec, Surrogate
from ...errors import InputError, UnsupportedModelError, VerificationError
from ...io import checked_model, load_ir, skeleton
from ..fold.driver import FoldOptions, FoldResult, fold_onnx
from ..graph.constants import constant_values
from ..graph.frontend import build_zero_mean_graph, load_graph
from ..graph.positions import position_limit
from ..runtime import decode, verify
from ..runtime.verify import check_input_shapes, fixed_dim, index_bounds, make_inputs, session
from .surrogates import Emitter, export_model, light_model, norm_cost, norm_spec, open_graph, width_of

CENTRING_TOLERANCE = 1e-4  # relative, float32: input centring may only change rounding


# --- data ----------------------------------------------------------------------------------------


def run_time_inputs(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """The graph inputs that are not initializers, by name."""
    initializers = {i.name for i in model.graph.initializer}
    return {value.name: value for value in model.graph.input if value.name not in initializers}


def input_spec(model: onnx.ModelProto) -> InputSpec:
    """Graph inputs that are not initializers (dtype, rank), and the tables integer inputs index; a KV-cache
    graph's cache, mask and positions may be left out (`decode.calibration_batches` fills them in)."""
    inputs: dict[str, tuple[np.dtype | None, int | None]] = {
        name: (
            np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)),
            len(value.type.tensor_type.shape.dim),
        )
        for name, value in run_time_inputs(model).items()
    }
    limit = position_limit(ir.from_proto(model))
    optional = decode.leaves_out(decode.signature(model))
    return InputSpec(inputs, index_bounds(model), optional, None if limit is None else limit.rows)


def refuse_scalar_inputs(model: onnx.ModelProto, name: str, verb: str) -> None:
    """Calibration data is split into samples along axis 0 of every input: refuse a model with a scalar input."""
    scalars = [n for n, value in run_time_inputs(model).items() if not value.type.tensor_type.shape.dim]
    if scalars:
        raise InputError(
            f"{name}: input {scalars[0]} is a scalar (rank 0): calibration data is split into samples along "
            f"axis 0 of every input, so {verb} takes models whose inputs all have a batch axis"
        )


def refuse_fixed_batch(model: onnx.ModelProto, name: str) -> None:
    """The surrogate pass splits calibration samples into parts of other sizes: axis 0 must not be fixed above 1."""
    dims = {key: value.type.tensor_type.shape.dim for key, value in run_time_inputs(model).items()}
    batched = [(key, size) for key, d in dims.items() if d and (size := fixed_dim(d[0])) is not None and size > 1]
    if batched:
        raise InputError(
            f"{name}: input {batched[0][0]} fixes axis 0, the samples, to {batched[0][1]}; the surrogate pass splits "
            "calibration samples into parts of other sizes: export the model with a dynamic batch axis"
        )


def synthetic_batches(
    model: onnx.ModelProto, samples: int = 64, batch_size: int = 16, seed: int = 0, input_shapes: dict | None = None
) -> list[Batch]:
    """Seeded random inputs (randn floats, in-range indices, all-ones masks). Tests and demos only."""
    batches = []
    spec = input_spec(model)
    names = [name for name in spec.names if name not in spec.optional]
    for index, start in enumerate(range(0, samples, batch_size)):
        size = min(batch_size, samples - start)
        shapes = dict(input_shapes or {})
        for name in names:
            if name not in shapes:
                value = next(v for v in model.graph.input if v.name == name)
                dims = value.type.tensor_type.shape.dim
                shapes[name] = tuple(fixed_dim(d) or (size if axis == 0 else 16) for axis, d in enumerate(dims))
            shapes[name] = (size,) + tuple(shapes[name][1:])
        batches.append(make_inputs(model, shapes, seed=seed * 100003 + index))
    return decode.calibration_batches(model, [{k: b[k] for k in names} for b in batches], "synthetic")


class DataOptions(Protocol):
    """How calibration inputs are read: `ReplaceOptions`, `SliceOptions`."""

    batch_size: int
    tokenizer: str | None
    max_length: int
    samples: int  # of synthetic data
    input_shapes: dict  # of synthetic data


def load(source, model: onnx.ModelProto, options: DataOptions, seed: int, minimum: int = MIN_SAMPLES) -> list[Batch]:
    """Calibration batches from `source` (`calibration.load_batches`, at least `minimum` samples, or
    `"synthetic"`), shape-checked."""
    if isinstance(source, str) and source == "synthetic":
        return synthetic_batches(model, options.samples, options.batch_size, seed, options.input_shapes)
    return load_fitting(source, model, options.batch_size, options.tokenizer, options.max_length, minimum)


def load_fitting(
    source, model: onnx.ModelProto, batch_size: int, tokenizer, max_length: int, minimum: int = MIN_SAMPLES
) -> list[Batch]:
    """`calibration.load_batches` for `model`, each batch's shapes checked against the model's fixed dims."""
    batches = load_batches(source, input_spec(model), batch_size, tokenizer, max_length, minimum)
    file = f"{source}: " if isinstance(source, (str, os.PathLike)) else ""
    for index, batch in enumerate(batches):
        check_input_shapes(model, {k: v.shape for k, v in batch.items()}, f"{file}calibration batch {index}, input")
    return decode.calibration_batches(model, batches, source_label(source))


def check_runs(runner: Runner | verify.Runner, batches: list[Batch], source) -> None:
    """The original model on the calibration batch holding the sample longest along axis 1: a sequence it cannot
    take (a bound the graph does not show as a table, such as OPT's positions counted from a mask) is refused as
    bad data, before the pass, instead of failing in its middle."""
    longest = longest_batch(batches)
    if longest is None:
        return
    batch, width = longest
    try:
        runner.run(batch)
    except Exception as e:  # ONNX Runtime's InvalidArgument, Fail ... derive from Exception only
        raise InputError(
            f"{source_label(source)}: the model does not run on the batch holding its longest sample ({width} along "
            f"axis 1): {str(e).splitlines()[0]}; shorten the sequences (text: --max-length) or give data that fits"
        ) from e


# --- running -------------------------------------------------------------------------------------


class Runner:
    """An ONNX Runtime session (CPU, optimizations off) for a model whose large weights are inputs."""

    def __init__(self, model: onnx.ModelProto, weights: dict[str, np.ndarray] | None = None):
        try:
            self.session = session(model)  # models over 2 GB, duplicate node names
        except UnsupportedModelError as e:
            raise InputError(f"the model being calibrated: {e}") from e
        self.weights = weights or {}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, batch: Batch, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        names = outputs or self.outputs
        return dict(zip(names, self.session.run(names, {**batch, **self.weights}), strict=True))


def opened(model: onnx.ModelProto | str | os.PathLike, name: str) -> tuple[onnx.ModelProto | Path, onnx.ModelProto]:
    """(the original to fold and run, its structure for the checks): a path and its skeleton (`io.skeleton` of
    `io.load_ir`: no large weight read), or the checked ModelProto twice."""
    if isinstance(model, (str, os.PathLike)):
        return Path(model), skeleton(load_ir(model))
    model = checked_model(model, name)
    return model, model


@contextlib.contextmanager
def reference_runner(model: onnx.ModelProto | Path, structure: onnx.ModelProto) -> Iterator[Runner | verify.Runner]:
    """A runner of the original model, from its file where it has one (ONNX Runtime reads its weights there:
    nothing else holds them), released when the block ends."""
    if isinstance(model, onnx.ModelProto):
        yield Runner(model)
        return
    with verify.Runner(model, structure) as runner:
        yield runner


class OnnxBench:
    """The core's `Workbench` for an ONNX model: working graphs of the exactly folded, centred base."""

    def __init__(
        self,
        base: onnx.ModelProto,
        shapes: dict,
        dtypes: dict,
        name: str,
        norms: list[NormInfo],
        mask_input: str | None,
        output_names: list[str],
        rms_op: str,
        provider: str | None,
        fused_adds: dict[str, int],
    ):
        self.base, self.shapes, self.dtypes, self.name = base, shapes, dtypes, name
        self.norms = norms
        self.by_name = {n.name: n for n in norms}
        self.specs = {n.name: norm_spec(n) for n in norms}
        self.widths = {n.name: int(width_of(shapes, n) or 0) for n in norms}  # candidates have one (why_not)
        self.mask_input = mask_input
        self.output_names = output_names
        self.rms_op = rms_op
        self.fused_adds = fused_adds
        self.provider = provider
        self.weights: dict[str, np.ndarray] = {}  # values of untouched large weights, converted once

    def spec(self, norm: str) -> NormSpec:
        return self.specs[norm]

    def width(self, norm: str) -> int:
        return self.widths[norm]

    def norm_cost(self, norm: str) -> float:
        return norm_cost(self.by_name[norm], self.fused_adds[norm], self.provider)

    def build(self, surrogates: list[tuple[str, Surrogate]]):
        """A working graph of the base with `surrogates` emitted: (graph, emitter, emissions)."""
        ctx = open_graph(self.base, self.shapes, self.name, self.dtypes)
        emitter = Emitter(ctx, self.rms_op, self.provider)
        emissions = emitter.emit_all(surrogates)
        return ctx, emitter, emissions

    def emission(self, norm: str, surrogate: Surrogate) -> Emission:
        return self.build([(norm, surrogate)])[2][norm]

    def statistics(self, surrogates, norms: list[str], batches: Iterable[Batch], into: StatsCollector) -> None:
        ctx, _, _ = self.build(surrogates)
        inputs = {m: self.by_name[m].input for m in norms}
        model, feeds = light_model(ctx, self.base, {t: np.dtype(np.float32) for t in inputs.values()}, self.weights)
        runner = Runner(model, feeds)
        wanted = sorted(set(inputs.values()))
        for batch in batches:
            out = runner.run(batch, wanted)
            mask = batch.get(self.mask_input) if self.mask_input else None
            for m, tensor in inputs.items():
                into.add(m, token_rows(out[tensor], mask))

    def outputs(self, surrogates, batches: Iterable[Batch]) -> list[dict[str, np.ndarray]]:
        ctx, _, _ = self.build(surrogates)
        model, feeds = light_model(ctx, self.base, None, self.weights)
        runner = Runner(model, feeds)
        return [runner.run(b, self.output_names) for b in batches]

    def runner(self, model: onnx.ModelProto) -> Runner:
        """A `Runner` of `model` (the base, or a final model built from it) fed its large weights as inputs, the
        base's untouched ones from `weights` (`light_model`): `Runner(model)` would hold the serialized model
        and a copy of every weight in the session."""
        return Runner(*light_model(open_graph(model, self.shapes, self.name, self.dtypes), model, None, self.weights))


def front_end_reason(norm: NormInfo) -> str | None:
    """What rules a norm out of the ONNX emission, beyond the core's `why_not`."""
    if norm.ref.skip is not None:
        return "a SkipLayerNormalization: surrogates for norms fused with their residual Add are not implemented"
    if norm.ref.gamma is not None and constant_values(norm.ref.gamma) is None:
        return "its γ is computed at run time, not a constant"
    return None


# --- the pass -----------------------------------------------------------------------------------


@dataclass
class Prepared:
    """Everything selection works on (tools use `search` to evaluate states directly)."""

    search: Search
    frame: Frame
    bench: OnnxBench
    fold: FoldResult  # the exact fold, before input centring
    docs: dict
    kinds: tuple
    cost_rule: str  # COST_RULES
    started: float

    @property
    def folded(self) -> onnx.ModelProto:
        """The exact fold as a ModelProto with every weight inside (made on first use)."""
        return self.fold.model


def prepare(
    model: onnx.ModelProto | str, calibration, options: ReplaceOptions | None = None, name: str = "model"
) -> Prepared:
    """Data, exact fold, candidates, input centring, the original's outputs, and the core's `Search`.

    A path is read lazily (see the module docstring); a ModelProto is not modified."""
    source, model = opened(model, name)
    options = options or ReplaceOptions()
    refuse_scalar_inputs(model, name, "the surrogate pass")
    refuse_fixed_batch(model, name)
    budget, kinds, cost_rule = options.checked()
    check_input_shapes(model, options.input_shapes)
    started = time.perf_counter()

    batches = load(calibration, model, options, options.seed)
    holdout = None if options.holdout is None else load(options.holdout, model, options, options.seed + 1)
    splits = split_roles(batches, holdout, options)
    mask_input = find_mask_input(input_spec(model), options.mask_input)

    folded = fold_onnx(
        source,
        FoldOptions(
            rms_op=options.rms_op,
            insert_centering=options.insert_centering,
            fuse_skip=False if options.all_norms else None,  # a fused Skip op is no candidate; export fuses
            verify=True,
            input_shapes=options.input_shapes,
            seed=options.seed,
        ),
        name=name,
    )
    exact = {d.name for d in folded.plan.folded}
    original = build_zero_mean_graph(load_graph(load_ir(source) if isinstance(source, Path) else model, name)).norms
    unfolded = {n.output for n in original if options.all_norms or n.name not in exact}
    ctx = load_graph(folded.ir_model.clone(), name)  # weights shared, none copied; the fold's model stays as it is
    emitter = Emitter(ctx, options.rms_op, options.provider)
    norms = [n for n in emitter.norms.values() if n.output in unfolded]
    if options.all_norms:  # a folded norm is named as the fold wrote it: the report uses those names
        renamed = {n.output: n.name for n in norms}
        exact = {renamed.get(n.output, n.name) for n in original if n.name in exact}
        original = [dataclasses.replace(n, name=renamed.get(n.output, n.name)) for n in original]
    candidates, declined = eligible(
        name, norms, exact, options, kinds, lambda n: width_of(ctx.shapes, n), front_end_reason
    )
    centred = {}
    if options.centre_inputs if options.centre_inputs is not None else "rms" in kinds:
        for norm in candidates:
            done = emitter.centre_inputs(norm)
            if done:
                centred[norm.name] = done
    emitter.remove_layer_scales()  # a LayerScale absorbed by a centring leaves no Mul by ones
    base = export_model(ctx, model, emitter.docs, {})

    with reference_runner(source, model) as reference:
        check_runs(reference, batches, calibration)
        if holdout is not None:
            check_runs(reference, holdout, options.holdout)
        for role in ("select", "check", "test"):
            data = splits.batches[role]
            splits.references[role] = [
                reference.run(b) for b in progress(data, f"original model ({role})", options.progress)
            ]
    output_names = [o.name for o in model.graph.output]
    fused_adds = {n.name: emitter.ort_fused_adds(n) for n in candidates}
    bench = OnnxBench(
        base,
        ctx.shapes,
        ctx.dtypes,
        name,
        candidates,
        mask_input,
        output_names,
        options.rms_op,
        options.provider,
        fused_adds,
    )
    if centred:
        first = splits.batches["select"][0]
        centring = compare(
            splits.references["select"][:1],
            [bench.runner(base).run(first, output_names)],
            [first.get(mask_input) if mask_input else None],
        )
        if centring.rel_max > CENTRING_TOLERANCE:
            raise VerificationError(
                f"{name}: input centring changed the outputs (relative error {centring.rel_max:.3g}); "
                "replace without input centring (ReplaceOptions.centre_inputs=False) and report this model"
            )
    frame = Frame(name, "onnx", [(n.name, n.op) for n in original], exact, declined, centred, kinds, _count_ops(model))
    return Prepared(
        Search(bench, splits, budget, options), frame, bench, folded, emitter.docs, kinds, cost_rule, started
    )


@dataclass
class ReplaceResult:
    model: onnx.ModelProto
    report: ReplaceReport

    @property
    def replaced(self) -> int:
        return self.report.replaced


def replace_onnx(
    model: onnx.ModelProto | str, calibration, options: ReplaceOptions | None = None, name: str = "model"
) -> ReplaceResult:
    """Replace the norms of `model` that do not fold exactly by surrogates, under `options.budget`.

    Raises `BudgetMissed` (its `.report` says what was tried) when the model misses the budget on
    the test split and `options.write_best` is off.
    """
    p = prepare(model, calibration, options, name)
    selection: Selection = select(p.search, p.kinds, p.cost_rule)
    bench, test = p.bench, p.search.splits.batches["test"]

    def build(surrogates):
        ctx, emitter, emissions = bench.build(surrogates)
        properties = {
            "normpass.version": __version__,
            "normpass.replaced": f"{len(surrogates)} of {len(p.frame.norms)} norms replaced by surrogates, "
            f"{len(p.frame.exact_left(dict(surrogates)))} folded exactly",
            "normpass.surrogate.fit": ", ".join(f"{n}={s.kind}" for n, s in surrogates),
            "normpass.budget": str(p.search.budget),
        }
        final = export_model(
            ctx, bench.base, {**p.docs, **emitter.docs}, properties, fuse_skip=bench.rms_op == "simplified"
        )
        runner = bench.runner(final)
        return final, [runner.run(b, bench.output_names) for b in test], emissions, _count_ops(final)

    final, report = conclude(p.search, selection, p.frame, build, p.started)
    assert isinstance(final, onnx.ModelProto)
    return ReplaceResult(final, report)


def _count_ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))
