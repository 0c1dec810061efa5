"""The surrogate pass for PyTorch modules: capture and emission around the shared core (`core/replace.py`).

    replaced, report = normpass.replace(model, calibration, ReplaceOptions(budget="cos=0.999"))

1. **Exact first.** `normpass.fold` folds every provable LayerNorm (verified on the first batch);
   the folded module is captured again, and the norms it leaves are candidates unless `why_not`
   (core) or this front end rules them out: a norm must be the whole forward of a norm module
   (a LayerNorm module as `fold` swaps them: `nn.LayerNorm`, timm's `LayerNorm`, and channels-first
   ones between permutes, timm's `LayerNorm2d`, whose surrogate sits between the same permutes;
   `nn.RMSNorm`, a `*RMSNorm` class) called once, whose parameters nothing else reads, so that
   swapping the module replaces exactly that norm. LayerNorms among them get input
   centring (the exact pass's centrings that are safe, `core/analysis.safe_centrings`), applied to
   parameters as `fold` applies them.
2. **Data.** An iterable of input dicts (keyword arguments of `forward`) or tuples (positional
   ones), or the CLI's files (`calibration.load_batches`: .npz, .npy directories, .txt/.jsonl with
   a tokenizer), split into the core's roles. Inputs become NumPy arrays for the split and
   tensors again to run.
3. **Capture.** A working copy whose candidate norms sit in slots (the norm, or a surrogate put
   there for one trial); forward pre-hooks on the slots collect each norm's input.
4. **Emission** (`emit`): a deep copy of the exactly folded, centred module whose norms are
   surrogate modules (`torch/surrogates.py`), with c, γ and β migrated into adjacent layers
   where exact (`torch/targets.py`): the c of `x − c` into the bias summed into x, γ and β into
   the `nn.Linear`s that read y, or β alone across a residual add into the other summand's bias;
   an affine's γ that stays is carried along the residual stream (`core/stream.py`).

The result runs eagerly, under `torch.compile` and through `torch.onnx.export`; with
`ReplaceOptions(migrate_affine=False)` every fitted term stays in its surrogate module (to train
them, e.g. inside a `SmoothRemoval`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..calibration import Batch, InputSpec, check_indices, distinct_holdout, find_mask_input, load_batches
from ..core.analysis import ShiftChecker, safe_centrings
from ..core.cost import CPU_COST, Emission
from ..core.graph import NormInfo, NormType
from ..core.progress import progress
from ..core.replace import (
    Frame,
    ReplaceOptions,
    ReplaceReport,
    Search,
    conclude,
    eligible,
    select,
    split_roles,
)
from ..core.stats import StatsCollector, token_rows
from ..core.stream import STREAM_KINDS, on_scaled_input, scale_limit, stream_scale
from ..core.surrogates import NormSpec, Surrogate
from ..errors import InputError
from .api import _arguments, _outputs, fold
from .capture import Attr, capture
from .fx import Layout, TorchGraph, build_zero_mean_graph, to_numpy
from .rewrite import (
    Permuted,
    RMSNormWithBias,
    _Editor,
    _edits_of,
    _wide,
    add_to_bias,
    carry_along_stream,
    move_affine,
    weighted_centre,
)
from .surrogates import surrogate_module
from .targets import BiasTarget, claim_residual, migration_targets, shift_target, stream_targets

# --- data ----------------------------------------------------------------------------------------


def input_spec(module: nn.Module) -> InputSpec:
    """The forward's parameters (those with a default may be left out); dtypes and ranks unknown; the
    positions the module takes where its configuration says (`position_limit`)."""
    parameters = [
        p
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    optional = frozenset(p.name for p in parameters if p.default is not p.empty)
    return InputSpec({p.name: (None, None) for p in parameters}, optional=optional, positions=position_limit(module))


def position_limit(module: nn.Module) -> int | None:
    """The most positions `module` takes, as the Hugging Face configuration of it or of a submodule says
    (`max_position_embeddings`; GPT-2's `n_positions`), or None: the graph is not read here, a longer
    sequence fails inside the module's own code."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _as_arrays(item, spec: InputSpec, module: nn.Module, where: str) -> Batch:
    """One calibration item (a dict of keyword arguments or a tuple of positional ones) as NumPy arrays."""
    if isinstance(item, torch.Tensor):
        item = (item,)
    if isinstance(item, (tuple, list)):
        try:
            item = dict(inspect.signature(module.forward).bind(*item).arguments)
        except TypeError as e:
            raise InputError(f"{where}: the positional inputs do not fit {type(module).__name__}.forward ({e})") from e
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a dict of keyword inputs or a tuple of positional ones")
    out = {}
    for name, value in item.items():
        if isinstance(value, torch.Tensor):
            out[name] = to_numpy(value)
        elif isinstance(value, np.ndarray):
            out[name] = value
        else:
            raise InputError(f"{where}: input {name} is a {type(value).__name__}; give tensors (or arrays) only")
    return out


def load(source, module: nn.Module, options: ReplaceOptions) -> list[Batch]:
    """Calibration batches for `module` from a file (the CLI's forms) or an iterable of dicts or tuples."""
    spec = input_spec(module)
    if not isinstance(source, (str, os.PathLike, dict)):
        produced = source() if callable(source) else source
        if not isinstance(produced, Iterable):
            raise InputError("calibration data: expected a file or an iterable of input dicts or tuples")
        source = [_as_arrays(item, spec, module, f"calibration batch {i}") for i, item in enumerate(produced)]
    return load_batches(source, spec, options.batch_size, options.tokenizer, options.max_length)


def _tensors(batch: Batch, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}


def _run(module: nn.Module, batch: Batch) -> dict[str, np.ndarray]:
    """`module`'s outputs on `batch` (moved to the module's device), as NumPy arrays."""
    return {k: to_numpy(v) for k, v in _outputs(module, (), _tensors(batch, _like(module).get("device"))).items()}


# --- where a surrogate's terms go ----------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a norm's surrogate may put its shift (a private bias), γ and β (linear layers), or β alone."""

    shift: BiasTarget | None
    full: list | None
    beta: list | None


def placement(tg: TorchGraph, norm: str, width: int, uses: dict) -> Placement:
    full = migration_targets(tg, norm, uses, needs_bias=True)
    beta = None if full is not None else migration_targets(tg, norm, uses, True, claim_residual(tg, width, uses))
    return Placement(shift_target(tg, norm, width, uses), full, beta)


def _names(targets: list) -> str:
    return ", ".join(t.node if isinstance(t, BiasTarget) else t.name for t in targets)


@dataclass
class Terms:
    """Which terms of a surrogate stay in its module, where the others go, and the emission record."""

    keep_shift: bool
    keep_gamma: bool
    keep_beta: bool
    shift_to: BiasTarget | None  # the bias taking c
    gamma_to: list | None  # linear targets taking γ (and β)
    beta_to: list | None  # targets taking β
    emission: Emission


def terms(where: Placement, surrogate: Surrogate, migrate: bool) -> Terms:
    """Decide, for one fitted surrogate, what migrates (see the module docstring) and what stays."""
    has_gamma = not np.all(surrogate.gamma == 1)
    has_beta = bool(np.any(surrogate.beta != 0))
    full = where.full if migrate else None
    gamma_to = full if has_gamma else None
    beta_to = (full or (where.beta if migrate else None)) if has_beta else None
    shift_to = where.shift if migrate and surrogate.has_shift else None
    keep_shift = surrogate.has_shift and shift_to is None
    emission = Emission()
    emission.shift = "Sub" if keep_shift else "none" if shift_to is None else f"migrated into {shift_to.node}"
    in_rms = "in the RMS op's weight" if surrogate.kind == "rms" else "Mul"
    emission.gamma = "none" if not has_gamma else in_rms if gamma_to is None else f"migrated into {_names(gamma_to)}"
    emission.beta = "none" if not has_beta else "Add" if beta_to is None else f"migrated into {_names(beta_to)}"
    keep_gamma, keep_beta = has_gamma and gamma_to is None, has_beta and beta_to is None
    return Terms(keep_shift, keep_gamma, keep_beta, shift_to, gamma_to, beta_to, emission)


def norm_cost(norm: NormInfo) -> float:
    """The norm's cost in `core/cost.py` units, as `torch.onnx.export` writes it: one LayerNormalization,
    or one RMSNormalization."""
    return CPU_COST["LayerNormalization"] if norm.norm_type is NormType.LAYER else CPU_COST["RMSNormalization"]


# --- the working copy ----------------------------------------------------------------------------


class _Slot(nn.Module):
    """A candidate norm in the working copy: the norm, or for one trial the surrogate put in its place
    (between the permutes of a channels-first LayerNorm module, `layout`)."""

    def __init__(self, norm: nn.Module, layout: Layout = (None, None)):
        super().__init__()
        self.norm, self.layout = norm, layout
        self.surrogate: nn.Module | None = None

    def norm_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the norm op inside the module normalizes: `x` after the permute before it."""
        return x if self.layout[0] is None else x.permute(self.layout[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.surrogate is None else _laid_out(self.surrogate, self.layout)(x)


def _laid_out(module: nn.Module, layout: Layout) -> nn.Module:
    """`module` between the permutes `layout` names (`rewrite.Permuted`), or itself where there are none."""
    return module if layout == (None, None) else Permuted(module, *layout)


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent), child, module)


class TorchBench:
    """The core's `Workbench` for a module: a working copy of the folded, centred base with slots."""

    def __init__(self, base: nn.Module, tg: TorchGraph, norms: list[NormInfo], mask_input: str | None, migrate: bool):
        self.base, self.tg, self.norms = base, tg, norms
        self.name = tg.zmg.model_name
        self.mask_input = mask_input
        self.migrate = migrate
        self.by_name = {n.name: n for n in norms}
        self.widths = {n.name: _candidate_width(tg, n) for n in norms}
        uses = tg.uses()
        self.placements = {n.name: placement(tg, n.name, self.widths[n.name], uses) for n in norms}
        self.working = copy.deepcopy(base)
        self.slots = {}
        for norm in norms:
            slot = _Slot(self.working.get_submodule(norm.ref.module), norm.ref.layout)
            _set_module(self.working, norm.ref.module, slot)
            self.slots[norm.name] = slot
        self.like = _like(base)

    def spec(self, norm: str) -> NormSpec:
        return norm_spec(self.tg, self.by_name[norm])

    def width(self, norm: str) -> int:
        return self.widths[norm]

    def norm_cost(self, norm: str) -> float:
        return norm_cost(self.by_name[norm])

    def emission(self, norm: str, surrogate: Surrogate) -> Emission:
        plan = terms(self.placements[norm], surrogate, self.migrate)
        module = surrogate_module(surrogate, self.widths[norm], plan.keep_shift, plan.keep_gamma, plan.keep_beta)
        plan.emission.ops.update(module.ops())
        return plan.emission

    def _fill(self, surrogates: list[tuple[str, Surrogate]]) -> None:
        for slot in self.slots.values():
            slot.surrogate = None
        for norm, surrogate in surrogates:
            self.slots[norm].surrogate = surrogate_module(surrogate, self.widths[norm], **self.like)

    def statistics(self, surrogates, norms: list[str], batches: Iterable[Batch], into: StatsCollector) -> None:
        self._fill(surrogates)
        mask: list = [None]

        def hook(name):
            slot = self.slots[name]
            return lambda _module, args: into.add(name, token_rows(to_numpy(slot.norm_input(args[0])), mask[0]))

        handles = [self.slots[m].register_forward_pre_hook(hook(m)) for m in norms]
        try:
            for batch in batches:
                mask[0] = batch.get(self.mask_input) if self.mask_input else None
                with torch.no_grad():
                    self.working(**_tensors(batch))
        finally:
            for handle in handles:
                handle.remove()

    def outputs(self, surrogates, batches: Iterable[Batch]) -> list[dict[str, np.ndarray]]:
        self._fill(surrogates)
        return [_run(self.working, b) for b in batches]


def norm_spec(tg: TorchGraph, norm: NormInfo) -> NormSpec:
    """The norm's exact formula, for computing its output from its input in NumPy."""
    gamma = None if norm.scale is None else tg.zmg.constant(norm.scale).astype(np.float64).reshape(-1)
    beta = None if norm.bias is None else tg.zmg.constant(norm.bias).astype(np.float64).reshape(-1)
    return NormSpec(norm.norm_type is NormType.LAYER, norm.epsilon, gamma, beta)


# --- emission ------------------------------------------------------------------------------------


def emit(
    base: nn.Module, tg: TorchGraph, surrogates: list[tuple[str, Surrogate]], migrate: bool = True
) -> tuple[nn.Module, dict[str, Emission]]:
    """A deep copy of `base` (captured as `tg`) whose norms are the given surrogates, terms migrated where exact.

    With `migrate`, a linear surrogate's γ that no linear layer can take alone is carried along the
    residual stream (`core/stream.py`): the surrogates downstream read the stream scaled, and take
    the scale into their own γ (`carried`).
    """
    module = copy.deepcopy(base)
    editor = _Editor(module)
    uses = tg.uses()
    like = _like(base)
    limit = scale_limit(str(like.get("dtype", torch.float32)).removeprefix("torch."))
    linear_norms = {name for name, s in surrogates if s.kind in STREAM_KINDS} if migrate else set()
    carried: dict[str, np.ndarray] = {}  # norm → the per-feature scale its input is divided by
    emissions = {}
    for name, surrogate in surrogates:
        if name in carried:
            surrogate = on_scaled_input(surrogate, carried.pop(name))
        norm = tg.zmg.norm_by_name(name)
        width = _candidate_width(tg, norm)
        plan = terms(placement(tg, name, width, uses), surrogate, migrate)
        emission = plan.emission
        if plan.shift_to is not None:
            add_to_bias(editor, plan.shift_to.attr, -np.asarray(surrogate.shift, dtype=np.float64))
            emission.changed.append(plan.shift_to.node)
        targets = plan.gamma_to or plan.beta_to
        if targets is not None:
            gamma = None if plan.gamma_to is None else surrogate.gamma
            beta = None if plan.beta_to is None else surrogate.beta
            emission.changed += move_affine(tg, editor, targets, gamma, beta)
        replaced = module.get_submodule(norm.ref.module)
        if isinstance(replaced, RMSNormWithBias):
            # the fold's β, which the same module adds after the norm (as edited so far), goes into the surrogate
            bias = to_numpy(replaced.bias.detach()).astype(np.float64)
            kept = np.asarray(surrogate.beta, dtype=np.float64) if plan.keep_beta else 0.0
            surrogate = dataclasses.replace(surrogate, beta=kept + bias)
            plan.keep_beta = True
        scale = stream_scale(surrogate, width, limit) if plan.keep_gamma and migrate else None
        stream = None if scale is None else stream_targets(tg, name, linear_norms, uses)
        if stream is not None and scale is not None:
            changed = carry_along_stream(tg, editor, stream, scale)
            for absorber in stream.absorbers:
                carried[absorber] = scale
            emission.changed += changed
            emission.gamma = f"carried along the residual stream into {', '.join(changed + stream.absorbers)}"
            plan.keep_gamma = False
            if plan.keep_beta:  # the module's output is the stream divided by the scale
                surrogate = dataclasses.replace(surrogate, beta=np.asarray(surrogate.beta) / scale)
        replacement = surrogate_module(surrogate, width, plan.keep_shift, plan.keep_gamma, plan.keep_beta, **like)
        emission.ops.update(replacement.ops())
        _set_module(module, norm.ref.module, _laid_out(replacement, norm.ref.layout))
        emissions[name] = emission
    editor.forget_hf_ties()
    return module, emissions


# --- the pass -----------------------------------------------------------------------------------


def _width(tg: TorchGraph, norm: NormInfo) -> int | None:
    width = (tg.zmg.shape(norm.input) or (None,))[-1]
    return width if isinstance(width, int) else None


def _candidate_width(tg: TorchGraph, norm: NormInfo) -> int:
    width = _width(tg, norm)
    if width is None:  # `why_not` declines such norms
        raise AssertionError(f"{norm.name}: a candidate of unknown width")
    return width


def _like(module: nn.Module) -> dict:
    """The dtype and device of `module`'s parameters, for the surrogate modules put in it."""
    parameter = next(module.parameters(), None)
    return {} if parameter is None else {"dtype": parameter.dtype, "device": parameter.device}


def front_end_reason(tg: TorchGraph, norm: NormInfo, uses: dict) -> str | None:
    """What keeps a module swap from replacing exactly this norm (see the module docstring)."""
    site = norm.ref
    module = tg.model.get_submodule(site.module) if site.module else tg.model
    swappable = (
        (norm.norm_type is NormType.LAYER and site.replace_blocked is None)  # fx._layer_norm_module
        or isinstance(module, nn.RMSNorm)
        or type(module).__name__.endswith("RMSNorm")
    )
    if not site.module or not swappable:
        return site.replace_blocked or f"{norm.op} is not the forward of a norm module"
    if sum(n.ref.module == site.module for n in tg.zmg.norms) > 1:
        return f"module {site.module} is called more than once; a module swap would replace every call"
    norms = {n.name for n in tg.zmg.norms}
    for name in ("weight", "bias"):
        readers = {node for node, _ in uses.get(Attr(site.module, name), [])} - norms
        readers = {node for node in readers if tg.zmg.nodes[node].ref.call.module != site.module}  # not its own
        if readers:
            return f"{sorted(readers)[0]} also reads the {name} of {site.module}, which the swap removes"
    return None


def _centre_inputs(tg: TorchGraph, editor: _Editor, norm: NormInfo, checker: ShiftChecker, uses: dict) -> list[str]:
    """Centre the layers the analysis finds safe to centre before a LayerNorm (exact); returns their nodes."""
    if not norm.removes_mean:
        return []
    done = []
    for centring in safe_centrings(tg.zmg, norm, checker):
        edits = _edits_of(tg, centring)
        if isinstance(edits, str):
            continue
        reads = {(node, tensor) for node, tensor, _ in edits}
        if any(set(uses.get(tg.attr(node, tensor), [])) - reads for node, tensor, _ in edits):
            continue  # a parameter read elsewhere too: centring it would change that reader
        for node, tensor, axis in edits:
            attr = tg.attr(node, tensor)
            current = None if attr is None else editor.get(attr)
            assert attr is not None and current is not None  # `_edits_of` checked: every read is an attribute
            editor.set(attr, weighted_centre(tg, _wide(current), axis, centring.weight))
        done.append(centring.node)
    return done


@dataclass
class Prepared:
    """Everything selection works on (tools and tests use `search` and `bench` directly)."""

    search: Search
    frame: Frame
    bench: TorchBench
    kinds: tuple
    cost_rule: str  # COST_RULES
    started: float


@dataclass
class Base:
    """The module the surrogates go into: exactly folded, inputs centred, captured; and its norms' fate."""

    module: nn.Module
    tg: TorchGraph
    original: list[tuple[str, str]]  # every norm of the given module: (name, op)
    exact: set[str]
    candidates: list[NormInfo]
    declined: dict[str, str]
    centred: dict[str, list[str]]


def base(module: nn.Module, example: dict[str, torch.Tensor], options: ReplaceOptions, name: str) -> Base:
    """Step 1 of the module docstring, on the example inputs `example` (keyword arguments)."""
    _, kinds, _ = options.checked()
    folded, fold_report = fold(module, (), example_kwargs=example, beta_across_residuals=True, name=name)
    exact = {d.name for d in fold_report.plan.folded}
    tg = build_zero_mean_graph(folded, capture(folded, (), example), name)
    uses = tg.uses()
    candidates, declined = eligible(
        name,
        [n for n in tg.zmg.norms if options.all_norms or n.name not in exact],
        exact,
        options,
        kinds,
        lambda n: _width(tg, n),
        lambda n: front_end_reason(tg, n, uses),
    )
    centred = {}
    if options.centre_inputs if options.centre_inputs is not None else "rms" in kinds:
        editor = _Editor(folded)
        checker = ShiftChecker(tg.zmg)
        for norm in candidates:
            done = _centre_inputs(tg, editor, norm, checker, uses)
            if done:
                centred[norm.name] = done
    original = [(d.name, d.op) for d in fold_report.plan.decisions]
    return Base(folded, tg, original, exact, candidates, declined, centred)


def prepare(module: nn.Module, calibration, options: ReplaceOptions | None = None, name: str | None = None) -> Prepared:
    """Data, the `base`, the original's outputs, and the core's `Search`."""
    options = options or ReplaceOptions()
    budget, kinds, cost_rule = options.checked()
    if options.provider is not None:
        raise InputError(
            "provider prices ONNX Runtime's fusions in an ONNX graph, which a module does not have: "
            "leave it unset, or export the module and use replace_onnx"
        )
    name = name or type(module).__name__
    _arguments(module, (), None)  # an nn.Module in eval mode
    started = time.perf_counter()

    distinct_holdout(calibration, options.holdout)
    batches = load(calibration, module, options)
    holdout = None if options.holdout is None else load(options.holdout, module, options)
    splits = split_roles(batches, holdout, options)
    example = _tensors(splits.batches["fit"][0])
    spec = input_spec(module)
    masked = InputSpec({k: v for k, v in spec.inputs.items() if k in example})
    mask_input = find_mask_input(masked, options.mask_input, batches + (holdout or []))
    b = base(module, example, options, name)
    bounds = {
        call.args["indices"]: int(b.tg.capture.shapes[call.args["weight"]][0])
        for call in b.tg.capture.calls
        if call.op == "embedding" and call.args.get("indices") in b.tg.capture.inputs
    }
    check_indices(batches + (holdout or []), bounds, "calibration data", options.tokenizer)

    for role in ("select", "check", "test"):
        data = splits.batches[role]
        splits.references[role] = [
            _run(module, batch) for batch in progress(data, f"original model ({role})", options.progress)
        ]
    bench = TorchBench(b.module, b.tg, b.candidates, mask_input, options.migrate_affine)
    frame = Frame(name, "pytorch", b.original, b.exact, b.declined, b.centred, kinds)
    return Prepared(Search(bench, splits, budget, options), frame, bench, kinds, cost_rule, started)


def apply_surrogates(
    module: nn.Module,
    example_inputs,
    surrogates: dict[str, Surrogate],
    options: ReplaceOptions | None = None,
    *,
    example_kwargs: dict | None = None,
) -> tuple[nn.Module, dict[str, Emission]]:
    """`module` with the given fitted surrogates (by norm name) in place, as `replace` writes them.

    No calibration: the surrogates were fitted elsewhere (by `replace`, on another front end, or
    trained). The module is folded exactly and its inputs centred as `replace` does with `options`
    (the same options the surrogates were fitted under), then the surrogates are emitted.
    """
    options = options or ReplaceOptions()
    args, kwargs = _arguments(module, example_inputs, example_kwargs)
    bound = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    b = base(module, bound, options, type(module).__name__)
    unknown = sorted(set(surrogates) - {n.name for n in b.candidates})
    if unknown:
        raise InputError(
            f"no candidate norm {', '.join(unknown)} (candidates: {', '.join(n.name for n in b.candidates)})"
        )
    ordered = [(n.name, surrogates[n.name]) for n in b.candidates if n.name in surrogates]
    return emit(b.module, b.tg, ordered, options.migrate_affine)


def replace(
    module: nn.Module, calibration, options: ReplaceOptions | None = None, *, name: str | None = None
) -> tuple[nn.Module, ReplaceReport]:
    """A copy of `module` whose norms that do not fold exactly are surrogate modules, under `options.budget`.

    `calibration`: an iterable of input dicts (keyword arguments of `forward`) or tuples, or a file
    as for the CLI (`.npz`, a directory of `.npy`, `.txt`/`.jsonl` with `options.tokenizer`).
    Raises `BudgetMissed` (its `.report` says what was tried) when the result misses the budget on
    the test split and `options.write_best` is off.
    """
    p = prepare(module, calibration, options, name)
    selection = select(p.search, p.kinds, p.cost_rule)
    bench, test = p.bench, p.search.splits.batches["test"]

    def build(surrogates):
        final, emissions = emit(bench.base, bench.tg, surrogates, bench.migrate)
        return final, [_run(final, b) for b in test], emissions, {}

    final, report = conclude(p.search, selection, p.frame, build, p.started)
    assert isinstance(final, nn.Module)
    return final, report
