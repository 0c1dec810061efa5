"""The surrogate pass: calibrated replacements for the norms that do not fold exactly, under a budget."""

from .driver import ReplaceResult, replace_onnx

__all__ = ["ReplaceResult", "replace_onnx"]
