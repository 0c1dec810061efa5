"""onnx-graphsurgeon at the edge: a `gs.Graph` in, a `gs.Graph` out; the fold itself runs on onnx-ir.

`fold_onnx` and `inspect_onnx` accept a `gs.Graph`, exported here to a `ModelProto`
(`gs.export_onnx`); `FoldResult.graphsurgeon()` imports the folded `ModelProto` back
(`gs.import_onnx`). onnx-graphsurgeon is the optional `graphsurgeon` extra: it is imported only
when a `gs.Graph` is given or asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import onnx

from ..errors import InputError, missing_extra

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs


def is_graphsurgeon_graph(model: object) -> bool:
    """Whether `model` is an onnx-graphsurgeon `Graph` (checked without importing onnx-graphsurgeon)."""
    return type(model).__module__.startswith("onnx_graphsurgeon") and type(model).__name__ == "Graph"


def from_graphsurgeon(model: Any) -> Any:
    """`model` as a `ModelProto` if it is a `gs.Graph`, else `model` itself.

    The exported model keeps the IR version the graph was imported with (`gs.import_onnx` records
    it), or ONNX's default for a graph built from scratch.
    """
    if not is_graphsurgeon_graph(model):
        return model
    gs = _graphsurgeon()
    try:
        return gs.export_onnx(model)
    except Exception as e:  # gs raises on dangling tensors, missing dtypes ...
        raise InputError(
            f"graph {model.name!r}: onnx-graphsurgeon cannot export it to ONNX ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no message'}); clean it up (graph.cleanup().toposort()) first"
        ) from e


def to_graphsurgeon(model: onnx.ModelProto) -> gs.Graph:
    """`model` as an onnx-graphsurgeon `Graph`."""
    return _graphsurgeon().import_onnx(model)


def _graphsurgeon():
    try:
        import onnx_graphsurgeon as gs
    except ModuleNotFoundError as e:
        if e.name != "onnx_graphsurgeon":
            raise
        raise missing_extra("a graphsurgeon Graph", "onnx-graphsurgeon", "graphsurgeon") from None
    return gs
