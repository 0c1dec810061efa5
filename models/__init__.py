"""normpass_models: seeded transformer models for testing and demonstrating normpass.

``REGISTRY`` maps a model name to a :class:`ModelEntry` that builds the model in
PyTorch, exports it to ONNX and records its expected norm and fold counts::

    from normpass_models import export_onnx, names
    for name in names(include_large=False):
        export_onnx(name, f"/tmp/{name}.onnx")
"""

from __future__ import annotations

import pathlib

from .registry import REGISTRY, ModelEntry, default_name, get, gpt2_config, gpt2_entry, gpt2_small_shape, names

__all__ = [
    "REGISTRY",
    "ModelEntry",
    "default_name",
    "export_onnx",
    "get",
    "gpt2_config",
    "gpt2_entry",
    "gpt2_small_shape",
    "names",
]


def export_onnx(name: str, path: str | pathlib.Path) -> pathlib.Path:
    """Export the registered model ``name`` to ONNX at ``path`` and return the path."""
    return get(name).export_onnx(path)
