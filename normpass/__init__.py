"""normpass: fold LayerNorms into RMSNorms exactly, where the zero-mean graph proves it.

Public API (ONNX): `inspect_onnx(model)` → `FoldPlan`; `fold_onnx(model, FoldOptions(...))` →
`FoldResult` (`.model`, `.plan`, `.comparison`, `.report()`).
"""

__version__ = "0.1.0"

from .errors import InputError, NormpassError, UnsupportedModelError, VerificationError  # noqa: E402
from .passes import FoldOptions, FoldResult, fold_onnx, inspect_onnx  # noqa: E402

__all__ = [
    "FoldOptions",
    "FoldResult",
    "InputError",
    "NormpassError",
    "UnsupportedModelError",
    "VerificationError",
    "fold_onnx",
    "inspect_onnx",
]
