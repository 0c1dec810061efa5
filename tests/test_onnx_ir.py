"""Folding a model with external data from its path (onnx-ir): weights read lazily, changed weights
computed when written, unchanged ones left as the file's tensors, and the file left as it was.

The weights here are 1 MiB each, the size from which a changed weight is computed when written
(`targets.LAZY_MIN_BYTES`); the folded model is checked against the original in ONNX Runtime
directly, from the files, independently of normpass's verifier.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from conftest import build, randn, rng

from normpass import FoldOptions, fold_onnx, inspect_onnx, io
from normpass.io import skeleton
from normpass.onnx.fold.targets import LAZY_MIN_BYTES

D = 512  # a D×D float32 weight is 1 MiB


def external_model(tmp_path) -> tuple:
    """y = LN(x·W1 + b1)·W2 + b2 (foldable: W1 is centred, γ/β move into W2), z = x·W3 (untouched), saved with
    external data."""
    gen = rng(3)
    model = build(
        f"""<ir_version: 10, opset_import: ["" : 17]>
agraph (float[B, {D}] x) => (float[B, {D}] y, float[B, {D}] z) {{
  h = MatMul(x, W1)
  hb = Add(h, b1)
  n = LayerNormalization<axis=-1, epsilon=1e-5>(hb, g, bt)
  m = MatMul(n, W2)
  y = Add(m, b2)
  z = MatMul(x, W3)
}}""",
        W1=randn(gen, D, D),
        b1=randn(gen, D),
        g=1 + randn(gen, D, scale=0.1),
        bt=randn(gen, D, scale=0.1),
        W2=randn(gen, D, D),
        b2=randn(gen, D),
        W3=randn(gen, D, D),
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path, tmp_path / "model.onnx.data"


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def outputs(path, feeds) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_fold_from_a_path_computes_changed_weights_when_written(tmp_path):
    path, data = external_model(tmp_path)
    before = digest(path), digest(data)
    result = fold_onnx(path, FoldOptions(fuse_skip=False))
    assert result.folded == 1 and result.comparison.passed
    tensors = {name: value.const_value for name, value in result.ir_model.graph.initializers.items()}
    assert isinstance(tensors["W3"], ir.ExternalTensor)  # unchanged: still the file's tensor
    assert "W1" not in tensors and "W2" not in tensors  # replaced by their rewritten copies
    rewritten = [t for name, t in tensors.items() if name.startswith(("W1.", "W2."))]
    assert len(rewritten) == 2 and all(isinstance(t, ir.LazyTensor) and t.nbytes >= LAZY_MIN_BYTES for t in rewritten)

    out = tmp_path / "out" / "folded.onnx"
    out.parent.mkdir()
    result.save(out)
    assert (digest(path), digest(data)) == before
    (written,) = [p for p in io.model_files("out", out).values() if p != out]
    assert written.name.startswith("folded.onnx.") and written.stat().st_size >= 3 * D * D * 4
    folded = onnx.load(str(out))
    assert [n.op_type for n in folded.graph.node].count("SimplifiedLayerNormalization") == 1
    feeds = {"x": (3 * randn(rng(7), 4, D) + 1).astype(np.float32)}
    for expected, got in zip(outputs(path, feeds), outputs(out, feeds), strict=False):
        assert np.abs(expected - got).max() <= 1e-4 * np.abs(expected).max()


def test_skeleton_holds_no_weights_and_leaves_the_model_as_it_was(tmp_path):
    path, _ = external_model(tmp_path)
    model = ir.load(path)
    proto = skeleton(model)
    large = [t for t in proto.graph.initializer if t.name.startswith("W")]
    assert len(large) == 3 and all(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in large)
    assert all(isinstance(model.graph.initializers[t.name].const_value, ir.ExternalTensor) for t in large)
    assert list(large[0].dims) == [D, D]


def every_tensor_external(tmp_path, model) -> tuple:
    """`model` saved with all its tensors, however small, in external data (`size_threshold=0`); an untouched copy."""
    kept = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save rewrites the proto it saves
    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path, kept


def test_small_external_tensors_are_read_for_shape_inference(tmp_path):
    """A Reshape whose target shape is stored externally keeps the normalized axis, as in memory."""
    gen = rng(5)
    path, model = every_tensor_external(
        tmp_path,
        build(
            f"""<ir_version: 10, opset_import: ["" : 17]>
agraph (float[B, {D}] x) => (float[B, {D}] y) {{
  h = MatMul(x, W1)
  r = Reshape(h, target)
  n = LayerNormalization<axis=-1, epsilon=1e-5>(r, g, bt)
  y = MatMul(n, W2)
}}""",
            W1=randn(gen, D, D),
            target=np.array([-1, D], np.int64),
            g=1 + randn(gen, D, scale=0.1),
            bt=randn(gen, D, scale=0.1),
            W2=randn(gen, D, D),
        ),
    )
    from_file, from_memory = inspect_onnx(path), inspect_onnx(model)
    assert [(d.name, d.foldable, d.reason) for d in from_file.decisions] == [
        (d.name, d.foldable, d.reason) for d in from_memory.decisions
    ]
    assert len(from_file.folded) == 1


def test_small_external_tensors_are_written_inline_after_verification(tmp_path):
    """A tiny constant read by the analysis from a memory map is written inline by the verified fold
    (fuzzing seed 30047: onnx-ir closed the map under the analysis's view of it, a BufferError)."""
    import graphgen

    path, _ = every_tensor_external(tmp_path, graphgen.generate(30047, graphgen.PINNED_FEATURES).model)
    result = fold_onnx(path)
    assert result.comparison.passed
    result.save(tmp_path / "folded.onnx")
    onnx.checker.check_model(str(tmp_path / "folded.onnx"))
