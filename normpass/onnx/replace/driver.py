"""The surrogate pass for ONNX models: capture and emission around the shared core (`core/replace.py`).

`replace_onnx(model, calibration, ReplaceOptions(...))` (docs/surrogates.md):

1. **Exact first.** `fold_onnx` folds every provable LayerNorm (verified); only the others are
   candidates, unless `why_not` (core) or this front end (a norm fused with its residual `Add`,
   an RMSNorm whose γ is computed at run time) rules them out. LayerNorms among them get *input
   centring* (exact, `onnx/replace/surrogates.py`), checked numerically against the folded model.
2. **Data.** `calibration.load_batches` against the graph inputs (or seeded `"synthetic"`
   inputs, for tests and demos), split into the core's roles.
3. **Capture.** A `Runner` (`onnx/calibrate`) is an ONNX Runtime session (CPU, optimizations off) of a working graph
   whose large weights are fed as inputs (`light_model`), so a session per trial model costs
   milliseconds; the norms' inputs are extra graph outputs while calibrating.
4. **Emission** (`Emitter.emit`) removes the norm and emits the surrogate with c, γ and β moved
   into adjacent layers where exact; what it leaves prices the candidate.

The core selects; `conclude` builds the final model with every weight inside, judges it on the
test split and writes the report.

**Memory.** A model given by its path is never read whole: it is loaded as `fold` loads it (`open_graph`:
`io.load_ir` maps its weights from the file), the checks read its structure (`io.skeleton`), and the
original runs from its file for the reference outputs, its session released once they are computed. What
holds weights after that is the centred base (a ModelProto), the arrays of its large weights that every
session is fed (`OnnxBench.weights`, converted once: `light_model`), and at the end the final model; no
session (a trial, the centring check, the final judgement) copies them.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx

from ... import __version__
from ...calibration import Batch, distinct_holdout, find_mask_input
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
from ...errors import InputError, VerificationError
from ..calibrate import (
    Runner,
    batch_size_for,
    check_runs,
    input_spec,
    load,
    reference_runner,
    refuse_scalar_inputs,
    run_time_inputs,
)
from ..fold import FoldOptions, FoldResult, ModelSource, fold_onnx
from ..graph.constants import constant_values
from ..graph.frontend import build_zero_mean_graph, load_graph, open_graph
from ..graphsurgeon import from_graphsurgeon
from ..runtime import decode
from ..runtime.verify import check_input_shapes, fixed_dim
from .surrogates import Emitter, export_model, light_model, norm_cost, norm_spec, width_of, working_graph

CENTRING_TOLERANCE = 1e-4  # relative, float32: input centring may only change rounding


# --- data ----------------------------------------------------------------------------------------


def refuse_fixed_batch(model: onnx.ModelProto, name: str) -> None:
    """The surrogate pass splits calibration samples into parts of other sizes: axis 0 must not be fixed above 1."""
    dims = {key: value.type.tensor_type.shape.dim for key, value in run_time_inputs(model).items()}
    batched = [(key, size) for key, d in dims.items() if d and (size := fixed_dim(d[0])) is not None and size > 1]
    if batched:
        raise InputError(
            f"{name}: input {batched[0][0]} fixes axis 0, the samples, to {batched[0][1]}; the surrogate pass splits "
            "calibration samples into parts of other sizes: export the model with a dynamic batch axis"
        )


# --- the bench -----------------------------------------------------------------------------------


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
        ctx = working_graph(self.base, self.shapes, self.name, self.dtypes)
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
        return Runner(
            *light_model(working_graph(model, self.shapes, self.name, self.dtypes), model, None, self.weights)
        )


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


def prepare(model: ModelSource, calibration, options: ReplaceOptions | None = None, name: str = "model") -> Prepared:
    """Data, exact fold, candidates, input centring, the original's outputs, and the core's `Search`.

    `model` is loaded as `fold_onnx` loads it (`open_graph`): a path lazily (see the module docstring), a
    ModelProto checked, not modified; an onnx-graphsurgeon `Graph` is exported to one first."""
    options = options or ReplaceOptions()
    budget, kinds, cost_rule = options.checked()  # bad options are refused before the model is read
    model = from_graphsurgeon(model)
    given = open_graph(model, name)
    source, structure = given.source or model, given.structure  # the original to fold and run, and to check
    refuse_scalar_inputs(structure, name, "the surrogate pass")
    refuse_fixed_batch(structure, name)
    check_input_shapes(structure, options.input_shapes)
    options = dataclasses.replace(options, batch_size=batch_size_for(structure, options.batch_size, name)[0])
    started = time.perf_counter()

    distinct_holdout(calibration, options.holdout)
    config = decode.read_config(source)  # a GenAI folder's decoder: sizes its graph may not show
    batches = load(calibration, structure, options, options.seed, config=config)
    holdout = None
    if options.holdout is not None:
        holdout = load(options.holdout, structure, options, options.seed + 1, config=config)
    splits = split_roles(batches, holdout, options)
    mask_input = find_mask_input(input_spec(structure), options.mask_input, batches + (holdout or []))

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
    original = build_zero_mean_graph(given).norms
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
    base = export_model(ctx, structure, emitter.docs, {})

    with reference_runner(source, structure) as reference:
        check_runs(reference, batches, calibration)
        if holdout is not None:
            check_runs(reference, holdout, options.holdout)
        for role in ("select", "check", "test"):
            data = splits.batches[role]
            splits.references[role] = [
                reference.run(b) for b in progress(data, f"original model ({role})", options.progress)
            ]
    output_names = [o.name for o in structure.graph.output]
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
        # float outputs only: an exact centring may still flip an id at a tie of its logits
        if centring.rel_max is not None and centring.rel_max > CENTRING_TOLERANCE:
            raise VerificationError(
                f"{name}: input centring changed the outputs (relative error {centring.rel_max:.3g}); "
                "replace without input centring (ReplaceOptions.centre_inputs=False) and report this model"
            )
    frame = Frame(
        name, "onnx", [(n.name, n.op) for n in original], exact, declined, centred, kinds, _count_ops(structure)
    )
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
    model: ModelSource, calibration, options: ReplaceOptions | None = None, name: str = "model"
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
