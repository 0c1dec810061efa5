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

With your own export: `fold_and_optimize(model, workdir, model_type, num_heads, hidden_size)`.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.transformers.optimizer import optimize_model

NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization")


def export_gpt2(path: Path) -> Path:
    """A 2-layer GPT-2 (hidden size 64, 4 heads) from `normpass.models`, exported by TorchScript."""
    from normpass import models

    return models.export_onnx("gpt2", path, form="torchscript")


def token_ids(model: Path, shape: tuple[int, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Random `input_ids` for a language model, below its vocabulary size (the last dim of its logits)."""
    logits = onnx.load(str(model), load_external_data=False).graph.output[0]
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    return {"input_ids": np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)}


def fold(model: Path, out: Path) -> dict:
    """`normpass fold MODEL -o OUT --report R`, as on the command line; the report."""
    report = out.with_suffix(".json")
    command = [sys.executable, "-m", "normpass", "fold", str(model), "-o", str(out), "--report", str(report)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def optimize(model: Path, out: Path, model_type: str, num_heads: int, hidden_size: int) -> collections.Counter:
    """ONNX Runtime's transformers optimizer on `model` (portable level 1), written to `out`; its op counts."""
    optimized = optimize_model(
        str(model), model_type=model_type, num_heads=num_heads, hidden_size=hidden_size, opt_level=1, use_gpu=False
    )
    optimized.save_model_to_file(str(out))
    return collections.Counter(node.op_type for node in optimized.model.graph.node)


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


def run(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)


def fold_and_optimize(model: Path, workdir: Path, model_type: str, num_heads: int, hidden_size: int, feeds) -> dict:
    """Fold and optimize `model`, optimize the original too, run all three; what each step did."""
    folded = workdir / f"{model.stem}.rms.onnx"
    report = fold(model, folded)
    optimized, baseline = workdir / f"{model.stem}.rms.opt.onnx", workdir / f"{model.stem}.opt.onnx"
    ops = optimize(folded, optimized, model_type, num_heads, hidden_size)
    baseline_ops = optimize(model, baseline, model_type, num_heads, hidden_size)
    reference, outputs = run(model, feeds), run(optimized, feeds)
    error = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(reference, outputs, strict=True))
    return {
        "folded": report["folded"],
        "norms": report["total"],
        "ops": dict(ops),
        "baseline_ops": dict(baseline_ops),
        "unfused_adds": unfused_adds(onnx.load(str(optimized))),
        "baseline_unfused_adds": unfused_adds(onnx.load(str(baseline))),
        "max_rel_error": error,
    }


def main(workdir: Path) -> dict:
    model = export_gpt2(workdir / "gpt2.onnx")
    return fold_and_optimize(model, workdir, "gpt2", num_heads=4, hidden_size=64, feeds=token_ids(model, (2, 16)))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)), indent=2))
