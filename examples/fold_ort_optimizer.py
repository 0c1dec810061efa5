"""A torch.onnx export → ONNX Runtime's transformers optimizer and `normpass fold`, in both orders → inference.

The pipeline of a model deployed on ONNX Runtime: export (here a small seeded GPT-2 from
`transformers` code, exported with `torch.onnx.export(dynamo=False)` as HF Optimum does), let
`onnxruntime.transformers.optimizer` fuse it, fold its LayerNorms. Two ways, each checked against
the optimizer's output for the unfolded export (`normpass.onnx.runtime.ortopt.fusion_losses`: every fused
op, every `Gemm → MatMul` conversion, no more nodes) and run against the original:

* one step, the order that holds for every model: `normpass fold MODEL --ort-optimizer gpt2:4:64`
  runs the optimizer first and folds its output (`SkipLayerNormalization` becomes
  `SkipSimplifiedLayerNormalization`, every other fusion stays);
* two steps, fold then optimize, as a pipeline that already runs the optimizer after other passes
  would: the fold turns the Conv1D projections next to a folded norm into `MatMul` itself, as the
  optimizer does only after a LayerNorm; on GPT-2 nothing is lost either. (The optimizer's Attention
  fusions start from LayerNorm nodes: where they fire, fold after the optimizer.)

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

from normpass.onnx.runtime.ortopt import OrtOptimizer, fusion_losses, optimize


def fold(model: Path, out: Path, *options: str) -> dict:
    """`normpass fold MODEL -o OUT --report R [OPTIONS]`, as on the command line; the report."""
    report = out.with_suffix(".json")
    command = [sys.executable, "-m", "normpass", "fold", str(model), "-o", str(out), "--report", str(report)]
    subprocess.run([*command, *options], check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def fold_and_optimize(
    model: Path, workdir: Path, model_type: str, num_heads: int, hidden_size: int, feeds: dict[str, np.ndarray]
) -> dict:
    """The optimizer's output for `model`, and the fold with the optimizer in each order: ops, losses, errors."""
    settings = OrtOptimizer(model_type, num_heads, hidden_size)
    baseline, _ = optimize(onnx.load(str(model)), settings)
    one_step = workdir / f"{model.stem}.opt.rms.onnx"
    report = fold(model, one_step, "--ort-optimizer", f"{model_type}:{num_heads}:{hidden_size}")
    folded = workdir / f"{model.stem}.rms.onnx"
    fold(model, folded)
    two_steps = workdir / f"{model.stem}.rms.opt.onnx"
    onnx.save(optimize(onnx.load(str(folded)), settings)[0], str(two_steps))
    reference = run(model, feeds)
    results = {"folded": report["folded"], "norms": report["total"], "baseline_ops": op_counts(baseline.graph.node)}
    for label, path in (("optimize_then_fold", one_step), ("fold_then_optimize", two_steps)):
        result = onnx.load(str(path))
        results[label] = {
            "ops": op_counts(result.graph.node),
            "losses": fusion_losses(baseline, result),
            "max_rel_error": max_rel_error(reference, run(path, feeds)),
        }
    return results


def main(workdir: Path) -> dict:
    return fold_and_optimize(tiny_gpt2(workdir), workdir, "gpt2", 4, 64, token_ids((2, 16)))


if __name__ == "__main__":
    cli(main)
