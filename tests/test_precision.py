"""fp16: folding an fp16-converted model, and converting a folded one, on the registry gpt2.

Both must agree with the fp16-converted original within the fp16 tolerance of `normpass.verify`,
and every norm must keep fp32 statistics (`stash_type=1`).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import normpass_models
from normpass.passes import fold_onnx
from normpass.verify import REL_TOLERANCE, verify

pytestmark = pytest.mark.filterwarnings("ignore:the float32 number")
pytest.importorskip("onnxconverter_common")
from normpass.precision import STASH_TYPE_OPS, to_fp16

FP16_TOLERANCE = REL_TOLERANCE[np.dtype(np.float16)]


@pytest.fixture(scope="module")
def gpt2(registry_export):
    return onnx.load(str(registry_export("gpt2")))


@pytest.fixture(scope="module")
def gpt2_fp16(gpt2):
    return to_fp16(gpt2)


def _stash_types(model) -> list[int]:
    return [next((a.i for a in n.attribute if a.name == "stash_type"), None)
            for n in model.graph.node if n.op_type in STASH_TYPE_OPS]


def test_conversion_is_fp16_with_fp32_norm_statistics(gpt2, gpt2_fp16):
    assert gpt2.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # input not modified
    assert gpt2_fp16.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    floats = [i for i in gpt2_fp16.graph.initializer if numpy_helper.to_array(i).dtype.kind == "f"]
    assert floats and all(i.data_type == onnx.TensorProto.FLOAT16 for i in floats)
    assert _stash_types(gpt2_fp16) == [1] * 5


def test_fold_after_conversion(gpt2_fp16):
    result = fold_onnx(gpt2_fp16)  # verifies against the fp16 original, fp16 tolerance
    assert result.folded == normpass_models.get("gpt2").expected_rewritten
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
