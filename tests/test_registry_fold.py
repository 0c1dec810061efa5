"""The fold on real exported architectures from the model registry (`normpass.models`).

Each non-large entry is exported and folded once per session (`registry_fold` in conftest.py, shared
with the corpus, CLI, viz and bench tests) and must fold exactly as many norms as the registry
records, verify with every RMS op form (`fold_onnx`'s own check; test_corpus.py checks the default
fold independently), and never change an original initializer in place.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import check_plain, check_structure, initializers, op_counts, rms_nodes, run_ort

from normpass import inspect_onnx
from normpass import models as builtin_models
from normpass.onnx.runtime.verify import make_inputs

SMALL = builtin_models.names(include_large=False)
RMS_OPS = ("simplified", "onnx", "decomposed")


@pytest.fixture(scope="module", params=SMALL)
def exported(request, registry_model):
    name = request.param
    return builtin_models.get(name), registry_model(name)


def test_registry_is_not_empty():
    assert {"gpt2", "bert", "vit", "llama"} <= set(SMALL)


def test_inspect_counts(exported):
    entry, model = exported
    plan = inspect_onnx(model)
    assert plan.total == entry.expected_norms, plan.to_json()
    assert len(plan.folded) == entry.expected_folded, plan.to_json()
    for decision in plan.decisions:
        if decision.foldable:
            assert decision.reason is None and decision.centred_layers
        else:
            assert decision.reason


@pytest.mark.parametrize("rms_op", RMS_OPS)
def test_fold_verifies(exported, rms_op, registry_export, registry_fold):
    entry, model = exported
    result = registry_fold(entry.name, rms_op=None if rms_op == "simplified" else rms_op)  # None: the default fold
    assert model.SerializeToString() == onnx.load(str(registry_export(entry.name))).SerializeToString()
    assert result.folded == entry.expected_rewritten and result.plan.total == entry.expected_norms
    assert sum(d.kept for d in result.plan.decisions) == entry.expected_kept
    assert result.comparison is not None and result.comparison.passed
    assert result.comparison.max_rel_error <= 1e-5, result.comparison
    folded = result.model
    counts = op_counts(folded)
    if rms_op == "simplified":
        check_structure(folded)
        assert len(rms_nodes(folded)) == entry.expected_rewritten
    else:
        check_plain(folded)
        assert not rms_nodes(folded)
        if rms_op == "onnx":
            assert counts["RMSNormalization"] == entry.expected_rewritten
            assert {o.domain: o.version for o in folded.opset_import}.get("") == 23
            assert folded.ir_version <= 13
        else:
            assert counts["RMSNormalization"] == 0
    assert counts["LayerNormalization"] == op_counts(model)["LayerNormalization"] - (
        entry.expected_rewritten if op_counts(model)["LayerNormalization"] else 0
    )
    # rewritten constants are new initializers: whatever keeps an original name keeps its values
    original = initializers(model)
    for name, values in initializers(folded).items():
        if name in original:
            np.testing.assert_array_equal(values, original[name], err_msg=name)


def test_fold_with_beta_add_rewrites_every_proven_norm(exported, registry_fold):
    entry, _ = exported
    result = registry_fold(entry.name, fold_with_beta_add=True)
    assert result.folded == entry.expected_folded and not any(d.kept for d in result.plan.decisions)
    assert result.comparison.passed and result.comparison.max_rel_error <= 1e-5
    # each kept-by-default norm now costs an RMS op plus a separate β Add
    kept_names = {d.name for d in registry_fold(entry.name).plan.decisions if d.kept}
    beta_adds = [
        n.name for n in result.model.graph.node if n.op_type == "Add" and n.name.removesuffix(".beta") in kept_names
    ]
    assert len(beta_adds) == entry.expected_kept, beta_adds


def test_bert_refusals_are_blocked_by_layernorms(registry_model):
    model = registry_model("bert")
    ops = {node.name: node.op_type for node in model.graph.node}
    plan = inspect_onnx(model)
    refused = [d for d in plan.decisions if not d.foldable]
    assert len(refused) == 4
    for decision in refused:
        assert decision.blocker is not None, decision
        assert ops.get(decision.blocker.node) == "LayerNormalization", (decision.name, decision.blocker)
        assert "post-LN" in decision.reason
    folded = plan.folded
    assert len(folded) == 1 and ops[folded[0].name] == "LayerNormalization"


def test_gpt2_tied_head_keeps_the_original_table(registry_fold):
    """The LM head reads the token table (or a transposed copy of it); it must not be centred."""
    folded = registry_fold("gpt2").model
    gathers = [n for n in folded.graph.node if n.op_type == "Gather" and n.input[0] in initializers(folded)]
    tables = initializers(folded)
    centred = [
        n
        for n in gathers
        if tables[n.input[0]].ndim == 2 and np.abs(tables[n.input[0]].astype(np.float64).sum(axis=1)).max() < 1e-4
    ]
    assert len(centred) == 2, [n.name for n in gathers]  # token and position embeddings


def test_llama_passes_through_bit_for_bit(registry_model, registry_fold):
    model = registry_model("llama")
    plan = inspect_onnx(model)
    assert plan.total == 5 and not plan.folded
    assert all("RMSNorm" in d.op for d in plan.decisions)
    for rms_op in (None, "onnx", "decomposed"):  # None: the default, "simplified"
        result = registry_fold("llama", rms_op=rms_op)
        assert result.folded == 0
        assert op_counts(result.model) == op_counts(model)  # (rms_op "onnx" may still raise the opset)
        for seed in (0, 1):
            feeds = make_inputs(model, {"input_ids": (2, 7)}, seed=seed)
            expected, got = run_ort(model, feeds), run_ort(result.model, feeds)
            for name in expected:
                assert got[name].tobytes() == expected[name].tobytes(), name
