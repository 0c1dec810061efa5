"""Write a rewritten graphsurgeon graph back to an ONNX ModelProto, copying each weight once.

graphsurgeon's own `export_onnx` copies every initializer several times (NumPy → bytes →
TensorProto → GraphProto → ModelProto), which dominated the pass's cost on a 124M model.
Here an unchanged initializer is the source `TensorProto`, appended once; a rewritten one is
serialised once from its array. Nodes keep the source's doc_string and metadata_props (the
exporter's provenance), with normpass's notes appended. An initializer that the source also lists
as a graph input (an overridable default) is written back unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues


def _append_initializer(graph: onnx.GraphProto, tensor: gs.Constant) -> None:
    if isinstance(tensor._values, LazyValues):
        graph.initializer.append(tensor._values.tensor)
        graph.initializer[-1].name = tensor.name
        return
    values = np.ascontiguousarray(tensor.values)
    proto = graph.initializer.add()
    proto.name = tensor.name
    proto.data_type = onnx.helper.np_dtype_to_tensor_dtype(values.dtype)
    proto.dims.extend(values.shape)
    proto.raw_data = values.tobytes()


def export_model(graph: gs.Graph, source: onnx.ModelProto, docs: dict[str, str], metadata: dict[str, str]) -> onnx.ModelProto:
    """The model for `graph`, with `source`'s model-level fields and `metadata` added to its props."""
    originals = {node.name: node for node in source.graph.node if node.name}
    model = onnx.ModelProto()
    model.ir_version = source.ir_version
    model.opset_import.extend(source.opset_import)
    model.producer_name, model.producer_version = source.producer_name, source.producer_version
    model.domain, model.model_version, model.doc_string = source.domain, source.model_version, source.doc_string
    model.functions.extend(source.functions)
    props = {p.key: p.value for p in source.metadata_props} | metadata
    onnx.helper.set_model_props(model, props)
    out = model.graph
    out.name, out.doc_string = source.graph.name, source.graph.doc_string
    for node in graph.nodes:
        proto = OnnxExporter.export_node(node)
        original = originals.get(node.name)
        if original is not None and original.op_type == node.op:
            proto.doc_string = original.doc_string
            proto.metadata_props.extend(original.metadata_props)
        if node.name in docs:
            proto.doc_string = (proto.doc_string + "\n" if proto.doc_string else "") + docs[node.name]
        out.node.append(proto)
    out.input.extend(OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.inputs)
    inputs = {t.name for t in graph.inputs}
    out.initializer.extend(init for init in source.graph.initializer if init.name in inputs)  # overridable defaults
    out.output.extend(OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.outputs)
    boundary = {t.name for t in graph.inputs + graph.outputs}
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant):
            _append_initializer(out, tensor)
        elif tensor.name not in boundary and (tensor.dtype is not None or tensor.shape is not None):
            out.value_info.append(OnnxExporter.export_value_info_proto(tensor, do_type_check=False))
    needed = {node.domain for node in graph.nodes if node.domain not in (None, "", "ai.onnx")}
    present = {o.domain for o in model.opset_import}
    model.opset_import.extend(onnx.helper.make_opsetid(domain, 1) for domain in sorted(needed - present))
    return model
