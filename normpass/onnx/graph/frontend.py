"""ONNX front end: load a model, infer shapes, and build its zero-mean graph.

The model is held as an `ir.Model` (onnx-ir): initializers stay the tensors they were loaded as
(memory-mapped `ir.ExternalTensor`s for a model with external data, the caller's `TensorProto`s
for an in-memory one), so a large model is never copied into NumPy. Shapes come from ONNX shape
inference run on a light proto of the model whose large initializers are declared as inputs.
The op → rule table below is the whole of what this front end knows about ONNX op semantics.

Model-local functions (`FunctionProto`s, as newer exporters emit for modules) are inlined first,
in place (onnx-ir's `InlinePass`), and the folded model keeps them inlined: a function's body is
shared by all its calls, so a norm inside it could only be rewritten for every call at once, and
the proof and the safety check must see through calls (the linear layers feeding a norm and the
readers of the stream are often in other functions); ONNX Runtime inlines them when it loads a
model anyway. An inlined node is named after its call (`call/node`). A function that cannot be
inlined (its opset imports differ from the model's, a call passes a graph attribute, functions
that call each other in a cycle) stays a call, opaque to the analysis; the norms in its body
are listed, declined with that reason.

Control flow (`If`, `Loop`, `Scan`): a body's nodes read outer-scope tensors as the very same
`ir.Value`s, so such a value lists the nested reader among its uses. For the analysis, a tensor
read anywhere inside a body (at any depth) is read by the top-level control-flow node: that
node's zero-mean-graph inputs include every outer-scope tensor its bodies read, and its rule is
`Opaque` (a shift reaching a body changes the model). Norms inside bodies are listed, with the
reason they are not rewritten.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import InlinePass

from ...core.graph import NodeKind, NormInfo, NormType, ZeroMeanGraph, ZNode
from ...core.rules import (
    Broadcast,
    Centered,
    Choose,
    Concat,
    Linear,
    Mix,
    NormRule,
    Opaque,
    Permute,
    Reduce,
    Regroup,
    Scale,
    Select,
    ShapeOnly,
    ShiftInvariant,
    Sum,
    Take,
)
from ...errors import InputError, UnsupportedModelError
from ...io import LIGHT_INITIALIZER_LIMIT, checked_model, load_ir, skeleton
from .constants import constant_values, is_constant, unit_slice
from .patterns import MatchContext, NormMatch, match_decomposed, match_single_op, norm_info
from .values import attr, bodies, input_at, is_initializer, name_of, shape_axes

SHAPE_READERS = ("Shape", "Size", "EyeLike", "RandomNormalLike", "RandomUniformLike")  # read no values
FLOAT_CASTS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}

ORT_SYMBOLIC_MODULE = "onnxruntime.tools.symbolic_shape_infer"
SYMBOLIC_MODULE = "normpass._ort_symbolic_shape_infer"  # the same file, run without `onnxruntime.tools`


@dataclass
class OnnxGraph:
    """A model being analysed or rewritten: the `ir.Model` plus inferred shapes and dtypes (by tensor name).

    `structure` is the model as loaded (functions inlined), without its large weights
    (`io.skeleton`), for signatures and verification inputs; `source` is the file it was loaded from
    (None for an in-memory model); `holders` maps id(node inside a body) to its top-level
    control-flow node; `kept_functions` the model-local functions left as calls, with why.
    """

    model: ir.Model
    structure: onnx.ModelProto
    shapes: dict[str, tuple | None] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    name: str = "model"
    holders: dict[int, ir.Node] = field(default_factory=dict)
    source: Path | None = None
    kept_functions: dict[ir.OperatorIdentifier, str] = field(default_factory=dict)

    @property
    def graph(self) -> ir.Graph:
        return self.model.graph

    def shape_of(self, value: ir.Value) -> tuple | None:
        """`value`'s shape as shape inference found it, else as the value declares it (a tensor or constant a
        rewrite made since); None: unknown."""
        shape = self.shapes.get(str(value.name))
        if shape is None and value.shape is not None:
            return tuple(value.shape)
        return shape

    def readers(self, tensor: ir.Value) -> list[ir.Node]:
        """Top-level nodes that read `tensor`, each once; a reader inside a body counts as its control-flow node."""
        found: dict[int, ir.Node] = {}
        for use in tensor.uses():
            holder = self.holders.get(id(use.node), use.node)
            found.setdefault(id(holder), holder)
        return list(found.values())

    @property
    def opset(self) -> int:
        imports = self.model.opset_imports
        return imports.get("", imports.get("ai.onnx", 1))


def infer_shapes(model: onnx.ModelProto) -> tuple[dict[str, tuple | None], dict[str, np.dtype], list[str]]:
    """Shapes (int, symbolic str or None dims) and dtypes of every tensor inference can reach, and the names
    of the `value_info` declarations dropped because they contradict what their node computes.

    `model` may hold initializers without their data (`io.skeleton`): only their types are read.
    """
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph = light.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    declared = {i.name for i in model.graph.input}
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) <= LIGHT_INITIALIZER_LIMIT and init.data_location != onnx.TensorProto.EXTERNAL:
            graph.initializer.append(init)
        elif init.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    shapes: dict[str, tuple | None] = {}
    dtypes: dict[str, np.dtype] = {}
    strict, dropped = _drop_contradicted(light)
    _read_types(_infer(light, strict), shapes, dtypes)
    if any(out and out not in shapes for node in light.graph.node for out in node.output):
        _read_types(_infer_at_latest_opset(light), shapes, dtypes, only_missing=True)
    if not _has_contrib_ops(light) and _unresolved_reshapes(light, shapes):
        _take_better_shapes(_symbolic_inference(light), shapes, _input_dims(light))
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
        dtypes[init.name] = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    return shapes, dtypes, dropped


def _read_types(inferred: onnx.ModelProto | None, shapes: dict, dtypes: dict, only_missing: bool = False) -> None:
    """Shapes (int, symbolic str or None dims) and dtypes of `inferred`'s typed tensors into `shapes`, `dtypes`
    (with `only_missing`, of those not there yet)."""
    if inferred is None:
        return
    for info in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        if only_missing and info.name in shapes:
            continue
        tensor_type = info.type.tensor_type
        if tensor_type.elem_type:
            dtypes[info.name] = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if tensor_type.HasField("shape"):
            shapes[info.name] = tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
                for d in tensor_type.shape.dim
            )


REGROUPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _input_dims(model: onnx.ModelProto) -> set[str]:
    """The symbolic dimensions the graph inputs declare (`batch`, `seq`): one value in every shape that names them."""
    return {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}


def _unresolved_reshapes(model: onnx.ModelProto, shapes: dict) -> bool:
    """Whether a reshape-like node has an input or output dimension ONNX's inference could not express in the
    graph inputs' dimensions (unknown, or a symbol it made up), which can leave its axes unproven."""
    named = _input_dims(model)
    for node in model.graph.node:
        if node.op_type in REGROUPS:
            for tensor in (node.input[0], *node.output):
                shape = shapes.get(tensor)
                if shape is None or any(not isinstance(d, int) and d not in named for d in shape):
                    return True
    return False


@functools.cache
def _symbolic_shape_inference() -> Any:
    """ONNX Runtime's `SymbolicShapeInference`, its module run from its file: importing it by name first runs
    `onnxruntime/tools/__init__.py`, which imports torch where torch is installed (seconds, for an export
    helper normpass never uses). By name where it is imported already, or ONNX Runtime keeps it elsewhere."""
    loaded = sys.modules.get(ORT_SYMBOLIC_MODULE)
    if loaded is not None:
        return loaded.SymbolicShapeInference
    found = importlib.util.find_spec("onnxruntime")  # a top-level name: found, not imported
    path = Path(found.origin).parent / "tools" / "symbolic_shape_infer.py" if found and found.origin else None
    spec = importlib.util.spec_from_file_location(SYMBOLIC_MODULE, path) if path and path.is_file() else None
    if spec is None or spec.loader is None:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        return SymbolicShapeInference
    module = importlib.util.module_from_spec(spec)
    sys.modules[SYMBOLIC_MODULE] = module
    spec.loader.exec_module(module)
    return module.SymbolicShapeInference


def _symbolic_inference(light: onnx.ModelProto) -> onnx.ModelProto | None:
    """ONNX Runtime's symbolic shape inference, or None where it fails (best effort).

    It runs on a copy whose `Constant` nodes hold their value as a tensor: it reads a constant's `value`
    attribute only, and fails on the whole model at the first `value_ints` or `value_float` (which the
    dynamo exporter writes unless its optimizer folds them away), leaving every shape after an ONNX Runtime
    op unknown.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(light)
    _constants_as_tensors(copy.graph)
    try:
        return _symbolic_shape_inference().infer_shapes(copy, auto_merge=True, guess_output_rank=True)
    except Exception:
        return None


CONSTANT_TYPES = {
    "value_float": onnx.TensorProto.FLOAT,
    "value_floats": onnx.TensorProto.FLOAT,
    "value_int": onnx.TensorProto.INT64,
    "value_ints": onnx.TensorProto.INT64,
    "value_string": onnx.TensorProto.STRING,
    "value_strings": onnx.TensorProto.STRING,
}  # a `Constant`'s attribute → the tensor it means: a scalar, or a vector for the plural


def _constants_as_tensors(graph: onnx.GraphProto) -> None:
    """Rewrite, in place and in every body, each `Constant` given by `value_<type>(s)` as the same `value` tensor."""
    for node in graph.node:
        for attribute in node.attribute:
            for body in [attribute.g, *attribute.graphs]:
                _constants_as_tensors(body)
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        attribute = node.attribute[0]
        if attribute.name not in CONSTANT_TYPES:
            continue
        value = onnx.helper.get_attribute_value(attribute)
        values = value if attribute.name.endswith("s") else [value]
        dims = [len(values)] if attribute.name.endswith("s") else []
        tensor = onnx.helper.make_tensor("value", CONSTANT_TYPES[attribute.name], dims, values)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", tensor))


def _take_better_shapes(inferred: onnx.ModelProto | None, shapes: dict, named: set[str]) -> None:
    """Replace each shape in `shapes` by `inferred`'s where that knows more static dimensions and agrees with every
    static one already known.

    ONNX's inference cannot evaluate shape arithmetic such as `Div` (a TorchScript export computes a reshape's
    target from the image size at run time); ONNX Runtime's symbolic inference can. A symbol it makes up is
    renamed (`…@symbolic`) so that it never equals one of ONNX's: only the graph inputs' dimensions mean the
    same in both.
    """
    if inferred is None:
        return
    found: dict[str, tuple | None] = {}
    _read_types(inferred, found, {})
    for tensor, shape in found.items():
        if shape is None:
            continue
        shape = tuple(d if isinstance(d, int) or d is None or d in named else f"{d}@symbolic" for d in shape)
        known = shapes.get(tensor)
        if known is None or (
            len(known) == len(shape)
            and all(not isinstance(k, int) or k == d for k, d in zip(known, shape, strict=True))
            and sum(isinstance(d, int) for d in shape) > sum(isinstance(k, int) for k in known)
        ):
            shapes[tensor] = shape


def _infer_at_latest_opset(light: onnx.ModelProto) -> onnx.ModelProto | None:
    """Shape inference on a copy converted to the newest opset ONNX knows, or None where it cannot be converted.

    Older op versions infer less: at opset 11 a `Reshape` to a computed shape of known length has an unknown
    rank, which opset 23's inference knows. The conversion keeps every existing tensor's name and value, so
    what it infers holds for the model as it is; only the shapes left unknown are taken from it (the target
    of the fold must not decide what is proven).
    """
    from onnx import version_converter

    latest = onnx.defs.onnx_opset_version()
    if any((o.domain or "") == "" and o.version >= latest for o in light.opset_import) or _has_contrib_ops(light):
        return None
    try:
        converted = version_converter.convert_version(light, latest)
        return onnx.shape_inference.infer_shapes(converted, data_prop=True)
    except Exception:  # best effort: the shapes stay unknown
        return None


def _has_contrib_ops(model: onnx.ModelProto) -> bool:
    """Whether some node is no ONNX op at the model's opset (an ONNX Runtime contrib op, say)."""
    versions = {o.domain or "": o.version for o in model.opset_import}
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        try:
            onnx.defs.get_schema(node.op_type, versions.get(domain, 1), domain)
        except onnx.defs.SchemaError:
            return True
    return False


def _infer(light: onnx.ModelProto, strict: onnx.ModelProto | None) -> onnx.ModelProto:
    """ONNX Runtime's symbolic shape inference where the graph has contrib ops (which ONNX's does not know),
    else `strict` (ONNX's strict inference, where it succeeded) or ONNX's; best effort: unknown shapes make
    the analysis decline."""
    if _has_contrib_ops(light):
        symbolic = _symbolic_inference(light)
        if symbolic is not None:
            return symbolic
    if strict is not None:
        return strict
    try:
        return onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:
        return light


def _drop_contradicted(light: onnx.ModelProto) -> tuple[onnx.ModelProto | None, list[str]]:
    """Remove from `light` every `value_info` declaration that contradicts what its node computes; return
    ONNX's strict inference of what is left (None where it fails) and the names removed.

    A `value_info` is a hint (ONNX Runtime ignores it: GenAI's builder declares a rank-0 shape for a
    1-element constant, and the model runs), so a contradicted one is dropped and the shape re-inferred;
    the analysis never reads it. A graph output's declared type or shape is the model's interface: one that
    contradicts its node is refused (`InputError`). ONNX's strict inference names the node, not the
    tensor: the declarations of that node's outputs are dropped, and inference runs again.
    """
    dropped: list[str] = []
    outputs = {o.name for o in light.graph.output}
    producers = {n.name: n for n in light.graph.node if n.name}
    while True:
        try:
            return onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True), dropped
        except Exception as e:  # strict mode fails on every node it cannot infer; only contradictions count
            where = _contradiction(e)
        if where is None:
            return None, dropped
        node_name, where_text = where
        node = producers.get(node_name)
        declared = [v for v in light.graph.value_info if node is not None and v.name in node.output]
        if not declared or any(v.name in outputs for v in declared):
            raise InputError(
                f"the declared type or shape of a graph output contradicts what its node computes: "
                f"{where_text}; correct or remove the declaration"
            )
        for info in declared:
            light.graph.value_info.remove(info)
            dropped.append(info.name)


def _contradiction(error: Exception) -> tuple[str, str] | None:
    """(node name, `node NAME (OP): what differs`) of the first contradiction ONNX's strict inference
    reports in `error`, or None where it reports none."""
    for line in str(error).splitlines():
        if "existing shape differ" in line or "differs from existing" in line:
            found = re.search(r"op_type:([^,]*), node name: ([^)]*)\): \[\w+\] (.*)", line)
            if found:
                return found[2], f"node {found[2]} ({found[1]}): {found[3]}"
            return "", line.strip()
    return None


def load_graph(model: onnx.ModelProto | ir.Model, name: str = "model", source: Path | None = None) -> OnnxGraph:
    """Wrap `model` for analysis and rewriting; unnamed or duplicate node names (in bodies too) get unique ones.

    A `ModelProto` is not modified (its tensors are shared, never written); an `ir.Model` (from
    `io.load_ir`, say) is taken over: the rewrite changes it in place. An initializer that is also
    listed in `graph.input` (IR < 4 models, `keep_initializers_as_inputs` exports) is a run-time
    input whose initializer is only a default: never a constant to centre or migrate into, and
    written back unchanged.
    """
    if isinstance(model, onnx.ModelProto):
        try:
            model = ir.from_proto(model)
        except Exception as e:  # onnx-ir rejects graphs it cannot represent
            raise UnsupportedModelError(
                f"{name}: cannot be analysed: {type(e).__name__}: {str(e).splitlines()[0]}"
            ) from e
    kept = inline_functions(model)
    structure = skeleton(model)
    graph = model.graph
    nodes = list(graph) + [inner for node in graph for inner, _ in nested_nodes(node)]
    taken = {node.name for node in nodes if node.name}  # a new name must not be one that comes later
    seen: set[str] = set()
    for index, node in enumerate(nodes):
        if not node.name or node.name in seen:
            base = f"{node.op_type}_{index}" if not node.name else f"{node.name}_{index}"
            fresh, suffix = base, 0
            while fresh in taken:
                suffix += 1
                fresh = f"{base}_{suffix}"
            node.name = fresh
            taken.add(fresh)
        seen.add(node.name)
    try:
        shapes, dtypes, dropped = infer_shapes(structure)
    except InputError as e:
        raise InputError(f"{name}: {e}") from e
    if dropped:
        _forget_declarations(model, structure, dropped)
        warnings.warn(
            f"{name}: dropped the declared shape (value_info) of {', '.join(dropped)}, which contradicts what "
            "its node computes (ONNX Runtime ignores it); the shape is inferred instead",
            stacklevel=2,
        )
    for node in graph:
        value = attr(node, "value") if node.op_type == "Constant" else None
        if isinstance(value, ir.TensorProtocol):
            shapes.setdefault(name_of(node.outputs[0]), tuple(value.shape.numpy()))
    return OnnxGraph(model, structure, shapes, dtypes, name, body_holders(graph), source, kept)


def _forget_declarations(model: ir.Model, structure: onnx.ModelProto, names: list[str]) -> None:
    """Clear the declared type and shape of the tensors `names` in `model` (the written model does not carry
    them) and in its skeleton `structure`."""
    doomed = set(names)
    for node in model.graph:
        for value in node.outputs:
            if value.name in doomed:
                value.shape = None
    kept = [v for v in structure.graph.value_info if v.name not in doomed]
    del structure.graph.value_info[:]
    structure.graph.value_info.extend(kept)


def open_graph(model: onnx.ModelProto | str | os.PathLike, name: str = "model") -> OnnxGraph:
    """The graph of `model`, as `fold`, `rotate`, `replace`, `inspect` and `viz` load it: a path is loaded
    lazily (`io.load_ir`: external weights stay on disk, mapped when read), a ModelProto checked
    (`io.checked_model`) and wrapped, not copied."""
    if isinstance(model, (str, os.PathLike)):
        return load_graph(load_ir(model), name, Path(model))
    return load_graph(checked_model(model, name), name)


# --- model-local functions ---------------------------------------------------------------------

INLINED_FROM = "normpass.inlined_from"  # metadata of a node while it is inlined: the call's name


def inline_functions(model: ir.Model) -> dict[ir.OperatorIdentifier, str]:
    """Inline every call of a model-local function that can be, in place (see the module docstring).

    Returns the functions left as calls, each with why it could not be inlined.
    """
    if not model.functions:
        return {}
    calls = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_identifier() in model.functions]
    calls += [n for f in model.functions.values() for n in f.all_nodes() if n.op_identifier() in model.functions]
    called = {n.op_identifier() for n in calls}
    kept = {key: why for key in called if (why := _not_inlinable(model, model.functions[key], calls))}
    for call in calls:
        if call.op_identifier() not in kept:
            call.metadata_props[INLINED_FROM] = call.name or call.op_type
    for function in model.functions.values():
        for node in function:
            node.name = node.name or (node.outputs[0].name if node.outputs else None) or node.op_type
    try:
        InlinePass(criteria=lambda function: function.identifier() not in kept)(model)
    except ir.passes.PreconditionError as e:  # functions calling each other in a cycle: nothing was inlined
        kept = {key: f"it cannot be inlined: {e}" for key in called}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        origin = node.metadata_props.pop(INLINED_FROM, None)
        if origin is not None and node.op_identifier() not in kept:  # a kept call is no inlined node
            node.name = f"{origin}/{node.name}"
    for function in model.functions.values():
        for node in function.all_nodes():
            node.metadata_props.pop(INLINED_FROM, None)
    return kept


def _not_inlinable(model: ir.Model, function: ir.Function, calls: list[ir.Node]) -> str | None:
    """Why the inliner cannot inline `function`'s calls, or None."""
    for domain, version in function.opset_imports.items():
        if model.opset_imports.get(domain, version) != version:
            return (
                f"its opset import {domain or 'ai.onnx'} {version} differs from the model's "
                f"{model.opset_imports[domain]}"
            )
    for call in calls:
        if call.op_identifier() != function.identifier():
            continue
        if len(call.inputs) > len(function.inputs):
            return f"{call.name} passes it more inputs than it declares"
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in call.attributes.values()):
            return f"{call.name} passes it a graph attribute"
    return None


# --- control flow ------------------------------------------------------------------------------


def body_holders(graph: ir.Graph) -> dict[int, ir.Node]:
    """id(node inside a body, at any depth) → the top-level control-flow node holding it."""
    return {id(inner): node for node in graph for inner, _ in nested_nodes(node)}


def nested_nodes(node: ir.Node, outer: str = "") -> Iterator[tuple[ir.Node, str]]:
    """Every node inside the bodies of `node` at any depth, with where it is ("the else-branch of If z")."""
    for name, body in bodies(node):
        where = f"the {name.replace('_', '-')} of {node.op_type} {node.name}" + (f", inside {outer}" if outer else "")
        for inner in body:
            yield inner, where
            yield from nested_nodes(inner, where)


def outer_reads(node: ir.Node) -> list[ir.Value]:
    """Run-time tensors that the bodies of `node` (at any depth) read from outside them.

    Constants are left out: a rewrite never changes a constant in place, so a body reading one
    is not affected by it.
    """
    found: dict[str, ir.Value] = {}
    for _, body in bodies(node):
        local = {t.name for t in body.inputs} | {t.name for inner in body for t in inner.outputs}
        for inner in body:
            for tensor in list(inner.inputs) + outer_reads(inner):
                if tensor is not None and tensor.name and tensor.name not in local and not is_initializer(tensor):
                    found.setdefault(tensor.name, tensor)
    return list(found.values())


# --- op table ----------------------------------------------------------------------------------


def _rank(ctx: OnnxGraph, tensor: ir.Value) -> int | None:
    shape = ctx.shapes.get(name_of(tensor))
    return None if shape is None else len(shape)


def _axis(value: int, rank: int | None) -> int | None:
    if value >= 0:
        return value
    return None if rank is None else value + rank


def _linear_or(reason: str, ok: bool, axis: int | None):
    if ok and axis is not None:
        return NodeKind.LINEAR, Linear(axis)
    return NodeKind.OTHER, Opaque(reason)


def _runtime(tensor: ir.Value) -> str:
    return f"{tensor.name} is not a constant (computed at run time, or an overridable graph input)"


def _matmul(ctx, node):
    weight = node.inputs[1]
    rank = _rank(ctx, node.outputs[0])
    if not is_constant(weight):
        return NodeKind.OTHER, Opaque(f"its weight {_runtime(weight)}")
    ok = not is_constant(node.inputs[0]) and len(ctx.shapes.get(weight.name) or ()) >= 2
    return _linear_or(
        "multiplies by a constant on the left, or by a weight of rank < 2", ok, None if rank is None else rank - 1
    )


def _gemm(ctx, node):
    bias = input_at(node, 2)
    ok = is_constant(node.inputs[1]) and (bias is None or is_constant(bias))
    kind, rule = _linear_or("its weight or bias is computed at run time", ok, 1)
    if bias is not None and isinstance(rule, Linear) and (bias.shape is None or (list(bias.shape) or [1])[-1] == 1):
        rule = Linear(1, bias_per_feature=False)  # C broadcast along the output features
    return kind, rule


def _conv(ctx, node):
    if attr(node, "group", 1) != 1:
        return NodeKind.OTHER, Opaque("a grouped or depthwise convolution cannot be centred (seed 003 §3)")
    ok = all(is_constant(t) for t in node.inputs[1:] if t is not None)
    return _linear_or("its weight is computed at run time", ok, 1)


def _gather(ctx, node):
    data, indices = node.inputs[0], node.inputs[1]
    axis = attr(node, "axis", 0)
    if is_constant(data):
        rank = _rank(ctx, node.outputs[0])
        ok = len(ctx.shapes.get(data.name) or ()) == 2 and _axis(axis, 2) == 0
        return _linear_or(
            "gathers from a constant that is not an embedding table", ok, None if rank is None else rank - 1
        )
    data_axis = _axis(axis, _rank(ctx, data))
    if data_axis is None:
        return NodeKind.OTHER, Opaque("a Gather along a negative axis of unknown rank")
    return NodeKind.LAYOUT, Take(data_axis, _rank(ctx, indices))


def _slice(ctx, node):
    rank = _rank(ctx, node.inputs[0])
    starts = node.inputs[1]
    if input_at(node, 3) is not None:
        axes = constant_values(node.inputs[3])
        if axes is None:
            return NodeKind.LAYOUT, Select(None)
        axes = [int(a) for a in np.ravel(axes)]
    else:
        values = constant_values(starts)
        count = (ctx.shapes.get(starts.name) or [None])[0] if values is None else values.size
        axes = list(range(count)) if isinstance(count, int) else None
    if axes is None or (rank is None and any(a < 0 for a in axes)):
        return NodeKind.LAYOUT, Select(None)
    resolved = tuple(_axis(a, rank) for a in axes)
    return NodeKind.LAYOUT, Select(resolved, _slice_bounds(ctx, node, resolved))


def _slice_bounds(ctx, node, axes) -> tuple[tuple[int, int, int], ...] | None:
    """(axis, start, stop) of each sliced axis, clamped to its static size, if the slice has unit steps and
    constant bounds (`rules.Select`)."""
    starts, ends, steps = constant_values(node.inputs[1]), constant_values(node.inputs[2]), _input_values(node, 4)
    shape = ctx.shapes.get(name_of(node.inputs[0]))
    if starts is None or ends is None or shape is None or np.size(starts) != len(axes) or np.size(ends) != len(axes):
        return None
    if input_at(node, 4) is not None and (steps is None or np.any(np.ravel(steps) != 1)):
        return None
    bounds = []
    for axis, start, end in zip(axes, np.ravel(starts).tolist(), np.ravel(ends).tolist(), strict=True):
        size = shape[axis] if axis is not None else None
        if not isinstance(size, int):
            return None
        bounds.append((axis, *(min(max(b + size if b < 0 else b, 0), size) for b in (start, end))))
    return tuple(bounds)


def _split(ctx, node):
    return NodeKind.LAYOUT, Select((_axis(attr(node, "axis", 0), _rank(ctx, node.inputs[0])),))


def _transpose(ctx, node):
    perm = attr(node, "perm")
    if perm is None:
        rank = _rank(ctx, node.inputs[0])
        if rank is None:
            return NodeKind.OTHER, Opaque("a Transpose of unknown rank")
        perm = list(reversed(range(rank)))
    if sorted(perm) != list(range(len(perm))):
        return NodeKind.OTHER, Opaque(f"a Transpose with an invalid perm {list(perm)}")
    return NodeKind.LAYOUT, Permute(tuple(perm))


def _concat(ctx, node):
    axis = _axis(attr(node, "axis", 0), _rank(ctx, node.outputs[0]))
    if axis is None:
        return NodeKind.OTHER, Opaque("a Concat of unknown rank")
    return NodeKind.LAYOUT, Concat(axis)


def _softmax(ctx, node):
    rank = _rank(ctx, node.inputs[0])
    axis = _axis(attr(node, "axis", -1 if ctx.opset >= 13 else 1), rank)
    if axis is None or rank is None:
        return NodeKind.OTHER, Opaque("a Softmax of unknown rank")
    if ctx.opset < 13 and axis != rank - 1:  # before opset 13 Softmax normalizes over axes [axis, rank)
        return NodeKind.OTHER, Opaque("Softmax over several axes")
    return NodeKind.OTHER, ShiftInvariant(axis)


def _cast(ctx, node):
    if attr(node, "to") in FLOAT_CASTS:
        return NodeKind.SCALAR, Scale(0, None)
    return NodeKind.OTHER, Opaque("casts to a non-float type")


def _sub(ctx, node):
    """x − ReduceMean(x, axis) is already centred (an inserted or hand-written centring)."""
    if len(node.inputs) != 2:
        return NodeKind.OTHER, Opaque("a Sub without two inputs")
    x, mean = node.inputs
    producer = None if mean is None else mean.producer()
    if (
        producer is not None
        and producer.op_type == "ReduceMean"
        and producer.inputs[0] is x
        and attr(producer, "keepdims", 1)
    ):
        axes = attr(producer, "axes")
        if axes is None and input_at(producer, 1) is not None:
            axes = constant_values(producer.inputs[1])
        if axes is not None and np.size(axes) == 1:
            axis = _axis(int(np.ravel(axes)[0]), _rank(ctx, x))
            if axis is not None:
                return NodeKind.CENTERED, Centered(axis)
    return NodeKind.RESIDUAL, Sum()


def _input_values(node: ir.Node, index: int) -> np.ndarray | None:
    """Values of optional input `index` if it is present and constant."""
    return constant_values(input_at(node, index))


def _unchanged_axes(rank: int, axes, factors, unchanged: int) -> list[int]:
    """Axes that `factors` (per entry of `axes`, or per axis) leave alone: equal to `unchanged`."""
    axes = list(range(rank)) if axes is None else [_axis(int(a), rank) for a in axes]
    if factors is None or np.size(factors) != len(axes):
        return [a for a in range(rank) if a not in axes]
    return [a for a in range(rank) if a not in axes or np.ravel(factors)[axes.index(a)] == unchanged]


def _resize(ctx, node):
    """Nearest/linear/cubic interpolation is one linear map per axis, the identity on an axis of scale 1."""
    rank = _rank(ctx, node.inputs[0])
    if rank is None:
        return NodeKind.OTHER, Opaque("a Resize of unknown rank")
    if attr(node, "coordinate_transformation_mode") == "tf_crop_and_resize":
        return NodeKind.OTHER, Opaque("crop-and-resize shifts even the axes it does not scale")
    axes = attr(node, "axes")
    scales = (
        attr(node, "scales")
        if "scales" in node.attributes
        else _input_values(node, 1 if node.op_type == "Upsample" or ctx.opset < 11 else 2)
    )
    if scales is not None and np.size(scales):
        return NodeKind.LAYOUT, Mix(tuple(_unchanged_axes(rank, axes, scales, 1)))
    sizes, in_shape = _input_values(node, 3), ctx.shapes.get(node.inputs[0].name)
    if attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        return NodeKind.LAYOUT, Mix(tuple(_unchanged_axes(rank, axes, None, 1)))
    if sizes is None:
        copied = _copied_dims(ctx, node.inputs[0], input_at(node, 3))
        targets = range(rank) if axes is None else [_axis(int(a), rank) for a in axes]
        resized = None if copied is None else [int(c != a) for c, a in zip(copied, targets, strict=False)]
        return NodeKind.LAYOUT, Mix(tuple(_unchanged_axes(rank, axes, resized, 0)))
    in_dims = [in_shape[a] for a in (range(rank) if axes is None else [_axis(int(a), rank) for a in axes])]
    resized = [int(size != dim) for size, dim in zip(np.ravel(sizes), in_dims, strict=False)]
    return NodeKind.LAYOUT, Mix(tuple(_unchanged_axes(rank, axes, resized, 0)))


def _copied_dims(ctx, data: ir.Value, sizes: ir.Value | None) -> list[int | None] | None:
    """Per entry of a Resize's run-time `sizes`, the axis of `data` whose size it copies (None: another value).

    Recognises sizes = Concat(Slice(Shape(data)), …), as torch exports `F.interpolate(size=…)`: the
    leading entries are the data's own batch and channel sizes, so those axes are not resized. Other
    parts of the Concat must have a static length; anything else is not recognised (None).
    """
    producer = None if sizes is None else sizes.producer()
    parts = producer.inputs if producer is not None and producer.op_type == "Concat" else [sizes]
    copied: list[int | None] = []
    for part in parts:
        axes = None if part is None else _shape_slice(ctx, data, part)
        if axes is not None:
            copied += axes
            continue
        shape = None if part is None else ctx.shapes.get(str(part.name))
        if shape is None or len(shape) != 1 or not isinstance(shape[0], int):
            return None
        copied += [None] * shape[0]
    return copied


def _shape_slice(ctx, data: ir.Value, part: ir.Value) -> list[int] | None:
    """The axes of `data` whose sizes `part` holds, if it is Shape(data) or a constant unit-step Slice of it."""
    node, bounds = part.producer(), slice(None)
    if node is not None and node.op_type == "Slice":
        sliced = unit_slice(node)
        if sliced is None:
            return None
        source = node.inputs[0]
        node = None if source is None else source.producer()
        bounds = sliced
    rank = _rank(ctx, data)
    if node is None or node.op_type != "Shape" or node.inputs[0] is not data or rank is None:
        return None
    return shape_axes(node, rank)[bounds]


def _reduce(ctx, node):
    """ReduceMean / ReduceSum over the axes of its attribute (opset < 18) or constant input 1 (all axes
    when none are given, unless `noop_with_empty_axes`)."""
    rank = _rank(ctx, node.inputs[0])
    keepdims = bool(attr(node, "keepdims", 1))
    axes = attr(node, "axes")
    if axes is None and input_at(node, 1) is not None:
        axes = constant_values(node.inputs[1])
        if axes is None:
            return NodeKind.LAYOUT, Reduce(None, keepdims)
    if axes is None or np.size(axes) == 0:
        if attr(node, "noop_with_empty_axes", 0):
            return NodeKind.SCALAR, Scale(0, None)
        axes = [] if rank is None else list(range(rank))
    resolved = tuple(_axis(int(a), rank) for a in np.ravel(axes))
    if rank is None or None in resolved:
        return NodeKind.LAYOUT, Reduce(None, keepdims)
    return NodeKind.LAYOUT, Reduce(tuple(a for a in resolved if a is not None), keepdims)


def _average_pool(ctx, node):
    """Averages over the spatial axes of N×C×spatial: the same weights for every (batch, channel)."""
    return NodeKind.LAYOUT, Mix((0, 1))


def _pad(ctx, node):
    """Zero (or reflected, edge, wrapped) padding of other axes keeps every row or adds zero rows."""
    rank = _rank(ctx, node.inputs[0])
    if rank is None:
        return NodeKind.OTHER, Opaque("a Pad of unknown rank")
    mode = attr(node, "mode", "constant")
    given = "pads" not in node.attributes and input_at(node, 2) is not None
    value = _input_values(node, 2) if given else attr(node, "value", 0.0)
    if mode == "constant" and (value is None or np.any(np.asarray(value) != 0)):
        return NodeKind.OTHER, Opaque("pads with a value that is not a constant zero, so padded rows are not zero-mean")
    pads = attr(node, "pads") if "pads" in node.attributes else _input_values(node, 1)
    axes = _input_values(node, 3)
    if pads is None:
        return NodeKind.LAYOUT, Mix(())
    pads = np.ravel(pads).reshape(2, -1)
    return NodeKind.LAYOUT, Mix(tuple(_unchanged_axes(rank, axes, np.abs(pads).sum(axis=0), 0)))


def _tile(ctx, node):
    rank = _rank(ctx, node.inputs[0])
    if rank is None:
        return NodeKind.OTHER, Opaque("a Tile of unknown rank")
    return NodeKind.LAYOUT, Mix(tuple(_unchanged_axes(rank, None, _input_values(node, 1), 1)))


def einsum_weight_axis(equation: str, weight_index: int, out_axis: int) -> int | None:
    """The axis of constant operand `weight_index` that becomes `out_axis` of an Einsum's output.

    Centring that operand along it makes the output zero-mean along `out_axis` iff its letter is
    in that operand once and in no other operand (a contraction x·W producing the axis).
    """
    if "..." in equation or "->" not in equation:
        return None
    operands, output = equation.replace(" ", "").split("->")
    terms = operands.split(",")
    if len(terms) != 2 or out_axis >= len(output):
        return None
    letter = output[out_axis]
    weight, other = terms[weight_index], terms[1 - weight_index]
    if weight.count(letter) != 1 or letter in other:
        return None
    return weight.index(letter)


def _einsum(ctx, node):
    """x·W written as an Einsum: general linear on the output axis produced by W alone."""
    rank = _rank(ctx, node.outputs[0])
    constant = [is_constant(t) for t in node.inputs]
    if len(node.inputs) != 2 or constant.count(True) != 1 or rank is None:
        return NodeKind.OTHER, Opaque("an Einsum that is not one run-time tensor times one constant")
    equation = attr(node, "equation", "")
    if einsum_weight_axis(equation, constant.index(True), rank - 1) is None:
        return NodeKind.OTHER, Opaque(f"Einsum {equation!r} does not produce its last axis from the constant alone")
    return NodeKind.LINEAR, Linear(rank - 1)


def _unary(ctx, node):
    return NodeKind.SCALAR, Scale(0, None)


def _mul(ctx, node):
    return NodeKind.SCALAR, Scale(None, None)


OP_TABLE = {
    "MatMul": _matmul,  # x·W with constant W: general linear, output features on the last axis
    "Gemm": _gemm,  # α·A·B + β·C with constant B, C: general linear on axis 1
    "Conv": _conv,  # group == 1 only: output channels on axis 1
    "Gather": _gather,  # embedding lookup from a constant [V, d] table, or layout gather
    "Add": lambda ctx, node: (NodeKind.RESIDUAL, Sum()),  # residual add / bias add
    "Sub": _sub,  # residual difference, or an explicit centring x − mean(x)
    "Mul": _mul,  # scalar multiply: one operand must be constant along the axis
    "Div": lambda ctx, node: (NodeKind.SCALAR, Scale(0, 1)),  # x / s, s constant along the axis
    "Neg": _unary,  # −x
    "Identity": _unary,  # x
    "Dropout": _unary,  # identity at inference
    "Cast": _cast,  # float → float: linear up to rounding
    "Transpose": _transpose,  # moves the axis
    "Reshape": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),  # axis intact iff size and suffix match
    "Flatten": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),
    "Squeeze": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),
    "Unsqueeze": lambda ctx, node: (NodeKind.LAYOUT, Regroup()),
    "Slice": _slice,  # keeps every slice along the other axes whole
    "Split": _split,
    "Expand": lambda ctx, node: (NodeKind.LAYOUT, Broadcast()),  # broadcast over other axes
    "Concat": _concat,  # zero-mean parts concatenate to zero mean
    "Softmax": _softmax,  # not linear, but removes a shift along its axis
    "Einsum": _einsum,  # x·W as an equation: general linear on the axis W produces
    "Resize": _resize,  # interpolation over other axes: the same linear map for every row
    "Upsample": _resize,
    "ReduceMean": _reduce,  # a mean over other axes (a mean-pooled head): the same average for every row
    "ReduceSum": _reduce,
    "AveragePool": _average_pool,  # averages over spatial axes, per channel
    "GlobalAveragePool": _average_pool,
    "Pad": _pad,  # zero rows (or copies) on other axes
    "Tile": _tile,  # copies along axes with repeat 1 left alone
    "Where": lambda ctx, node: (NodeKind.RESIDUAL, Choose()),  # whole rows from one input or the other
    **{op: lambda ctx, node: (NodeKind.CONSTANT, ShapeOnly()) for op in SHAPE_READERS},
}


def _opaque(reason: str):
    return lambda ctx, node: (NodeKind.OTHER, Opaque(reason))


CONTRIB_TABLE = {  # com.microsoft ops that ONNX Runtime's transformers optimizer emits
    "BiasAdd": lambda ctx, node: (NodeKind.RESIDUAL, Sum()),  # x + bias + skip
    **{op: _opaque("a GELU is nonlinear") for op in ("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasFastGelu")},
    **{
        op: _opaque("fused attention: a linear projection of its input, so a shift changes its output")
        for op in ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention")
    },
    "SkipGroupNorm": _opaque("a GroupNorm fused with a residual add is not analysed"),
}
DOMAINS = {"": OP_TABLE, "ai.onnx": OP_TABLE, "com.microsoft": CONTRIB_TABLE}


def classify(ctx: OnnxGraph, node: ir.Node):
    """(kind, rule) of `node`; never raises: what cannot be analysed is `Opaque`, with the reason."""
    domain = node.domain or ""
    handler = DOMAINS.get(domain, {}).get(node.op_type)
    if handler is None:
        named = node.op_type if domain in ("", "ai.onnx") else f"{domain}.{node.op_type}"
        return NodeKind.OTHER, Opaque(f"{named} is not linear in its input")
    try:
        return handler(ctx, node)
    except (IndexError, KeyError, TypeError, ValueError) as e:  # a malformed node (missing inputs or attributes)
        return NodeKind.OTHER, Opaque(f"cannot be analysed ({type(e).__name__}: {e})")


def norm_matches(nodes, context: MatchContext) -> Iterator[tuple[ir.Node, str, tuple[NormType, NormMatch]]]:
    """(anchor node, op shown to users, (norm type, match)) of every norm among `nodes`."""
    in_norm: set[int] = set()
    for node in nodes:
        if id(node) in in_norm:
            continue
        single = match_single_op(node, context.graph_outputs)
        found = (*single, node.op_type) if single is not None else match_decomposed(node, context)
        if found is not None:
            norm_type, match, op = found
            in_norm.update(id(n) for n in match.nodes)
            yield node, op, (norm_type, match)


def _declined_norms(nodes: list[tuple[ir.Node, str]], outputs: set[str], why: str, prefix: str = "") -> list[NormInfo]:
    """The norms among `nodes` (each with where it is), named `prefix` + anchor, declined: "inside {where}: {why}"."""
    where = {id(node): place for node, place in nodes}
    context = MatchContext(outputs, {id(node) for node, _ in nodes})
    norms = []
    for anchor, op, (norm_type, match) in norm_matches([node for node, _ in nodes], context):
        norm = norm_info(prefix + (anchor.name or anchor.op_type), op, norm_type, match, None)
        norm.unsupported = f"inside {where[id(anchor)]}: {why}"
        norms.append(norm)
    return norms


def _nested_norms(node: ir.Node) -> list[NormInfo]:
    """The norms inside the bodies of `node`, each declined with where it is."""
    return _declined_norms(list(nested_nodes(node)), set(), "norms in control-flow bodies are not rewritten")


def _control_flow(node: ir.Node) -> tuple[NodeKind, Opaque, list[str]]:
    """A control-flow node reads its inputs and every outer-scope tensor of its bodies."""
    reads = [name_of(t) for t in outer_reads(node)]
    reason = "control flow: a shift reaching its inputs" + (
        f" or what its bodies read ({', '.join(reads)})" if reads else ""
    )
    return NodeKind.OTHER, Opaque(reason + " changes its outputs"), reads


def build_zero_mean_graph(ctx: OnnxGraph) -> ZeroMeanGraph:
    """Classify every node of `ctx` and recognise its normalizations (those in bodies are declined)."""
    graph = ctx.graph
    outputs = {name_of(t) for t in graph.outputs}
    zmg = ZeroMeanGraph(model_name=ctx.name, shapes=ctx.shapes)
    zmg.graph_inputs = {name_of(t) for t in graph.inputs}
    zmg.graph_outputs = outputs
    for tensor in graph_values(graph):
        if is_constant(tensor):
            zmg.constants[name_of(tensor)] = _loader(tensor)
    in_norm: set[int] = set()
    context = MatchContext(outputs, {id(node) for node in graph}, ctx.shapes, ctx.dtypes)
    for node, op, (norm_type, match) in norm_matches(list(graph), context):
        if norm_type is NormType.LAYER and match.unsupported is None and len(match.nodes) == 1:
            _check_affine(ctx, node, match)
        zmg.norms.append(norm_info(name_of(node), op, norm_type, match, _rank(ctx, match.x)))
        in_norm.update(id(n) for n in match.nodes)
    norms_by_anchor = {norm.ref.nodes[0].name: norm for norm in zmg.norms}
    for node in graph:
        if node.name in norms_by_anchor:
            norm = norms_by_anchor[node.name]
            inputs = [norm.input] + [t for t in (norm.scale, norm.bias) if t]
            if norm.ref.skip is not None:
                _add_skip_sum(ctx, zmg, node, norm)
            zmg.add_node(ZNode(norm.name, norm.op, NodeKind.NORM, NormRule(norm), inputs, [norm.output], norm.ref))
            continue
        if id(node) in in_norm:
            continue
        inputs = [name_of(t) for t in node.inputs]
        if bodies(node):
            kind, rule, reads = _control_flow(node)
            inputs += [name for name in reads if name not in inputs]
        else:
            kind, rule = classify(ctx, node)
        zmg.add_node(ZNode(name_of(node), node.op_type, kind, rule, inputs, [name_of(t) for t in node.outputs], node))
    declined = [norm for node in graph for norm in _nested_norms(node)]
    for key, why in ctx.kept_functions.items():
        function = ctx.model.functions[key]
        where = [(node, f"model-local function {function.name}") for node in function]
        outputs = {name_of(t) for t in function.outputs}
        declined += _declined_norms(
            where, outputs, f"not rewritten: the function is not inlined ({why})", f"{function.name}/"
        )
    for norm in declined:
        zmg.norms.append(norm)
        zmg.add_node(ZNode(norm.name, norm.op, NodeKind.NORM, NormRule(norm), [], [], norm.ref))
    return zmg


def _loader(tensor: ir.Value) -> Callable[[], np.ndarray]:
    """What reads the values of the constant `tensor` when the analysis first asks for them."""

    def load() -> np.ndarray:
        values = constant_values(tensor)
        if values is None:  # a malformed node on its way from the initializers
            raise UnsupportedModelError(f"constant {name_of(tensor)}: its values cannot be computed")
        return values

    return load


def _check_affine(ctx: OnnxGraph, node: ir.Node, match) -> None:
    """Refuse (`InputError`) a LayerNorm op whose γ or β does not fit its input's trailing dims (each
    equal, or 1): the model is invalid, ONNX Runtime refuses to run it, and no rewrite can use it.
    (A decomposed norm may apply γ to a reshaped tensor, as ONNX's own expansion does: not checked.)"""
    x_shape = ctx.shapes.get(match.x.name) or ()
    for role, tensor in (("scale", match.gamma), ("bias", match.beta)):
        shape = () if tensor is None else ctx.shapes.get(tensor.name) or ()
        pairs = list(zip(shape[::-1], x_shape[::-1], strict=False))
        if any(isinstance(a, int) and isinstance(b, int) and a not in (b, 1) for a, b in pairs):
            raise InputError(
                f"{ctx.name}: node {node.name}: its {role} {tensor.name} has shape {list(shape)}, which does not "
                f"fit its input's shape {list(x_shape)}; the model is invalid (ONNX Runtime refuses to run it)"
            )


def graph_values(graph: ir.Graph) -> Iterator[ir.Value]:
    """Every named tensor of the top-level graph, once: inputs, initializers, node inputs and outputs."""
    seen: set[int] = set()
    for value in [
        *graph.inputs,
        *graph.initializers.values(),
        *(t for node in graph for t in (*node.inputs, *node.outputs)),
    ]:
        if value is not None and value.name and id(value) not in seen:
            seen.add(id(value))
            yield value


def _add_skip_sum(ctx: OnnxGraph, zmg: ZeroMeanGraph, node: ir.Node, norm) -> None:
    """A Skip*LayerNormalization normalizes x + skip (+ bias): model that sum as its own `Sum` node.

    Its output is the op's output 3 where something reads it, else a name of its own; it has x's shape.
    """
    match = norm.ref
    operands = [t.name for t in (match.x, match.skip, match.skip_bias) if t is not None]
    ctx.shapes.setdefault(norm.input, ctx.shapes.get(match.x.name))
    zmg.add_node(
        ZNode(f"{node.name}.sum", f"{node.op_type} (sum)", NodeKind.RESIDUAL, Sum(), operands, [norm.input], node)
    )
