"""Tests for the model registry ``normpass.models`` (registry level only, no normpass imports).

Every non-large entry is exported once per session (``registry_export`` in
conftest.py); the export must be a valid ONNX model that ONNX Runtime runs to
the PyTorch output, with one LayerNormalization node per LayerNorm module,
distinct norm parameters, and the seeded weights: a second build of the model
has the same parameters, and the export holds them (checked against the built
module instead of a second export).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from normpass import models as builtin_models
from normpass.models import REGISTRY, default_name, get, gpt2_small_shape, names

SMALL = names(include_large=False)


def _norm_kind(module: torch.nn.Module) -> str | None:
    if isinstance(module, torch.nn.LayerNorm):
        return "layernorm"
    if isinstance(module, (torch.nn.RMSNorm, torch.nn.GroupNorm)):
        return "other"
    if type(module).__name__.endswith("RMSNorm"):  # e.g. LlamaRMSNorm
        return "other"
    return None


def _norms_used(module: torch.nn.Module, inputs: tuple) -> list[str]:
    """Kinds of the norm modules that run in one forward pass."""
    used: list[str] = []
    hooks = [
        sub.register_forward_hook(lambda mod, args, out, kind=kind: used.append(kind))
        for sub in module.modules()
        if (kind := _norm_kind(sub))
    ]
    with torch.no_grad():
        module(*inputs)
    for hook in hooks:
        hook.remove()
    return used


@pytest.fixture(scope="module", params=SMALL)
def exported(request, registry_export, registry_model):
    name = request.param
    return get(name), registry_export(name), registry_model(name)


def test_registry_contents():
    assert names() == ["gpt2", "bert", "vit", "llama", "swin", "opt", "gpt2-small-shape"]
    assert SMALL == ["gpt2", "bert", "vit", "llama", "swin", "opt"]
    assert default_name in REGISTRY and not get(default_name).large
    assert get("gpt2-small-shape").large
    assert set(builtin_models.__all__) >= {"ModelEntry", "REGISTRY", "get", "names", "export_onnx"}
    for entry in REGISTRY.values():
        assert 0 <= entry.expected_folded <= entry.expected_norms
        assert entry.why and entry.summary
        assert len(entry.input_names) == len(entry.dynamic_shapes)
    with pytest.raises(KeyError, match="known models"):
        get("no-such-model")


def test_gpt2_entry_scales_with_depth():
    deep = gpt2_small_shape("gpt2-48", n_layer=48)
    assert deep.expected_norms == deep.expected_folded == 97
    assert deep.large


def test_export_is_valid_onnx(exported):
    entry, path, model = exported
    onnx.checker.check_model(str(path))
    assert model.ir_version <= 10
    assert [i.name for i in model.graph.input] == list(entry.input_names)
    assert [o.name for o in model.graph.output] == list(entry.output_names)
    for graph_input, dims in zip(model.graph.input, entry.dynamic_shapes, strict=False):
        shape = graph_input.type.tensor_type.shape.dim
        assert {axis: shape[axis].dim_param for axis in dims} == dims


def test_onnxruntime_matches_torch(exported):
    entry, path, _ = exported
    module, _ = entry.build_torch()
    inputs = entry.make_inputs(3, 11, 123)  # shapes differ from the export example
    with torch.no_grad():
        expected = module(*inputs).numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (actual,) = session.run(None, {n: t.numpy() for n, t in zip(entry.input_names, inputs, strict=False)})
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


def test_norm_counts(exported):
    entry, _, model = exported
    module, inputs = entry.build_torch()
    used = _norms_used(module, inputs)
    assert len(used) == entry.expected_norms
    layer_norms = [node for node in model.graph.node if node.op_type == "LayerNormalization"]
    assert len(layer_norms) == used.count("layernorm")
    assert entry.expected_folded <= len(layer_norms)


def test_norm_parameters_are_distinct(exported):
    _, _, model = exported
    initializers = {init.name for init in model.graph.initializer}
    params = [node.input[1:] for node in model.graph.node if node.op_type == "LayerNormalization"]
    flat = [name for pair in params for name in pair]
    assert all(len(pair) == 2 for pair in params)
    assert set(flat) <= initializers and len(set(flat)) == len(flat)


def test_export_holds_the_seeded_weights(exported):
    """Two builds have the same parameters, and every one exported under its own name (each norm's γ and
    β among them; linear weights are stored transposed) has its values. (test_onnxruntime_matches_torch
    checks the export computes what a fresh build computes.)"""
    entry, _, model = exported
    first, second = (entry.build_torch()[0].state_dict() for _ in range(2))
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert torch.equal(value, second[key]), key
    exported_values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    named = set(first) & set(exported_values)
    norm_parameters = {
        name for node in model.graph.node if node.op_type == "LayerNormalization" for name in node.input[1:]
    }
    assert named and norm_parameters <= named, sorted(norm_parameters - named)
    for key in named:
        np.testing.assert_array_equal(exported_values[key], first[key].numpy(), err_msg=key)
