"""Reading an onnx-ir graph: producers, readers, attributes, constant initializers, bodies.

The analysis and the rewrite see the model as an `ir.Model`: a value (`ir.Value`) has one
producer (`value.producer()`, None for graph inputs and initializers) and is read through
`value.uses()`, one use per input slot, bodies of control-flow nodes included (a body reads an
outer-scope value as that very value). An absent optional input is `None` in `node.inputs`.
An initializer that is also a graph input is a run-time input whose initializer is only a
default: it is never a constant.
"""

from __future__ import annotations

import onnx_ir as ir


def attr(node: ir.Node, name: str, default=None):
    """The Python value of attribute `name` (lists for repeated ones), or `default` where it is absent."""
    attribute = node.attributes.get(name)
    if attribute is None or not isinstance(attribute, ir.Attr):
        return default
    value = attribute.value
    return list(value) if isinstance(value, tuple) else value


def name_of(item: ir.Value | ir.Node | None) -> str:
    """The name of a value or node; "" for an absent optional input and for an unnamed value or node
    (onnx-ir allows them; every value of a loaded model is named, and `frontend.load_graph` names
    every node)."""
    return "" if item is None else item.name or ""


def readers(value: ir.Value) -> list[ir.Node]:
    """The nodes reading `value`, once per input slot it fills (bodies included)."""
    return [use.node for use in value.uses()]


def input_at(node: ir.Node, index: int) -> ir.Value | None:
    """Input `index` of `node`, or None where it is absent (omitted, or past the end)."""
    return node.inputs[index] if index < len(node.inputs) else None


def is_initializer(value: ir.Value | None) -> bool:
    """A constant initializer: stored, and not overridable as a graph input."""
    return value is not None and value.is_initializer() and not value.is_graph_input() and value.const_value is not None


def bodies(node: ir.Node) -> list[tuple[str, ir.Graph]]:
    """The subgraphs of a control-flow node, with the attribute that holds each."""
    return [
        (name, a.value)
        for name, a in node.attributes.items()
        if isinstance(a, ir.Attr) and a.type == ir.AttributeType.GRAPH
    ]


def take_over(old: ir.Value, new: ir.Value) -> None:
    """`new` replaces `old` for every reader and as a graph output, under `old`'s name (and shape, where `new`
    has none)."""
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if new.shape is None:
        new.shape = old.shape
    old.name, new.name = None, old.name


def input_dims(graph: ir.Graph) -> set[str]:
    """The names of the graph inputs' symbolic dims."""
    dims = [d for value in graph.inputs if value.shape is not None for d in value.shape]
    return {d.value for d in dims if isinstance(d, ir.SymbolicDim) and d.value}


def shape_axes(node: ir.Node, rank: int) -> list[int]:
    """The axes a `Shape` node with its `start` and `end` reports of a tensor of rank `rank`."""
    return list(range(rank))[attr(node, "start", 0) : attr(node, "end", rank)]
