"""normpass: fold LayerNorms into RMSNorms exactly, where the zero-mean graph proves it.

Public API:
* ONNX: `inspect_onnx(model)` → `FoldPlan`; `fold_onnx(model, FoldOptions(...))` → `FoldResult`
  (`.model`, `.plan`, `.comparison`, `.report()`, `.graphsurgeon()`); `FoldPass(FoldOptions(...))`,
  the same fold as an onnx-ir pass for `onnx_ir.passes.PassManager` pipelines;
  `rotate_onnx(model, RotateOptions(...))` → `RotateResult` (a `FoldResult` with `.rotation`, the
  residual streams rotated and why the others were not); `slice_onnx(model, calibration,
  SliceOptions(ratio=R))` → `SliceResult` (SliceGPT: each proven stream cut to its principal subspace,
  judged on held-out data; `.model`, `.slicing`, `.held_out`, `.report()`), `inspect_slice(model)`, and
  `SlicePass(calibration, SliceOptions(...))`, the same as an onnx-ir pass.
* PyTorch (the `torch` extra): `inspect(module, example_inputs)` → `FoldPlan`;
  `fold(module, example_inputs)` → `(folded module, TorchFoldReport)`;
  `fold_graph(module, example_inputs)` → `(folded torch.fx.GraphModule, TorchFoldReport)`, which also
  makes the centrings inside a module's forward that `fold` declines; `slice(module, example_inputs,
  calibration, SliceOptions(...))` → `(sliced torch.fx.GraphModule, TorchSliceReport)`, the ONNX
  slice's proof, bases and cut on torch.export's graph, with `recover_train` seconds of training
  toward the module. These import torch on first
  use only, so the ONNX path never loads it; without torch they raise `MissingExtraError` naming
  `normpass[torch]`.
* Surrogates for the norms that do not fold exactly, under an accuracy budget:
  `replace_onnx(model, calibration, ReplaceOptions(...))` → `ReplaceResult` (`.model`, `.report`);
  `replace(module, calibration, ReplaceOptions(...))` → `(module, ReplaceReport)`, whose norms are
  surrogate modules (`Affine`, `ScaleBias`, `DyT`, `Derf`, `ShiftedRMSNorm`); `apply_surrogates`
  builds such a module from surrogates fitted elsewhere; `smooth_removal` wraps each surrogate in a
  `SmoothRemoval` with its norm, for training.
* Label-free distillation (the `torch` extra): `distill(module, calibration, DistillOptions(...))`
  → `(module, DistillReport)`, the norms replaced by reduction-free surrogates trained against the
  module itself (DaMN's smooth removal), emitted as `replace` emits them.
"""

__version__ = "0.1.0"

from .core.replace import BudgetMissed, ReplaceOptions, ReplaceReport
from .errors import InputError, MissingExtraError, NormpassError, UnsupportedModelError, VerificationError
from .onnx.fold.driver import FoldOptions, FoldPass, FoldResult, fold_onnx, inspect_onnx
from .onnx.replace.driver import ReplaceResult, replace_onnx
from .onnx.rotate.driver import RotateOptions, RotateResult, rotate_onnx
from .onnx.slice.driver import SliceOptions, SlicePass, SlicePlan, SliceResult, inspect_slice, slice_onnx

TORCH_API = {
    "fold": "api",
    "fold_graph": "api",
    "inspect": "api",
    "TorchFoldReport": "api",
    "replace": "replace",
    "Affine": "surrogates",
    "ScaleBias": "surrogates",
    "DyT": "surrogates",
    "Derf": "surrogates",
    "ShiftedRMSNorm": "surrogates",
    "SmoothRemoval": "surrogates",
    "smooth_removal": "surrogates",
    "apply_surrogates": "replace",
    "distill": "distill",
    "DistillOptions": "distill",
    "DistillReport": "distill",
    "slice": "slice",
    "TorchSliceReport": "slice",
}


def __getattr__(name):  # PEP 562: the PyTorch API is imported when first used
    if name in TORCH_API:
        import importlib

        return getattr(importlib.import_module(f".torch.{TORCH_API[name]}", __name__), name)
    raise AttributeError(f"module 'normpass' has no attribute {name!r}")


__all__ = [
    "Affine",
    "BudgetMissed",
    "Derf",
    "DistillOptions",
    "DistillReport",
    "DyT",
    "FoldOptions",
    "FoldPass",
    "FoldResult",
    "InputError",
    "MissingExtraError",
    "NormpassError",
    "ReplaceOptions",
    "ReplaceReport",
    "ReplaceResult",
    "RotateOptions",
    "RotateResult",
    "ScaleBias",
    "ShiftedRMSNorm",
    "SliceOptions",
    "SlicePass",
    "SlicePlan",
    "SliceResult",
    "SmoothRemoval",
    "TorchFoldReport",
    "TorchSliceReport",
    "UnsupportedModelError",
    "VerificationError",
    "apply_surrogates",
    "distill",
    "fold",
    "fold_graph",
    "fold_onnx",
    "inspect",
    "inspect_onnx",
    "inspect_slice",
    "replace",
    "replace_onnx",
    "rotate_onnx",
    "slice",
    "slice_onnx",
    "smooth_removal",
]
