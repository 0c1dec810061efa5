"""Half-precision (fp16) copies of ONNX models, to check and time folded models in fp16, and fp32
copies of bfloat16 models, to check them where ONNX Runtime has no bfloat16 kernels.

`to_fp16` converts every float tensor with onnxconverter-common's float16 converter (the one
ONNX Runtime's transformers tools use). With `keep_io_types=False` (the default here) the outputs
are fp16 too, so `verify` judges them with the fp16 tolerance (`verify.REL_TOLERANCE`, 1e-2);
fp32 outputs of an fp16 computation would be held to the fp32 tolerance (1e-4), which fp16
rounding alone exceeds. Every norm op that has a `stash_type` (ONNX LayerNormalization and
RMSNormalization, ORT's SimplifiedLayerNormalization) gets `stash_type=1`: its mean and variance
are computed in fp32 and only its inputs, weights and outputs are stored in fp16. ORT's
`Skip*LayerNormalization` ops have no such attribute.

The converter retypes every float tensor to float16 but leaves the `to` of the graph's own
`Cast(to=float)` nodes (e.g. torch's `_to_copy`), so their outputs would be float feeding fp16
ops, which ONNX Runtime rejects. Each such Cast gets the type the converter gave its output:
float16, or float where the converter kept the tensor float deliberately (the inputs it casts
back to float for ops on its block list, whose kernels are fp32-only).

Folding commutes with the conversion up to fp16 rounding: an fp16 model folds (the weight algebra
runs in float64 and rounds once to fp16), and a folded model converts.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ...errors import InputError

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
    _retype_float_casts(converted.graph)
    for node in converted.graph.node:
        if node.op_type in STASH_TYPE_OPS:
            attributes = [a for a in node.attribute if a.name != "stash_type"]
            del node.attribute[:]
            node.attribute.extend([*attributes, onnx.helper.make_attribute("stash_type", FLOAT)])
    return converted


def _retype_float_casts(graph: onnx.GraphProto) -> None:
    """Give every `Cast(to=float)` (subgraphs included) the element type its output has after conversion."""
    declared = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.output)}
    for node in graph.node:
        for attribute in node.attribute:
            for subgraph in [*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs]:
                _retype_float_casts(subgraph)
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == onnx.TensorProto.FLOAT:
                attribute.i = declared.get(node.output[0]) or attribute.i


def uses_bf16(model: onnx.ModelProto) -> bool:
    """Whether `model` computes in bfloat16 anywhere (its initializers' data is not read)."""
    return _bf16_to_fp32(model.graph, apply=False)


def bf16_as_fp32(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """An fp32 copy of a model that computes in bfloat16 (None if nothing is bfloat16).

    Every bfloat16 tensor, type, `Cast(to=)` and `dtype=` becomes float32: the same computation
    without bfloat16 rounding, for runtimes without bfloat16 kernels (ONNX Runtime's CPU MatMul).
    """
    if not uses_bf16(model):
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    _bf16_to_fp32(copy.graph, apply=True)
    return copy


def _bf16_to_fp32(graph: onnx.GraphProto, apply: bool) -> bool:
    """Whether `graph` (subgraphs included) uses bfloat16; with `apply`, convert it in place."""
    bf16, fp32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    found = False
    tensor_types = [v.type.tensor_type for v in (*graph.input, *graph.output, *graph.value_info)]
    tensors = [*graph.initializer]
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name in ("to", "dtype") and attribute.type == onnx.AttributeProto.INT and attribute.i == bf16:
                found = True
                if apply:
                    attribute.i = fp32
            tensors += [attribute.t] if attribute.HasField("t") else []
            for subgraph in [*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs]:
                found |= _bf16_to_fp32(subgraph, apply)
    for tensor_type in tensor_types:
        if tensor_type.elem_type == bf16:
            found = True
            if apply:
                tensor_type.elem_type = fp32
    for tensor in tensors:
        if tensor.data_type == bf16:
            found = True
            if apply:
                tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))
    return found
