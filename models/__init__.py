"""normpass.models: seeded transformer models for testing and demonstrating normpass.

``REGISTRY`` maps a model name to a :class:`ModelEntry` that builds the model in
PyTorch, exports it to ONNX and records its expected norm and fold counts::

    from normpass.models import export_onnx, names
    for name in names(include_large=False):
        export_onnx(name, f"/tmp/{name}.onnx")

``export_onnx(name, path, form=...)`` writes the same model as another exporter would (``FORMS``:
dynamo, torchscript, ort-optimized, fp16; see ``forms.py``).
"""

from __future__ import annotations

import pathlib

from .forms import BASE_FORM, FORMS, convert, export_form
from .registry import REGISTRY, ModelEntry, default_name, get, gpt2_config, gpt2_entry, gpt2_small_shape, names

__all__ = [
    "BASE_FORM",
    "FORMS",
    "REGISTRY",
    "ModelEntry",
    "convert",
    "default_name",
    "export_onnx",
    "get",
    "gpt2_config",
    "gpt2_entry",
    "gpt2_small_shape",
    "names",
]


def export_onnx(name: str, path: str | pathlib.Path, form: str = "dynamo") -> pathlib.Path:
    """Export the registered model ``name`` to ONNX at ``path`` in ``form`` and return the path."""
    return export_form(get(name), path, form)
