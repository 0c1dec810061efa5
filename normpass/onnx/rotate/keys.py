"""Key centring: an exact, calibrated change of attention's key bias that narrows what a quantizer sees.

Softmax over an axis ignores a constant added along it: softmax(s + c) = softmax(s). Attention's
scores are S = A·B, B the keys laid out per head as Kᵀ, and K = Z + b with b the key projection's
bias along the features. Replacing b by b − m subtracts A·M from S, where M is m laid out as B is:
m is constant along every axis but the features, so M is constant along B's last axis (the keys), and
so is A·M along S's. Each row of scores loses one constant (q_i · m of its head), and the Softmax over
the keys gives exactly what it gave, for any m. With m the mean key over calibration data (per
feature), the keys are centred and the scores lose each row's offset q_i · mean(k): a per-tensor
quantizer of the keys, of Q·Kᵀ and of Softmax's input sees narrower ranges. No op is added.

The proof, per Softmax (`find_sites`), walking back from it; a site that fails any step is refused
with the node and the reason:

* the Softmax normalises the last axis (`axis` −1 or rank − 1; before opset 13 the same axes, which
  then flatten nothing after them);
* from the scores to the Softmax only `Mul`/`Div` by a scalar constant (the scores the dividend) and
  `Add`/`Sub` of anything (a mask): a constant of each row stays one;
* the scores are a `MatMul` whose B has rank ≥ 2, and B comes from an `Add` of a constant bias that
  is broadcast along the last axis only, through `Mul` by a scalar constant, `Transpose` and
  `Reshape`, with the axes that may carry the features tracked (`_reshape_features`: a split of the
  features into heads, a merge of heads with the batch); B's last axis must not be one of them;
* every tensor from the bias `Add` to the scores and from the scores to the Softmax has that one
  reader (besides `Shape`s) and is no graph output: nothing else sees the change.

`rotate --calib` applies it after the rotation (`rotator.Rotator.centre_keys`): the new bias is a new
initializer (a bias shared with another layer keeps its values there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from ..fold.targets import value_readers
from ..graph.constants import constant_values, is_constant
from ..graph.export import STANDARD_DOMAINS as STANDARD
from ..graph.frontend import OnnxGraph
from ..graph.values import attr, name_of


@dataclass(frozen=True)
class KeySite:
    """An attention whose key bias may change: `add` adds the bias (input `bias_index`) to the keys."""

    softmax: str
    add: ir.Node
    bias_index: int

    @property
    def keys(self) -> str:
        return name_of(self.add.outputs[0])


@dataclass
class KeyPlan:
    """The Softmaxes whose keys centre (`sites`) and the others with why not (`refused`: name → reason)."""

    sites: list[KeySite]
    refused: dict[str, str]

    @property
    def total(self) -> int:
        """The Softmaxes looked at."""
        return len(self.sites) + len(self.refused)

    def to_json(self) -> dict:
        return {
            "centred": [{"softmax": s.softmax, "bias_add": name_of(s.add)} for s in self.sites],
            "refused": [{"softmax": name, "reason": reason} for name, reason in self.refused.items()],
        }


def _shared(value: ir.Value) -> str | None:
    """Why something besides its one reader sees `value`'s values (`Shape` and `Size` read none), or None."""
    if value.is_graph_output():
        return f"{name_of(value)} is a graph output"
    readers = value_readers(value)
    if len(readers) > 1:
        return f"{name_of(value)} is also read by {', '.join(sorted({name_of(n) for n in readers[1:]}))}"
    return None


def _scalar(value: ir.Value | None) -> bool:
    values = constant_values(value) if value is not None and is_constant(value) else None
    return values is not None and values.size == 1


def _scaled(node: ir.Node) -> ir.Value | None:
    """The other input of a `Mul` by a scalar constant, else None."""
    ins = list(node.inputs)
    if node.op_type != "Mul" or len(ins) != 2 or not any(_scalar(v) for v in ins):
        return None
    return ins[1] if _scalar(ins[0]) else ins[0]


def _scores(value: ir.Value) -> ir.Node | str:
    """The MatMul whose output reaches `value` through ops that keep a constant of each row one, or why not."""
    shared = _shared(value)
    if shared:
        return shared
    node = value.producer()
    if node is None or node.domain not in STANDARD:
        return f"{name_of(value)} is not computed by a MatMul and row-wise scalings"
    if node.op_type == "MatMul":
        return node
    ins = list(node.inputs)
    scaled = _scaled(node)
    if scaled is not None:
        return _scores(scaled)
    if node.op_type == "Div" and len(ins) == 2 and _scalar(ins[1]):
        return _scores(ins[0])  # type: ignore[arg-type]
    if node.op_type in ("Add", "Sub"):
        reasons = []
        for v in ins:
            if v is None or is_constant(v):
                continue
            found = _scores(v)
            if isinstance(found, ir.Node):
                return found
            reasons.append(found)
        return reasons[0] if reasons else f"{node.name} adds constants only"
    return f"{node.name} ({node.op_type}) stands between the scores and the Softmax"


def _key_bias(ctx: OnnxGraph, matmul: ir.Node) -> tuple[ir.Node, int] | str:
    """(the bias Add, its bias input) whose keys `matmul` reads as its B, constant along B's last axis; or why not."""
    chain: list[ir.Node] = []  # from B back to the Add, exclusive
    value = matmul.inputs[1]
    while True:
        assert value is not None
        shared = _shared(value)
        if shared:
            return shared
        node = value.producer()
        if node is None or node.domain not in STANDARD:
            return f"{matmul.name}'s second input does not come from a biased layer"
        ins = list(node.inputs)
        if node.op_type == "Add":
            index = next((i for i, v in enumerate(ins) if v is not None and is_constant(v)), None)
            if index is None:
                return f"{node.name} adds no constant bias to the keys"
            break
        scaled = _scaled(node)
        if scaled is not None:
            value = scaled
        elif node.op_type in ("Transpose", "Reshape"):
            value = ins[0]
        elif node.op_type in ("MatMul", "Gemm", "Conv", "Einsum"):
            return f"the keys from {node.name} have no bias Add to take the shift"
        else:
            return f"{node.name} ({node.op_type}) stands between the keys and the scores"
        chain.append(node)
    shape = ctx.shapes.get(name_of(node.outputs[0]))
    bias = constant_values(ins[index])
    if not shape or not isinstance(shape[-1], int) or bias is None:
        return f"the feature width of {node.name}'s output is unknown"
    if bias.ndim > len(shape) or any(d != 1 for d in bias.shape[:-1]) or bias.shape[-1:] != (shape[-1],):
        return f"{node.name}'s constant is not a bias along the last axis"
    features = {len(shape) - 1}
    for step in reversed(chain):
        rank = len(ctx.shapes.get(name_of(step.inputs[0])) or ())
        if step.op_type == "Transpose":
            perm = attr(step, "perm", None) or list(reversed(range(rank)))
            if not perm:
                return f"the rank at {step.name} is unknown"
            features = {i for i, p in enumerate(perm) if p in features}
        elif step.op_type == "Reshape":
            reshaped = _reshape_features(ctx, step, features)
            if reshaped is None:
                return f"the shapes around {step.name} are unknown"
            features = reshaped
    b_rank = len(ctx.shapes.get(name_of(matmul.inputs[1])) or ())
    if b_rank < 2 or b_rank - 1 in features:
        return f"the keys' features reach the last axis of {matmul.name}'s second input"
    return node, index


def _reshape_features(ctx: OnnxGraph, reshape: ir.Node, features: set[int]) -> set[int] | None:
    """The output axes of `reshape` that may carry the features, given the input axes that do; None where
    the shapes are unknown.

    Row-major order: a common suffix of equal dims (the same int, or the same symbol, which inference
    gives to equal sizes) maps axis to axis; in the leading block before it, features on its last axes
    split or merge into the output block's last axes of the same known product, and the axes before
    those carry none; otherwise every output axis of the block may."""
    before = ctx.shapes.get(name_of(reshape.inputs[0]))
    after = ctx.shapes.get(name_of(reshape.outputs[0]))
    if not before or not after:
        return None
    common = 0
    while (
        common < min(len(before), len(after))
        and before[-1 - common] is not None
        and before[-1 - common] == after[-1 - common]
    ):
        common += 1
    lead_in, lead_out = len(before) - common, len(after) - common
    found = {a - lead_in + lead_out for a in features if a >= lead_in}
    inside = sorted(a for a in features if a < lead_in)
    if not inside:
        return found
    block = before[inside[0] : lead_in]
    if inside == list(range(inside[0], lead_in)) and all(isinstance(d, int) for d in block):
        for count in range(1, lead_out + 1):
            trailing = after[lead_out - count : lead_out]
            if not all(isinstance(d, int) for d in trailing):
                break
            if math.prod(trailing) == math.prod(block):
                return found | set(range(lead_out - count, lead_out))
    return found | set(range(lead_out))


def find_sites(ctx: OnnxGraph) -> KeyPlan:
    """Every Softmax of the main graph whose key bias may change exactly, and why the others may not."""
    sites, refused = [], {}
    for softmax in ctx.graph:
        if softmax.op_type != "Softmax" or softmax.domain not in STANDARD:
            continue
        rank = len(ctx.shapes.get(name_of(softmax.inputs[0])) or ())
        axis = attr(softmax, "axis", -1 if ctx.opset >= 13 else 1)
        if not rank or axis % rank != rank - 1:
            refused[name_of(softmax)] = "it does not normalise the last axis of an input of known rank"
            continue
        scores = _scores(softmax.inputs[0])  # type: ignore[arg-type]
        found = _key_bias(ctx, scores) if isinstance(scores, ir.Node) else scores
        if isinstance(found, str):
            refused[name_of(softmax)] = found
        else:
            sites.append(KeySite(name_of(softmax), *found))
    return KeyPlan(sites, refused)
