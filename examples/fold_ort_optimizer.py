"""A torch.onnx export → `normpass fold` → ONNX Runtime's transformers optimizer → inference.

The pipeline of a model deployed on ONNX Runtime: export (here a small seeded GPT-2 from
`transformers` code, exported with `torch.onnx.export(dynamo=False)` as HF Optimum does), fold
its LayerNorms with the `normpass` command, then let `onnxruntime.transformers.optimizer` fuse
the rest. The optimizer fuses a residual `Add` into a folded norm as it fuses one into a
LayerNorm, so the folded model keeps every skip fusion the original gets:
`SkipSimplifiedLayerNormalization` where `SkipLayerNormalization` was, and no `Add` left feeding
a norm that the original's optimization fused (GPT-2's embedding sum stays an `Add` in both). The
optimized folded model then runs in ONNX Runtime and is compared with the original.

    python examples/fold_ort_optimizer.py [WORKDIR]      # needs normpass[models] for the export

With your own export: `fold_and_optimize(model, workdir, model_type, num_heads, hidden_size, feeds)`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from _shared import cli, max_rel_error, op_counts, run, tiny_gpt2, token_ids
from onnxruntime.transformers.optimizer import optimize_model

NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization")


def fold(model: Path, out: Path) -> dict:
    """`normpass fold MODEL -o OUT --report R`, as on the command line; the report."""
    report = out.with_suffix(".json")
    command = [sys.executable, "-m", "normpass", "fold", str(model), "-o", str(out), "--report", str(report)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def optimize(model: Path, out: Path, model_type: str, num_heads: int, hidden_size: int) -> dict[str, int]:
    """ONNX Runtime's transformers optimizer on `model` (portable level 1), written to `out`; its op counts."""
    optimized = optimize_model(
        str(model), model_type=model_type, num_heads=num_heads, hidden_size=hidden_size, opt_level=1, use_gpu=False
    )
    optimized.save_model_to_file(str(out))
    return op_counts(optimized.model.graph.node)


def unfused_adds(model: onnx.ModelProto) -> list[str]:
    """Adds of two run-time tensors that feed a norm unfused."""
    constants = {t.name for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    return [
        producers[node.input[0]].name
        for node in model.graph.node
        if node.op_type in NORM_OPS
        and (add := producers.get(node.input[0])) is not None
        and add.op_type == "Add"
        and not constants & set(add.input)
    ]


def fold_and_optimize(
    model: Path, workdir: Path, model_type: str, num_heads: int, hidden_size: int, feeds: dict[str, np.ndarray]
) -> dict:
    """Fold and optimize `model`, optimize the original too, run the original and the result; what each step did."""
    folded = workdir / f"{model.stem}.rms.onnx"
    report = fold(model, folded)
    optimized, baseline = workdir / f"{model.stem}.rms.opt.onnx", workdir / f"{model.stem}.opt.onnx"
    ops = optimize(folded, optimized, model_type, num_heads, hidden_size)
    baseline_ops = optimize(model, baseline, model_type, num_heads, hidden_size)
    return {
        "folded": report["folded"],
        "norms": report["total"],
        "ops": ops,
        "baseline_ops": baseline_ops,
        "unfused_adds": unfused_adds(onnx.load(str(optimized))),
        "baseline_unfused_adds": unfused_adds(onnx.load(str(baseline))),
        "max_rel_error": max_rel_error(run(model, feeds), run(optimized, feeds)),
    }


def main(workdir: Path) -> dict:
    return fold_and_optimize(tiny_gpt2(workdir), workdir, "gpt2", 4, 64, token_ids((2, 16)))


if __name__ == "__main__":
    cli(main)
