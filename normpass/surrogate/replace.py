"""The surrogate pass for ONNX models: replace the norms the exact fold cannot fold, under a budget.

`replace_onnx(model, calibration, ReplaceOptions(...))` (docs/surrogates.md):

1. **Exact first.** `fold_onnx` folds every provable LayerNorm (verified); only the others are
   candidates. LayerNorms among them get *input centring* (exact, see
   `surrogate/emit.py`), checked numerically against the folded model.
2. **Data.** Calibration batches are split into fit (statistics), validation (every decision)
   and test (the final figures; never used to decide) — or test comes from `holdout`.
   `check > 0` holds back part of validation to check each selection (see 5).
3. **Candidates.** Per norm and allowed kind (`rms`, `affine`, `dyt`, `derf`) a surrogate is
   fitted (`surrogate/fit.py`); its emission (`Emitter.emit`) says which ops remain and what they
   cost (`OP_COST`, in units of one LayerNorm). With `kind="auto"` only candidates cheaper than
   the norm they replace are fitted and considered.
4. **Sequential calibration** (DaMN, seed 000 App. C): a replaced norm is fitted on statistics
   collected with every earlier (topologically upstream) replacement in place; a state is a set
   of (norm, kind) and its model is rebuilt and recalibrated in topological order, so the model
   evaluated is the model written. Least-squares fits target the original model's norm outputs
   on the same tokens (`target="original"`; `"local"`: N(x) of the modified model).
   `sequential=False` fits every norm on the original model (the paper's "parallel" ablation).
5. **Selection** on validation, greedy, for each order in `orders` (`input`: topological;
   `damage`: ascending individual damage; `output`: reverse topological); the best result
   (most norms replaced, then lowest cost class, then least damage) is kept. Per norm in order,
   the candidates are tried by individual damage (`policy="count"`, the default: most norms
   first, then a second sweep swaps each replaced norm for a cheaper candidate where the budget
   still holds) or by cost (`policy="cheapest"`: the cheapest candidate that keeps the budget).
   A trial keeps the budget when validation uses at most `margin` of its allowance; with a check
   split, a selection whose check misses is redone with `margin × margin_step`.
6. **Final check** on the test split: a model missing the budget there raises `BudgetMissed`
   (a `VerificationError`) and nothing is returned to write.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import onnx

from .. import __version__
from ..core.graph import NormInfo, NormType
from ..errors import InputError, VerificationError
from ..io import checked_model
from ..onnx.constants import constant_values
from ..onnx.frontend import build_zero_mean_graph, load_graph
from ..onnx.passes import FoldOptions, fold_onnx
from ..onnx.patterns import ALREADY_RMS
from ..onnx.verify import check_input_shapes
from .calibrate import (
    Budget,
    Metrics,
    NormStats,
    Runner,
    collect,
    compare,
    find_mask_input,
    load_batches,
    progress,
    split_batches,
)
from .emit import (
    Emission,
    Emitter,
    export_model,
    light_model,
    norm_cost,
    norm_spec,
    open_graph,
    width_of,
)
from .fit import KINDS, Surrogate, fit_affine, fit_pointwise, fit_rms, with_fit_error

ORDERS = ("input", "damage", "output")
POLICIES = ("count", "cheapest")
CENTRING_TOLERANCE = 1e-4
# Costs closer than this (in LayerNorm units) are ties: op timings on a CPU are not more precise,
# and swapping a surrogate for a slightly cheaper but less accurate one is not worth the budget.
COST_RESOLUTION = 0.1  # relative, float32: input centring may only change rounding


@dataclass
class ReplaceOptions:
    kind: str = "auto"  # auto | rms | affine | dyt | derf
    budget: Budget | str = "cos=0.999"
    sequential: bool = True
    orders: tuple[str, ...] = ("input", "damage")
    policy: str = "count"
    split: tuple[float, float, float] = (0.5, 0.25, 0.25)  # fit, validation, test
    holdout: object = None  # test data from elsewhere (same forms as the calibration data)
    margin: float = 0.8  # share of the budget's allowance the selection split may use (first attempt)
    check: float = 0.0  # share of the validation split held back to check each selection; 0: no check
    retries: int = 3  # selections retried with margin × `margin_step` while the check split misses the budget
    margin_step: float = 0.6
    centre_inputs: bool | None = None  # default: on when rms surrogates are allowed (see docs/surrogates.md)
    refit: bool = True  # rms: least-squares γ/β against the norm's outputs
    target: str = (
        "original"  # least squares against the original model's norm outputs, or "local": N(x) of the modified model
    )
    only_cheaper: bool | None = None  # default: True for auto
    tries: int = 2  # policy "count": candidates tried per norm, by individual damage
    norms: tuple[str, ...] | None = None  # restrict the candidates to these norms
    rms_op: str = "simplified"
    insert_centering: bool = True  # exact pass: may insert an explicit x − mean(x)
    reservoir: int = 8192  # tokens sampled per norm for least squares
    batch_size: int = 16
    samples: int = 64  # synthetic data only
    input_shapes: dict = field(default_factory=dict)  # synthetic data only
    mask_input: str | None = None
    seed: int = 0
    progress: bool = False


@dataclass
class Candidate:
    norm: str
    kind: str
    alone: Metrics | None = None
    usage: float = math.inf
    cost: float = math.inf
    fit_error: float | None = None


@dataclass
class OrderResult:
    order: str
    state: tuple  # ((norm, kind), ...) in topological order
    metrics: Metrics
    usage: float
    cost: float
    trials: int
    seconds: float

    def to_json(self) -> dict:
        return {
            "order": self.order,
            "replaced": len(self.state),
            "surrogates": dict(self.state),
            "cost": self.cost,
            "validation": self.metrics.to_json(),
            "budget_used": self.usage,
            "trials": self.trials,
            "seconds": round(self.seconds, 2),
        }


class BudgetMissed(VerificationError):
    """The selected model misses the budget on the held-out split; `report` says what was tried."""

    def __init__(self, report: dict, model: onnx.ModelProto, message: str):
        super().__init__(message)
        self.report = report
        self.model = model  # for inspection only: never to be written as the pass's result


@dataclass
class ReplaceResult:
    model: onnx.ModelProto
    report_data: dict
    passed: bool

    def report(self) -> dict:
        return self.report_data

    @property
    def replaced(self) -> int:
        return self.report_data["replaced"]


class Search:
    """States of replaced norms, their sequentially calibrated models, and their validation metrics."""

    def __init__(
        self,
        base: onnx.ModelProto,
        shapes: dict,
        dtypes: dict,
        name: str,
        candidates: list[NormInfo],
        fit,
        splits: dict[str, tuple[list, list]],
        mask_input: str | None,
        budget: Budget,
        options: ReplaceOptions,
    ):
        self.base, self.shapes, self.dtypes, self.name = base, shapes, dtypes, name
        self.order = [n.name for n in candidates]
        self.index = {name: i for i, name in enumerate(self.order)}
        self.norms = {n.name: n for n in candidates}
        self.specs = {n.name: norm_spec(n) for n in candidates}
        self.widths = {n.name: width_of(SimpleNamespace(shapes=shapes), n) for n in candidates}
        self.fit = fit
        self.splits = splits  # name → (batches, reference outputs of the original model)
        self.mask_input = mask_input
        self.budget, self.options = budget, options
        self.margin = options.margin
        self.weights: dict[str, np.ndarray] = {}
        self._stats: collections.OrderedDict = collections.OrderedDict()
        self._stats_bytes = 0
        self._surrogates: dict = {}
        self._metrics: dict = {}
        self._emissions: dict = {}
        self.passes = 0
        self.evaluations = 0

    # --- statistics and fits ----------------------------------------------------------------------

    def upstream(self, state: tuple, norm: str) -> tuple:
        if not self.options.sequential:
            return ()
        return tuple(item for item in state if self.index[item[0]] < self.index[norm])

    def stats(self, norm: str, upstream: tuple) -> NormStats:
        key = (norm, upstream)
        if key in self._stats:
            self._stats.move_to_end(key)
            return self._stats[key]
        replaced = {n for n, _ in upstream}
        last = max((self.index[n] for n in replaced), default=-1)
        wanted = [m for m in self.order if self.index[m] > last and m not in replaced]
        ctx, _, _ = self.build(self.materialize(upstream))
        dtypes = {self.norms[m].input: np.float32 for m in wanted}
        model, feeds = light_model(ctx, self.base, dtypes, self.weights)
        runner = Runner(model, feeds)
        tensors = {m: (self.norms[m].input, _identity, self.specs[m]) for m in wanted}
        label = f"calibrating after {len(upstream)} replacement(s)" if upstream else "calibrating"
        found = collect(
            runner,
            self.fit,
            tensors,
            self.mask_input,
            self.options.reservoir,
            self.options.seed,
            self.options.progress,
            label,
        )
        self.passes += 1
        for m, stats in found.items():
            self._remember((m, upstream), stats)
        return found[norm]

    def _remember(self, key, stats: NormStats, limit: int = 1 << 30) -> None:
        self._stats[key] = stats
        self._stats_bytes += stats.nbytes
        while self._stats_bytes > limit and len(self._stats) > 1:
            _, old = self._stats.popitem(last=False)
            self._stats_bytes -= old.nbytes

    def surrogate(self, norm: str, kind: str, upstream: tuple) -> Surrogate:
        key = (norm, kind, upstream)
        if key not in self._surrogates:
            stats = self.stats(norm, upstream)
            target = None
            if upstream and self.options.target == "original":
                target = self.specs[norm](self.stats(norm, ()).sample.astype(np.float64))
            self._surrogates[key] = fit_surrogate(kind, stats, self.norms[norm], self.specs[norm], self.options, target)
        return self._surrogates[key]

    def materialize(self, state: tuple) -> list[tuple[str, Surrogate]]:
        return [(norm, self.surrogate(norm, kind, self.upstream(state, norm))) for norm, kind in state]

    # --- models ----------------------------------------------------------------------------------

    def build(self, surrogates: list[tuple[str, Surrogate]]):
        ctx = open_graph(self.base, self.shapes, self.name, self.dtypes)
        emitter = Emitter(ctx, self.options.rms_op)
        emissions = {norm: emitter.emit(emitter.norms[norm], surrogate) for norm, surrogate in surrogates}
        return ctx, emitter, emissions

    def emission(self, norm: str, kind: str) -> Emission:
        """What replacing `norm` alone by `kind` emits (its structure does not depend on the fit)."""
        key = (norm, kind)
        if key not in self._emissions:
            _, _, emissions = self.build([(norm, self.surrogate(norm, kind, ()))])
            self._emissions[key] = emissions[norm]
        return self._emissions[key]

    def structural_cost(self, norm: str, kind: str) -> float:
        """The cost of emitting `kind` for `norm` with generic parameters (no calibration needed)."""
        width = self.widths[norm]
        shift = 1.0 if kind in ("rms", "derf") else 0.0
        dummy = Surrogate(kind, np.full(width, 2.0), np.ones(width), shift=shift, alpha=1.0, epsilon=1e-5)
        _, _, emissions = self.build([(norm, dummy)])
        return emissions[norm].cost

    def cost(self, state: tuple) -> float:
        return sum(self.emission(norm, kind).cost for norm, kind in state)

    def evaluate(self, state: tuple, split: str = "select") -> Metrics:
        """Metrics of the model for `state` against the original on a split (cached)."""
        state = self.normal(state)
        key = (state, split)
        if key not in self._metrics:
            batches, references = self.splits[split]
            masks = [b.get(self.mask_input) if self.mask_input else None for b in batches]
            self._metrics[key] = compare(references, self.outputs(state, split), masks)
            self.evaluations += 1
        return self._metrics[key]

    def outputs(self, state: tuple, split: str) -> list[dict[str, np.ndarray]]:
        """The outputs of the model for `state` on every batch of a split."""
        batches, references = self.splits[split]
        ctx, _, _ = self.build(self.materialize(self.normal(state)))
        model, feeds = light_model(ctx, self.base, None, self.weights)
        runner = Runner(model, feeds)
        return [runner.run(b, list(references[0])) for b in batches]

    def normal(self, state) -> tuple:
        return tuple(sorted(state, key=lambda item: self.index[item[0]]))

    def usage(self, state: tuple) -> float:
        return self.budget.usage(self.evaluate(state))

    def holds(self, state: tuple) -> bool:
        return self.usage(state) <= self.margin


def _identity(rows: np.ndarray) -> np.ndarray:
    return rows


def fit_surrogate(kind: str, stats: NormStats, norm: NormInfo, spec, options: ReplaceOptions, target=None) -> Surrogate:
    """Fit one kind of surrogate to the collected statistics of a norm.

    `target`: the original model's outputs of this norm on the same sample of tokens (least-squares
    fits then also absorb the systematic part of the upstream replacements' errors); default N(x).
    """
    x = stats.sample.astype(np.float64)
    y = spec(x) if target is None or target.shape != x.shape else target
    if kind == "affine":
        surrogate = fit_affine(stats.x, stats.y)
    elif kind == "rms":
        surrogate = fit_rms(x, y, stats.x, norm.epsilon, spec, refit=options.refit)
    else:
        fits = [
            with_fit_error(fit_pointwise(kind, x, y, stats.x, shift, seed=options.seed), x, y)
            for shift in ("none", "feature")
        ]
        return min(fits, key=lambda s: s.fit_error)
    return with_fit_error(surrogate, x, y)


# --- eligibility --------------------------------------------------------------------------------


def why_not(norm: NormInfo, width: int | None, kind: str) -> str | None:
    """Why no surrogate of `kind` can replace `norm`, or None.

    The front end's reason (`NormInfo.unsupported`: its axes, used statistics, run-time γ, β or ε,
    a control-flow body) rules a LayerNorm out; an RMSNorm, which it declines for being one, is
    ruled out for the rms kind only. Grouped norms, Skip ops and an unknown width are what the
    surrogates do not implement.
    """
    if norm.norm_type is NormType.GROUP:
        return "GroupNorm: surrogates for grouped norms are not implemented"
    if norm.norm_type is NormType.RMS and norm.unsupported == ALREADY_RMS:
        if kind == "rms":
            return "already an RMSNorm"
        if norm.axis is None:
            return "does not normalize over one (last) axis"
        if norm.ref.gamma is not None and constant_values(norm.ref.gamma) is None:
            return "its γ is computed at run time, not a constant"
    elif norm.unsupported:
        return norm.unsupported
    if norm.ref.skip is not None:
        return "a SkipLayerNormalization: surrogates for norms fused with their residual Add are not implemented"
    if width is None:
        return "the normalized width is unknown"
    return None


# --- the pass -----------------------------------------------------------------------------------


@dataclass
class Prepared:
    """Everything the selection works on: data splits, the exactly folded and centred base model,
    the candidate norms and a `Search` over them (tools use it to evaluate states directly)."""

    options: ReplaceOptions
    budget: Budget
    kinds: tuple
    only_cheaper: bool
    model: onnx.ModelProto
    name: str
    fit: list
    select: list
    check: list
    test: list
    mask_input: str | None
    folded: object
    exact: set
    original_norms: dict
    declined: dict
    candidates: list
    centred: dict
    ctx: object
    docs: dict
    output_names: list
    search: Search
    seconds: dict
    started: float


def prepare(
    model: onnx.ModelProto | str, calibration, options: ReplaceOptions | None = None, name: str = "model"
) -> Prepared:
    """Steps 1–2 of the pass: data, exact fold, input centring, references, and the `Search`."""
    model = checked_model(model, name)
    options = options or ReplaceOptions()
    check_input_shapes(model, options.input_shapes)
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    budget = options.budget if isinstance(options.budget, Budget) else Budget.parse(options.budget)
    kinds = _kinds(options.kind)
    if options.policy not in POLICIES:
        raise InputError(f"policy {options.policy!r}: choose one of {', '.join(POLICIES)}")
    bad = [o for o in options.orders if o not in ORDERS]
    if bad or not options.orders:
        raise InputError(f"orders {list(options.orders)!r}: choose from {', '.join(ORDERS)}")
    if not options.margin > 0:
        raise InputError(f"margin {options.margin}: must be > 0")
    only_cheaper = options.kind == "auto" if options.only_cheaper is None else options.only_cheaper

    # data
    batches = load_batches(calibration, model, options.batch_size, options.samples, options.seed, options.input_shapes)
    if options.holdout is not None:
        test = load_batches(
            options.holdout, model, options.batch_size, options.samples, options.seed + 1, options.input_shapes
        )
        fit, val, _ = split_batches(
            batches, (options.split[0], options.split[1], 0.0), options.seed, options.batch_size
        )
    else:
        fit, val, test = split_batches(batches, options.split, options.seed, options.batch_size)
    for index, batch in enumerate(batches + (test if options.holdout is not None else [])):
        check_input_shapes(model, {k: v.shape for k, v in batch.items()}, f"calibration batch {index}, input")
    select, check = val, []
    if options.check > 0 and options.retries > 0 and _count(val) >= 2:
        select, check, _ = split_batches(
            val, (1 - options.check, options.check, 0.0), options.seed + 7, options.batch_size
        )
    mask_input = find_mask_input(model, options.mask_input)

    # exact fold, then input centring
    folded = fold_onnx(
        model,
        FoldOptions(
            rms_op=options.rms_op,
            insert_centering=options.insert_centering,
            verify=True,
            input_shapes=options.input_shapes,
            seed=options.seed,
        ),
        name=name,
    )
    exact = {d.name for d in folded.plan.folded}
    original_norms = {n.name: n for n in build_zero_mean_graph(load_graph(model, name)).norms}
    unfolded_outputs = {n.output for n in original_norms.values() if n.name not in exact}
    ctx = load_graph(folded.model, name)
    shapes = ctx.shapes
    emitter = Emitter(ctx, options.rms_op)
    norms = [n for n in emitter.norms.values() if n.output in unfolded_outputs]
    if options.norms is not None:
        unknown = sorted(set(options.norms) - {n.name for n in norms} - exact)
        if unknown:
            raise InputError(
                f"{name}: no norm {', '.join(unknown)} among those the exact pass leaves ({', '.join(n.name for n in norms)})"
            )
        norms = [n for n in norms if n.name in options.norms]
    declined: dict[str, str] = {}
    candidates: list[NormInfo] = []
    for norm in norms:
        width = width_of(ctx, norm)
        reasons = [why_not(norm, width, k) for k in kinds]
        if all(reasons):
            declined[norm.name] = reasons[0]
        else:
            candidates.append(norm)
    centred = {}
    if options.centre_inputs if options.centre_inputs is not None else "rms" in kinds:
        for norm in candidates:
            done = emitter.centre_inputs(norm)
            if done:
                centred[norm.name] = done
    base = export_model(ctx, folded.model, emitter.docs, {})
    seconds["fold"] = time.perf_counter() - started

    # the original model's outputs on every split that judges
    start = time.perf_counter()
    reference_runner = Runner(model)
    output_names = reference_runner.outputs
    splits = {}
    for split, data in (("select", select), ("check", check), ("test", test)):
        splits[split] = (
            data,
            [reference_runner.run(b) for b in progress(data, f"original model ({split})", options.progress)],
        )
    if centred:
        base_runner = Runner(base)
        first = select[0]
        centring = compare(
            splits["select"][1][:1],
            [base_runner.run(first, output_names)],
            [first.get(mask_input) if mask_input else None],
        )
        if centring.rel_max > CENTRING_TOLERANCE:
            raise VerificationError(
                f"{name}: input centring changed the outputs (relative error {centring.rel_max:.3g}); "
                "replace without input centring (ReplaceOptions.centre_inputs=False) and report this model"
            )
    seconds["references"] = time.perf_counter() - start

    search = Search(base, shapes, ctx.dtypes, name, candidates, fit, splits, mask_input, budget, options)
    return Prepared(
        options,
        budget,
        kinds,
        only_cheaper,
        model,
        name,
        fit,
        select,
        check,
        test,
        mask_input,
        folded,
        exact,
        original_norms,
        declined,
        candidates,
        centred,
        ctx,
        emitter.docs,
        output_names,
        search,
        seconds,
        started,
    )


def replace_onnx(
    model: onnx.ModelProto | str, calibration, options: ReplaceOptions | None = None, name: str = "model"
) -> ReplaceResult:
    """Replace the norms of `model` that do not fold exactly by surrogates, under `options.budget`."""
    p = prepare(model, calibration, options, name)
    options, budget, search, seconds, ctx = p.options, p.budget, p.search, p.seconds, p.ctx
    check, test, mask_input, splits = p.check, p.test, p.mask_input, search.splits
    start = time.perf_counter()
    pool = _individual(search, p.candidates, p.kinds, p.only_cheaper, ctx)
    seconds["individual"] = time.perf_counter() - start
    attempts = []
    start = time.perf_counter()
    for _attempt in range(options.retries + 1 if check else 1):
        results = []
        for order in options.orders:
            begin = time.perf_counter()
            before = search.evaluations
            state = _greedy(search, _ordered(order, search, pool), pool, options)
            metrics = search.evaluate(state)
            results.append(
                OrderResult(
                    order,
                    state,
                    metrics,
                    budget.usage(metrics),
                    search.cost(state),
                    search.evaluations - before,
                    time.perf_counter() - begin,
                )
            )
        best = min(results, key=lambda r: (-len(r.state), _cost_class(r.cost), r.usage))
        checked = search.evaluate(best.state, "check") if check else None
        attempts.append(
            {
                "margin": search.margin,
                "orders": [r.to_json() for r in results],
                "chosen_order": best.order,
                "replaced": len(best.state),
                "check": None if checked is None else checked.to_json(),
                "check_holds": None if checked is None else budget.holds(checked),
            }
        )
        if checked is None or budget.holds(checked) or not best.state:
            break
        search.margin *= options.margin_step
    seconds["selection"] = time.perf_counter() - start

    # the model to write, and its figures on held-out data
    start = time.perf_counter()
    surrogates = search.materialize(best.state)
    final_ctx, final_emitter, emissions = search.build(surrogates)
    properties = {
        "normpass.version": __version__,
        "normpass.replaced": f"{len(best.state)} of {len(p.original_norms)} norms replaced by surrogates, {len(p.exact)} folded exactly",
        "normpass.surrogate.fit": ", ".join(f"{n}={k}" for n, k in best.state),
        "normpass.budget": str(budget),
    }
    final = export_model(final_ctx, p.folded.model, {**p.docs, **final_emitter.docs}, properties)
    final_runner = Runner(final)
    test_masks = [b.get(mask_input) if mask_input else None for b in test]
    test_metrics = compare(splits["test"][1], [final_runner.run(b, p.output_names) for b in test], test_masks)
    seconds["final"] = time.perf_counter() - start
    seconds["total"] = time.perf_counter() - p.started
    passed = budget.holds(test_metrics)

    report = _report(
        name,
        options,
        budget,
        p.kinds,
        p.original_norms,
        p.exact,
        p.declined,
        p.candidates,
        p.centred,
        pool,
        best,
        attempts,
        dict(surrogates),
        emissions,
        search,
        test_metrics,
        passed,
        p.fit,
        p.select,
        check,
        test,
        seconds,
        model,
        final,
    )
    if not passed:
        raise BudgetMissed(
            report,
            final,
            f"{name}: the replaced model misses the budget {budget} on the held-out split "
            f"({_figures(test_metrics)}; validation: {_figures(best.metrics)}); nothing written. "
            "Give more calibration data, a smaller margin (ReplaceOptions.margin), or a looser budget",
        )
    return ReplaceResult(final, report, passed)


def _figures(m: Metrics) -> str:
    text = f"cos min {m.cos_min:.6f}, rel max {m.rel_max:.3g}"
    return text + (f", top1 {m.top1:.4f}" if m.top1 is not None else "")


def _kinds(kind: str) -> tuple[str, ...]:
    if kind == "auto":
        return KINDS
    if kind not in KINDS:
        raise InputError(f"surrogate kind {kind!r}: choose one of auto, {', '.join(KINDS)}")
    return (kind,)


def _individual(
    search: Search, candidates: list[NormInfo], kinds, only_cheaper: bool, ctx
) -> dict[str, list[Candidate]]:
    """Every allowed (norm, kind) alone on the model: its damage, cost and fit error."""
    pool: dict[str, list[Candidate]] = {}
    for norm in candidates:
        own = norm_cost(norm)
        options = []
        for kind in kinds:
            if why_not(norm, width_of(ctx, norm), kind):
                continue
            candidate = Candidate(norm.name, kind)
            candidate.cost = search.structural_cost(norm.name, kind)
            if only_cheaper and candidate.cost >= own:
                options.append(candidate)  # not fitted: it could not save anything
                continue
            candidate.cost = search.emission(norm.name, kind).cost
            candidate.fit_error = search.surrogate(norm.name, kind, ()).fit_error
            candidate.alone = search.evaluate(((norm.name, kind),))
            candidate.usage = search.budget.usage(candidate.alone)
            options.append(candidate)
        pool[norm.name] = options
    return pool


def _usable(pool: dict[str, list[Candidate]], norm: str) -> list[Candidate]:
    return [c for c in pool.get(norm, []) if c.alone is not None]


def _ordered(order: str, search: Search, pool) -> list[str]:
    names = [n for n in search.order if _usable(pool, n)]
    if order == "output":
        return names[::-1]
    if order == "damage":
        return sorted(names, key=lambda n: (min(c.usage for c in _usable(pool, n)), search.index[n]))
    return names


def _greedy(search: Search, order: list[str], pool, options: ReplaceOptions) -> tuple:
    """Greedy selection along `order` (see the module docstring); returns the accepted state."""
    state: tuple = ()
    for norm in order:
        options_here = _usable(pool, norm)
        if options.policy == "cheapest":
            tried = sorted(options_here, key=lambda c: (_cost_class(c.cost), c.usage))
        else:
            tried = sorted(options_here, key=lambda c: (c.usage, c.cost))[: max(options.tries, 1)]
        for candidate in tried:
            if candidate.usage > search.margin:
                continue  # alone it already breaks the budget
            trial = search.normal(state + ((norm, candidate.kind),))
            if search.holds(trial):
                state = trial
                break
    if options.policy == "count":
        for norm in order:
            current = dict(state).get(norm)
            if current is None:
                continue
            cost = next(c.cost for c in _usable(pool, norm) if c.kind == current)
            for candidate in sorted(_usable(pool, norm), key=lambda c: (c.cost, c.usage)):
                if candidate.cost > cost - COST_RESOLUTION or candidate.usage > search.margin:
                    continue
                trial = search.normal(tuple((n, candidate.kind if n == norm else k) for n, k in state))
                if search.holds(trial):
                    state = trial
                    break
    return state


def _cost_class(cost: float) -> int:
    return round(cost / COST_RESOLUTION)


def _count_ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))


def _report(
    name,
    options,
    budget,
    kinds,
    original_norms,
    exact,
    declined,
    candidates,
    centred,
    pool,
    best,
    attempts,
    surrogates,
    emissions,
    search: Search,
    test_metrics,
    passed,
    fit,
    select,
    check,
    test,
    seconds,
    model,
    final,
) -> dict:
    chosen = dict(best.state)
    rows = []
    for norm_name, norm in original_norms.items():
        row = {"name": norm_name, "op": norm.op}
        if norm_name in exact:
            row.update(decision="exact", reason="folded exactly into an RMSNorm by the exact pass", kept=False)
        elif norm_name in declined:
            row.update(decision="unsupported", reason=declined[norm_name], kept=True)
        elif norm_name not in search.norms:
            row.update(decision="kept", reason="not selected (ReplaceOptions.norms)", kept=True)
        else:
            own = norm_cost(search.norms[norm_name])
            row["original_cost"] = own
            row["input_centring"] = centred.get(norm_name, [])
            row["candidates"] = [
                {
                    "kind": c.kind,
                    "cost": c.cost,
                    "fit_error": c.fit_error,
                    "alone": None if c.alone is None else {**c.alone.to_json(), "budget_used": c.usage},
                    "skipped": None if c.alone is not None else "not cheaper than the norm it would replace",
                }
                for c in pool.get(norm_name, [])
            ]
            if norm_name in chosen:
                surrogate = surrogates[norm_name]
                emission = emissions[norm_name]
                row.update(
                    decision="replaced",
                    kept=False,
                    surrogate=chosen[norm_name],
                    parameters=surrogate.describe(),
                    emission=emission.to_json(),
                    cost_change=emission.cost - own,
                    reason=f"{chosen[norm_name]} surrogate keeps the budget",
                )
            else:
                usable = _usable(pool, norm_name)
                if not usable:
                    reason = (
                        "no surrogate kind is cheaper than this norm"
                        if pool.get(norm_name)
                        else "no applicable surrogate"
                    )
                elif all(c.usage > search.margin for c in usable):
                    reason = "every surrogate alone already breaks the budget on validation"
                else:
                    reason = "replacing it as well breaks the budget on validation"
                row.update(decision="kept", kept=True, reason=reason)
        rows.append(row)
    replaced_cost = sum(emissions[n].cost for n in chosen)
    original_cost = sum(norm_cost(search.norms[n]) for n in chosen)
    return {
        "normpass_version": __version__,
        "model": name,
        "kind": options.kind,
        "kinds": list(kinds),
        "budget": {"cos": budget.cos, "rel": budget.rel, "top1": budget.top1, "margin": search.margin},
        "policy": options.policy,
        "calibration": "sequential" if options.sequential else "parallel",
        "samples": {"fit": _count(fit), "selection": _count(select), "check": _count(check), "test": _count(test)},
        "total": len(original_norms),
        "exact": len(exact),
        "replaced": len(chosen),
        "kept": len(original_norms) - len(exact) - len(chosen),
        "attempts": attempts,
        "chosen_order": best.order,
        "validation": best.metrics.to_json(),
        "check": attempts[-1]["check"],
        "test": test_metrics.to_json(),
        "passed": passed,
        "norm_cost": {
            "replaced_norms_before": original_cost,
            "replaced_norms_after": replaced_cost,
            "unit": "one LayerNormalization over the same tensor (estimated, see OP_COST)",
        },
        "ops": {"before": _count_ops(model), "after": _count_ops(final)},
        "norms": rows,
        "calibration_passes": search.passes,
        "evaluations": search.evaluations,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


def _count(batches) -> int:
    return int(sum(next(iter(b.values())).shape[0] for b in batches))
