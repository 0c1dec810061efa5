"""Reference runs in ONNX Runtime that use none of normpass's code, to check a rewrite independently.

``rewrite_error(original, rewritten, feeds)`` runs both models in their own CPU sessions with every
graph optimization off and returns the largest output difference relative to that output's
largest magnitude, with the tolerance for the output's dtype (1e-4 for fp32, 1e-2 for fp16).
``entry_feeds`` gives a registry entry's seeded inputs at a chosen size, in the graph's dtypes.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from .registry import ModelEntry

TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 1e-2}
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_unoptimized(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of ``model`` on ``feeds``, by name."""
    session = _session(model)
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=False))


def rewrite_error(
    original: onnx.ModelProto, rewritten: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> tuple[float, float]:
    """(relative error of ``rewritten`` against ``original`` on ``feeds``, the tolerance for its dtype)."""
    expected, got = run_unoptimized(original, feeds), run_unoptimized(rewritten, feeds)
    worst = 0.0
    for name, ref in expected.items():
        if got[name].shape != ref.shape or got[name].dtype != ref.dtype:
            return float("inf"), TOLERANCE[ref.dtype]
        ref64, out64 = ref.astype(np.float64), got[name].astype(np.float64)
        worst = max(worst, float(np.abs(ref64 - out64).max()) / max(float(np.abs(ref64).max()), 1e-30))
    return worst, TOLERANCE[next(iter(expected.values())).dtype]


def entry_feeds(
    entry: ModelEntry, model: onnx.ModelProto, batch: int = 3, seq: int = 7, seed: int = 123
) -> dict[str, np.ndarray]:
    """``entry``'s seeded inputs at ``batch`` x ``seq`` (the exports saw 2 x 8), in ``model``'s input dtypes."""
    dtypes = {i.name: NUMPY_TYPES[i.type] for i in _session(model).get_inputs()}
    tensors = entry.make_inputs(batch, seq, seed)
    return {name: tensor.numpy().astype(dtypes[name]) for name, tensor in zip(entry.input_names, tensors, strict=False)}
