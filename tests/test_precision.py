"""fp16: folding an fp16-converted model, and converting a folded one, on the registry gpt2.

Both must agree with the fp16-converted original within the fp16 tolerance of `normpass.onnx.runtime.verify`,
and every norm must keep fp32 statistics (`stash_type=1`).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import build
from onnx import numpy_helper

from normpass import models as builtin_models
from normpass.onnx.fold.driver import fold_onnx
from normpass.onnx.runtime.precision import STASH_TYPE_OPS, to_fp16  # imports onnxconverter_common when converting
from normpass.onnx.runtime.verify import REL_TOLERANCE, verify

pytestmark = pytest.mark.filterwarnings("ignore:the float32 number")
pytest.importorskip("onnxconverter_common")

FP16_TOLERANCE = REL_TOLERANCE[np.dtype(np.float16)]


@pytest.fixture(scope="module")
def gpt2(registry_export):
    return onnx.load(str(registry_export("gpt2")))


@pytest.fixture(scope="module")
def gpt2_fp16(gpt2):
    return to_fp16(gpt2)


def _stash_types(model) -> list[int | None]:
    return [
        next((a.i for a in n.attribute if a.name == "stash_type"), None)
        for n in model.graph.node
        if n.op_type in STASH_TYPE_OPS
    ]


def test_conversion_is_fp16_with_fp32_norm_statistics(gpt2, gpt2_fp16):
    assert gpt2.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # input not modified
    assert gpt2_fp16.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    floats = [i for i in gpt2_fp16.graph.initializer if numpy_helper.to_array(i).dtype.kind == "f"]
    assert floats and all(i.data_type == onnx.TensorProto.FLOAT16 for i in floats)
    assert _stash_types(gpt2_fp16) == [1] * 5


def test_fold_after_conversion(gpt2_fp16):
    result = fold_onnx(gpt2_fp16)  # verifies against the fp16 original, fp16 tolerance
    assert result.folded == builtin_models.get("gpt2").expected_rewritten
    assert result.comparison.outputs[0].dtype == "float16"
    assert 0 < result.comparison.max_rel_error <= FP16_TOLERANCE
    rms = [n for n in result.model.graph.node if "Simplified" in n.op_type]
    assert len(rms) == result.folded
    assert all(t == 1 for t in _stash_types(result.model))


def test_conversion_after_fold(gpt2, gpt2_fp16):
    folded_fp16 = to_fp16(fold_onnx(gpt2).model)
    comparison = verify(gpt2_fp16, folded_fp16)
    assert comparison.passed and comparison.max_rel_error <= FP16_TOLERANCE
    assert _stash_types(folded_fp16) and all(t == 1 for t in _stash_types(folded_fp16))


def test_graph_casts_to_float_become_fp16_except_into_fp32_only_ops():
    """A graph's own `Cast(to=float)` casts to float16 after conversion; the converter's casts to
    float in front of the ops it keeps in fp32 (its block list, here `Max`) stay float."""
    model = build(
        """<ir_version: 10, opset_import: ["" : 17]>
agraph (float[2, 4] x, int64[2, 4] k) => (float[2, 4] y) {
  kf = Cast<to=1>(k)
  s = Add(x, kf)
  m = Max(s, x)
  y = Mul(m, w)
}""",
        w=np.full(4, 0.5, np.float32),
    )
    converted = to_fp16(model)
    producers = {out: n for n in converted.graph.node for out in n.output}
    casts = {n.output[0]: n.attribute[0].i for n in converted.graph.node if n.op_type == "Cast"}
    assert casts[producers["s"].input[1]] == onnx.TensorProto.FLOAT16
    max_node = next(n for n in converted.graph.node if n.op_type == "Max")
    assert [casts[i] for i in max_node.input] == [onnx.TensorProto.FLOAT] * 2
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(converted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    k = np.arange(-4, 4, dtype=np.int64).reshape(2, 4)
    (y,) = session.run(None, {"x": x.astype(np.float16), "k": k})
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, np.maximum(x + k, x) * 0.5, rtol=FP16_TOLERANCE)
