"""What an emitted surrogate costs: ops counted in units of one LayerNormalization (no ONNX import).

Both front ends describe what replacing a norm leaves in the model as ONNX op types (the PyTorch
front end as what `torch.onnx.export` makes of its modules), so one table prices both. A table per
ONNX Runtime provider (`OP_COSTS`): the CPU one also prices ops alone (no provider given, and the
PyTorch front end); the CUDA one, where every op is one memory-bound kernel, counts kernels.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

# Estimated cost of each op a surrogate may emit, relative to one LayerNormalization over the
# same tensor (ONNX Runtime 1.31, CPU, 8192×384 fp32, one thread, 10th percentile of 300 runs
# each, interleaved: LN 5.5 ms, SimplifiedLayerNormalization 3.0, Add/Sub/Mul 2.4–2.7,
# Tanh 3.1, Erf 7.3). Memory-bound elementwise ops cost about half a LayerNorm each, so an
# affine that keeps both a Mul and an Add saves nothing. Ops on reduced tensors cost ~0.
#
# Fused norms (ONNX Runtime 1.32, CPU, one thread, all-MiniLM-L6-v2 at 1×128 and 8×128 tokens, the
# profiler's kernel times, docs/BENCHMARKS.md): SkipLayerNormalization, the LayerNorm that ORT
# fuses with its residual and bias Adds, costs 7.6 LayerNorms — three times the LayerNorm and
# the two Adds it replaces; SkipSimplifiedLayerNormalization costs 1.5–1.8.
CPU_COST = {
    "LayerNormalization": 1.0,
    "SkipLayerNormalization": 7.5,
    "SkipSimplifiedLayerNormalization": 1.6,
    "SimplifiedLayerNormalization": 0.55,
    "RMSNormalization": 0.55,
    "Add": 0.5,
    "Sub": 0.5,
    "Mul": 0.5,
    "Div": 0.5,
    "Tanh": 0.6,
    "Erf": 1.3,
    "ReduceMean": 0.5,
    "Sqrt": 0.05,
    "Add(ε)": 0.05,
}
# ONNX Runtime 1.31.1, CUDA provider, NVIDIA H200, [8192, 768] fp16 (fp32 within 0.1), median of 30
# interleaved runs each (tools/bench_kernels.py --provider cuda, docs/BENCHMARKS.md): LayerNorm
# 0.062 ms; every elementwise op (Add, Mul, Tanh, Erf, a copy) 0.044–0.048 ms, 0.71–0.77 of it, so an
# op costs about one pass over the activations whatever it computes; SkipLayerNormalization (with
# bias), which ORT's optimizer makes of a LayerNorm and its residual and bias Adds, is one kernel
# of 0.049 ms — less than the two Adds it absorbs (0.056 ms together). ReduceMean and the ops on
# reduced tensors were not measured: priced as one pass and as a small launch.
CUDA_COST = {
    "LayerNormalization": 1.0,
    "SkipLayerNormalization": 0.8,
    "SkipSimplifiedLayerNormalization": 0.8,
    "SimplifiedLayerNormalization": 0.75,
    "RMSNormalization": 0.75,
    "Add": 0.75,
    "Sub": 0.75,
    "Mul": 0.75,
    "Div": 0.75,
    "Tanh": 0.7,
    "Erf": 0.75,
    "ReduceMean": 0.75,
    "Sqrt": 0.1,
    "Add(ε)": 0.1,
}
OP_COSTS = {"cpu": CPU_COST, "cuda": CUDA_COST}
# Costs closer than this (in LayerNorm units) are ties: op timings on a CPU are not more precise,
# and swapping a surrogate for a slightly cheaper but less accurate one is not worth the budget.
COST_RESOLUTION = 0.1


def costs(provider: str | None) -> dict[str, float]:
    """The table for ONNX Runtime's `provider` (cpu, cuda); the CPU one for ops priced alone (None)."""
    return OP_COSTS.get(provider or "cpu", CPU_COST)


def op_cost(ops: dict[str, int], provider: str | None = None) -> float:
    table = costs(provider)
    return float(sum(table.get(op, table["Add"]) * count for op, count in ops.items()))


def cost_class(cost: float) -> int:
    return round(cost / COST_RESOLUTION)


@dataclass
class Emission:
    """What emitting one surrogate did: the ops left where the norm was, and where c, γ and β went."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    shift: str = "none"  # "none" | "migrated into <layer>" | "Sub"
    gamma: str = ""
    beta: str = ""
    changed: list[str] = field(default_factory=list)  # layers whose constants were rewritten
    unfused_adds: int = 0  # Adds (counted in `ops`) that ran fused with the norm and now run alone
    provider: str | None = None  # whose table prices the ops (`costs`)

    @property
    def cost(self) -> float:
        return op_cost(self.ops, self.provider)

    def to_json(self) -> dict:
        return {
            "ops": dict(self.ops),
            "cost": self.cost,
            "shift": self.shift,
            "gamma": self.gamma,
            "beta": self.beta,
            "rewritten_layers": sorted(set(self.changed)),
            "unfused_adds": self.unfused_adds,
        }
