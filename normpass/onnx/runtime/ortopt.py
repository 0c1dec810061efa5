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
  LayerNorm, cannot fire after the fold. `ordering_note` says so where that order is being set up.

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


def ordering_note(nodes: Iterable) -> str | None:
    """A note for a fold for ONNX Runtime of a graph with these `nodes` (ONNX or onnx-ir nodes) when it has
    attention (a Softmax) and no op of ORT's fusions (no com.microsoft node: the transformers optimizer has not
    run on it): the optimizer, if run after the fold, cannot fuse that attention."""
    ops = {(n.op_type, n.domain) for n in nodes}
    if any(domain == MS_DOMAIN for _, domain in ops) or ("Softmax", "") not in ops:
        return None
    return (
        "ONNX Runtime's transformers optimizer starts its Attention fusions from LayerNormalization nodes: "
        "run it before the fold (normpass fold --ort-optimizer TYPE does both), not after"
    )
