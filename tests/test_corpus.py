"""The exporter axis: every small registry model in every form folds as its dynamo export does.

Each (model, form) is exported and folded once per session (``registry_export``, ``registry_fold`` in
conftest.py; ``builtin_models.FORMS``: dynamo, torchscript, ort-optimized, fp16). Per form:

* ``inspect`` finds the registry's norm count and proves the registry's count, and the declined
  norms are declined for the same reasons as in the dynamo export (reasons compared by category:
  node names and the spelling of the LayerNorm op are normalised away);
* ``fold``: normpass's verifier passes, an independent check (``builtin_models.reference``: both
  models run in ONNX Runtime, optimizations off, on inputs of a shape the export did not see)
  agrees within 1e-4 relative (fp32) or 1e-2 (fp16), and it rewrites the registry's count;
* ``inspect``, ``fold`` and ``viz`` through the CLI never raise on the file (``fold --no-verify``: the
  same fold was verified above).

The target is exporter-independence; forms that do not reach it yet fail with normpass's reason.
"""

from __future__ import annotations

import collections
import re

import pytest
from corpus_checks import cli_exit_code

from normpass import inspect_onnx
from normpass import models as builtin_models
from normpass.models.reference import entry_feeds, rewrite_error

SMALL = builtin_models.names(include_large=False)
CASES = [(name, form) for name in SMALL for form in builtin_models.get(name).forms]


def reason_category(reason: str) -> str:
    """A decline reason without node/tensor names and with every LayerNorm op spelled alike."""
    words = [("<name>" if re.search(r"[/_.:\d]", word) else word) for word in reason.split()]
    return re.sub(r"\b\w*LayerNormalization\b", "LayerNorm", " ".join(words))


def reasons(plan) -> collections.Counter:
    return collections.Counter(reason_category(d.reason) for d in plan.decisions if d.reason and not d.foldable)


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{form}" for name, form in CASES])
def case(request, registry_export):
    name, form = request.param
    return builtin_models.get(name), form, registry_export(name, form)


def test_forms_cover_every_small_entry():
    assert builtin_models.FORMS == ("dynamo", "torchscript", "ort-optimized", "fp16")
    assert {"gpt2", "bert", "vit", "llama", "swin", "opt"} <= set(SMALL)
    assert all(builtin_models.get(name).forms == builtin_models.FORMS for name in SMALL)


def test_reason_category_ignores_names_and_spelling():
    dynamo = "centring node_add is unsafe: LayerNormalization node_layer_norm_1 has an unknown shape"
    optimized = "centring /model/Add_3 is unsafe: SkipLayerNormalization SkipLayerNorm_0 has an unknown shape"
    assert reason_category(dynamo) == reason_category(optimized)
    assert reason_category(dynamo) != reason_category("already an RMSNorm: there is no mean subtraction to remove")


def test_inspect_proves_what_dynamo_proves(case, registry_model):
    entry, form, _ = case
    plan = inspect_onnx(registry_model(entry.name, form))
    summary = [(d.name, d.reason) for d in plan.decisions if not d.foldable]
    assert plan.total == entry.expected_norms, summary
    assert len(plan.folded) == entry.expected_folded, summary
    reference = inspect_onnx(registry_model(entry.name))
    assert reasons(plan) == reasons(reference)


def test_fold_rewrites_what_dynamo_rewrites_and_verifies(case, registry_model, registry_fold):
    entry, form, _ = case
    model = registry_model(entry.name, form)
    result = registry_fold(entry.name, form)
    assert result.comparison is not None and result.comparison.passed, result.comparison
    error, tolerance = rewrite_error(model, result.model, entry_feeds(entry, model))
    assert error <= tolerance, f"{entry.name} {form}: relative error {error:.3g}"
    summary = [(d.name, d.reason) for d in result.plan.decisions if d.reason]
    assert result.folded == entry.expected_rewritten, summary


@pytest.mark.parametrize("command", ["inspect", "fold", "viz"])
def test_cli_never_raises(case, command, tmp_path):
    _entry, _form, path = case
    options = ["--no-verify"] if command == "fold" else []  # test_fold_rewrites_... verifies this fold
    code, output = cli_exit_code(command, path, tmp_path, *options)
    assert code in (0, 2), output[-2000:]
