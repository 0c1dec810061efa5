"""normpass: fold LayerNorms into RMSNorms exactly, where the zero-mean graph proves it.

Public API:
* ONNX: `inspect_onnx(model)` → `FoldPlan`; `fold_onnx(model, FoldOptions(...))` → `FoldResult`
  (`.model`, `.plan`, `.comparison`, `.report()`, `.graphsurgeon()`); `FoldPass(FoldOptions(...))`,
  the same fold as an onnx-ir pass for `onnx_ir.passes.PassManager` pipelines;
  `rotate_onnx(model, RotateOptions(...))` → `RotateResult` (a `FoldResult` with `.rotation`, the
  residual streams rotated and why the others were not).
* PyTorch (the `torch` extra): `inspect(module, example_inputs)` → `FoldPlan`;
  `fold(module, example_inputs)` → `(folded module, TorchFoldReport)`. These import torch on first
  use only, so the ONNX path never loads it; without torch they raise `MissingExtraError` naming
  `normpass[torch]`.
"""

__version__ = "0.1.0"

from .errors import InputError, MissingExtraError, NormpassError, UnsupportedModelError, VerificationError
from .onnx.passes import FoldOptions, FoldPass, FoldResult, fold_onnx, inspect_onnx
from .onnx.rotate import RotateOptions, RotateResult, rotate_onnx

TORCH_API = ("fold", "inspect", "TorchFoldReport")


def __getattr__(name):  # PEP 562: the PyTorch API is imported when first used
    if name in TORCH_API:
        from .torch import api as torch_api

        return getattr(torch_api, name)
    raise AttributeError(f"module 'normpass' has no attribute {name!r}")


__all__ = [
    "FoldOptions",
    "FoldPass",
    "FoldResult",
    "InputError",
    "MissingExtraError",
    "NormpassError",
    "RotateOptions",
    "RotateResult",
    "TorchFoldReport",
    "UnsupportedModelError",
    "VerificationError",
    "fold",
    "fold_onnx",
    "inspect",
    "inspect_onnx",
    "rotate_onnx",
]
