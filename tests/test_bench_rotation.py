"""tools/bench_rotation.py's recipes on the registry's small models: which nodes a recipe keeps in fp32, and
that ONNX Runtime's quantizer then leaves exactly those unquantized."""

from __future__ import annotations

import logging
import pathlib
import sys

import numpy as np
import onnx
from conftest import load_module, run_ort

from normpass.onnx.runtime.verify import make_inputs

bench_rotation = load_module(pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench_rotation.py")


def test_attention_cores_are_the_score_and_probability_matmuls_softmax_and_the_mask_between(registry_export):
    graph = onnx.load(str(registry_export("bert")), load_external_data=False).graph
    nodes = {n.name: n for n in graph.node}
    weights = {i.name for i in graph.initializer}
    core = bench_rotation.attention_cores(graph)
    assert sorted(nodes[name].op_type for name in core) == ["Add"] * 2 + ["MatMul"] * 4 + ["Softmax"] * 2
    producer = {o: n.name for n in graph.node for o in n.output}
    for softmax in (nodes[name] for name in core if nodes[name].op_type == "Softmax"):
        mask = nodes[producer[softmax.input[0]]]  # the mask Add, reading the scores' MatMul
        assert mask.name in core and any(producer.get(i) in core for i in mask.input)
    assert not any(set(nodes[name].input) & weights for name in core if nodes[name].op_type == "MatMul")


def test_fp32_attention_recipe_leaves_the_core_unquantized_and_the_rest_in_int8(registry_export, tmp_path):
    source = registry_export("vit")
    model = onnx.load(str(source))
    calibration = [make_inputs(model, seed=seed) for seed in range(4)]
    found = {}
    for recipe in ("default", "default-fp32-attention"):
        out = bench_rotation.quantize(source, recipe, calibration, tmp_path / f"{recipe}.onnx", [])
        found[recipe] = onnx.load(str(out))
        onnx.checker.check_model(found[recipe])
    core = bench_rotation.attention_cores(model.graph)
    for recipe, quantized_model in found.items():
        graph = quantized_model.graph
        producer = {o: n.op_type for n in graph.node for o in n.output}
        quantizes = {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
        matmuls = [n for n in graph.node if n.name in core and n.op_type == "MatMul"]
        scores_and_outputs = {n.output[0] for n in matmuls}  # Q·Kᵀ's scores, P·V's attention output
        probabilities = {n.output[0] for n in graph.node if n.op_type == "Softmax"}
        assert len(matmuls) == 4 and len(probabilities) == 2
        if recipe == "default":  # the scores, P and the attention output are quantized
            assert probabilities <= quantizes and scores_and_outputs <= quantizes
        else:  # none of them is; the linear layers' weights are
            assert not (probabilities | scores_and_outputs) & quantizes
            linear = [n for n in graph.node if n.op_type == "MatMul" and n.name not in core]
            assert linear and all(producer.get(n.input[1]) == "DequantizeLinear" for n in linear)
    feeds = make_inputs(model, seed=99)
    reference = run_ort(model, feeds)
    output = model.graph.output[0].name
    for recipe, quantized_model in found.items():
        got = run_ort(quantized_model, feeds)[output]
        error = np.linalg.norm(got - reference[output]) / np.linalg.norm(reference[output])
        assert 0 < error < 0.2, (recipe, error)


def test_the_weight_only_quantizer_is_imported_with_the_root_logger_kept(monkeypatch):
    """ORT's `matmul_nbits_quantizer` calls `logging.basicConfig(level=INFO)` when imported: the root logger
    would print every library's INFO records after a weight-only recipe ran."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a plain process (pytest adds its own), so basicConfig acts
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.delitem(sys.modules, "onnxruntime.quantization.matmul_nbits_quantizer", raising=False)
    quantizer = bench_rotation.nbits_quantizer()
    assert quantizer.__name__ == "MatMulNBitsQuantizer"
    assert "onnxruntime.quantization.matmul_nbits_quantizer" in sys.modules  # imported afresh here
    assert root.level == logging.WARNING and root.handlers == []
