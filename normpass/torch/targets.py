"""Where a norm's shift and affine can go in a PyTorch module, found on its zero-mean graph.

The module-level counterpart of `onnx/fold/targets.py`; both rewrites use it (the exact fold for γ/β,
the surrogates for c, γ and β). A norm writes y = u⊙γ + β from x (a surrogate: u = core(x − c)):

* **γ and β into linear layers** (`migration_targets`): when every path from y reaches, through
  views and aliases that keep the last axis, a linear layer contracting over it whose parameters
  nothing else reads, (u⊙γ + β)·W + b = u·W' + b' with W' = diag(γ)·W, b' = b + β·W.
* **β alone across a residual add** (`claim_residual`): an `add(y, s)` whose other summand s
  carries a private bias c_s (a linear layer's bias, or a parameter added in) takes
  (y − β) + (s + β): c_s' = c_s + β. γ then stays in the surrogate.
* **c into a private bias** (`shift_target`): when x is read by the norm alone and is such a sum,
  the bias takes b − c and the layer outputs x − c, exactly.

"Private" means one reader: editing that parameter changes nothing else, the module's other
calls included (every read of each parameter is checked through `TorchGraph.uses`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core.graph import NodeKind, ZNode
from .capture import Attr
from .fx import NodeRef, TorchGraph


@dataclass(frozen=True)
class BiasTarget:
    """A bias vector (a linear layer's, or a parameter summed in) that a shift or β can move into."""

    node: str  # the zero-mean graph node that reads it
    attr: Attr


def _ref(node: ZNode) -> NodeRef | None:
    return node.ref if isinstance(node.ref, NodeRef) else None


def _private(tg: TorchGraph, tensor: str) -> bool:
    """Whether one node reads `tensor` and it is not a model output."""
    return tensor not in tg.zmg.graph_outputs and len(tg.zmg.consumers.get(tensor, [])) == 1


def _only_reader(uses: dict, tg: TorchGraph, node: str, tensor: str) -> Attr | None:
    """The attribute `node` reads `tensor` through, if that is the attribute's only read."""
    attr = tg.attr(node, tensor)
    return attr if attr is not None and uses.get(attr) == [(node, tensor)] else None


def _two_term_add(node: ZNode) -> bool:
    """Whether `node` is `add(a, b)` of two different tensors, unscaled (a residual or bias sum)."""
    ref = _ref(node)
    return (
        ref is not None
        and node.kind is NodeKind.RESIDUAL
        and ref.call.op == "add"
        and ref.call.args.get("alpha", 1) == 1
        and len(node.inputs) == 2
        and node.inputs[0] != node.inputs[1]
    )


def private_bias(tg: TorchGraph, tensor: str, width: int, uses: dict) -> BiasTarget | None:
    """A bias summed into `tensor` through nodes that only it reads (see the module docstring)."""
    zmg = tg.zmg
    node = zmg.producer_of(tensor)
    ref = None if node is None else _ref(node)
    if node is None or ref is None:
        return None
    if ref.identity and node.inputs and _private(tg, node.inputs[0]):
        return private_bias(tg, node.inputs[0], width, uses)
    linear = ref.linear
    if linear is not None:
        if linear.bias is None or linear.bias_axis is None or zmg.shape(linear.bias) != (width,):
            return None
        attr = _only_reader(uses, tg, node.name, linear.bias)
        return None if attr is None else BiasTarget(node.name, attr)
    if not _two_term_add(node):
        return None
    for operand in node.inputs:
        if zmg.is_constant(operand) and zmg.shape(operand) == (width,):
            attr = _only_reader(uses, tg, node.name, operand)
            if attr is not None:
                return BiasTarget(node.name, attr)
    for operand in node.inputs:
        if not zmg.is_constant(operand) and _private(tg, operand):
            found = private_bias(tg, operand, width, uses)
            if found is not None:
                return found
    return None


def shift_target(tg: TorchGraph, norm_name: str, width: int, uses: dict) -> BiasTarget | None:
    """Where the shift c of a surrogate for `norm_name` can go: a private bias of its input."""
    norm = tg.zmg.norm_by_name(norm_name)
    return private_bias(tg, norm.input, width, uses) if _private(tg, norm.input) else None


def claim_residual(tg: TorchGraph, width: int, uses: dict):
    """A claim for `migration_targets`: an `add(y, s)` whose other summand carries a private bias."""

    def claim(node: ZNode, tensor: str) -> BiasTarget | None:
        if not _two_term_add(node):
            return None
        if (tg.zmg.shape(node.outputs[0]) or (None,))[-1] != width:
            return None
        other = node.inputs[1] if node.inputs[0] == tensor else node.inputs[0]
        if tg.zmg.is_constant(other) or not _private(tg, other):
            return None
        return private_bias(tg, other, width, uses)

    return claim


def _norm_called_once(tg: TorchGraph, norm_name: str):
    """(the norm, its output width) if its module is called once (an edit for it changes no other call),
    else (None, None)."""
    norm = tg.zmg.norm_by_name(norm_name)
    if sum(n.ref.module == norm.ref.module for n in tg.zmg.norms) > 1:
        return None, None
    return norm, (tg.zmg.shape(norm.output) or (None,))[-1]


def migration_targets(tg: TorchGraph, norm_name: str, uses: dict, needs_bias: bool, claim=None) -> list | None:
    """The linear nodes (and claimed `BiasTarget`s) that read a norm's output, if its affine can move into them.

    Views that keep the last axis, aliases, casts and inference dropout may sit in between; each
    linear target's parameters must be read by that node alone. `needs_bias`: a target without a
    bias must be an `nn.Linear`, which can be given one. `claim(node, tensor)` may take a consumer
    that is not such a layer.
    """
    zmg = tg.zmg
    norm, width = _norm_called_once(tg, norm_name)
    if norm is None:
        return None
    frontier, targets = [norm.output], []
    while frontier:
        tensor = frontier.pop()
        if tensor in zmg.graph_outputs:
            return None
        for node, index in zmg.consumers_of(tensor):
            ref = _ref(node)
            out_shape = zmg.shape(node.outputs[0]) or (None,)
            if ref is not None and ref.identity and index == 0 and out_shape[-1] == width:
                frontier.append(node.outputs[0])
                continue
            if claim is not None and (claimed := claim(node, tensor)) is not None:
                targets.append(claimed)
                continue
            linear = ref.linear if ref is not None else None
            if linear is None or index != 0 or linear.in_axis is None or not linear.migratable:
                return None
            if linear.bias is not None and linear.bias_axis is None:
                return None  # a broadcast bias cannot take β·W
            targets.append(node)
    for node in targets:
        if isinstance(node, BiasTarget):
            continue
        linear = node.ref.linear
        weight = _only_reader(uses, tg, node.name, linear.weight)
        if weight is None or (linear.bias is not None and _only_reader(uses, tg, node.name, linear.bias) is None):
            return None
        if linear.bias is None and needs_bias and type(tg.model.get_submodule(weight.module)) is not nn.Linear:
            return None  # nowhere to put β
    return targets or None


@dataclass
class Stream:
    """Where a surrogate's γ goes along the residual stream (`core/stream.py`): the linear layers
    that read the stream (their input rows take D), the linear layers that write into it through a
    residual add (their output rows and bias take 1/D), and the surrogates that read it (they take D)."""

    readers: list[ZNode]
    writers: list[ZNode]
    absorbers: list[str]


def _writer(tg: TorchGraph, tensor: str, width: int, uses: dict) -> ZNode | None:
    """The linear layer whose private output is `tensor` (through aliases only it reads), its weight
    and bias read by it alone, with a bias (if any) along the output features."""
    zmg = tg.zmg
    node = zmg.producer_of(tensor)
    ref = None if node is None else _ref(node)
    if node is None or ref is None or not _private(tg, tensor):
        return None
    if ref.identity and node.inputs:
        return _writer(tg, node.inputs[0], width, uses)
    linear = ref.linear
    if linear is None or not linear.migratable or linear.in_axis is None:
        return None
    shape = zmg.shape(linear.weight)
    if shape is None or shape[linear.out_axis] != width:
        return None
    if _only_reader(uses, tg, node.name, linear.weight) is None:
        return None
    if linear.bias is not None and (linear.bias_axis is None or _only_reader(uses, tg, node.name, linear.bias) is None):
        return None
    return node


def stream_targets(tg: TorchGraph, norm_name: str, absorbers: set[str], uses: dict) -> Stream | None:
    """The stream a norm's output starts, if every reader of it is a private linear layer, a residual
    add with a private linear writer, or one of `absorbers` (norms replaced by linear surrogates);
    None otherwise (a graph output, another reader, a shared parameter)."""
    zmg = tg.zmg
    norm, width = _norm_called_once(tg, norm_name)
    if norm is None or not isinstance(width, int):
        return None
    frontier, seen = [norm.output], {norm.output}
    stream = Stream([], [], [])
    while frontier:
        tensor = frontier.pop()
        if tensor in zmg.graph_outputs:
            return None
        for node, index in zmg.consumers_of(tensor):
            ref = _ref(node)
            keeps_width = (zmg.shape(node.outputs[0]) or (None,))[-1] == width
            follow = None
            if node.name in absorbers and index == 0:
                stream.absorbers.append(node.name)
            elif ref is not None and ref.identity and index == 0 and keeps_width:
                follow = node.outputs[0]
            elif ref is not None and ref.linear is not None:
                linear = ref.linear
                if index != 0 or linear.in_axis is None or not linear.migratable:
                    return None
                if _only_reader(uses, tg, node.name, linear.weight) is None:
                    return None
                stream.readers.append(node)
            elif _two_term_add(node) and keeps_width:
                other = node.inputs[1] if node.inputs[0] == tensor else node.inputs[0]
                writer = None if other in seen else _writer(tg, other, width, uses)
                if writer is None:
                    return None
                stream.writers.append(writer)
                follow = node.outputs[0]
            else:
                return None
            if follow is not None and follow not in seen:
                seen.add(follow)
                frontier.append(follow)
    linears = [n.name for n in stream.readers + stream.writers]
    return stream if len(set(linears)) == len(linears) else None
