"""How many positions a model takes along the sequence axis, where a constant of the graph bounds them.

A model with learned positions cannot run on a sequence longer than its table: GPT-2 gathers row `i`
of its position embedding for token `i`, BERT slices its `position_ids` and `token_type_ids` buffers
to the sequence length and fails once they come out short (ONNX Runtime: "invalid expand shape"). Both
forms are read from the graph, without running it:

* **Position ids** are tensors computed from the inputs' shapes through a `Range`, never from an
  input's values. Every tensor gets one kind, in one topological pass: `data` (a graph input, or
  anything computed from one), `shape` (from `Shape`/`Size` and constants), `range` (from a `Range`
  over shapes) or `const`.
* A **table** is a constant gathered on axis 0 with `range` indices (its rows bound the length), or a
  constant sliced with `shape` or `range` ends (its length along each sliced axis bounds it).

`position_limit` is the smallest bound found, with the constant's name; it applies to the sequence axis
(axis 1) of the integer inputs, which is where exporters take the length that makes the position ids.
Position ids computed from an input's values (OPT's, from the attention mask) are `data`: no bound is
read there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .constants import constant_values, is_constant
from .values import attr, input_at, is_initializer, name_of

DATA, SHAPE, RANGE, CONST = "data", "shape", "range", "const"


@dataclass(frozen=True)
class PositionLimit:
    """The most positions a model takes (`rows`), and the constant that bounds them (`table`)."""

    rows: int
    table: str


def _kinds(graph: ir.Graph) -> dict[ir.Value | None, str]:
    """Each node output's kind (see the module docstring), in the graph's topological order."""
    kinds: dict[ir.Value | None, str] = {}

    def kind(value: ir.Value | None) -> str:
        if value is None:
            return CONST
        if value in kinds:
            return kinds[value]
        return CONST if is_initializer(value) else DATA  # a graph input, or a value from an outer graph

    for node in graph:
        found = {kind(value) for value in node.inputs}
        if node.op_type in ("Shape", "Size"):
            made = SHAPE
        elif DATA in found:
            made = DATA
        elif RANGE in found or (node.op_type == "Range" and SHAPE in found):
            made = RANGE
        else:
            made = SHAPE if SHAPE in found else CONST
        for output in node.outputs:
            kinds[output] = made
    return kinds


def _dims(value: ir.Value) -> tuple[int, ...] | None:
    """The static shape of a constant: declared, else computed from its (small) constant subgraph."""
    if value.shape is not None and value.shape.is_static():
        return tuple(int(d) for d in value.shape.numpy())
    values = constant_values(value)
    return None if values is None else values.shape


def _bounds(node: ir.Node, kinds: dict[ir.Value | None, str]) -> list[int]:
    """The lengths `node` bounds: a table gathered by position ids, a constant sliced to a shape's length."""
    data = input_at(node, 0)
    if data is None or not is_constant(data) or (dims := _dims(data)) is None or not dims:
        return []
    if node.op_type == "Gather" and kinds.get(input_at(node, 1)) == RANGE and attr(node, "axis", 0) in (0, -len(dims)):
        return [dims[0]]
    if node.op_type == "Slice" and kinds.get(input_at(node, 2)) in (SHAPE, RANGE):
        given = input_at(node, 3)
        axes = constant_values(given) if given is not None else np.arange(len(dims))
        if axes is None:
            return []
        return [dims[int(axis)] for axis in np.ravel(axes) if -len(dims) <= int(axis) < len(dims)]
    return []


def position_limit(model: ir.Model) -> PositionLimit | None:
    """The smallest bound on the sequence length the graph holds (see the module docstring), or None."""
    kinds = _kinds(model.graph)
    found = [
        PositionLimit(rows, name_of(node.inputs[0]))
        for node in model.graph
        if node.op_type in ("Gather", "Slice") and node.domain in ("", "ai.onnx")
        for rows in _bounds(node, kinds)
    ]
    return min(found, key=lambda limit: limit.rows) if found else None
