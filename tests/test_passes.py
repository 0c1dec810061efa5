"""`FoldPass`, the fold as an onnx-ir pass: its contract (functional, what `modified` means, how
errors surface) and the same result as `fold_onnx`, alone and inside a `PassManager` beside
onnxscript's and onnx-ir's passes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import assert_equivalent, op_counts, rms_nodes
from onnx_ir.passes.common import IdentityEliminationPass, RemoveUnusedNodesPass, TopologicalSortPass
from onnxscript.rewriter import RewritePass
from onnxscript.rewriter.rules.common import mul_by_1_rule, no_op_cast_rule

from normpass import FoldOptions, FoldPass, InputError, VerificationError, fold_onnx
from normpass.onnx.fold import rewrite

ONNXSCRIPT_RULES = [no_op_cast_rule, *mul_by_1_rule.commute()]


def with_no_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with a no-op Cast and a Mul by 1 before its first LayerNorm: onnxscript's rules make them
    Identity nodes, which onnx-ir's IdentityEliminationPass removes."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    index, norm = next((i, n) for i, n in enumerate(graph.node) if n.op_type == "LayerNormalization")
    float32 = onnx.TensorProto.FLOAT
    graph.node.insert(index, onnx.helper.make_node("Cast", [norm.input[0]], ["cast_x"], to=float32, name="no_op_cast"))
    graph.node.insert(index + 1, onnx.helper.make_node("Mul", ["cast_x", "one"], ["times_one"], name="no_op_mul"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"))
    graph.value_info.extend(onnx.helper.make_tensor_value_info(n, float32, None) for n in ("cast_x", "times_one"))
    norm.input[0] = "times_one"
    return copy


def proto_bytes(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString(deterministic=True)


def same_model(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    """The same nodes (op, name, inputs, outputs, attributes), initializers and metadata."""
    assert [(n.op_type, n.domain, n.name, list(n.input), list(n.output)) for n in a.graph.node] == [
        (n.op_type, n.domain, n.name, list(n.input), list(n.output)) for n in b.graph.node
    ]
    assert [n.attribute for n in a.graph.node] == [n.attribute for n in b.graph.node]
    weights_a = {t.name: onnx.numpy_helper.to_array(t) for t in a.graph.initializer}
    weights_b = {t.name: onnx.numpy_helper.to_array(t) for t in b.graph.initializer}
    assert weights_a.keys() == weights_b.keys()
    assert all(np.array_equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert {p.key: p.value for p in a.metadata_props} == {p.key: p.value for p in b.metadata_props}


def test_the_pass_gives_fold_onnx_result_and_leaves_its_input_alone(registry_model, registry_fold):
    model = ir.from_proto(registry_model("gpt2"))
    before = proto_bytes(model)
    fold = FoldPass()
    result = fold(model)
    assert result.modified and result.model is not model
    assert proto_bytes(model) == before
    expected = registry_fold("gpt2")
    assert fold.result is not None and fold.result.plan.to_json() == expected.plan.to_json()
    assert fold.result.folded == 4 and fold.result.comparison is not None and fold.result.comparison.passed
    same_model(ir.to_proto(result.model), expected.model)


def test_inside_a_pass_manager_beside_onnxscript_and_onnx_ir_passes(registry_model):
    original = with_no_ops(registry_model("gpt2"))
    fold = FoldPass()
    cleanup = [RewritePass(ONNXSCRIPT_RULES), IdentityEliminationPass(), RemoveUnusedNodesPass()]
    pipeline = ir.passes.PassManager([*cleanup, fold, TopologicalSortPass()], steps=2)
    result = pipeline(ir.from_proto(original))
    assert result.modified
    folded = ir.to_proto(result.model)
    counts = op_counts(folded)
    assert "Identity" not in counts and not [n.name for n in folded.graph.node if n.name.startswith("no_op")]
    assert counts["LayerNormalization"] == 1 and len(rms_nodes(folded)) == 4
    # the same as fold_onnx on what onnxscript's rules made of the model
    cleaned = ir.passes.Sequential(*cleanup)(ir.from_proto(original))
    reference = fold_onnx(ir.to_proto(cleaned.model))
    same_model(folded, reference.model)
    assert_equivalent(original, folded)
    # step 2 ran the pass on its own output: nothing more to fold, the first run's notes kept
    assert fold.result is not None and not fold.result.modified and fold.result.folded == 0
    props = {p.key: p.value for p in folded.metadata_props}
    assert props["normpass.folded"] == "4 of 5 norms folded into RMSNorm"


def test_a_model_with_nothing_to_fold_comes_back_unmodified(registry_model):
    model = ir.from_proto(registry_model("llama"))
    result = FoldPass()(model)
    assert not result.modified and result.model is not model
    assert proto_bytes(result.model) == proto_bytes(model)


def test_bad_options_fail_when_the_pass_is_made():
    with pytest.raises(InputError, match="target 'trt'"):
        FoldPass(FoldOptions(target="trt"))


def test_input_shapes_that_do_not_fit_fail_the_precondition(registry_model):
    fold = FoldPass(FoldOptions(input_shapes={"no_such_input": (1, 4)}))
    with pytest.raises(ir.passes.PreconditionError) as caught:
        fold(ir.from_proto(registry_model("gpt2")))
    assert isinstance(caught.value.__cause__, InputError) and "no_such_input" in str(caught.value.__cause__)
    assert fold.result is None


def test_a_fold_that_fails_verification_raises_and_hands_nothing_back(registry_model, monkeypatch) -> None:
    monkeypatch.setattr(rewrite, "centre", lambda values, axis=None: values * 1.5)  # a wrong centring
    model = ir.from_proto(registry_model("gpt2"))
    before = proto_bytes(model)
    with pytest.raises(VerificationError, match="does not match the original"):
        FoldPass()(model)
    assert proto_bytes(model) == before
    with pytest.raises(ir.passes.PassError) as caught:
        ir.passes.PassManager([RewritePass(ONNXSCRIPT_RULES), FoldPass()])(model)
    causes = []
    error: BaseException | None = caught.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(e, VerificationError) for e in causes)


@pytest.mark.parametrize("folded_before", [False, True])
def test_a_model_with_external_data_keeps_it_through_the_pass(registry_model, tmp_path, folded_before):
    """A model read with its weights in a data file is marked to be written so again (`io.keeps_external_data`):
    the pass's result keeps the mark, folded or returned as a clone, so `io.save_ir` writes a data file."""
    from normpass import io

    proto = onnx.ModelProto()
    proto.CopyFrom(registry_model("gpt2"))  # saving with external data changes the proto it saves
    if folded_before:  # nothing left to fold: the pass returns a clone of its input
        proto = fold_onnx(proto).model
    onnx.save(proto, tmp_path / "in.onnx", save_as_external_data=True, location="in.onnx.data", size_threshold=0)
    model = io.load_ir(tmp_path / "in.onnx")
    result = FoldPass()(model)
    assert result.modified != folded_before
    assert io.keeps_external_data(result.model)
    io.save_ir(tmp_path / "out.onnx", result.model)
    assert (tmp_path / "out.onnx.data").stat().st_size > 0
