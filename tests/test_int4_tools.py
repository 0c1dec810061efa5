"""tools/eval_int4.py: the weights ONNX Runtime's 4-bit quantizer sees, their groups, the formats, the gap."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
from conftest import IR_VERSION, load_module, rng, run_ort
from onnx import helper, numpy_helper

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"
eval_int4 = load_module(TOOLS / "eval_int4.py")

D, INNER, VOCAB = 64, 256, 33


def tied_decoder() -> onnx.ModelProto:
    """A GPT-2's shape in miniature: an embedding table E read by a Gather and, through a Transpose, by the
    LM head (tied, as torch.onnx exports GPT-2), one attention-sized projection, an MLP's up and down."""
    g = rng(3)
    weights = {
        "E": g.normal(size=(VOCAB, D)),
        "Wa": g.normal(size=(D, D)),
        "Wup": g.normal(size=(D, INNER)),
        "Wdown": g.normal(size=(INNER, D)),
    }
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["x"], name="embed"),
        helper.make_node("MatMul", ["x", "Wa"], ["a"], name="attention"),
        helper.make_node("MatMul", ["a", "Wup"], ["u"], name="up"),
        helper.make_node("MatMul", ["u", "Wdown"], ["h"], name="down"),
        helper.make_node("Transpose", ["E"], ["Et"], name="tie", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 8, VOCAB])],
        [numpy_helper.from_array(w.astype(np.float32), name) for name, w in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


FEEDS = {"ids": np.arange(8, dtype=np.int64)[None] % VOCAB}


def quantized_names(model: onnx.ModelProto) -> set[str]:
    return {n.name.removesuffix("_Q4") for n in model.graph.node if n.op_type == "MatMulNBits"}


def test_the_tied_head_is_quantized_only_once_its_transpose_is_a_constant():
    model = tied_decoder()
    assert quantized_names(eval_int4.quantize(model, "asym-0", 32)) == {"attention", "up", "down"}
    assert not quantized_names(model)  # the quantizer's input is left as it was
    exact = eval_int4.quantizable(model)
    np.testing.assert_array_equal(run_ort(exact, FEEDS)["logits"], run_ort(model, FEEDS)["logits"])
    assert {i.name for i in exact.graph.initializer} >= {"E", "E.T"}  # the Gather still reads E
    assert quantized_names(eval_int4.quantize(exact, "asym-0", 32)) == {"attention", "up", "down", "head"}


def test_groups_and_one_group_at_a_time():
    exact = eval_int4.quantizable(tied_decoder())
    kinds = eval_int4.groups(exact, INNER, VOCAB, D)
    assert kinds == {"attention": "out", "up": "mlp", "down": "mlp", "head": "head"}
    assert quantized_names(eval_int4.quantize(exact, "sym-4", 32, ["up", "down"])) == {"up", "down"}


def test_the_formats_reach_the_matmulnbits_attributes():
    exact = eval_int4.quantizable(tied_decoder())
    for form, (symmetric, level) in eval_int4.FORMATS.items():
        for block in (32, 64):
            quantized = eval_int4.quantize(exact, form, block)
            for node in (n for n in quantized.graph.node if n.op_type == "MatMulNBits"):
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                assert attrs["block_size"] == block and attrs.get("accuracy_level", 0) == level
                assert (len(node.input) > 3 and bool(node.input[3])) != symmetric  # zero points: asymmetric
            error = np.abs(run_ort(quantized, FEEDS)["logits"] - run_ort(exact, FEEDS)["logits"]).max()
            assert 0 < error < 0.5 * np.abs(run_ort(exact, FEEDS)["logits"]).max()


def test_the_gap_is_the_perplexity_ratio_and_its_spread_brackets_it():
    tokens = 10
    base = np.full(40, 2.0 * tokens)
    worse = base + tokens * np.log(1.1) + rng(0).normal(scale=0.5, size=40)
    worse -= worse.mean() - base.mean() - tokens * np.log(1.1)  # exactly 10 % over on the whole
    top = np.zeros((40, tokens + 1), dtype=np.int64)
    logp = np.log(np.full((40, tokens, 4), 0.25))
    found = eval_int4.judged((worse, top, logp), (base, top, logp), tokens)
    assert abs(found["gap"] - 0.1) < 1e-12
    low, high = found["gap_p5_p95"]
    assert low < 0.1 < high and high - low < 0.05
    assert found["top1_agree"] == 1.0
    assert abs(found["kl"]) < 1e-12
    sharper = np.log(np.array([0.5, 0.5 / 3, 0.5 / 3, 0.5 / 3]))  # KL(uniform ‖ sharper) = ¼·ln ½ + ¾·ln 1.5
    found = eval_int4.judged((worse, top, np.broadcast_to(sharper, logp.shape)), (base, top, logp), tokens)
    assert abs(found["kl"] - (0.25 * np.log(0.5) + 0.75 * np.log(1.5))) < 1e-12
