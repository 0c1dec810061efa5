"""The exporter axis: every registry model as the ONNX files people actually have.

A registry entry exports one seeded model; ``export_form`` writes it in one of four forms:

* ``dynamo``: ``torch.onnx.export(dynamo=True)`` with dynamic shapes (the registry's own export);
* ``torchscript``: ``torch.onnx.export(dynamo=False)``, opset 17, dynamic batch/sequence axes, the
  exporter HF Optimum and most published ONNX files use (γ/β deduplicated and read through
  ``Identity``, shapes computed at run time with ``Shape``/``Gather``/``Concat``);
* ``ort-optimized``: the TorchScript export after ``onnxruntime.transformers.optimizer`` with the
  entry's model type at ``opt_level=1`` (portable: ORT's basic constant folding plus the Python
  fusions: ``SkipLayerNormalization``, fused GELU and, where the pattern matches, ``Attention``);
* ``fp16``: the dynamo export converted by ``normpass.onnx.runtime.precision.to_fp16`` (fp16 outputs too).

The same weights are exported in every form, so the fold's target is the same in every form: the
norms the dynamo export proves and rewrites, with the same reasons for the others.
"""

from __future__ import annotations

import contextlib
import pathlib
import unittest.mock

import onnx
import torch

from .registry import FORMS, ModelEntry, _quiet

TORCHSCRIPT_OPSET = 17
BASE_FORM = {"ort-optimized": "torchscript", "fp16": "dynamo"}  # forms made from another form's file


def export_form(entry: ModelEntry, path: str | pathlib.Path, form: str = "dynamo") -> pathlib.Path:
    """Export ``entry`` to ONNX at ``path`` in ``form`` (one of ``FORMS``); return the path."""
    path = pathlib.Path(path)
    if form == "dynamo":
        return entry.export_onnx(path)
    if form == "torchscript":
        return _export_torchscript(entry, path)
    if form not in BASE_FORM:
        raise ValueError(f"unknown form {form!r}; known forms: {', '.join(FORMS)}")
    base = export_form(entry, path.with_suffix(f".{BASE_FORM[form]}.onnx"), BASE_FORM[form])
    return convert(entry, base, path, form)


def convert(entry: ModelEntry, source: str | pathlib.Path, path: str | pathlib.Path, form: str) -> pathlib.Path:
    """Write ``form`` of ``entry`` at ``path`` from ``source``, its export in ``BASE_FORM[form]``."""
    path = pathlib.Path(path)
    if form == "ort-optimized":
        return _optimize(entry, pathlib.Path(source), path)
    if form == "fp16":
        from normpass.onnx.runtime.precision import to_fp16

        onnx.save(to_fp16(onnx.load(str(source))), str(path))
        return path
    raise ValueError(f"form {form!r} is not made from another form; derived forms: {', '.join(BASE_FORM)}")


@contextlib.contextmanager
def _no_packed_sequences():
    """Keep transformers' packed-sequence detection out of a traced graph.

    Without an attention mask, transformers (5.x) looks for packed sequences in the position ids
    with ``torch.diff``, which the TorchScript exporter cannot export (and a ``CumSum`` of bools,
    which ONNX rejects). Exports from Optimum or older transformers have no such subgraph.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    with unittest.mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def torchscript_export(module, inputs, path, input_names, output_names, dynamic_axes) -> pathlib.Path:
    """``torch.onnx.export(dynamo=False)`` at opset 17 with ``dynamic_axes`` ({name: {axis: dim}}), quietly."""
    with _quiet(), _no_packed_sequences(), torch.no_grad():
        torch.onnx.export(
            module,
            inputs,
            str(path),
            dynamo=False,
            opset_version=TORCHSCRIPT_OPSET,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
        )
    return pathlib.Path(path)


def _export_torchscript(entry: ModelEntry, path: pathlib.Path) -> pathlib.Path:
    module, inputs = entry.build_torch()
    axes = dict(zip(entry.input_names, entry.dynamic_shapes, strict=False))
    axes.update({name: entry.dynamic_shapes[0] for name in entry.output_names})
    return torchscript_export(module, inputs, path, entry.input_names, entry.output_names, axes)


def _optimize(entry: ModelEntry, source: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    from onnxruntime.transformers.optimizer import optimize_model

    with _quiet():
        optimized = optimize_model(
            str(source),
            model_type=entry.ort_model_type,
            num_heads=entry.num_heads,
            hidden_size=entry.hidden_size,
            opt_level=1,
            use_gpu=False,
        )
    onnx.save(optimized.model, str(path))
    return path
