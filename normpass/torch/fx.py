"""PyTorch front end: the zero-mean graph of a captured module (ATen op → rule table).

The capture (`torch/capture.py`) gives calls in ATen vocabulary; this module classifies each with the
same rules the ONNX front end uses (see `graph.py`), so the shared analysis and planner decide
both front ends alike:

* general linear, when its weight (and bias) is a parameter or buffer: `aten.linear` (nn.Linear,
  F.linear; W [out, in]), `aten.addmm` / `aten.mm` / `aten.matmul` (HF Conv1D and `x @ W`;
  W [in, out]), `aten.embedding` (a [V, d] table), `aten.convolution` with `groups == 1`
  (output channels on axis 1);
* residual `add` / `sub` of two tensors (position tables and CLS tokens are constants added into
  the stream; `x − mean(x)` is already centred); scalar `mul` / `div` and `neg`;
* value-preserving ops (`alias`, `clone`, float casts, dropout at inference) and layout ops:
  views, permutes, `cat`, slices, splits, `select`, `index` (one index tensor: on a parameter
  table it is an embedding), `roll`, `expand` (and `repeat` along axes of size 1), zero padding
  of one axis, interpolation (`F.interpolate`: `upsample_*`, one linear map of the spatial axes for
  every batch and channel, as ONNX `Resize`); `zeros_like` and kin read only a shape; an in-place
  `add_`/`sub_`/`mul_`/`div_` is its out-of-place op where nothing reads its target after it (Falcon's residual `add_`);
  dropout at inference, copies and aliases make no node (their readers read their input), so a
  LayerScale after a dropout is seen next to its layer; calls whose values nothing reads are left out;
* norms: `aten.layer_norm` (nn.LayerNorm, F.layer_norm; a LayerNorm *module*, which the rewrite
  swaps, is any module whose forward is that call over its own weight and bias, with at most a
  permute on each side: timm's LayerNorm2d, HF's ConvNextLayerNorm), `aten.group_norm`,
  `aten.rms_norm`, and any module whose class name ends in `RMSNorm` (HF `LlamaRMSNorm` and kin,
  which decompose into pow/mean/rsqrt/mul) as one already-normalizing node;
* `softmax` is shift-invariant; everything else is opaque.

Names: a norm is named by its module path (`model.transformer.h.0.ln_1`, `…@1` for a second call
of the same module); other nodes by `module path/fx node`; constants by their path in the model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from ..core.algebra import has_zero_mean, is_uniform
from ..core.graph import ALREADY_RMS, NodeKind, NormInfo, NormType, Rule, ZeroMeanGraph, ZNode
from ..core.rules import (
    Broadcast,
    Centered,
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
from .capture import Attr, Call, Capture, Ref


@dataclass(frozen=True)
class LinearParams:
    """The constants of a general linear node and the axes the rewrite edits them along.

    `out_axis` of `weight` indexes output features (centred); `in_axis` indexes input features (a
    norm's γ migrates along it), None where the input is not a feature vector (embedding, conv).
    `bias_axis` is the bias's output-feature axis, None where it broadcasts (its centred value is 0).
    `migratable` is False where the op scales its terms (addmm with α or β ≠ 1).
    """

    weight: str
    out_axis: int
    in_axis: int | None
    bias: str | None = None
    bias_axis: int | None = None
    migratable: bool = True


@dataclass(frozen=True)
class NodeRef:
    """`ZNode.ref` of the PyTorch front end: the call, and what the rewrite needs to know about it."""

    call: Call
    linear: LinearParams | None = None
    identity: bool = False  # output is the input, up to layout (views, aliases, dropout at inference)


Permutation = tuple[int, ...]
Layout = tuple[Permutation | None, Permutation | None]  # the permutes before and after a LayerNorm module's norm


@dataclass(frozen=True)
class NormSite:
    """`NormInfo.ref`: where a norm lives in the module tree, and whether a module swap can replace it.

    `layout` is the permutes the module's forward makes around its `layer_norm` (a channels-first
    LayerNorm2d: (0, 2, 3, 1) before, (0, 3, 1, 2) after), which the swapped-in RMSNorm keeps.
    """

    call: Call
    module: str
    replace_blocked: str | None = None  # None when the call is a LayerNorm module's own forward
    layout: Layout = (None, None)


@dataclass
class TorchGraph:
    """A module's zero-mean graph plus what the rewrite needs: which attribute each constant read uses."""

    model: nn.Module
    capture: Capture
    zmg: ZeroMeanGraph
    node_of_call: dict[str, str] = field(default_factory=dict)  # fx node → zero-mean graph node

    def attr(self, node: str, tensor: str) -> Attr | None:
        """The module attribute through which zero-mean graph node `node` reads constant `tensor`."""
        return self.capture.reads.get((self.zmg.nodes[node].ref.call.node, tensor))

    def uses(self) -> dict[Attr, list[tuple[str, str]]]:
        """Every (zero-mean graph node, constant) read of each attribute."""
        found: dict[Attr, list[tuple[str, str]]] = {}
        for (fx_node, tensor), attr in self.capture.reads.items():
            if attr is not None and fx_node in self.node_of_call:
                entry = (self.node_of_call[fx_node], tensor)
                if entry not in found.setdefault(attr, []):
                    found[attr].append(entry)
        return found


@dataclass(frozen=True)
class Classified:
    kind: NodeKind
    rule: Rule
    inputs: list[str] | None = None  # None: every tensor argument, in order
    linear: LinearParams | None = None
    identity: bool = False


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU NumPy copy; dtypes NumPy lacks (bfloat16) widen to float32."""
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.float().numpy()


# --- op table ----------------------------------------------------------------------------------


class _Context:
    """Lookups the handlers share: shapes, constants, producers and readers of tensors."""

    def __init__(self, capture: Capture):
        self.capture = capture
        self.producer = {out: call for call in capture.calls for out in call.outputs if out}
        self.readers: dict[str, set[str]] = {}
        for call in capture.calls:
            for ref in call.refs():
                self.readers.setdefault(ref, set()).add(call.node)
        self.used = set(self.readers) | set(capture.outputs)
        self.order = {call.node: position for position, call in enumerate(capture.calls)}

    def transposed_constant(self, tensor, reader: Call) -> Ref | None:
        """The matrix W if `tensor` is Wᵀ of a parameter W read by `reader` alone; the read moves to `reader`.

        So the layer reads its parameter itself, as nn.Linear does, and centring it is `reader`'s edit.
        """
        producer = self.producer.get(tensor)
        if producer is None or producer.op not in ("t", "numpy_T", "transpose", "permute") or self.rank(tensor) != 2:
            return None
        source = producer.args["self"]
        dims = producer.args.get("dims")
        if not self.is_constant(source) or (dims is not None and [d % 2 for d in dims] != [1, 0]):
            return None
        if self.readers.get(tensor) != {reader.node} or tensor in self.capture.outputs:
            return None
        reads = self.capture.reads
        if (producer.node, source) in reads:
            reads[(reader.node, source)] = reads.pop((producer.node, source))
        return source

    def mutation_seen(self, call: Call) -> str | None:
        """Why in-place `call` (x.add_(y): Falcon's residual) is not the same as its out-of-place op, or None.

        It is the same when nothing reads `x` after it (every later reader reads the call's output:
        torch.export renames them) and `x` is no view of another tensor, which it would change too.
        """
        target = call.args["self"]
        later = [r for r in self.readers.get(target, set()) if self.order.get(r, -1) > self.order[call.node]]
        if later or target in self.capture.outputs or self.is_constant(target):
            return f"{call.target} changes {target}, which is read again after it"
        if self.view_base(target) != target:
            return f"{call.target} changes {target}, a view of {self.view_base(target)}"
        return None

    def view_base(self, tensor: str) -> str:
        """The tensor that `tensor` is a view of (through views, slices, permutes), or itself."""
        producer = self.producer.get(tensor)
        while producer is not None and producer.op in VIEW_OPS and isinstance(producer.args.get("self"), Ref):
            tensor = producer.args["self"]
            producer = self.producer.get(tensor)
        return tensor

    def changed_through_views(self) -> dict[str, str]:
        """Tensors that an in-place op changes through a view of them, with the op: their readers read
        values the graph does not show."""
        changed = {}
        for call in self.capture.calls:
            if call.op.endswith("_") and isinstance(call.args.get("self"), Ref):
                base = self.view_base(call.args["self"])
                if base != call.args["self"]:
                    changed[base] = f"{call.target} {call.node} changes it in place through a view"
        return changed

    def rank(self, tensor) -> int | None:
        shape = self.capture.shapes.get(tensor)
        return None if shape is None else len(shape)

    def is_constant(self, tensor) -> bool:
        return isinstance(tensor, Ref) and tensor in self.capture.constants


def _opaque(reason: str) -> Classified:
    return Classified(NodeKind.OTHER, Opaque(reason))


def _axis(dim, rank: int | None) -> int | None:
    if not isinstance(dim, int) or rank is None:
        return None
    return dim % rank if rank else 0


def _general_linear(ctx, call, x, weight, bias, out_axis, in_axis, rule_axis, bias_axis, migratable=True) -> Classified:
    if not ctx.is_constant(weight) or (bias is not None and not ctx.is_constant(bias)):
        return _opaque("its weight or bias is computed at run time")
    if ctx.rank(weight) != 2 or rule_axis is None:
        return _opaque("its weight is not a matrix, or its output rank is unknown")
    if bias is not None and bias_axis is not None:
        shape = ctx.capture.shapes[bias]
        bias_axis = bias_axis % len(shape) if shape and shape[bias_axis] != 1 else None
    params = LinearParams(weight, out_axis, in_axis, bias, bias_axis, migratable)
    return Classified(NodeKind.LINEAR, Linear(rule_axis), [x, weight] + ([bias] if bias else []), params)


def _last_axis(ctx, call):
    rank = ctx.rank(call.node)
    return None if rank is None else rank - 1


def _linear(ctx, call):  # F.linear / nn.Linear: y = x·Wᵀ + b, W [out, in]
    a = call.args
    return _general_linear(ctx, call, a["input"], a["weight"], a["bias"], 0, 1, _last_axis(ctx, call), -1)


def _addmm(ctx, call):  # HF Conv1D: y = β·b + α·x·W, W [in, out]
    a = call.args
    return _general_linear(
        ctx,
        call,
        a["mat1"],
        a["mat2"],
        a["self"],
        1,
        0,
        _last_axis(ctx, call),
        -1,
        a.get("alpha", 1) == 1 and a.get("beta", 1) == 1,
    )


def _mm(ctx, call):  # x·W, W [in, out]
    a = call.args
    other = a.get("mat2", a.get("other"))
    if ctx.is_constant(a["self"]):
        return _opaque("multiplies a constant on the left")
    transposed = ctx.transposed_constant(other, call)
    if transposed is not None:  # x·Wᵀ with W [out, in] (Falcon's `x @ self.weight.T`)
        return _general_linear(ctx, call, a["self"], transposed, None, 0, 1, _last_axis(ctx, call), None)
    return _general_linear(ctx, call, a["self"], other, None, 1, 0, _last_axis(ctx, call), None)


def _embedding(ctx, call):  # a lookup in a [V, d] table: rows are centred along d
    a = call.args
    if not ctx.is_constant(a["weight"]):
        return _opaque("looks up a table computed at run time")
    params = LinearParams(a["weight"], 1, None)
    return Classified(NodeKind.LINEAR, Linear(_last_axis(ctx, call)), [a["indices"], a["weight"]], params)


def _convolution(ctx, call):  # W [Cout, Cin/groups, k…]; output channels on axis 1
    a = call.args
    if a.get("transposed"):
        return _opaque("a transposed convolution is not centred by normpass")
    if a.get("groups", 1) != 1:
        return _opaque("a grouped or depthwise convolution cannot be centred (seed 003 §3)")
    if not ctx.is_constant(a["weight"]) or (a.get("bias") is not None and not ctx.is_constant(a["bias"])):
        return _opaque("its weight is computed at run time")
    bias = a.get("bias")
    params = LinearParams(a["weight"], 0, None, bias, 0 if bias else None)
    return Classified(NodeKind.LINEAR, Linear(1), [a["input"], a["weight"]] + ([bias] if bias else []), params)


def _add(ctx, call):  # residual add, bias add; x − mean(x) is already centred
    a, b = call.args["self"], call.args["other"]
    if isinstance(a, Ref) and isinstance(b, Ref):
        if call.op == "sub":
            mean = ctx.producer.get(b)
            if mean is not None and mean.op == "mean" and mean.args.get("self") == a and mean.args.get("keepdim"):
                dims = mean.args.get("dim")
                dims = [dims] if isinstance(dims, int) else dims
                axis = _axis(dims[0], ctx.rank(a)) if isinstance(dims, (list, tuple)) and len(dims) == 1 else None
                if axis is not None:
                    return Classified(NodeKind.CENTERED, Centered(axis), [a])
        return Classified(NodeKind.RESIDUAL, Sum(), [a, b])
    tensor, number = (a, b) if isinstance(a, Ref) else (b, a)
    if number == 0 and isinstance(tensor, Ref):
        return Classified(NodeKind.SCALAR, Scale(0, None), [tensor], identity=True)
    return _opaque(f"adds the Python number {number}, which cannot be centred")


def _mul(ctx, call):  # x·s: s must be constant along the axis (the analysis decides which operand)
    a, b = call.args["self"], call.args["other"]
    if isinstance(a, Ref) and isinstance(b, Ref):
        return Classified(NodeKind.SCALAR, Scale(None, None), [a, b])
    return Classified(NodeKind.SCALAR, Scale(0, None), [a if isinstance(a, Ref) else b])


def _div(ctx, call):  # x / s
    a, b = call.args["self"], call.args["other"]
    if call.args.get("rounding_mode") is not None or not isinstance(a, Ref):
        return _opaque("a rounding or reciprocal division is not linear in x")
    if isinstance(b, Ref):
        return Classified(NodeKind.SCALAR, Scale(0, 1), [a, b])
    return Classified(NodeKind.SCALAR, Scale(0, None), [a])


def _unary(ctx, call):  # −x
    return Classified(NodeKind.SCALAR, Scale(0, None), [call.args["self"]])


def _same(ctx, call):  # alias, clone, contiguous, …: the same values
    return Classified(NodeKind.SCALAR, Scale(0, None), [call.refs()[0]], identity=True)


def _cast(ctx, call):  # a float → float cast is linear up to rounding
    dtype = call.args.get("dtype")
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return Classified(NodeKind.SCALAR, Scale(0, None), [call.args["self"]], identity=True)
    return _opaque("casts to a non-float type")


def _dropout(ctx, call):  # identity at inference
    if call.args.get("train"):
        return _opaque("dropout in training mode; call model.eval() first")
    return Classified(NodeKind.SCALAR, Scale(0, None), [call.refs()[0]], identity=True)


def _regroup(ctx, call):  # reshape-like: the axis is intact iff size and suffix match
    return Classified(NodeKind.LAYOUT, Regroup(), [call.args["self"]], identity=True)


def _permute(ctx, call):
    rank = ctx.rank(call.args["self"])
    if rank is None:
        return _opaque("a permute of unknown rank")
    if call.op == "permute":
        perm = [_axis(d, rank) for d in call.args["dims"]]
    else:
        perm = list(range(rank))
        if call.op == "transpose":
            i, j = _axis(call.args["dim0"], rank), _axis(call.args["dim1"], rank)
            perm[i], perm[j] = perm[j], perm[i]
        elif call.op == "numpy_T" or rank == 2:  # x.T reverses every axis; t swaps a matrix's
            perm.reverse()
    return Classified(NodeKind.LAYOUT, Permute(tuple(perm)), [call.args["self"]])


def _expand(ctx, call):  # broadcast over other axes
    return Classified(NodeKind.LAYOUT, Broadcast(), [call.args["self"]])


def _repeat(ctx, call):  # x.repeat(r…) along axes of size 1 is x.expand (XCiT's position encoding per image)
    shape, repeats = ctx.capture.shapes.get(call.args["self"]), list(call.args["repeats"])
    if shape is None or len(repeats) != len(shape):
        return _opaque("repeats into more axes than it has")
    if any(r != 1 and d != 1 for r, d in zip(repeats, shape, strict=True)):
        return _opaque("repeats (tiles) an axis longer than 1")
    return Classified(NodeKind.LAYOUT, Broadcast(), [call.args["self"]])


def _cat(ctx, call):  # zero-mean parts concatenate to zero mean
    axis = _axis(call.args["dim"], ctx.rank(call.node))
    if axis is None:
        return _opaque("a concatenation of unknown rank")
    return Classified(NodeKind.LAYOUT, Concat(axis), list(call.args["tensors"]))


def _select_axes(ctx, call, dims) -> Classified:
    rank = ctx.rank(call.args["self"])
    axes = [_axis(d, rank) for d in dims] if isinstance(dims, (list, tuple)) else [None]
    known = tuple(axis for axis in axes if axis is not None)
    if len(known) != len(axes):  # dims not a list, or an axis that cannot be resolved
        return Classified(NodeKind.LAYOUT, Select(None), [call.args["self"]])
    return Classified(NodeKind.LAYOUT, Select(known), [call.args["self"]])


def _slice(ctx, call):  # slice / split / narrow / roll along `dim`: other axes' slices stay whole
    if call.op == "slice_axes":
        return _select_axes(ctx, call, call.args["dims"])
    if call.op == "roll":
        dims = call.args.get("dims")
        if not dims:
            return _opaque("rolls the flattened tensor")
        return _select_axes(ctx, call, dims)
    selected = _select_axes(ctx, call, [call.args.get("dim", 0)])
    if call.op != "slice" or not isinstance(selected.rule, Select) or not selected.rule.axes:
        return selected
    return replace(selected, rule=Select(selected.rule.axes, _slice_bounds(ctx, call, selected.rule.axes[0])))


def _slice_bounds(ctx, call, axis: int) -> tuple[tuple[int, int, int], ...] | None:
    """(axis, start, stop) of `x[..., start:end]` along a static `axis`, with step 1 (`rules.Select`)."""
    a = call.args
    size = (ctx.capture.shapes.get(a["self"]) or ())[axis : axis + 1]
    start, end = a.get("start") or 0, a.get("end")
    if a.get("step", 1) != 1 or len(size) != 1 or not all(isinstance(v, int) for v in (size[0], start, end or 0)):
        return None
    begin, stop, _ = slice(start, end).indices(size[0])
    return ((axis, begin, stop),)


def _select(ctx, call):  # x.select(dim, i): a gather with a scalar index
    axis = _axis(call.args["dim"], ctx.rank(call.args["self"]))
    if axis is None:
        return _opaque("a select of unknown rank")
    return Classified(NodeKind.LAYOUT, Take(axis, 0), [call.args["self"]])


def _index_select(ctx, call):
    axis = _axis(call.args["dim"], ctx.rank(call.args["self"]))
    if axis is None:
        return _opaque("an index_select of unknown rank")
    return Classified(NodeKind.LAYOUT, Take(axis, 1), [call.args["self"], call.args["index"]])


def _index(ctx, call):  # x[i] with one index tensor: rows of a parameter table (an embedding), else a gather
    indices = call.args["indices"]
    given = [(axis, index) for axis, index in enumerate(indices) if index is not None]
    if len(given) != 1 or not isinstance(given[0][1], Ref):
        return _opaque("indexes with several tensors or a mask")
    (axis, index), table = given[0], call.args["self"]
    if ctx.is_constant(table) and axis == 0 and ctx.rank(table) == 2:
        params = LinearParams(table, 1, None)
        return Classified(NodeKind.LINEAR, Linear(_last_axis(ctx, call)), [index, table], params)
    return Classified(NodeKind.LAYOUT, Take(axis, ctx.rank(index)), [table, index])


def _shape_only(ctx, call):  # zeros_like(x), x.new_ones(…): values that do not depend on x's
    return Classified(NodeKind.CONSTANT, ShapeOnly(), [call.refs()[0]])


def _pad(ctx, call):
    """Zero padding of one axis: like a gather along it (padded slices are zero vectors, shifts stay
    constant along every other axis); padding along the normalized axis blocks, as a gather does."""
    a = call.args
    if a.get("mode", "constant") != "constant" or a.get("value") not in (None, 0):
        return _opaque("pads with a non-zero value or by reflection")
    rank, pad = ctx.rank(a["self"]), list(a["pad"])
    if rank is None:
        return _opaque("a pad of unknown rank")
    axes = [rank - 1 - i for i in range(len(pad) // 2) if pad[2 * i] != 0 or pad[2 * i + 1] != 0]
    if not axes:
        return Classified(NodeKind.SCALAR, Scale(0, None), [a["self"]], identity=True)
    if len(axes) > 1:
        return _opaque("pads several axes")
    return Classified(NodeKind.LAYOUT, Take(axes[0], 1), [a["self"]])


def _interpolate(ctx, call):  # F.interpolate: the same linear map of axes 2… for every (batch, channel) slice
    x = call.args.get("self", call.args.get("input"))
    if ctx.rank(x) is None:
        return _opaque("an interpolation of unknown rank")
    return Classified(NodeKind.LAYOUT, Mix((0, 1)), [x])


def _reduce(ctx, call):  # x.mean(dim) / x.sum(dim): the same average (sum) of rows for every row
    rank, dims = ctx.rank(call.args["self"]), call.args.get("dim")
    if rank is None:
        return _opaque(f"a {call.op} of unknown rank")
    dims = list(range(rank)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else dims
    axes = tuple(_axis(d, rank) for d in dims)
    if None in axes:
        return Classified(NodeKind.LAYOUT, Reduce(None, False), [call.args["self"]])
    return Classified(NodeKind.LAYOUT, Reduce(axes, bool(call.args.get("keepdim"))), [call.args["self"]])


def _softmax(ctx, call):  # not linear, but f(x + c·1) = f(x) along its axis
    axis = _axis(call.args["dim"], ctx.rank(call.args["self"]))
    if axis is None:
        return _opaque("a softmax over an unknown axis")
    return Classified(NodeKind.OTHER, ShiftInvariant(axis), [call.args["self"]])


UPSAMPLE = [f"upsample_{mode}" for mode in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d")]
UPSAMPLE += ["upsample_bicubic2d", "upsample_trilinear3d"]

OP_TABLE = {
    "linear": _linear,  # nn.Linear, F.linear: W [out, in]
    "addmm": _addmm,  # HF Conv1D, Linear on 2-D inputs: W [in, out]
    "mm": _mm,  # x·W with a parameter W
    "matmul": _mm,
    "embedding": _embedding,  # nn.Embedding: rows of a parameter table
    "convolution": _convolution,  # nn.Conv*d, groups == 1
    "conv1d": _convolution,
    "conv2d": _convolution,
    "conv3d": _convolution,
    "add": _add,  # residual add, constant (position table) add
    "sub": _add,  # residual difference, or x − mean(x)
    "mul": _mul,  # scale by a factor constant along the axis
    "div": _div,
    "neg": _unary,
    "alias": _same,
    "clone": _same,
    "contiguous": _same,
    "detach": _same,
    "lift_fresh_copy": _same,
    "_to_copy": _cast,
    "to": _cast,
    "type_as": _cast,
    "dropout": _dropout,  # identity in eval mode
    "feature_dropout": _dropout,
    "alpha_dropout": _dropout,
    "view": _regroup,
    "reshape": _regroup,
    "_unsafe_view": _regroup,
    "unsqueeze": _regroup,
    "squeeze": _regroup,
    "flatten": _regroup,
    "unflatten": _regroup,
    "permute": _permute,
    "transpose": _permute,
    "t": _permute,
    "numpy_T": _permute,
    "expand": _expand,
    "repeat": _repeat,
    "cat": _cat,
    "concat": _cat,
    "slice": _slice,
    "slice_axes": _slice,  # x[..., a:b] from symbolic_trace
    "split": _slice,
    "split_with_sizes": _slice,
    "chunk": _slice,
    "narrow": _slice,
    "roll": _slice,
    "select": _select,
    "index_select": _index_select,
    "index": _index,  # table[positions] (Whisper's positional embedding), x[idx]
    "zeros_like": _shape_only,
    "ones_like": _shape_only,
    "empty_like": _shape_only,
    "full_like": _shape_only,
    "new_zeros": _shape_only,
    "new_ones": _shape_only,
    "new_empty": _shape_only,
    "new_full": _shape_only,
    "pad": _pad,
    "constant_pad_nd": _pad,
    **dict.fromkeys(UPSAMPLE, _interpolate),  # F.interpolate; DINOv2's position table resized to the image
    "mean": _reduce,  # mean-pooled heads: a mean over tokens or space
    "sum": _reduce,
    "softmax": _softmax,
    "_softmax": _softmax,
    "log_softmax": _softmax,
    "_log_softmax": _softmax,
}

NORM_OPS = {
    "layer_norm": NormType.LAYER,
    "native_layer_norm": NormType.LAYER,
    "group_norm": NormType.GROUP,
    "native_group_norm": NormType.GROUP,
    "rms_norm": NormType.RMS,
}


IN_PLACE = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}
PASS_THROUGH = {"dropout", "feature_dropout", "alpha_dropout", "alias", "clone", "contiguous", "detach"}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "slice", "select", "narrow", "split", "split_with_sizes", "chunk"}
VIEW_OPS |= {"unsqueeze", "squeeze", "flatten", "unflatten", "permute", "transpose", "t", "numpy_T", "expand"}
VIEW_OPS |= {"alias", "as_strided", "diagonal", "unbind", "view_as", "detach"}


def classify(ctx: _Context, call: Call) -> Classified:
    handler = OP_TABLE.get(IN_PLACE.get(call.op, call.op))
    if handler is None:
        return _opaque(f"{call.target} is not linear in its input")
    if call.op in IN_PLACE and (why := ctx.mutation_seen(call)):
        return _opaque(why)
    try:
        return handler(ctx, call)
    except (KeyError, IndexError, TypeError):  # arguments of an unexpected form
        return _opaque(f"{call.target} is called with arguments normpass does not model")


# --- norms -------------------------------------------------------------------------------------


def _is_rms_module(module: nn.Module) -> bool:
    return isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def _norm_name(call: Call, own: bool, taken: set[str]) -> str:
    if own:
        base = call.module + (f"@{call.call.rpartition('@')[2]}" if "@" in call.call else "")
    else:
        base = f"{call.module}/{call.node}" if call.module else call.node
    name, index = base, 1
    while name in taken:
        index += 1
        name = f"{base}@{index}"
    taken.add(name)
    return name


def _norm(tg: TorchGraph, ctx: _Context, call: Call, taken: set[str]) -> tuple[NormInfo, list[str]]:
    """NormInfo of a norm op, and the inputs of its zero-mean graph node."""
    norm_type = NORM_OPS[call.op]
    a = call.args
    x = a["input"]
    gamma, beta = a.get("weight"), a.get("bias")
    module = tg.model.get_submodule(call.module)
    layout = _layer_norm_module(tg, ctx, call) if norm_type is NormType.LAYER else "it is not a LayerNorm"
    own = not isinstance(layout, str)
    name = _norm_name(call, own or _owns(module, norm_type), taken)
    rank = ctx.rank(x)
    width = len(a.get("normalized_shape") or [None])
    extra = [o for o in call.outputs[1:] if o and o in ctx.used]
    unsupported = None
    if norm_type is NormType.GROUP:
        unsupported = (
            "GroupNorm: centring leaves a shift that varies over spatial positions, which GroupNorm "
            "does not remove; not rewritten"
        )
    elif norm_type is NormType.RMS:
        unsupported = ALREADY_RMS
    elif rank is None:
        unsupported = f"the rank of {x} is unknown, so the normalized axis cannot be tracked"
    elif width != 1:
        unsupported = (
            f"normalizes over axes {rank - width}..{rank - 1}: zero mean along one axis does not make a "
            "multi-axis LayerNorm an RMSNorm"
        )
    elif extra:
        unsupported = "its mean/rstd outputs are used"
    elif any(t is not None and not ctx.is_constant(t) for t in (gamma, beta)):
        unsupported = "its γ or β is computed at run time, not a parameter"
    output_centred = (
        norm_type is NormType.LAYER
        and not unsupported
        and (
            (gamma is None or is_uniform(to_numpy(tg.capture.constants[gamma])))
            and (beta is None or has_zero_mean(to_numpy(tg.capture.constants[beta])))
        )
    )
    blocked = (
        None
        if own
        else (
            f"{call.target} is called inside {type(module).__name__} {call.module or '(root)'}.forward, which is "
            f"not a LayerNorm module ({layout}): the PyTorch rewrite swaps LayerNorm modules only "
            "(the ONNX front end can fold it)"
        )
    )
    info = NormInfo(
        name=name,
        op=type(module).__name__ if own else call.target,
        norm_type=norm_type,
        input=x,
        output=call.outputs[0],
        axis=rank - 1 if rank is not None and width == 1 else None,
        epsilon=float(a.get("eps") or 0.0),
        scale=gamma,
        bias=beta,
        output_centred=output_centred,
        unsupported=unsupported,
        ref=NormSite(call, call.module, blocked, layout if not isinstance(layout, str) else (None, None)),
    )
    return info, [x] + [t for t in (gamma, beta) if t is not None]


LAYOUT_ONLY = ("permute", "contiguous", "clone", "alias", "detach")  # ops a LayerNorm module may make around it


def _layer_norm_module(
    tg: TorchGraph, ctx: _Context, call: Call
) -> tuple[Permutation | None, Permutation | None] | str:
    """The permutes around `call` if the module making it is a LayerNorm, else why it is not.

    A LayerNorm module (nn.LayerNorm and its subclasses: timm's LayerNorm and LayerNorm2d, HF's
    ConvNextLayerNorm; or any module) has no submodules, reads γ and β as its own `weight` and
    `bias`, and its forward is the `layer_norm` alone or a chain of one permute before it, one after,
    and copies (a channels-first LayerNorm), whose inner values nothing else reads. Swapping it for
    an RMSNorm with the same permutes computes the same function of the module's input.
    """
    if not call.module:
        return "the model itself"
    module = tg.model.get_submodule(call.module)
    if next(module.children(), None) is not None:
        return "it has submodules"
    reads = tg.capture.reads
    for tensor, name in ((call.args.get("weight"), "weight"), (call.args.get("bias"), "bias")):
        if tensor is not None and reads.get((call.node, tensor)) != Attr(call.module, name):
            return f"its {'γ' if name == 'weight' else 'β'} is not its own `{name}`"
    region = [c for c in tg.capture.calls if c.call == call.call]
    permutes: list[Permutation | None] = [None, None]
    after = False
    for position, member in enumerate(region):
        source = call.args["input"] if member is call else member.refs()[0] if member.refs() else None
        if position and source != region[position - 1].outputs[0]:
            return "its forward is not one chain of calls"
        if position < len(region) - 1 and ctx.readers.get(member.outputs[0], set()) != {region[position + 1].node}:
            return "a value inside its forward is read outside it"
        if member is call:
            after = True
        elif member.op not in LAYOUT_ONLY:
            return f"its forward also calls {member.target}"
        elif member.op == "permute":
            rank = ctx.rank(member.args["self"])
            if permutes[after] is not None or rank is None:
                return "its forward permutes more than once on one side of the norm"
            permutes[after] = tuple(int(d) % rank for d in member.args["dims"])
    return permutes[0], permutes[1]


def _owns(module: nn.Module, norm_type: NormType) -> bool:
    """Whether the norm op is the whole forward of a GroupNorm / RMSNorm module (named after it)."""
    if norm_type is NormType.GROUP:
        return isinstance(module, nn.GroupNorm)
    return norm_type is NormType.RMS and _is_rms_module(module)


def _rms_regions(tg: TorchGraph) -> dict[str, list[Call]]:
    """Calls of modules named *RMSNorm that decompose into several ops, by module call.

    A leading cast of the input stays outside: `x.to(float32)` of a float32 tensor is `x` itself,
    so the caller's residual branch may read it.
    """
    regions: dict[str, list[Call]] = {}
    for call in tg.capture.calls:
        if call.call and _is_rms_module(tg.model.get_submodule(call.module)):
            regions.setdefault(call.call, []).append(call)
    for _key, calls in regions.items():
        while calls and calls[0].op in ("to", "_to_copy", "alias", "contiguous"):
            calls.pop(0)
    return {key: calls for key, calls in regions.items() if calls and not any(c.op in NORM_OPS for c in calls)}


def _region_norm(tg: TorchGraph, ctx: _Context, calls: list[Call], taken: set[str]):
    """One RMSNorm node for a decomposed RMSNorm module call: one input, one output, ≤ 1 weight.

    Returns (NormInfo, node inputs, fx nodes covered), or None if the calls are not of that form.
    """
    constants = tg.capture.constants
    produced = {o for c in calls for o in c.outputs if o}
    inside = {c.node for c in calls}
    inputs = {r for c in calls for r in c.refs() if r not in produced and r not in constants}
    weights = {r for c in calls for r in c.refs() if r in constants}
    outputs = [o for o in produced if ctx.readers.get(o, set()) - inside or o in tg.capture.outputs]
    if len(inputs) != 1 or len(outputs) != 1 or len(weights) > 1:
        return None
    first = calls[0]
    module = tg.model.get_submodule(first.module)
    x, weight = next(iter(inputs)), next(iter(weights), None)
    rank = len(tg.capture.shapes.get(x) or ()) or None
    info = NormInfo(
        name=_norm_name(first, True, taken),
        op=type(module).__name__,
        norm_type=NormType.RMS,
        input=x,
        output=outputs[0],
        axis=None if rank is None else rank - 1,
        epsilon=float(getattr(module, "variance_epsilon", getattr(module, "eps", 0.0)) or 0.0),
        scale=weight,
        unsupported=ALREADY_RMS,
        ref=NormSite(first, first.module, "already an RMSNorm"),
    )
    return info, [x] + ([weight] if weight else []), [c.node for c in calls]


# --- build -------------------------------------------------------------------------------------


def build_zero_mean_graph(model: nn.Module, capture: Capture, name: str = "model") -> TorchGraph:
    """Classify every call of `capture` and recognise its normalizations."""
    zmg = ZeroMeanGraph(model_name=name, shapes=dict(capture.shapes))
    zmg.graph_inputs = set(capture.inputs)
    zmg.graph_outputs = set(capture.outputs)
    for tensor_name, tensor in capture.constants.items():
        zmg.constants[tensor_name] = functools.partial(to_numpy, tensor)
    tg = TorchGraph(model, capture, zmg)
    ctx = _Context(capture)
    changed = ctx.changed_through_views()
    taken: set[str] = set()
    region_of: dict[str, list[Call]] = {}
    for calls in _rms_regions(tg).values():
        for call in calls:
            region_of[call.node] = calls
    done: set[str] = set()
    same: dict[str, str] = {}  # output of a pass-through call → the tensor it passes through

    def add_norm(info: NormInfo, inputs: list[str], members: list[str]) -> None:
        info = dataclasses.replace(info, input=same.get(info.input, info.input))
        _add_norm(tg, info, [same.get(t, t) for t in inputs], members)

    for call in capture.calls:
        if call.node in done:
            continue
        if call.node in region_of:
            found = _region_norm(tg, ctx, region_of[call.node], taken)
            if found is not None:
                info, inputs, members = found
                add_norm(info, inputs, members)
                done.update(members)
                continue
            for member in region_of[call.node]:
                region_of.pop(member.node, None)
        if call.op in NORM_OPS:
            info, inputs = _norm(tg, ctx, call, taken)
            add_norm(info, inputs, [call.node])
            continue
        if not call.op.endswith("_") and not any(o in ctx.used for o in call.outputs):
            continue  # dead: a value computed and never read (mBART's `inputs_embeds[:, :, -1]`)
        result = classify(ctx, call)
        if call.outputs and call.outputs[0] in changed:  # its value is not what the graph shows
            result = _opaque(changed[call.outputs[0]])
        inputs = [same.get(t, t) for t in (result.inputs if result.inputs is not None else call.refs())]
        if call.op in PASS_THROUGH and result.identity and len(inputs) == 1:
            same[call.outputs[0]] = inputs[0]  # no node: its readers read its input (a LayerScale after a dropout)
            continue
        node_name = _node_name(call)
        ref = NodeRef(call, result.linear, result.identity)
        zmg.add_node(ZNode(node_name, call.target, result.kind, result.rule, inputs, list(call.outputs), ref))
        tg.node_of_call[call.node] = node_name
    zmg.graph_outputs = {same.get(t, t) for t in capture.outputs}
    return tg


def _node_name(call: Call) -> str:
    """`module path/fx node`; just the path for a module's own call (symbolic_trace's call_module)."""
    if not call.module:
        return call.node
    return call.module if call.node == call.module.replace(".", "_") else f"{call.module}/{call.node}"


def _add_norm(tg: TorchGraph, info: NormInfo, inputs: list[str], members: list[str]) -> None:
    tg.zmg.norms.append(info)
    tg.zmg.add_node(ZNode(info.name, info.op, NodeKind.NORM, NormRule(info), inputs, [info.output], info.ref))
    for member in members:
        tg.node_of_call[member] = info.name
