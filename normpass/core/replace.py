"""The surrogate pass, front-end neutral: sequential calibration, selection under a budget, the report.

A front end (`onnx/replace/driver.py`, `torch/replace.py`) folds what folds exactly, finds the candidate
norms, and gives this module a `Workbench`: a model whose candidate norms it can replace by
surrogates, run on calibration batches (collecting each norm's input, or the outputs) and emit
(saying which ops remain and what they cost). Everything else happens here, in NumPy:

1. **Data roles.** Calibration samples are split (seeded) into *fit* (statistics), *select*
   (every greedy decision), *check* (the back-off, below) and *test* (the final figures and the
   gate) — or test comes from a separate holdout. No split decides what another measures.
2. **Candidates.** Per norm and allowed kind a surrogate is fitted (`core/surrogates.py`); its
   emission says what it costs (`core/cost.py`). The cost rule (`pays`, `COST_RULES`): with
   `kind="auto"` a candidate must cost less than the norm it replaces ("cheaper"; else the norm is
   kept and the report says why); a kind the caller names is the caller's choice ("any": emitted
   wherever it keeps the budget, whatever it costs; the report has both costs). "no dearer" (cost ≤
   the norm's) is there for callers that ask for it (`cost_rule`).
3. **Sequential calibration** (DaMN, seed 000 App. C): a replaced norm is fitted on statistics
   collected with every earlier (topologically upstream) replacement in place; a state is a set of
   (norm, kind), always rebuilt and recalibrated in topological order, so the model judged is the
   model written. Least-squares fits target the original model's norm outputs on the same tokens
   (`target="original"`; `"local"`: N(x) of the modified model). `sequential=False` fits every
   norm on the original model (the paper's "parallel" ablation).
4. **Selection** on select, greedy, for each order in `orders` (`input`: topological; `damage`:
   ascending individual damage; `output`: reverse topological). Per norm in order, candidates are
   tried by individual damage (`policy="count"`: most norms first, then a sweep swapping replaced
   norms for cheaper candidates where the budget still holds) or by cost (`"cheapest"`). A trial
   keeps the budget when select uses at most `margin` of its allowance. Each accepted trial
   extends the order's *path* of states.
5. **Back-off** (why: docs/surrogates.md, "A selection that generalizes"): the decision is the
   largest state on the path whose figures on the check split — samples no decision has seen —
   keep the budget within `check_margin`; the best order's (most norms, lowest cost class, least
   damage on check) is kept. A worst case over a few dozen samples is an extreme statistic, and
   greedy acceptance favours states whose select figures happen to be low: the check split sees
   neither bias.
6. **Gate** on test: a model missing the budget there is refused (`BudgetMissed`, which carries
   the report), unless `write_best`, which writes the largest state on the chosen path that meets
   the budget on test instead (test then decided that, and the report says so).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import __version__
from ..calibration import Batch, sample_count, split_batches
from ..errors import InputError, VerificationError
from .budget import Budget, Metrics, compare
from .cost import COST_RESOLUTION, Emission, cost_class
from .graph import NormInfo
from .progress import progress
from .stats import NormStats, StatsCollector
from .surrogates import KINDS, NormSpec, Surrogate, fit_surrogate, why_not

ORDERS = ("input", "damage", "output")
POLICIES = ("count", "cheapest")
# The cost rule (module docstring, step 2): whether a surrogate costing `cost` may replace a norm costing `own`.
COST_RULES: dict[str, Callable[[float, float], bool]] = {
    "cheaper": lambda cost, own: cost < own,
    "no dearer": lambda cost, own: cost <= own,
    "any": lambda cost, own: True,
}
SPLITS = ("fit", "select", "check", "test")


@dataclass
class ReplaceOptions:
    """Options of the surrogate pass, the same for both front ends (the CLI flag is named in brackets)."""

    kind: str = "auto"  # auto | rms | affine | scalebias | dyt | derf  [--with]
    budget: Budget | str = "cos=0.999"
    sequential: bool = True  # [--parallel: False]
    orders: tuple[str, ...] = ("input", "damage")
    policy: str = "count"
    split: tuple[float, float, float] = (0.4, 0.4, 0.2)  # fit, validation (select + check), test
    check: float = 0.5  # share of validation held back for the back-off; 0: decide on select alone
    holdout: object = None  # test data from elsewhere (same forms as the calibration data)
    margin: float = 0.8  # share of the budget's allowance the selection split may use
    check_margin: float = 0.8  # share of the budget's allowance the check split may use
    write_best: bool = False  # on a miss, write the largest selection that meets the budget on test
    centre_inputs: bool | None = None  # default: on when rms surrogates are allowed (docs/surrogates.md)
    refit: bool = True  # rms: least-squares γ/β against the norm's outputs
    target: str = "original"  # least squares against the original model's norm outputs, or "local"
    cost_rule: str | None = None  # COST_RULES; default: "cheaper" for auto, "any" for a named kind
    tries: int = 2  # policy "count": candidates tried per norm, by individual damage
    norms: tuple[str, ...] | None = None  # restrict the candidates to these norms
    all_norms: bool = False  # the norms the exact pass folds are candidates too (a norm-free model)  [--all-norms]
    migrate_affine: bool = True  # move c, γ and β into adjacent layers where exact
    rms_op: str = "simplified"  # ONNX: the op of exact folds and rms surrogates
    provider: str | None = None  # ONNX: price ONNX Runtime's fusions on this provider (cpu, cuda)  [--provider]
    insert_centering: bool = True  # ONNX exact pass: may insert an explicit x − mean(x)
    reservoir: int = 8192  # tokens sampled per norm for least squares
    batch_size: int = 16
    tokenizer: str | None = None  # for .txt / .jsonl calibration files
    max_length: int = 128  # tokens per sentence of text calibration
    samples: int = 64  # ONNX synthetic data only
    input_shapes: dict = field(default_factory=dict)  # ONNX synthetic data only
    mask_input: str | None = None
    seed: int = 0
    progress: bool = False

    def checked(self) -> tuple[Budget, tuple[str, ...], str]:
        """The parsed budget, the allowed kinds and the cost rule (`COST_RULES`); refuses bad values."""
        budget = self.budget if isinstance(self.budget, Budget) else Budget.parse(self.budget)
        kinds: tuple[str, ...]
        if self.kind == "auto":
            kinds = KINDS
        elif self.kind in KINDS:
            kinds = (self.kind,)
        else:
            raise InputError(f"surrogate kind {self.kind!r}: choose one of auto, {', '.join(KINDS)}")
        if self.policy not in POLICIES:
            raise InputError(f"policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if not self.orders or any(o not in ORDERS for o in self.orders):
            raise InputError(f"orders {list(self.orders)!r}: choose from {', '.join(ORDERS)}")
        if not self.margin > 0:
            raise InputError(f"margin {self.margin}: must be > 0")
        if not self.check_margin > 0:
            raise InputError(f"check-margin {self.check_margin}: must be > 0")
        if (
            len(self.split) != 3
            or not all(math.isfinite(f) and f >= 0 for f in self.split)
            or not self.split[0] > 0
            or not self.split[1] > 0
        ):
            raise InputError(
                f"split {tuple(self.split)}: give finite fractions fit,validation,test with fit and validation > 0"
            )
        if self.split[2] == 0 and self.holdout is None:
            raise InputError(
                f"split {tuple(self.split)}: the test fraction is 0 and no holdout is given, so the budget would be "
                "judged on no data; give the test split a share, or held-out data (--holdout)"
            )
        if not 0 <= self.check < 1:
            raise InputError(f"check {self.check}: the share of validation held back must be in [0, 1)")
        if self.provider not in (None, "cpu", "cuda"):
            raise InputError(f"provider {self.provider!r}: choose cpu or cuda (or none: ops priced alone)")
        if self.target not in ("original", "local"):
            raise InputError(f"target {self.target!r}: choose original or local")
        cost_rule = self.cost_rule or ("cheaper" if self.kind == "auto" else "any")
        if cost_rule not in COST_RULES:
            raise InputError(f"cost rule {cost_rule!r}: choose one of {', '.join(COST_RULES)}")
        return budget, kinds, cost_rule


class Workbench(Protocol):
    """What a front end gives the pass: its candidate norms, and a model it can replace them in.

    `surrogates` arguments are (norm name, surrogate) pairs in topological order; a model built
    from them has exactly those norms replaced. Batches are iterated once.
    """

    name: str
    norms: list[NormInfo]  # the candidates, in topological order
    mask_input: str | None

    def spec(self, norm: str) -> NormSpec: ...

    def width(self, norm: str) -> int: ...

    def norm_cost(self, norm: str) -> float: ...

    def emission(self, norm: str, surrogate: Surrogate) -> Emission: ...

    def statistics(
        self, surrogates: list[tuple[str, Surrogate]], norms: list[str], batches: Iterable[Batch], into: StatsCollector
    ) -> None: ...

    def outputs(
        self, surrogates: list[tuple[str, Surrogate]], batches: Iterable[Batch]
    ) -> list[dict[str, np.ndarray]]: ...


# --- data ---------------------------------------------------------------------------------------


@dataclass
class Splits:
    """The batches of each data role and the original model's outputs on those that judge."""

    batches: dict[str, list[Batch]]  # fit, select, check, test
    references: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)  # select, check, test

    def count(self, role: str) -> int:
        return sample_count(self.batches.get(role, []))


def split_roles(batches: list[Batch], holdout: list[Batch] | None, options: ReplaceOptions) -> Splits:
    """Fit, select, check and test batches (see the module docstring); a holdout is the test split,
    batched like the others (sentences collated)."""
    fit_share, val_share, test_share = options.split
    if holdout is not None:
        test_share = 0.0
        (holdout,) = split_batches(holdout, (1.0,), options.seed, options.batch_size)
    val_shares = (val_share * (1 - options.check), val_share * options.check)
    shares = (fit_share, *val_shares, test_share)
    fit, select, check, test = split_batches(batches, shares, options.seed, options.batch_size)
    return Splits({"fit": fit, "select": select, "check": check, "test": holdout if holdout is not None else test})


def eligible(
    name: str,
    norms: list[NormInfo],
    exact: set[str],
    options: ReplaceOptions,
    kinds: tuple[str, ...],
    width: Callable[[NormInfo], int | None],
    front_end_reason: Callable[[NormInfo], str | None],
) -> tuple[list[NormInfo], dict[str, str]]:
    """The candidates among the norms the exact pass left (`options.norms` restricts them), and why
    the others are declined: no allowed kind can replace them (`why_not`)."""
    if options.norms is not None:
        unknown = sorted(set(options.norms) - {n.name for n in norms} - exact)
        if unknown:
            raise InputError(
                f"{name}: no norm {', '.join(unknown)} among those the exact pass leaves "
                f"({', '.join(n.name for n in norms)})"
            )
        norms = [n for n in norms if n.name in options.norms]
    declined: dict[str, str] = {}
    candidates = []
    for norm in norms:
        reasons = [why_not(norm, width(norm), kind, front_end_reason(norm)) for kind in kinds]
        if all(reasons):
            declined[norm.name] = str(reasons[0])
        else:
            candidates.append(norm)
    return candidates, declined


# --- search -------------------------------------------------------------------------------------


class Search:
    """States of replaced norms, their sequentially calibrated surrogates, and their metrics per split."""

    def __init__(self, bench: Workbench, splits: Splits, budget: Budget, options: ReplaceOptions):
        self.bench = bench
        self.order = [n.name for n in bench.norms]
        self.index = {name: i for i, name in enumerate(self.order)}
        self.specs = {name: bench.spec(name) for name in self.order}
        self.epsilons = {n.name: n.epsilon for n in bench.norms}
        self.splits = splits
        self.budget, self.options = budget, options
        budget.refuse_unjudgeable(self.judge("test", splits.references["test"]), "the test split")
        self.margin = options.margin
        self._stats: collections.OrderedDict = collections.OrderedDict()
        self._stats_bytes = 0
        self._surrogates: dict = {}
        self._metrics: dict = {}
        self._emissions: dict = {}
        self.passes = 0
        self.evaluations = 0

    # statistics and fits

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
        collector = StatsCollector({m: self.specs[m] for m in wanted}, self.options.reservoir, self.options.seed)
        label = f"calibrating after {len(upstream)} replacement(s)" if upstream else "calibrating"
        batches = progress(self.splits.batches["fit"], label, self.options.progress)
        self.bench.statistics(self.materialize(upstream), wanted, batches, collector)
        self.passes += 1
        found = collector.result()
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
            self._surrogates[key] = fit_surrogate(
                kind, stats, self.specs[norm], self.epsilons[norm], target, self.options.refit, self.options.seed
            )
        return self._surrogates[key]

    def materialize(self, state: tuple) -> list[tuple[str, Surrogate]]:
        return [(norm, self.surrogate(norm, kind, self.upstream(state, norm))) for norm, kind in self.normal(state)]

    # cost

    def emission(self, norm: str, kind: str) -> Emission:
        """What replacing `norm` alone by `kind` emits (its structure does not depend on the fit)."""
        key = (norm, kind)
        if key not in self._emissions:
            self._emissions[key] = self.bench.emission(norm, self.surrogate(norm, kind, ()))
        return self._emissions[key]

    def structural_cost(self, norm: str, kind: str) -> float:
        """The cost of emitting `kind` for `norm` with generic parameters (no calibration needed)."""
        width = self.bench.width(norm)
        shift = 1.0 if kind in ("rms", "derf") else 0.0
        dummy = Surrogate(kind, np.full(width, 2.0), np.ones(width), shift=shift, alpha=2.0, epsilon=1e-5)
        return self.bench.emission(norm, dummy).cost

    def cost(self, state: tuple) -> float:
        return sum(self.emission(norm, kind).cost for norm, kind in state)

    # judging

    def evaluate(self, state: tuple, split: str = "select") -> Metrics:
        """Metrics of the model for `state` against the original on a split (cached)."""
        state = self.normal(state)
        key = (state, split)
        if key not in self._metrics:
            self._metrics[key] = self.judge(split, self.outputs(state, split))
            self.evaluations += 1
        return self._metrics[key]

    def judge(self, split: str, outputs: list[dict[str, np.ndarray]]) -> Metrics:
        """Metrics of `outputs` (one dict per batch of `split`) against the original's."""
        batches = self.splits.batches[split]
        masks = [b.get(self.bench.mask_input) if self.bench.mask_input else None for b in batches]
        return compare(self.splits.references[split], outputs, masks)

    def outputs(self, state: tuple, split: str) -> list[dict[str, np.ndarray]]:
        """The outputs of the model for `state` on every batch of a split."""
        return self.bench.outputs(self.materialize(state), self.splits.batches[split])

    def normal(self, state) -> tuple:
        return tuple(sorted(state, key=lambda item: self.index[item[0]]))

    def usage(self, state: tuple, split: str = "select") -> float:
        return self.budget.usage(self.evaluate(state, split))

    def holds(self, state: tuple, split: str = "select") -> bool:
        return self.usage(state, split) <= self.margin


# --- selection ----------------------------------------------------------------------------------


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
    """One greedy order: its path of accepted states and the state the back-off decided on."""

    order: str
    path: list[tuple]  # accepted states, in acceptance order (the first is empty)
    state: tuple
    metrics: Metrics  # select
    check: Metrics | None
    cost: float
    trials: int
    seconds: float

    @property
    def greedy(self) -> tuple:
        return self.path[-1]

    def to_json(self, budget: Budget) -> dict:
        return {
            "order": self.order,
            "greedy": len(self.greedy),
            "replaced": len(self.state),
            "backed_off": len(self.path) - 1 - self.path.index(self.state),
            "surrogates": dict(self.state),
            "cost": self.cost,
            "selection": self.metrics.to_json(),
            "selection_budget_used": budget.usage(self.metrics),
            "check": None if self.check is None else self.check.to_json(),
            "check_budget_used": None if self.check is None else budget.usage(self.check),
            "trials": self.trials,
            "seconds": round(self.seconds, 2),
        }


def pays(cost: float, own: float, cost_rule: str) -> bool:
    """Whether a surrogate whose emission costs `cost` may replace a norm that costs `own` (`COST_RULES`)."""
    return COST_RULES[cost_rule](cost, own)


def candidate_pool(search: Search, kinds: tuple[str, ...], cost_rule: str) -> dict[str, list[Candidate]]:
    """Every allowed (norm, kind) alone on the model: its damage on select, cost and fit error."""
    pool: dict[str, list[Candidate]] = {}
    for norm in search.bench.norms:
        own = search.bench.norm_cost(norm.name)
        found = []
        for kind in kinds:
            if why_not(norm, search.bench.width(norm.name), kind):
                continue
            candidate = Candidate(norm.name, kind)
            candidate.cost = search.structural_cost(norm.name, kind)
            if not pays(candidate.cost, own, cost_rule):
                found.append(candidate)  # not fitted: the cost rule refuses it
                continue
            candidate.cost = search.emission(norm.name, kind).cost
            if not pays(candidate.cost, own, cost_rule):
                found.append(candidate)  # fitted, but its emission with these parameters does not pay
                continue
            candidate.fit_error = search.surrogate(norm.name, kind, ()).fit_error
            candidate.alone = search.evaluate(((norm.name, kind),))
            candidate.usage = search.budget.usage(candidate.alone)
            found.append(candidate)
        pool[norm.name] = found
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


def greedy(search: Search, order: list[str], pool, options: ReplaceOptions) -> list[tuple]:
    """Greedy selection on select along `order`; returns the path of accepted states."""
    state: tuple = ()
    path = [state]
    for norm in order:
        here = _usable(pool, norm)
        if options.policy == "cheapest":
            tried = sorted(here, key=lambda c: (cost_class(c.cost), c.usage))
        else:
            tried = sorted(here, key=lambda c: (c.usage, c.cost))[: max(options.tries, 1)]
        for candidate in tried:
            if candidate.usage > search.margin:
                continue  # alone it already breaks the budget
            trial = search.normal(state + ((norm, candidate.kind),))
            if search.holds(trial):
                state = trial
                path.append(state)
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
                    path.append(state)
                    break
    return path


def back_off(search: Search, path: list[tuple], split: str, margin: float) -> tuple:
    """The last state of `path` whose figures on `split` keep the budget within `margin`."""
    for state in reversed(path):
        if search.budget.usage(search.evaluate(state, split)) <= margin:
            return state
    return ()


@dataclass
class Selection:
    """The decision: the state to write, every order's result, and the pool of candidates."""

    state: tuple
    chosen: OrderResult
    orders: list[OrderResult]
    pool: dict[str, list[Candidate]]
    seconds: dict[str, float]


def select(search: Search, kinds: tuple[str, ...], cost_rule: str) -> Selection:
    """Steps 2, 4 and 5 of the module docstring."""
    options = search.options
    seconds = {}
    start = time.perf_counter()
    pool = candidate_pool(search, kinds, cost_rule)
    seconds["individual"] = time.perf_counter() - start
    start = time.perf_counter()
    has_check = bool(search.splits.batches.get("check"))
    results = []
    for order in options.orders:
        begin, before = time.perf_counter(), search.evaluations
        path = greedy(search, _ordered(order, search, pool), pool, options)
        state = back_off(search, path, "check", options.check_margin) if has_check else path[-1]
        results.append(
            OrderResult(
                order,
                path,
                state,
                search.evaluate(state),
                search.evaluate(state, "check") if has_check else None,
                search.cost(state),
                search.evaluations - before,
                time.perf_counter() - begin,
            )
        )
    judged = "check" if has_check else "select"
    chosen = min(
        results,
        key=lambda r: (-len(r.state), cost_class(r.cost), search.budget.usage(search.evaluate(r.state, judged))),
    )
    seconds["selection"] = time.perf_counter() - start
    return Selection(chosen.state, chosen, results, pool, seconds)


# --- the outcome ---------------------------------------------------------------------------------


class BudgetMissed(VerificationError):
    """The selected model misses the budget on the test split; `report` says what was tried.

    `model` is the refused model, for inspection (tools measure it); never the pass's result.
    """

    def __init__(self, report: ReplaceReport, message: str, model: Any = None):
        super().__init__(message)
        self.report = report
        self.model = model


@dataclass
class ReplaceReport:
    """What `replace` did, for either front end: `to_json()` is the `--report` file.

    `surrogates` holds the fitted `Surrogate` of every replaced norm (its parameters before any
    migration into adjacent layers); `emissions` where its constants went.
    """

    data: dict
    surrogates: dict[str, Surrogate] = field(default_factory=dict)
    emissions: dict[str, Emission] = field(default_factory=dict)

    def to_json(self) -> dict:
        return self.data

    @property
    def passed(self) -> bool:
        return bool(self.data["passed"])

    @property
    def replaced(self) -> int:
        return int(self.data["replaced"])

    @property
    def exact(self) -> int:
        return int(self.data["exact"])

    @property
    def total(self) -> int:
        return int(self.data["total"])

    @property
    def test(self) -> dict:
        return self.data["test"]

    def decisions(self) -> dict[str, str]:
        """Per norm: exact, replaced, kept or unsupported."""
        return {row["name"]: row["decision"] for row in self.data["norms"]}

    def reasons(self) -> dict[str, str]:
        return {row["name"]: row["reason"] for row in self.data["norms"]}


@dataclass
class Frame:
    """What the front end found before selection, for the report."""

    name: str
    front_end: str
    norms: list[tuple[str, str]]  # every norm of the original model: (name, op), topological
    exact: set[str]
    declined: dict[str, str]
    centred: dict[str, list[str]]
    kinds: tuple[str, ...]
    ops_before: dict[str, int] = field(default_factory=dict)

    def exact_left(self, replaced) -> set[str]:
        """The norms the exact fold folded that no surrogate replaced (with `all_norms` one may have)."""
        return self.exact - set(replaced)


Build = Callable[[list[tuple[str, Surrogate]]], tuple[object, list[dict[str, np.ndarray]], dict[str, Emission], dict]]


def conclude(
    search: Search, selection: Selection, frame: Frame, build: Build, started: float
) -> tuple[object, ReplaceReport]:
    """Step 6: build the decided model (`build(surrogates)` → (model, its outputs on test, emissions,
    op counts)), judge it on test, fall back or refuse; returns (model, report)."""
    options, budget = search.options, search.budget
    start = time.perf_counter()
    state = selection.state
    surrogates = search.materialize(state)
    model, outputs, emissions, ops_after = build(surrogates)
    test = search.judge("test", outputs)
    passed = budget.holds(test)
    fallback, best = None, ()
    if not passed:
        path = selection.chosen.path
        best = back_off(search, path[: path.index(state) + 1], "test", 1.0)
        fallback = {"replaced": len(best), "surrogates": dict(best), "test": search.evaluate(best, "test").to_json()}
        if options.write_best:
            state, surrogates = best, search.materialize(best)
            model, outputs, emissions, ops_after = build(surrogates)
            test = search.judge("test", outputs)
            passed = budget.holds(test)
    seconds = {**selection.seconds, "final": time.perf_counter() - start, "total": time.perf_counter() - started}
    report = ReplaceReport(
        _report(
            search, selection, frame, state, dict(surrogates), emissions, test, passed, fallback, ops_after, seconds
        ),
        dict(surrogates),
        emissions,
    )
    if not passed:
        best_text = (
            f"the largest selection on the way that meets it there replaces {len(best)} "
            f"({search.evaluate(best, 'test').describe(mean=False)}); write it with --write-best "
            "(ReplaceOptions.write_best)"
            if best
            else "no selection on the way with a surrogate meets it there (--write-best would write the exact "
            "folds alone)"
        )
        raise BudgetMissed(
            report,
            f"{frame.name}: the replaced model misses the budget {budget} on the test split "
            f"({test.describe(mean=False)}; selection: {selection.chosen.metrics.describe(mean=False)}); nothing "
            f"written; {best_text}. Give more "
            "calibration data, a smaller margin or a looser budget",
            model,
        )
    return model, report


def _report(
    search: Search,
    selection: Selection,
    frame: Frame,
    state: tuple,
    surrogates: dict[str, Surrogate],
    emissions: dict[str, Emission],
    test: Metrics,
    passed: bool,
    fallback: dict | None,
    ops_after: dict,
    seconds: dict,
) -> dict:
    options, budget, pool = search.options, search.budget, selection.pool
    chosen = dict(state)
    exact = frame.exact_left(chosen)
    rows = []
    for name, op in frame.norms:
        row: dict = {"name": name, "op": op}
        if name in exact:
            row.update(decision="exact", reason="folded exactly into an RMSNorm by the exact pass", kept=False)
        elif name in frame.declined:
            row.update(decision="unsupported", reason=frame.declined[name], kept=True)
        elif name not in search.index:
            row.update(decision="kept", reason="not selected (ReplaceOptions.norms)", kept=True)
        else:
            own = search.bench.norm_cost(name)
            row["original_cost"] = own
            row["input_centring"] = frame.centred.get(name, [])
            row["candidates"] = [
                {
                    "kind": c.kind,
                    "cost": c.cost,
                    "fit_error": c.fit_error,
                    "alone": None if c.alone is None else {**c.alone.to_json(), "budget_used": c.usage},
                    "skipped": None if c.alone is not None else _unpaid(c.cost, own),
                }
                for c in pool.get(name, [])
            ]
            if name in chosen:
                emission = emissions[name]
                row.update(
                    decision="replaced",
                    kept=False,
                    surrogate=chosen[name],
                    parameters=surrogates[name].describe(),
                    emission=emission.to_json(),
                    cost_change=emission.cost - own,
                    reason=f"{chosen[name]} surrogate keeps the budget",
                )
            else:
                row.update(decision="kept", kept=True, reason=_kept_reason(search, selection, pool, name, state))
        rows.append(row)
    replaced_cost = sum(emissions[n].cost for n in chosen)
    original_cost = sum(search.bench.norm_cost(n) for n in chosen)
    check = search.evaluate(state, "check") if search.splits.batches.get("check") else None
    return {
        "normpass_version": __version__,
        "model": frame.name,
        "front_end": frame.front_end,
        "kind": options.kind,
        "kinds": list(frame.kinds),
        "budget": {
            "cos": budget.cos,
            "rel": budget.rel,
            "top1": budget.top1,
            "margin": search.margin,
            "check_margin": options.check_margin,
        },
        "policy": options.policy,
        "calibration": "sequential" if options.sequential else "parallel",
        "samples": {role: search.splits.count(role) for role in SPLITS},
        "total": len(frame.norms),
        "exact": len(exact),
        "replaced": len(chosen),
        "kept": len(frame.norms) - len(exact) - len(chosen),
        "orders": [r.to_json(budget) for r in selection.orders],
        "chosen_order": selection.chosen.order,
        "validation": search.evaluate(state).to_json(),
        "check": None if check is None else check.to_json(),
        "test": test.to_json(),
        "passed": passed,
        "fallback": fallback,
        "wrote_fallback": bool(fallback) and options.write_best,
        "norm_cost": {
            "replaced_norms_before": original_cost,
            "replaced_norms_after": replaced_cost,
            "unit": "one LayerNormalization over the same tensor (estimated, see core/cost.py OP_COSTS)",
        },
        "ops": {"before": frame.ops_before, "after": ops_after},
        "norms": rows,
        "calibration_passes": search.passes,
        "evaluations": search.evaluations,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


def _unpaid(cost: float, own: float) -> str:
    return (
        f"would cost {cost:.2f} where the norm costs {own:.2f} "
        f"({'more' if cost > own else 'no less'}; LayerNorm units, core/cost.py)"
    )


def _kept_reason(search: Search, selection: Selection, pool, name: str, state: tuple) -> str:
    usable = _usable(pool, name)
    if not usable:
        if not pool.get(name):
            return "no applicable surrogate"
        cheapest = min(pool[name], key=lambda c: c.cost)
        return (
            f"no surrogate pays: the cheapest, {cheapest.kind}, {_unpaid(cheapest.cost, search.bench.norm_cost(name))}"
        )
    if all(c.usage > search.margin for c in usable):
        return "every surrogate alone already breaks the budget on the selection split"
    if name in dict(selection.chosen.greedy) and state != selection.chosen.greedy:
        return "selected, then backed off: the check split does not keep the budget with it"
    return "replacing it as well breaks the budget on the selection split"
