"""`tools/eval_decode.four_bit`: the format ONNX Runtime GenAI's builder serves on CPU by default (block 32,
symmetric, accuracy level 4), the asymmetric fp32-compute format on request; numerics within 4-bit rounding."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
from conftest import load_module, run_ort
from onnx import TensorProto, helper, numpy_helper

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
eval_decode = load_module(TOOLS / "eval_decode.py")


def one_matmul(k: int = 64, n: int = 48) -> onnx.ModelProto:
    weight = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "one_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def nbits(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert not [n for n in model.graph.node if n.op_type == "MatMul"]
    return node


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_the_default_is_the_builders_cpu_format_symmetric_with_int8_activations():
    node = nbits(eval_decode.four_bit(one_matmul()))
    found = attributes(node)
    assert (found["bits"], found["block_size"], found["accuracy_level"]) == (4, 32, 4)
    assert len([name for name in node.input if name]) == 3  # A, B, scales: no zero points, symmetric


def test_asymmetric_fp32_compute_on_request_has_zero_points():
    node = nbits(eval_decode.four_bit(one_matmul(), symmetric=False, accuracy_level=0))
    assert attributes(node).get("accuracy_level", 0) == 0
    assert len([name for name in node.input if name]) == 4  # A, B, scales, zero points


def test_each_format_computes_the_matmul_within_4_bit_rounding():
    model = one_matmul()
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    exact = run_ort(model, {"x": x})["y"]
    for symmetric, level in ((True, 4), (False, 0)):
        found = run_ort(eval_decode.four_bit(model, symmetric=symmetric, accuracy_level=level), {"x": x})["y"]
        relative = np.linalg.norm(found - exact) / np.linalg.norm(exact)
        assert 1e-4 < relative < 0.2, (symmetric, level, relative)  # quantized, not exact, not garbage


def test_the_block_size_is_a_keyword_too():
    node = nbits(eval_decode.four_bit(one_matmul(k=256), block_size=128))
    assert attributes(node)["block_size"] == 128
