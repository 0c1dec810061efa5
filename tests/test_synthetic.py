"""tools/synthetic_stack.py at tiny sizes: a valid model with the stated parameter count, weights
streamed to external data from a seeded generator, and every norm but the last folded exactly."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
from conftest import load_module
from onnx import numpy_helper

from normpass.onnx.fold.driver import FoldOptions, fold_onnx

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "synthetic_stack.py"
synthetic_stack = load_module(TOOL)

TINY = {"hidden": 16, "heads": 2, "vocab": 48}
WEIGHT_SUFFIXES = (".weight", ".bias", ".gamma", ".beta")
IDS = np.array([[0, 5, 47]], dtype=np.int64)


def _build(tmp_path, name="model.onnx", **kwargs):
    return synthetic_stack.build(tmp_path / name, **{"params": 2e4, "dtype": "float32", **TINY, **kwargs})


def _run(path: str, ids: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {
        init.name: numpy_helper.to_array(init)
        for init in model.graph.initializer
        if init.name.endswith(WEIGHT_SUFFIXES)
    }


def test_tiny_stack_is_valid_runs_and_counts_its_parameters(tmp_path):
    info = _build(tmp_path)
    layers = info["layers"]
    assert layers == round((2e4 - 2 * 48 * 16 - 2 * 16) / (12 * 16 * 16 + 13 * 16)) == 6
    onnx.checker.check_model(info["path"], full_check=True)

    model = onnx.load(info["path"], load_external_data=False)
    external = [init for init in model.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL]
    assert sum(math.prod(init.dims) for init in external) == info["params"]
    assert info["weight_bytes"] == 4 * info["params"]
    assert (tmp_path / "model.onnx.data").stat().st_size >= info["weight_bytes"]
    assert [n.op_type for n in model.graph.node].count("LayerNormalization") == 2 * layers + 1

    logits = _run(info["path"], IDS)
    assert logits.shape == (1, 3, 48) and np.isfinite(logits).all()


def test_folded_tiny_stack_matches_the_original_in_onnx_runtime(tmp_path):
    info = _build(tmp_path)
    folded = fold_onnx(onnx.load(info["path"]), FoldOptions(verify=False))
    assert folded.folded == 2 * info["layers"]
    onnx.save(folded.model, str(tmp_path / "folded.onnx"))
    original, rewritten = _run(info["path"], IDS), _run(str(tmp_path / "folded.onnx"), IDS)
    np.testing.assert_allclose(rewritten, original, rtol=1e-4, atol=1e-5 * np.abs(original).max())


def test_weights_follow_the_seed(tmp_path):
    first = _weights(onnx.load(_build(tmp_path, "a.onnx")["path"]))
    again = _weights(onnx.load(_build(tmp_path, "b.onnx")["path"]))
    other = _weights(onnx.load(_build(tmp_path, "c.onnx", seed=1)["path"]))
    assert all(np.array_equal(first[name], again[name]) for name in first)
    assert not np.array_equal(first["embed.weight"], other["embed.weight"])
    assert abs(first["layer0.ln1.gamma"].mean() - 1) < 0.05 and abs(first["layer0.up.weight"].std() - 0.02) < 0.005


def test_float16_stack_folds_every_norm_but_the_final_one(tmp_path):
    info = _build(tmp_path, dtype="float16")
    model = onnx.load(info["path"])
    assert {init.data_type for init in model.graph.initializer if init.name.endswith(WEIGHT_SUFFIXES)} == {
        onnx.TensorProto.FLOAT16
    }
    result = fold_onnx(model)  # verified; the final norm's β has no linear layer to move into
    assert (result.folded, result.plan.total) == (2 * info["layers"], 2 * info["layers"] + 1)
    assert result.comparison.max_rel_error < 1e-2


def test_the_centred_model_has_one_large_weight_that_every_verb_changes(tmp_path):
    """`build_centred` (tools/bench_pass.py's centred-* targets): W0 holds nearly every byte, in external data, and
    the fold centres it (a new W0), exactly."""
    info = synthetic_stack.build_centred(tmp_path / "centred.onnx", 2**20, hidden=64, outputs=8)
    assert info["rows"] == 4096 and info["weight_bytes"] >= 2**20
    model = onnx.load(info["path"], load_external_data=False)
    assert all(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "LayerNormalization", "MatMul", "Add"]
    result = fold_onnx(info["path"], FoldOptions())
    assert result.folded == 1 and result.comparison is not None and result.comparison.passed
    assert "W0" not in result.ir_model.graph.initializers, "W0 was centred: a new weight"
