"""Fuse `Add` + `SimplifiedLayerNormalization` into ORT's `SkipSimplifiedLayerNormalization`.

ONNX Runtime's session optimizer fuses `Add + LayerNormalization` into `SkipLayerNormalization`
but not `Add + SimplifiedLayerNormalization`, so a folded model would lose that fusion. Here
s = a + b; y = RMSNorm(s)·γ becomes one `com.microsoft.SkipSimplifiedLayerNormalization(a, b, γ)`
whose outputs are (y, -, -, s); s is kept only where the residual stream goes on. The fused node
takes the Add's place in the node order, so everything that read s still comes after it.
Only same-shape, run-time operands in float or float16 qualify (ORT registers the op for those
alone: a double model keeps the pair), the dtype read from γ's initializer. When one of them is
itself t + c, with c a constant 1-D bias and t + c read by nothing else (a linear layer's bias
`Add`), that Add goes into the op's bias input too: s = a + t + c = Skip(a, t, γ, c), as ORT's own
BiasSkipLayerNorm fusion does.
"""

from __future__ import annotations

import onnx_ir as ir

from ..graph.values import attr, input_at, is_initializer, name_of, take_over

MS_DOMAIN = "com.microsoft"
SKIP_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)  # ORT's kernels for SkipSimplifiedLayerNormalization


def ort_fuses_into_skip_layer_norm(x: ir.Value, shapes: dict[str, tuple | None], graph_outputs: set[str]) -> bool:
    """Whether ORT's session optimizer will fuse the `Add` writing a LayerNorm's input `x` with it.

    Its SkipLayerNormFusion takes `Add(a, b) → LayerNormalization` when a and b are same-shape
    run-time tensors and nothing else reads the sum (as at the last norm of a pre-LN stack).
    """
    add = x.producer()
    if add is None or add.op_type != "Add" or len(add.inputs) != 2 or len(x.uses()) != 1 or x.name in graph_outputs:
        return False
    first, second = add.inputs
    if first is None or second is None:
        return False
    shape = shapes.get(name_of(first))
    return (
        not is_initializer(first)
        and not is_initializer(second)
        and shape is not None
        and shapes.get(name_of(second)) == shape
        and len(shape) in (2, 3)
    )


def skip_fused_adds(x: ir.Value, shapes: dict[str, tuple | None], graph_outputs: set[str]) -> int:
    """How many `Add`s ORT runs inside the SkipLayerNormalization of the LayerNorm reading `x`.

    The residual `Add(a, b)` when `ort_fuses_into_skip_layer_norm`, and a linear layer's bias
    `Add(t, c)` writing a or b (read by nothing else), which its fusion takes as the bias input.
    Removing the norm leaves these Adds to run on their own; 0 when ORT fuses nothing there.
    """
    if not ort_fuses_into_skip_layer_norm(x, shapes, graph_outputs):
        return 0
    add = x.producer()
    assert add is not None  # a residual Add (checked above)
    shape = shapes.get(name_of(add.inputs[0]))
    for operand in add.inputs:
        if operand is None or shape is None or operand.name in graph_outputs or len(operand.uses()) != 1:
            continue
        producer = operand.producer()
        if producer is not None and _bias_split(producer, shape, shapes) is not None:
            return 2
    return 1


def _is_constant(value: ir.Value) -> bool:
    """An initializer (overridable ones too) or a `Constant` node's output."""
    producer = value.producer()
    return value.is_initializer() or (producer is not None and producer.op_type == "Constant")


def _vector_dims(value: ir.Value) -> tuple | None:
    """The dims of a 1-D initializer, else None."""
    if not value.is_initializer() or value.const_value is None or len(value.const_value.shape) != 1:
        return None
    return tuple(value.const_value.shape.numpy())


def fuse_skip_rms(model: ir.Model, shapes: dict[str, tuple | None]) -> int:
    """Rewrite `model` in place; returns the number of fused pairs."""
    graph = model.graph
    graph_outputs = {o.name for o in graph.outputs}
    fused: set[int] = set()  # ids of the Adds fused (each fused once)
    count = 0
    for norm in list(graph):
        x = (
            norm.inputs[0]
            if norm.op_type == "SimplifiedLayerNormalization" and norm.domain in ("", "ai.onnx")
            else None
        )
        add = x.producer() if x is not None else None
        if add is None or add.op_type != "Add" or id(add) in fused or len(add.inputs) != 2 or add.graph is not graph:
            continue
        gamma = input_at(norm, 1)
        if gamma is None or not gamma.is_initializer() or gamma.dtype not in SKIP_DTYPES:
            continue
        first, second = add.inputs
        if first is None or second is None:
            continue
        shape = shapes.get(name_of(first))
        if (
            _is_constant(first)
            or _is_constant(second)
            or shape is None
            or shapes.get(name_of(second)) != shape
            or len(shape) not in (2, 3)
        ):
            continue
        if attr(norm, "axis", -1) not in (-1, len(shape) - 1):
            continue
        total = add.outputs[0]
        keep_sum = len(total.uses()) > 1 or total.name in graph_outputs
        inputs, note = [first, second, gamma], f"normpass: fused with residual Add {add.name}"
        removed = [norm, add]
        for index in (1, 0):
            bias_add = inputs[index].producer()
            if bias_add is None or id(bias_add) in fused:
                continue
            split = _bias_split(bias_add, shape, shapes)
            if split is not None and len(inputs[index].uses()) == 1 and inputs[index].name not in graph_outputs:
                inputs[index] = split[0]
                inputs.append(split[1])
                removed.append(bias_add)
                note += f" and bias Add {bias_add.name}"
                break
        y = norm.outputs[0]
        taken_over = [(y, _like(y))] + ([(total, _like(total))] if keep_sum else [])
        outputs = [new for _, new in taken_over]  # (y, -, -, sum) where the sum is kept
        skip = ir.node(
            "SkipSimplifiedLayerNormalization",
            inputs,
            {"epsilon": attr(norm, "epsilon", 1e-5)},
            outputs=outputs[:1] + [ir.Value(name=""), ir.Value(name="")] + outputs[1:] if keep_sum else outputs,
            domain=MS_DOMAIN,
            name=norm.name,
            doc_string=(norm.doc_string + "\n" if norm.doc_string else "") + note,
        )
        graph.insert_before(add, skip)  # the Add's place: everything that read the sum comes after it
        for old, new in taken_over:  # the fused node's outputs replace the norm's and the sum
            take_over(old, new)
        graph.remove(removed, safe=True)
        fused.add(id(add))
        count += 1
    if count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return count


def _like(value: ir.Value) -> ir.Value:
    """A new value of `value`'s type (its name and shape come with `take_over`)."""
    return ir.Value(type=value.type)


def _bias_split(node: ir.Node, shape: tuple, shapes: dict) -> tuple[ir.Value, ir.Value] | None:
    """(t, c) if `node` is t + c with c a 1-D initializer over the last axis and t shaped like the sum."""
    if node.op_type != "Add" or len(node.inputs) != 2:
        return None
    for t, c in (node.inputs, node.inputs[::-1]):
        if t is None or c is None:
            continue
        if _vector_dims(c) == (shape[-1],) and _vector_dims(t) is None and shapes.get(name_of(t)) == shape:
            return t, c
    return None
