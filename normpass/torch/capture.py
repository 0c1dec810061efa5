"""Capture a PyTorch module as a list of calls in ATen vocabulary, with shapes and provenance.

Two capture methods, tried in order:

1. `torch.export.export(model, args, strict=False)`: the ATen graph (`aten.linear`, `aten.addmm`,
   `aten.layer_norm`, …). Parameters and buffers are lifted to placeholders; the graph signature
   names them. Shapes come from each node's FakeTensor (`meta["val"]`), symbolic where the caller
   asked for dynamic shapes. This is the method normally used.
2. `torch.fx.symbolic_trace(model)` with `ShapeProp` on the example inputs, for modules torch.export
   rejects (an op without a fake-tensor kernel, a function wrapped with `torch.fx.wrap` that branches
   on data). Its graph speaks torch-level ops (`nn.Linear` calls, `operator.add`, `Tensor.view`), so
   each node is lowered here onto the ATen op and argument names of (1); whatever is not in the
   lowering table stays an unknown call, which the analysis treats as opaque. Its graph does not
   track mutation, so an in-place op whose target is read again makes this method fail.

Either way the result is a `Capture`: `Call`s whose tensor arguments are `Ref`s (tensor names),
bound by the ATen schema's argument names, plus for every constant the module attribute it was read
through (`reads`), which is what the rewrite edits. A parameter shared by two modules (a tied LM
head) is read through two attributes, one per module, so the rewrite can give one of them its own
copy. If both methods fail, `UnsupportedModelError` names the construct each one failed on.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from ..errors import UnsupportedModelError

TORCH_DIR = os.path.dirname(torch.__file__)
NORMPASS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the normpass package
EXPORT, SYMBOLIC_TRACE = "torch.export", "torch.fx.symbolic_trace"


class Ref(str):
    """The name of a tensor, as an argument of a `Call` (plain `str` arguments are Python values)."""


@dataclass(frozen=True)
class Attr:
    """A module attribute holding a parameter or buffer: `model.get_submodule(module).<name>`."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name


@dataclass
class Call:
    """One graph node: `op` is an ATen op name ("linear", "add", …) or, if unknown, what was called."""

    node: str  # fx node name; also the name of its (first) output tensor
    op: str
    args: dict[str, Any]
    outputs: list[str]
    target: str  # what the user sees: "aten.linear", "nn.Linear", "Tensor.view", …
    module: str = ""  # path of the innermost module whose forward made this call
    call: str = ""  # that module call (repeated calls of one module differ)
    stack: tuple[str, ...] = ()  # module paths, outermost first

    def refs(self) -> list[Ref]:
        """Every tensor argument, in argument order."""
        found: list[Ref] = []

        def walk(value):
            if isinstance(value, Ref):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    walk(item)

        for value in self.args.values():
            walk(value)
        return found


@dataclass
class Capture:
    method: str
    calls: list[Call]
    inputs: list[str]
    outputs: list[str]
    shapes: dict[str, tuple]
    constants: dict[str, torch.Tensor]  # tensor name → parameter, buffer or constant tensor
    reads: dict[tuple[str, str], Attr | None] = field(default_factory=dict)  # (fx node, constant) → attribute
    export_error: str | None = None  # why torch.export was not used
    program: Any = None  # the torch.export.ExportedProgram, where that captured it


# --- entry point ---------------------------------------------------------------------------------


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, dynamic_shapes=None) -> Capture:
    """Capture `model` called on `args`/`kwargs` with torch.export, else with symbolic_trace."""
    kwargs = kwargs or {}
    try:
        with _quiet():
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many unrelated types
        export_error = _describe_failure(e)
    else:
        return _from_export(model, program)
    try:
        with _quiet():
            result = _from_symbolic_trace(model, args, kwargs)
    except Exception as e:
        raise UnsupportedModelError(
            f"{type(model).__name__}: cannot capture the model as a graph. torch.export failed: {export_error}. "
            f"torch.fx.symbolic_trace failed: {_describe_failure(e)}. Make that code traceable: no Python branching "
            "on tensor values (use torch.where or torch.cond)"
        ) from e
    result.export_error = export_error
    return result


@contextlib.contextmanager
def _quiet():
    """Silence torch while capturing: a failing export logs warnings and prints its partial graph."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _describe_failure(error: BaseException) -> str:
    """The first line of `error` and the innermost line of user code that raised it."""
    message = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    if len(message) > 240:
        message = message[:237] + "..."
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith((TORCH_DIR + os.sep, NORMPASS_DIR + os.sep))
    ]
    where = ""
    if frames:
        frame = frames[-1]
        where = f" at {frame.filename}:{frame.lineno} in {frame.name}" + (f": `{frame.line}`" if frame.line else "")
    return f"{type(error).__name__}: {message}{where}"


# --- torch.export ------------------------------------------------------------------------------


def _val_shape(value: torch.Tensor) -> tuple:
    """A fake tensor's shape: ints, and symbolic sizes by name."""
    return tuple(d if isinstance(d, int) else str(d) for d in value.shape)


def _module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """(call key, module path) pairs, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(key, entry[0]) for key, entry in stack.items()]


def _owner(model: nn.Module, tensor: torch.Tensor, stack: tuple[str, ...], fqns: list[str]) -> Attr | None:
    """The attribute through which a node in module `stack` reads `tensor`.

    The innermost module on the stack that holds `tensor` directly wins (a tied LM head reads the
    shared table through `lm_head.weight`, the embedding through `wte.weight`); otherwise the
    tensor's only path in the model; None when that is ambiguous.
    """
    for path in reversed(stack):
        module = model.get_submodule(path)
        for name, held in list(module._parameters.items()) + list(module._buffers.items()):
            if held is tensor:
                return Attr(path, name)
    if len(fqns) == 1:
        owner, _, name = fqns[0].rpartition(".")
        return Attr(owner, name)
    return None


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(tensor) → every path under which the model holds it (tied weights have several)."""
    paths: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(tensor), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        paths.setdefault(id(buffer), []).append(name)
    return paths


def _constant_name(fqn: str) -> str:
    """Constants are named by their path in the model; `self.` keeps root attributes apart from fx names."""
    return fqn if "." in fqn else f"self.{fqn}"


def _bind(node: torch.fx.Node) -> dict[str, Any] | None:
    """Arguments of an ATen call by schema name (defaults filled in), or None for non-ATen targets."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    bound = {}
    for index, argument in enumerate(schema.arguments):
        if not argument.kwarg_only and index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def _convert(value, names: dict[str, str]):
    """fx nodes → `Ref`s (tensors) or their value as text (SymInts); containers recursively."""
    if isinstance(value, torch.fx.Node):
        if value.name in names:
            return Ref(names[value.name])
        val = value.meta.get("val")
        return str(val) if val is not None else None
    if isinstance(value, (list, tuple)):
        return type(value)(_convert(v, names) for v in value)
    return value


def _tuple_outputs(node: torch.fx.Node) -> list[str]:
    """Names of the `getitem` users of a tuple-valued node, by index ("" where an item is unused)."""
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    outputs = [""] * (len(val) if isinstance(val, (list, tuple)) else 0)
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            outputs[user.args[1]] = user.name
    return outputs


def _from_export(model: nn.Module, program) -> Capture:
    graph = program.graph_module.graph
    signature = program.graph_signature
    aliases = _aliases(model)
    result = Capture(EXPORT, [], [], [], {}, {}, program=program)
    names: dict[str, str] = {}  # fx node name → tensor name
    fqn_of: dict[str, str] = {}
    for spec in signature.input_specs:
        if spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            fqn_of[spec.arg.name] = spec.target
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in fqn_of:
                fqn = fqn_of[node.name]
                try:
                    tensor = _get_attr(model, fqn)
                except AttributeError:  # a tensor constant lifted out of forward: no attribute holds it
                    tensor = program.constants[fqn]
                name = _constant_name(fqn)
                result.constants[name] = tensor
                result.shapes[name] = tuple(tensor.shape)
            elif isinstance(node.meta.get("val"), torch.Tensor):
                name = node.name
                result.inputs.append(name)
                result.shapes[name] = _val_shape(node.meta["val"])
            else:
                continue
            names[node.name] = name
        elif node.op == "call_function":
            val = node.meta.get("val")
            if node.target is operator.getitem:
                if isinstance(val, torch.Tensor):
                    names[node.name] = node.name
                    result.shapes[node.name] = _val_shape(val)
                continue
            tensors = [v for v in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(v, torch.Tensor)]
            if not tensors:
                continue  # shape arithmetic, assertions
            if isinstance(val, torch.Tensor):
                outputs = [node.name]
                result.shapes[node.name] = _val_shape(val)
            else:
                outputs = _tuple_outputs(node)
            names[node.name] = node.name
            result.calls.append(_export_call(node, outputs, names))
    for node in graph.nodes:
        if node.op == "output":
            result.outputs = [names[n.name] for n in node.all_input_nodes if n.name in names]
    # constants read by each call, and the attribute each read goes through
    for call in result.calls:
        for ref in call.refs():
            if ref in result.constants:
                tensor = result.constants[ref]
                result.reads[(call.node, ref)] = _owner(model, tensor, call.stack, aliases.get(id(tensor), []))
    return result


def _get_attr(model: nn.Module, fqn: str) -> torch.Tensor:
    module, _, name = fqn.rpartition(".")
    return getattr(model.get_submodule(module), name)


def _export_call(node: torch.fx.Node, outputs: list[str], names: dict[str, str]) -> Call:
    stack = _module_stack(node)
    call_key, module = stack[-1] if stack else ("", "")
    bound = _bind(node)
    if bound is not None and isinstance(node.target, torch._ops.OpOverload):
        op = node.target.overloadpacket.__name__
        target = f"aten.{op}"
    else:  # higher-order ops and other non-ATen targets
        op, target = str(node.target), str(node.target)
        bound = {"inputs": [*node.args, *node.kwargs.values()]}
    args = {key: _convert(value, names) for key, value in bound.items()}
    return Call(node.name, op, args, outputs, target, module, call_key, tuple(path for _, path in stack))


# --- torch.fx.symbolic_trace -------------------------------------------------------------------
#
# Each entry maps a torch-level callable onto (ATen op name, arguments by ATen schema name). The
# functions take the traced call's arguments exactly as the torch API does.


def _as_list(dims) -> list:
    return list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)) else list(dims)


def _binary(op):
    return lambda input, other, *, alpha=1, out=None: (op, {"self": input, "other": other, "alpha": alpha})


def _div(input, other, *, rounding_mode=None, out=None):
    return "div", {"self": input, "other": other, "rounding_mode": rounding_mode}


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    return None if max_norm is not None else ("embedding", {"weight": weight, "indices": input})  # max_norm edits W


def _to(self, *args, **kwargs):
    """`x.to(dtype)`, `x.to(device)`, `x.to(device, dtype)`; `x.to(other)` is left unknown."""
    if any(isinstance(a, torch.fx.Node) for a in args):
        return None
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
    return "_to_copy", {"self": self, "dtype": dtype}


def _getattr(value, name):
    """`x.T` (Falcon's `x @ W.T`); other attributes (`x.shape`) are not tensors."""
    return ("numpy_T", {"self": value}) if name == "T" else None


FUNCTIONS = {
    getattr: _getattr,
    operator.add: _binary("add"),  # x + y
    torch.add: _binary("add"),
    operator.sub: _binary("sub"),
    torch.sub: _binary("sub"),
    operator.mul: lambda a, b: ("mul", {"self": a, "other": b}),
    torch.mul: lambda input, other, *, out=None: ("mul", {"self": input, "other": other}),
    operator.truediv: lambda a, b: ("div", {"self": a, "other": b, "rounding_mode": None}),
    torch.div: _div,
    operator.neg: lambda a: ("neg", {"self": a}),
    torch.neg: lambda input: ("neg", {"self": input}),
    operator.matmul: lambda a, b: ("matmul", {"self": a, "other": b}),
    torch.matmul: lambda input, other, *, out=None: ("matmul", {"self": input, "other": other}),
    torch.cat: lambda tensors, dim=0, *, out=None: ("cat", {"tensors": list(tensors), "dim": dim}),
    torch.flatten: lambda input, start_dim=0, end_dim=-1: (
        "flatten",
        {"self": input, "start_dim": start_dim, "end_dim": end_dim},
    ),
    torch.reshape: lambda input, shape: ("reshape", {"self": input, "shape": list(shape)}),
    torch.permute: lambda input, dims: ("permute", {"self": input, "dims": list(dims)}),
    torch.transpose: lambda input, dim0, dim1: ("transpose", {"self": input, "dim0": dim0, "dim1": dim1}),
    torch.unsqueeze: lambda input, dim: ("unsqueeze", {"self": input, "dim": dim}),
    torch.squeeze: lambda input, dim=None: ("squeeze", {"self": input, "dim": dim}),
    torch.roll: lambda input, shifts, dims=None: ("roll", {"self": input, "shifts": shifts, "dims": dims}),
    torch.split: lambda tensor, split_size_or_sections, dim=0: ("split", {"self": tensor, "dim": dim}),
    torch.chunk: lambda input, chunks, dim=0: ("split", {"self": input, "dim": dim}),
    F.linear: lambda input, weight, bias=None: ("linear", {"input": input, "weight": weight, "bias": bias}),
    F.embedding: _embedding,
    F.layer_norm: lambda input, normalized_shape, weight=None, bias=None, eps=1e-5: (
        "layer_norm",
        {"input": input, "normalized_shape": list(normalized_shape), "weight": weight, "bias": bias, "eps": eps},
    ),
    F.group_norm: lambda input, num_groups, weight=None, bias=None, eps=1e-5: (
        "group_norm",
        {"input": input, "num_groups": num_groups, "weight": weight, "bias": bias, "eps": eps},
    ),
    F.rms_norm: lambda input, normalized_shape, weight=None, eps=None: (
        "rms_norm",
        {"input": input, "normalized_shape": list(normalized_shape), "weight": weight, "eps": eps},
    ),
    F.dropout: lambda input, p=0.5, training=True, inplace=False: (
        "dropout",
        {"input": input, "p": p, "train": training},
    ),
    F.softmax: lambda input, dim=None, _stacklevel=3, dtype=None: ("softmax", {"self": input, "dim": dim}),
    torch.softmax: lambda input, dim, dtype=None: ("softmax", {"self": input, "dim": dim}),
    F.pad: lambda input, pad, mode="constant", value=None: (
        "pad",
        {"self": input, "pad": list(pad), "mode": mode, "value": value},
    ),
    F.conv1d: lambda input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1: (
        "convolution",
        {"input": input, "weight": weight, "bias": bias, "transposed": False, "groups": groups},
    ),
    F.conv2d: lambda input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1: (
        "convolution",
        {"input": input, "weight": weight, "bias": bias, "transposed": False, "groups": groups},
    ),
    torch.zeros_like: lambda input, **kwargs: ("zeros_like", {"self": input}),
    torch.ones_like: lambda input, **kwargs: ("ones_like", {"self": input}),
    torch.empty_like: lambda input, **kwargs: ("empty_like", {"self": input}),
    torch.full_like: lambda input, fill_value, **kwargs: ("full_like", {"self": input}),
}

METHODS = {
    "view": lambda self, *shape: ("view", {"self": self, "size": _as_list(shape)}),
    "reshape": lambda self, *shape: ("reshape", {"self": self, "shape": _as_list(shape)}),
    "flatten": lambda self, start_dim=0, end_dim=-1: (
        "flatten",
        {"self": self, "start_dim": start_dim, "end_dim": end_dim},
    ),
    "permute": lambda self, *dims: ("permute", {"self": self, "dims": _as_list(dims)}),
    "transpose": lambda self, dim0, dim1: ("transpose", {"self": self, "dim0": dim0, "dim1": dim1}),
    "t": lambda self: ("t", {"self": self}),
    "unsqueeze": lambda self, dim: ("unsqueeze", {"self": self, "dim": dim}),
    "squeeze": lambda self, dim=None: ("squeeze", {"self": self, "dim": dim}),
    "contiguous": lambda self, memory_format=None: ("contiguous", {"self": self}),
    "expand": lambda self, *sizes: ("expand", {"self": self, "size": _as_list(sizes)}),
    "softmax": lambda self, dim, dtype=None: ("softmax", {"self": self, "dim": dim}),
    "add": _binary("add"),
    "sub": _binary("sub"),
    "mul": lambda self, other: ("mul", {"self": self, "other": other}),
    "div": _div,
    "neg": lambda self: ("neg", {"self": self}),
    "mean": lambda self, dim=None, keepdim=False, *, dtype=None: (
        "mean",
        {"self": self, "dim": dim, "keepdim": keepdim},
    ),
    "roll": lambda self, shifts, dims=None: ("roll", {"self": self, "shifts": shifts, "dims": dims}),
    "split": lambda self, split_size, dim=0: ("split", {"self": self, "dim": dim}),
    "chunk": lambda self, chunks, dim=0: ("split", {"self": self, "dim": dim}),
    "to": _to,
    "float": lambda self, memory_format=None: ("_to_copy", {"self": self, "dtype": torch.float32}),
    "double": lambda self, memory_format=None: ("_to_copy", {"self": self, "dtype": torch.float64}),
    "half": lambda self, memory_format=None: ("_to_copy", {"self": self, "dtype": torch.float16}),
    "repeat": lambda self, *sizes: ("repeat", {"self": self, "repeats": _as_list(sizes)}),
    "add_": _binary("add_"),
    "sub_": _binary("sub_"),
    "mul_": lambda self, other: ("mul_", {"self": self, "other": other}),
    "div_": lambda self, other: ("div_", {"self": self, "other": other, "rounding_mode": None}),
    "new_zeros": lambda self, *size, **kwargs: ("new_zeros", {"self": self}),
    "new_ones": lambda self, *size, **kwargs: ("new_ones", {"self": self}),
    "new_empty": lambda self, *size, **kwargs: ("new_empty", {"self": self}),
}


def _module_call(module: nn.Module, path: str, args: tuple, kwargs: dict) -> tuple[str, dict] | None:
    """Leaf modules of symbolic_trace, as the ATen call their forward makes (parameters as `Ref(path.name)`)."""
    x = args[0] if args else next(iter(kwargs.values()), None)

    def param(name):
        return None if getattr(module, name, None) is None else Ref(_constant_name(f"{path}.{name}"))

    if type(module) is nn.Linear:
        return "linear", {"input": x, "weight": param("weight"), "bias": param("bias")}
    if type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        return "convolution", {
            "input": x,
            "weight": param("weight"),
            "bias": param("bias"),
            "transposed": False,
            "groups": module.groups,
        }
    if type(module) is nn.Embedding and module.max_norm is None:
        return "embedding", {"weight": param("weight"), "indices": x}
    if type(module) is nn.LayerNorm:
        return "layer_norm", {
            "input": x,
            "normalized_shape": list(module.normalized_shape),
            "weight": param("weight"),
            "bias": param("bias"),
            "eps": module.eps,
        }
    if type(module) is nn.GroupNorm:
        return "group_norm", {
            "input": x,
            "num_groups": module.num_groups,
            "weight": param("weight"),
            "bias": param("bias"),
            "eps": module.eps,
        }
    if type(module) is nn.RMSNorm:
        return "rms_norm", {
            "input": x,
            "normalized_shape": list(module.normalized_shape),
            "weight": param("weight"),
            "eps": module.eps,
        }
    if type(module) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
        return "dropout", {"input": x, "p": module.p, "train": module.training}
    if type(module) is nn.Identity:
        return "alias", {"self": x}
    if type(module) is nn.Softmax:
        return "softmax", {"self": x, "dim": module.dim}
    if type(module) is nn.Flatten:
        return "flatten", {"self": x, "start_dim": module.start_dim, "end_dim": module.end_dim}
    return None


def _getitem(value, index):
    """Basic indexing `x[...]` with slices only is a slice along the sliced axes; `x[None]` adds axes;
    `x[:, i]` is a select; `x[t]` with one tensor `t` is `aten.index` (a row lookup: `table[positions]`)."""
    if isinstance(index, torch.fx.Node):
        return "index", {"self": value, "indices": [index]}
    items = index if isinstance(index, tuple) else (index,)
    if None in items and all(i is None or i == slice(None) for i in items):
        return "unsqueeze", {"self": value}  # `pos[None]`: new axes of size 1 (a reshape)
    integers = [position for position, i in enumerate(items) if isinstance(i, int)]
    if len(integers) == 1 and all(i == slice(None) for i in items if not isinstance(i, int)):
        return "select", {"self": value, "dim": integers[0], "index": items[integers[0]]}  # `x[:, :, -1]`
    if not all(isinstance(i, slice) or i is Ellipsis for i in items) or items.count(Ellipsis) > 1:
        return None
    axes, after_ellipsis = [], False
    for position, item in enumerate(items):
        if item is Ellipsis:
            after_ellipsis = True
            continue
        if item != slice(None):
            axes.append(position - len(items) if after_ellipsis else position)
    return "slice_axes", {"self": value, "dims": axes}


RENAMED_IN_PLACE = {"add_", "sub_", "mul_", "div_"}  # x.add_(y) on a fresh x: later readers of x read its result
VIEWS = {"view", "view_as", "reshape", "permute", "transpose", "t", "expand", "expand_as", "narrow", "select"}
VIEWS |= {"squeeze", "unsqueeze", "flatten", "unflatten", "split", "chunk", "unbind", "contiguous", "detach"}
VIEWS |= {"as_strided", "diagonal", "getitem", "getattr"}


def _name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _renamed_in_place(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor `node` changes in place, where its later readers can read `node`'s result instead.

    So is `h.add_(branch)` (Falcon's residual) when h is computed in the forward (not an input, a
    parameter or a view of another tensor, which would change too) and no view of h taken before
    is read after it (it would see the change). torch.export renames them so itself.
    """
    target = node.args[0] if node.args else None
    if node.op != "call_method" or node.target not in RENAMED_IN_PLACE or not isinstance(target, torch.fx.Node):
        return None
    if target.op in ("placeholder", "get_attr") or _name(target) in VIEWS:
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    views = [u for u in target.users if u is not node and _name(u) in VIEWS]
    while views:
        view = views.pop()
        if any(order[u] > order[node] for u in view.users):
            return None
        views += [u for u in view.users if _name(u) in VIEWS]
    return target


def _check_no_visible_mutation(graph_module: torch.fx.GraphModule) -> None:
    """symbolic_trace records in-place ops as if they were pure: refuse any whose target is read again,
    unless the capture renames its later readers (`_renamed_in_place`).

    (`x = relu_(linear(h))` is fine, `y = linear(h); y.mul_(g); return ln(y) + y` is renamed, so is
    `h.add_(f(h))`; `h[:, :1].add_(…)` changes h through a view and is refused.)
    """
    modules = dict(graph_module.named_modules())
    for node in graph_module.graph.nodes:
        name = _name(node)
        inplace = (
            (node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__"))
            or (node.op == "call_function" and (node.target is operator.setitem or node.kwargs.get("inplace")))
            or (node.op == "call_module" and getattr(modules.get(node.target), "inplace", False))
        )
        target = node.args[0] if node.args else None
        if inplace and isinstance(target, torch.fx.Node) and len(target.users) > 1 and not _renamed_in_place(node):
            raise TypeError(
                f"in-place {name or node.target} at node {node.name} changes {target.name}, which is "
                "read again; symbolic_trace graphs do not track mutation"
            )


def _from_symbolic_trace(model: nn.Module, args: tuple, kwargs: dict) -> Capture:
    graph_module = torch.fx.symbolic_trace(model)
    _check_no_visible_mutation(graph_module)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    values = _bind_forward(model, args, kwargs, [n.target for n in placeholders])
    ShapeProp(graph_module).propagate(*values)
    result = Capture(SYMBOLIC_TRACE, [], [], [], {}, {})
    names: dict[str, str] = {}  # fx node name → tensor name
    fqns: dict[str, str] = {}  # constant tensor name → its path in the model

    def add_constant(fqn: str) -> str:
        name = _constant_name(fqn)
        tensor = _get_attr(model, fqn)
        result.constants[name], result.shapes[name], fqns[name] = tensor, tuple(tensor.shape), fqn
        return name

    for node, value in zip(placeholders, values, strict=False):
        if isinstance(value, torch.Tensor):
            names[node.name] = node.name
            result.inputs.append(node.name)
            result.shapes[node.name] = tuple(value.shape)
    modules = dict(model.named_modules())
    for node in graph_module.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if node.op == "get_attr":
            if isinstance(_get_attr(model, node.target), torch.Tensor):
                names[node.name] = add_constant(node.target)
        elif node.op == "output":
            result.outputs = [names[n.name] for n in node.all_input_nodes if n.name in names]
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0].meta.get("tensor_meta"), (list, tuple))
            and not hasattr(node.args[0].meta["tensor_meta"], "shape")  # a tuple of tensors, not TensorMetadata
        ):
            if hasattr(meta, "shape"):  # an item of a tuple-valued call, named by the call's outputs
                names[node.name] = node.name
                result.shapes[node.name] = tuple(meta.shape)
        elif node.op in ("call_function", "call_method", "call_module") and (
            hasattr(meta, "shape") or isinstance(meta, (list, tuple))
        ):
            if node.op == "call_module":
                module = modules[node.target]
                for attr, held in list(module._parameters.items()) + list(module._buffers.items()):
                    if held is not None:
                        add_constant(f"{node.target}.{attr}" if node.target else attr)
            if hasattr(meta, "shape"):
                result.shapes[node.name] = tuple(meta.shape)
            names[node.name] = node.name
            result.calls.append(_traced_call(node, modules, names))
            if (target := _renamed_in_place(node)) is not None:
                names[target.name] = node.name  # later readers of the target read the changed value
    for call in result.calls:
        for ref in call.refs():
            if ref in fqns:
                module, _, attr = fqns[ref].rpartition(".")
                result.reads[(call.node, ref)] = Attr(module, attr)
    return result


def _bind_forward(model: nn.Module, args: tuple, kwargs: dict, params: list[str]) -> list:
    """The example inputs in placeholder order (symbolic_trace makes one placeholder per forward argument)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    return [values[name] for name in params]


def _traced_call(node: torch.fx.Node, modules: dict, names: dict[str, str]) -> Call:
    stack = [(key, entry[0]) for key, entry in (node.meta.get("nn_module_stack") or {}).items()]
    call_key, module = stack[-1] if stack else ("", "")
    outputs = [node.name] if hasattr(node.meta.get("tensor_meta"), "shape") else _tuple_outputs(node)
    lowered, target = None, str(node.target)
    try:
        if node.op == "call_module":
            target = f"nn.{type(modules[node.target]).__name__}"
            lowered = _module_call(modules[node.target], str(node.target), node.args, node.kwargs)
            module = call_key = node.target
        elif node.op == "call_method":
            target = f"Tensor.{node.target}"
            if node.target in METHODS:
                lowered = METHODS[node.target](*node.args, **node.kwargs)
        elif node.target is operator.getitem:
            target = "Tensor.__getitem__"
            lowered = _getitem(*node.args)
        elif node.target in FUNCTIONS:
            target = f"{getattr(node.target, '__module__', None) or 'torch'}.{node.target.__name__}"
            lowered = FUNCTIONS[node.target](*node.args, **node.kwargs)
        else:
            target = getattr(node.target, "__qualname__", str(node.target))
    except TypeError:  # called with arguments the table does not model
        lowered = None
    op, args = lowered if lowered is not None else (target, {"inputs": [*node.args, *node.kwargs.values()]})
    converted = {key: _convert(value, names) for key, value in args.items()}
    return Call(node.name, op, converted, outputs, target, module, call_key, tuple(path for _, path in stack))
