"""The exact fold pass for PyTorch modules: capture → plan → restrict → apply → verify.

    folded, report = normpass.fold(model, example_inputs)   # nn.Module in, nn.Module out
    plan = normpass.inspect(model, example_inputs)         # the verdicts `fold` acts on

The analysis and planner are the ones the ONNX front end uses; only capture (`torch/capture.py`), the op
table (`torch/fx.py`) and the rewrite (`torch/rewrite.py`) are PyTorch-specific. Rewriting modules rather
than graphs, a module's forward code is not edited: an `x − mean(x)` is inserted only as a `Centred`
wrapper of a module, and `rewrite.restrict` declines, with a reason, folds that a module edit cannot
express (an `F.layer_norm` call, a centring inside a forward, a layer called where centring is unsafe).
`fold_graph` applies the whole plan to the captured graph instead (`torch/graph_rewrite.py`):

    graph, report = normpass.fold_graph(model, example_inputs)  # a torch.fx.GraphModule

The user's module is never modified: the rewrite works on a deep copy. The copy is verified
against the original on the example inputs (fp32 tolerance 1e-4 relative; `VerificationError`
above it), and, where the model is small enough to copy once more, both are compared with a
float64 run of the original, which shows how much of the difference is fp32 rounding.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import time
import warnings
from dataclasses import dataclass, field, replace

import onnx
import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..core.analysis import plan as make_plan
from ..core.plan import FoldPlan
from ..errors import InputError, UnsupportedModelError, VerificationError
from ..onnx.fold.driver import fold_report
from ..onnx.runtime.verify import BFLOAT16_TOLERANCE, Comparison, compare_outputs
from .capture import capture
from .fx import TorchGraph, build_zero_mean_graph, to_numpy
from .rewrite import apply, restrict

FLOAT64_PARAMETER_LIMIT = 50_000_000  # above this, the float64 reference is skipped (memory)


@dataclass
class TorchFoldReport:
    """What `fold` did: the plan, how the model was captured, where γ/β went, and the numerics."""

    plan: FoldPlan
    capture: str  # "torch.export" or "torch.fx.symbolic_trace"
    export_error: str | None  # why torch.export was not used
    comparison: Comparison | None
    float64: dict = field(default_factory=dict)
    affine_notes: dict[str, str] = field(default_factory=dict)
    untied: dict[str, list[str]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def folded(self) -> int:
        return len(self.plan.folded)

    @property
    def max_abs_error(self) -> float | None:
        return None if self.comparison is None else self.comparison.max_abs_error

    @property
    def max_rel_error(self) -> float | None:
        return None if self.comparison is None else self.comparison.max_rel_error

    def to_json(self) -> dict:
        return fold_report(self.plan, self.comparison, self.affine_notes, self.seconds) | {
            "frontend": "pytorch",
            "capture": self.capture,
            "export_error": self.export_error,
            "float64": self.float64,
            "untied": self.untied,
        }


def _arguments(model, example_inputs, example_kwargs) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise InputError(f"expected a torch.nn.Module, got {type(model).__name__}")
    meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise InputError(
            f"{type(model).__name__}: {meta} is on the meta device (a shape without values); load the "
            "weights first, e.g. model.to_empty(device='cpu') and then load_state_dict"
        )
    if model.training:
        raise InputError(
            f"{type(model).__name__} is in training mode; folding is an inference rewrite: call model.eval() first"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(
            f"example_inputs must be a tensor or a tuple of arguments, got {type(example_inputs).__name__}"
        )
    return tuple(example_inputs), dict(example_kwargs or {})


def _analyse(model, args, kwargs, dynamic_shapes, name) -> tuple[TorchGraph, FoldPlan]:
    captured = capture(model, args, kwargs, dynamic_shapes)
    if captured.export_error:
        warnings.warn(
            f"{name}: torch.export failed ({captured.export_error}); captured with torch.fx.symbolic_trace instead",
            UserWarning,
            stacklevel=3,
        )
    tg = build_zero_mean_graph(model, captured, name)
    return tg, restrict(tg, make_plan(tg.zmg))


def inspect(
    model: nn.Module,
    example_inputs,
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    name: str | None = None,
) -> FoldPlan:
    """Which LayerNorms of `model` fold exactly into RMSNorms, and why the others do not.

    `example_inputs` (a tensor or a tuple) and `example_kwargs` are what `model(...)` is called with;
    `dynamic_shapes` is passed to `torch.export.export` (the proof holds for the captured shapes).
    """
    args, kwargs = _arguments(model, example_inputs, example_kwargs)
    return _analyse(model, args, kwargs, dynamic_shapes, name or type(model).__name__)[1]


def fold(
    model: nn.Module,
    example_inputs,
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    migrate_affine: bool = True,
    beta_across_residuals: bool = False,
    verify: bool = True,
    name: str | None = None,
) -> tuple[nn.Module, TorchFoldReport]:
    """A copy of `model` with every provable LayerNorm folded into an RMSNorm, and a report.

    `beta_across_residuals`: a β that cannot go into linear layers with γ moves across residual adds
    into the other summand's bias instead of staying in the RMSNorm (as the ONNX fold does; the
    surrogate pass uses it so that both front ends fold into the same function at every norm's input).

    Raises `UnsupportedModelError` if the model cannot be captured and `VerificationError` if the
    folded copy does not match the original on the example inputs.
    """
    args, kwargs = _arguments(model, example_inputs, example_kwargs)
    name = name or type(model).__name__
    seconds = {}
    start = time.perf_counter()
    tg, fold_plan = _analyse(model, args, kwargs, dynamic_shapes, name)
    seconds["analysis"] = time.perf_counter() - start
    start = time.perf_counter()
    folded = copy.deepcopy(model)
    notes, untied = (
        apply(tg, fold_plan, folded, migrate_affine, beta_across_residuals) if fold_plan.folded else ({}, {})
    )
    seconds["rewrite"] = time.perf_counter() - start
    report = TorchFoldReport(fold_plan, tg.capture.method, tg.capture.export_error, None, {}, notes, untied, seconds)
    if verify:
        _verify(model, folded, args, kwargs, report, f"{name}: folded module")
    return folded, report


def fold_graph(
    model: nn.Module,
    example_inputs,
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes=None,
    verify: bool = True,
    name: str | None = None,
) -> tuple[torch.fx.GraphModule, TorchFoldReport]:
    """`model`'s `torch.export` graph with every provable LayerNorm folded, and a report.

    Folds what the ONNX front end folds, including the centrings a module swap cannot reach (inside a
    module's forward: `torch/graph_rewrite.py`), at a cost: the result is a `torch.fx.GraphModule`
    called like `model`, not `model`'s class, and it runs only at the captured shapes unless
    `dynamic_shapes` (passed to `torch.export.export`) says which may vary. `fold` keeps the class.

    Raises `UnsupportedModelError` where torch.export cannot capture the model (`fold` can fall back
    to symbolic_trace) and `VerificationError` if the result does not match the original.
    """
    from . import graph_rewrite

    args, kwargs = _arguments(model, example_inputs, example_kwargs)
    name = name or type(model).__name__
    seconds = {}
    start = time.perf_counter()
    captured = capture(model, args, kwargs, dynamic_shapes)
    if captured.program is None:
        raise UnsupportedModelError(
            f"{name}: fold_graph rewrites torch.export's graph, and torch.export failed ({captured.export_error}); "
            "normpass.fold captures it with symbolic_trace instead"
        )
    tg = build_zero_mean_graph(model, captured, name)
    graph_module = copy.deepcopy(captured.program.module())
    fold_plan = graph_rewrite.restrict(tg, make_plan(tg.zmg), graph_module)
    seconds["analysis"] = time.perf_counter() - start
    start = time.perf_counter()
    notes = graph_rewrite.apply(tg, fold_plan, graph_module) if fold_plan.folded else {}
    seconds["rewrite"] = time.perf_counter() - start
    report = TorchFoldReport(fold_plan, captured.method, None, None, {}, notes, {}, seconds)
    if verify:
        _verify(model, graph_module, args, kwargs, report, f"{name}: folded graph")
    return graph_module, report


# --- verification ------------------------------------------------------------------------------


def _outputs(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Every tensor the module returns, by its path in the output structure."""
    with torch.no_grad():
        result = module(*args, **kwargs)
    leaves, _ = pytree.tree_flatten_with_path(result)
    return {
        pytree.keystr(path) or "output": leaf.detach().cpu() for path, leaf in leaves if isinstance(leaf, torch.Tensor)
    }


def _compare(reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor], shapes=None) -> Comparison:
    """`verify.compare_outputs` on NumPy copies; bfloat16 outputs (widened for NumPy) keep their tolerance."""
    comparison = compare_outputs(
        {k: to_numpy(v) for k, v in reference.items()}, {k: to_numpy(v) for k, v in candidate.items()}, shapes
    )
    outputs = [
        replace(o, dtype="bfloat16", tolerance=BFLOAT16_TOLERANCE) if reference[o.name].dtype == torch.bfloat16 else o
        for o in comparison.outputs
    ]
    return Comparison(tuple(outputs), comparison.input_shapes)


def _widen(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _verify(model: nn.Module, folded: nn.Module, args: tuple, kwargs: dict, report: TorchFoldReport, what: str) -> None:
    """Compare `folded` with `model` on the example inputs into `report` (its float64 check too, timed as
    `seconds["verify"]`); raise `VerificationError` naming `what` where they differ."""
    start = time.perf_counter()
    _compare_into(model, folded, args, kwargs, report)
    report.seconds["verify"] = time.perf_counter() - start
    comparison = report.comparison
    assert comparison is not None  # set by _compare_into
    if not comparison.passed:
        raise VerificationError(f"{what} does not match the original: {comparison.failures()}")


def _compare_into(model: nn.Module, folded: nn.Module, args: tuple, kwargs: dict, report: TorchFoldReport) -> None:
    reference = _outputs(model, args, kwargs)
    candidate = _outputs(folded, args, kwargs)
    shapes = {f"input[{i}]": list(a.shape) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    report.comparison = _compare(reference, candidate, shapes)
    size = sum(p.numel() for p in model.parameters())
    if size > FLOAT64_PARAMETER_LIMIT:
        report.float64 = {"skipped": f"{size} parameters: a float64 copy is too large"}
        return
    try:
        wide = copy.deepcopy(model).double()
        exact = _outputs(wide, pytree.tree_map(_widen, args), pytree.tree_map(_widen, kwargs))
    except Exception as e:  # some models do not run in float64; the check is informative only
        report.float64 = {"skipped": f"the model does not run in float64 ({type(e).__name__}: {e})"}
        return
    report.float64 = {
        "original_rel_error": _compare(exact, reference).max_rel_error,
        "folded_rel_error": _compare(exact, candidate).max_rel_error,
    }


# --- building a module from a `package.module:factory` spec ------------------------------------


def load_factory(spec: str) -> tuple[nn.Module, tuple]:
    """`package.module:factory` → `factory()`, which must return `(module, example_inputs)`: a module in eval
    mode, with its weights, that runs on the example inputs (a tensor, or a tuple of arguments). Run once here,
    without gradients, so that inputs that do not fit are said before any work."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"factory {spec!r}: expected package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise InputError(f"factory {spec!r}: cannot import it ({e})") from e
    if not callable(factory):
        raise InputError(f"factory {spec!r}: {attr} is not callable")
    try:
        built = factory()
    except Exception as e:
        raise InputError(f"factory {spec!r}: the factory raised {type(e).__name__}: {e}") from e
    except SystemExit as e:
        raise InputError(
            f"factory {spec!r}: the factory exited (sys.exit({e.code!r})) instead of returning (module, example_inputs)"
        ) from e
    if not (isinstance(built, tuple) and len(built) == 2):
        raise InputError(
            f"factory {spec!r}: the factory must return (module, example_inputs), got {type(built).__name__}"
        )
    try:
        inputs, _ = _arguments(*built, None)
    except InputError as e:
        raise InputError(f"factory {spec!r}: {e}") from None
    module = built[0]
    try:
        with torch.no_grad():
            module(*inputs)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(
            f"factory {spec!r}: the module does not run on its example inputs: {type(e).__name__}: {first}"
        ) from e
    return module, inputs


# The exporter's op registry warns through torch's own stderr handler (not the root logger) for each
# torchvision op it skips where torchvision is not installed: four lines per run, nothing to act on.
REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def _registration_quiet():
    """The exporter's op registry logs errors only while the block runs."""
    logger = logging.getLogger(REGISTRATION_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def auto_dynamic_shapes(example_inputs, batch_only: bool = False) -> tuple:
    """`dynamic_shapes` for `torch.export` with every dimension of every tensor input `Dim.AUTO` (or axis 0
    alone, `batch_only`): dynamic where the module allows it, static where it specializes it (a width its
    weights fix)."""
    return tuple(
        {axis: torch.export.Dim.AUTO for axis in range(min(x.dim(), 1) if batch_only else x.dim())}
        if isinstance(x, torch.Tensor)
        else None
        for x in example_inputs
    )


def to_onnx(module: nn.Module, example_inputs: tuple, dynamic_shapes=None) -> onnx.ModelProto:
    """`module` exported with `torch.onnx.export(dynamo=True)`; a failure is an `UnsupportedModelError`.

    Without `dynamic_shapes`, every dimension of every tensor input is `Dim.AUTO`: dynamic where
    the module allows it, so the file runs at other batch sizes and lengths than the examples'.
    """
    if dynamic_shapes is None:
        dynamic_shapes = auto_dynamic_shapes(example_inputs)
    try:
        with _registration_quiet():
            program = torch.onnx.export(
                module, tuple(example_inputs), dynamo=True, dynamic_shapes=dynamic_shapes, verbose=False
            )
    except Exception as e:
        raise UnsupportedModelError(
            f"torch.onnx.export failed on the {type(module).__name__} module: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if program is None:
        raise UnsupportedModelError(f"torch.onnx.export gave no ONNX program for the {type(module).__name__} module")
    return program.model_proto


def export_onnx(module: nn.Module, example_inputs: tuple, path, dynamic_shapes=None) -> None:
    """Export `module` with `torch.onnx.export(dynamo=True)` and write it atomically to `path`."""
    from ..io import save_onnx_atomic

    save_onnx_atomic(to_onnx(module, example_inputs, dynamic_shapes), path)
