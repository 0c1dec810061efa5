"""ONNX Runtime's transformers optimizer beside the fold: running it, and checking that the fold loses none
of its fusions.

`onnxruntime.transformers.optimizer.optimize_model` is what ORT's documentation, HF Optimum's
ORTOptimizer and Olive's `OrtTransformersOptimization` run before deploying a transformer on ORT:
it fuses attention, GELU, each norm with its residual and bias Adds (`SkipLayerNormalization`), and
(model type gpt2) turns HF Conv1D's `Reshape → Gemm → Reshape` into `MatMul`. Its patterns start
from `LayerNormalization` / `SkipLayerNormalization` nodes, so the order matters:

* optimize → fold: the fold rewrites the optimizer's fused norms (`SkipLayerNormalization` →
  `SkipSimplifiedLayerNormalization`) and keeps every other fusion as it is. This order holds for
  every model; `FoldOptions.ort_optimizer` runs it in one call.
* fold → optimize: the optimizer fuses Adds into the RMS ops as it does into LayerNorms, and the fold
  converts the Conv1D Gemms itself (`matmul.py`); but an `Attention` fusion, which starts from a
  LayerNorm, cannot fire after the fold. `ordering_note` says so where that order is being set up and
  the graph has an attention ORT's fusions would match (on today's exports they match none).

`fusion_losses(reference, candidate)` compares two optimizer outputs by structure: every fused op
(an RMS op counts as the LayerNorm it replaced), every `Gemm → MatMul` conversion, and no more nodes.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from ...errors import InputError

# Each RMS op the fold emits counts as the LayerNorm op it replaces.
AS_LAYER_NORM = {
    "SimplifiedLayerNormalization": "LayerNormalization",
    "RMSNormalization": "LayerNormalization",
    "SkipSimplifiedLayerNormalization": "SkipLayerNormalization",
}
# Ops that count as fusions besides the contrib ops: a LayerNorm the optimizer fused from its decomposed form.
FUSED_STANDARD_OPS = {"LayerNormalization"}
MS_DOMAIN = "com.microsoft"
MAX_INT64 = 2**63 - 1  # the optimizer writes the heads into an ONNX int64 attribute


@dataclass(frozen=True)
class OrtOptimizer:
    """Settings of `onnxruntime.transformers.optimizer.optimize_model`: model type (bert, gpt2, vit, swin, …),
    attention heads and hidden size (0: the optimizer detects them), and whether the result is for the GPU."""

    model_type: str
    num_heads: int = 0
    hidden_size: int = 0
    use_gpu: bool = True

    @classmethod
    def parse(cls, spec: str, use_gpu: bool = True) -> OrtOptimizer:
        """`TYPE` or `TYPE:HEADS:HIDDEN`, as the command line gives it."""
        parts = spec.split(":")
        try:
            heads, hidden = (int(p) for p in parts[1:]) if len(parts) == 3 else (0, 0)
        except ValueError:
            heads = hidden = -1
        if len(parts) not in (1, 3) or heads < 0 or hidden < 0:
            raise InputError(f"--ort-optimizer {spec!r}: give TYPE or TYPE:HEADS:HIDDEN, e.g. gpt2 or gpt2:12:768")
        try:
            return cls(parts[0], heads, hidden, use_gpu).checked()
        except InputError as e:
            raise InputError(f"--ort-optimizer {spec!r}: {e}") from None

    def checked(self) -> OrtOptimizer:
        """These settings, after checking what the optimizer would otherwise fail an assertion on."""
        from onnxruntime.transformers.optimizer import MODEL_TYPES

        if self.model_type not in MODEL_TYPES:
            raise InputError(
                f"ORT optimizer model type {self.model_type!r}: choose one of {', '.join(sorted(MODEL_TYPES))}"
            )
        if (self.num_heads, self.hidden_size) == (0, 0):
            return self  # the optimizer detects both
        heads, hidden = self.num_heads, self.hidden_size
        if not 0 < heads <= MAX_INT64 or not 0 < hidden <= MAX_INT64:
            problem = f"{heads} heads and hidden size {hidden}: give each from 1 to {MAX_INT64} (an ONNX int64)"
        elif hidden % heads:
            problem = f"{heads} heads do not divide the hidden size {hidden} (HEADS must divide HIDDEN)"
        else:
            return self
        raise InputError(
            f"{problem}, e.g. gpt2:12:768, or give the model type alone to have both detected from the model"
        )

    def report(self, optimized: onnx.ModelProto, fused: dict[str, int]) -> dict:
        """What the optimizer was asked and what it used: the heads of its fused attention ops (`num_heads`)
        and the width of its fused norms' γ (`hidden_size`), the values given where the graph shows none,
        null where neither does (nothing fused, nothing given)."""
        heads = sorted(
            {a.i for n in optimized.graph.node if n.domain == MS_DOMAIN for a in n.attribute if a.name == "num_heads"}
        )
        widths = sorted(_norm_widths(optimized))
        return {
            "model_type": self.model_type,
            "num_heads": _one_or_all(heads) or self.num_heads or None,
            "hidden_size": _one_or_all(widths) or self.hidden_size or None,
            "detected": (self.num_heads, self.hidden_size) == (0, 0),
            "use_gpu": self.use_gpu,
            "fused": fused,
        }


def _one_or_all(values: list[int]) -> int | list[int] | None:
    return values[0] if len(values) == 1 else values or None


def _norm_widths(model: onnx.ModelProto) -> set[int]:
    """The lengths of the γ initializers of `model`'s fused norms (LayerNormalization, SkipLayerNormalization)."""
    sizes = {t.name: list(t.dims) for t in model.graph.initializer}
    scales = (
        n.input[2 if n.op_type.startswith("Skip") else 1]
        for n in model.graph.node
        if AS_LAYER_NORM.get(n.op_type, n.op_type) in ("LayerNormalization", "SkipLayerNormalization")
    )
    return {sizes[s][-1] for s in scales if len(sizes.get(s, [])) == 1}


def optimize(model: onnx.ModelProto, settings: OrtOptimizer) -> tuple[onnx.ModelProto, dict[str, int]]:
    """`model` through ORT's transformers optimizer (its Python fusions alone, opt_level 0, as Optimum and
    Olive run it before a session's own optimizations), and the fused ops it reports. `model` is not modified
    (the optimizer rewrites a copy); what the optimizer logs is kept off the console."""
    from onnxruntime.transformers.optimizer import optimize_model

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with _quiet():
        optimized = optimize_model(
            copy,
            model_type=settings.model_type,
            num_heads=settings.num_heads,
            hidden_size=settings.hidden_size,
            opt_level=0,
            use_gpu=settings.use_gpu,
        )
        fused = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
    return optimized.model, fused


@contextlib.contextmanager
def _quiet():
    """ORT's optimizer logs through `logging`, prints, and draws progress bars on stderr (tqdm, for unet and
    mmdit): all held back while it runs."""
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(level)


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    """Op types of the main graph, each RMS op counted as the LayerNorm op it replaces."""
    return collections.Counter(AS_LAYER_NORM.get(n.op_type, n.op_type) for n in model.graph.node)


def fused_ops(model: onnx.ModelProto) -> set[str]:
    """The fused op types of `model` (contrib ops and LayerNormalization), RMS ops counted as LayerNorms."""
    return {
        AS_LAYER_NORM.get(n.op_type, n.op_type)
        for n in model.graph.node
        if n.domain == MS_DOMAIN or AS_LAYER_NORM.get(n.op_type, n.op_type) in FUSED_STANDARD_OPS
    }


def fusion_losses(reference: onnx.ModelProto, candidate: onnx.ModelProto, extra_nodes: int = 0) -> list[str]:
    """What `candidate` lost against `reference`, two optimizer outputs of one model: a fused op it has fewer
    of, a `Gemm` the reference turned into `MatMul` and it did not, more nodes than the reference (beyond
    `extra_nodes` allowed). Empty when it lost nothing."""
    ref, got = op_counts(reference), op_counts(candidate)
    losses = [f"{op}: {got[op]} instead of {ref[op]}" for op in sorted(fused_ops(reference)) if got[op] < ref[op]]
    if got["MatMul"] < ref["MatMul"] or got["Gemm"] > ref["Gemm"]:
        losses.append(
            f"Gemm → MatMul: {got['Gemm']} Gemm and {got['MatMul']} MatMul, the reference has "
            f"{ref['Gemm']} and {ref['MatMul']}"
        )
    nodes, ref_nodes = len(candidate.graph.node), len(reference.graph.node)
    if nodes > ref_nodes + extra_nodes:
        more = {op: got[op] - ref[op] for op in sorted(got) if got[op] > ref[op]}
        losses.append(f"{nodes} nodes instead of {ref_nodes} (more {', '.join(f'{k} +{v}' for k, v in more.items())})")
    return losses


# How the attention scores reach the Softmax in the attentions ORT's LayerNorm-anchored fusions recognise
# (`fusion_attention.py`'s qk paths for bert/vit, `fusion_gpt_attention.py`'s for gpt2): op types from the
# Softmax upwards, each with the input it is read from (None: any). Scores scaled on q and k apart, as
# today's exporters write scaled-dot-product attention, match none of them (ORT fuses no attention there).
SCORE_PATHS: tuple[tuple[tuple[str, ...], tuple[int | None, ...]], ...] = (
    (("Add", "Div", "MatMul"), (0, None, 0)),
    (("Add", "Mul", "MatMul"), (0, None, 0)),
    (("Where", "MatMul", "Div"), (0, 2, 0)),
    (("Add", "Where", "MatMul"), (0, 0, 2)),
    (("Div", "MatMul"), (0, 0)),
    (("Add", "MatMul", "Mul", "Sqrt"), (0, None, 0, 1)),
    (("Sub", "Mul", "Div", "MatMul"), (0, 0, 0, 0)),
    (("Where", "Div", "MatMul"), (0, 1, 0)),
    (("Add", "Where", "Div", "MatMul"), (0, None, 1, 0)),
)
# Steps from the Softmax to the attention's ends: back to its Q/K projections' input (scores, scaling, heads
# split, bias, MatMul), forward through `softmax · V`, the heads merged and the output projection to the residual.
INPUT_STEPS = 7
OUTPUT_STEPS = 8
TO_THE_RESIDUAL = {"Transpose", "Reshape", "MatMul", "Gemm", "Add"}


def ordering_note(graph: ir.Graph, folded: Iterable[ir.Value]) -> str | None:
    """A note for a fold for ONNX Runtime when ORT's transformers optimizer, run after it, would miss an
    attention fusion it makes on the original: the graph has no op of ORT's fusions yet (no com.microsoft
    node: the optimizer has not run), and an attention whose scores reach the Softmax as ORT's fusions match
    them (`SCORE_PATHS`) reads the output of a norm the fold rewrites or writes (through `softmax · V` and its
    output projection) the input of one: `folded`, those norms' inputs and outputs. The fusion starts from
    those LayerNorms."""
    nodes = list(graph.all_nodes())
    if any(node.domain == MS_DOMAIN for node in nodes):
        return None
    values = set(folded)
    if not any(node.op_type == "Softmax" and _fusible_attention(node, values) for node in nodes):
        return None
    return (
        "ONNX Runtime's transformers optimizer would fuse this model's attention, but it starts its Attention "
        "fusions from LayerNormalization nodes: run it before the fold (normpass fold --ort-optimizer TYPE "
        "does both), not after"
    )


def _fusible_attention(softmax: ir.Node, norm_values: set[ir.Value]) -> bool:
    """Whether `softmax` is in an attention ORT's fusions match whose input or output is one of `norm_values`."""
    if not any(_parent_path(softmax, ops, inputs) for ops, inputs in SCORE_PATHS):
        return False
    uses = list(softmax.outputs[0].uses())
    if len(uses) != 1 or uses[0][0].op_type != "MatMul" or uses[0][1] != 0:
        return False
    frontier = [softmax]
    for _ in range(INPUT_STEPS):
        values = [value for node in frontier for value in node.inputs if value is not None]
        if norm_values.intersection(values):
            return True
        frontier = [producer for value in values if (producer := value.producer()) is not None]
    frontier = [uses[0][0]]
    for _ in range(OUTPUT_STEPS):
        if any(value in norm_values for node in frontier for value in node.outputs):
            return True
        frontier = [
            reader for node in frontier for reader, _ in node.outputs[0].uses() if reader.op_type in TO_THE_RESIDUAL
        ]
    return False


def _parent_path(node: ir.Node, ops: tuple[str, ...], inputs: tuple[int | None, ...]) -> bool:
    """Whether `node`'s input 0 is produced by `ops[0]`, whose input `inputs[1]` by `ops[1]`, and so on (an input
    None: any of them), as `onnx_model.match_parent_path` reads it."""
    if not ops:
        return True
    index, rest = inputs[0], inputs[1:]
    candidates = range(len(node.inputs)) if index is None else [index]
    for i in candidates:
        value = node.inputs[i] if i < len(node.inputs) else None
        parent = value.producer() if value is not None else None
        if parent is not None and parent.op_type == ops[0] and _parent_path(parent, ops[1:], rest):
            return True
    return False
