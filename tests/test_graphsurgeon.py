"""onnx-graphsurgeon at the edge: `fold_onnx` and `inspect_onnx` take a `gs.Graph`, and
`FoldResult.graphsurgeon()` gives the folded model back as one; the input graph is left as it was."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import assert_equivalent, check_structure, op_counts

from normpass import FoldOptions, InputError, MissingExtraError, fold_onnx, inspect_onnx

gs = pytest.importorskip("onnx_graphsurgeon", reason="pip install -e '.[graphsurgeon]'")


def graph_summary(graph) -> list[tuple]:
    return [(node.op, node.name, [t.name for t in node.inputs], [t.name for t in node.outputs]) for node in graph.nodes]


def test_a_graphsurgeon_graph_round_trips_through_the_fold(registry_model):
    original = registry_model("gpt2")
    graph = gs.import_onnx(original)
    before = graph_summary(graph)
    weights = {name: np.array(t.values) for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}
    assert len(inspect_onnx(graph).folded) == 5
    result = fold_onnx(graph, FoldOptions(fuse_skip=False))
    assert result.folded == 4
    folded = result.graphsurgeon()
    assert isinstance(folded, gs.Graph)
    ops = [node.op for node in folded.nodes]
    assert ops.count("SimplifiedLayerNormalization") == 4 and ops.count("LayerNormalization") == 1
    back = gs.export_onnx(folded)
    assert back.ir_version == original.ir_version
    assert op_counts(back) == op_counts(result.model)
    check_structure(back)
    assert_equivalent(original, back)
    # the input graph is untouched: same nodes, same weights
    assert graph_summary(graph) == before
    after = {name: np.array(t.values) for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}
    assert after.keys() == weights.keys() and all(np.array_equal(after[k], weights[k]) for k in weights)


def test_a_graph_that_cannot_be_exported_is_a_one_line_input_error():
    x = gs.Variable("x", dtype=None, shape=None)  # no dtype: gs refuses to export a graph input without one
    y = gs.Variable("y", dtype=np.float32, shape=(2,))
    graph = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[y])], inputs=[x], outputs=[y], name="untyped")
    with pytest.raises(InputError, match="onnx-graphsurgeon cannot export it") as caught:
        fold_onnx(graph)
    assert "'untyped'" in str(caught.value) and "\n" not in str(caught.value)


def test_without_graphsurgeon_the_result_names_the_extra(registry_fold, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx_graphsurgeon", None)  # as if it were not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'normpass\[graphsurgeon\]'") as caught:
        registry_fold("gpt2").graphsurgeon()
    assert isinstance(caught.value, ImportError)
