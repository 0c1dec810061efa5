"""Half-precision (fp16) copies of ONNX models, to check and time folded models in fp16.

`to_fp16` converts every float tensor with onnxconverter-common's float16 converter (the one
ONNX Runtime's transformers tools use). With `keep_io_types=False` (the default here) the outputs
are fp16 too, so `verify` judges them with the fp16 tolerance (`verify.REL_TOLERANCE`, 1e-2);
fp32 outputs of an fp16 computation would be held to the fp32 tolerance (1e-4), which fp16
rounding alone exceeds. Every norm op that has a `stash_type` (ONNX LayerNormalization and
RMSNormalization, ORT's SimplifiedLayerNormalization) gets `stash_type=1`: its mean and variance
are computed in fp32 and only its inputs, weights and outputs are stored in fp16. ORT's
`Skip*LayerNormalization` ops have no such attribute.

Folding commutes with the conversion up to fp16 rounding: an fp16 model folds (the weight algebra
runs in float64 and rounds once to fp16), and a folded model converts.
"""

from __future__ import annotations

import onnx

from .errors import InputError

STASH_TYPE_OPS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
FLOAT = 1  # stash_type value: compute statistics in float32


def to_fp16(model: onnx.ModelProto, keep_io_types: bool = False) -> onnx.ModelProto:
    """An fp16 copy of `model` (the input is not modified); norms keep fp32 statistics."""
    try:
        from onnxconverter_common import float16
    except ImportError as e:
        raise InputError(f"fp16 conversion needs onnxconverter-common: pip install 'normpass[bench]' ({e})") from e
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    converted = float16.convert_float_to_float16(copy, keep_io_types=keep_io_types)
    for node in converted.graph.node:
        if node.op_type in STASH_TYPE_OPS:
            attributes = [a for a in node.attribute if a.name != "stash_type"]
            del node.attribute[:]
            node.attribute.extend([*attributes, onnx.helper.make_attribute("stash_type", FLOAT)])
    return converted
