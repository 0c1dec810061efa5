"""The exact pass: prove which LayerNorms read zero-mean input, centre their writers, make them RMS ops."""

from .driver import FoldOptions, FoldPass, FoldResult, ModelSource, fold_onnx, inspect_onnx

__all__ = ["FoldOptions", "FoldPass", "FoldResult", "ModelSource", "fold_onnx", "inspect_onnx"]
