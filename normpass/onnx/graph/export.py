"""Finish a rewritten `ir.Model` for writing: normpass's notes and metadata, the opsets its ops need.

Nodes keep their own doc_string and metadata_props (the exporter's provenance); normpass's note
on a node is appended to its doc_string. Unchanged initializers stay the tensors they were
loaded as (lazy external data included): writing the model (`io.save_ir`) copies each weight
once, from its source to the output file, and `ir.to_proto` only where a caller needs a
`ModelProto` in memory.
"""

from __future__ import annotations

import onnx_ir as ir

STANDARD_DOMAINS = ("", "ai.onnx")


def export_model(model: ir.Model, docs: dict[str, str], metadata: dict[str, str]) -> ir.Model:
    """Add `docs` (node name → note) to the nodes' doc_strings and `metadata` to the model's props, in place."""
    for node in model.graph:
        if node.name in docs:
            node.doc_string = (node.doc_string + "\n" if node.doc_string else "") + docs[node.name]
    model.metadata_props.update(metadata)
    import_domains(model)
    return model


def import_domains(model: ir.Model) -> None:
    """Import version 1 of every non-standard domain a main-graph node uses and the model does not import."""
    for node in model.graph:
        if node.domain not in STANDARD_DOMAINS:
            model.opset_imports.setdefault(node.domain, 1)
