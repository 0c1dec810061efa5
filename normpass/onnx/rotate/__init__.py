"""The rotation pass: an exact orthogonal change of basis of each residual stream the fold proves."""

from .driver import RotateOptions, RotateResult, inspect_rotation, rotate_onnx

__all__ = ["RotateOptions", "RotateResult", "inspect_rotation", "rotate_onnx"]
