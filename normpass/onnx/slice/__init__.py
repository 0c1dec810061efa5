"""The slice pass (SliceGPT): each proven residual stream cut to its principal subspace, judged on held-out data."""

from .driver import SliceOptions, SlicePass, SlicePlan, SliceResult, inspect_slice, slice_onnx

__all__ = ["SliceOptions", "SlicePass", "SlicePlan", "SliceResult", "inspect_slice", "slice_onnx"]
