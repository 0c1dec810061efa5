"""An onnx-ir `PassManager` pipeline: onnxscript's optimizer, normpass's `FoldPass`, onnx-ir's checks.

`FoldPass` is an onnx-ir pass (`onnx_ir.passes.FunctionalPass`): it takes an `ir.Model` and returns
a `PassResult` with the folded model, verified against its input. Here it runs after onnxscript's
optimizer (constant folding and its rewrite rules: the TorchScript export's `Constant` and
`Shape` arithmetic folds away) and before onnx-ir's topological sort and ONNX checker. With
`target="onnx"` the fold emits standard ops only (opset-23 `RMSNormalization`), so the full ONNX
checker accepts the result and any runtime that implements opset 23 runs it.

    python examples/pass_manager.py [WORKDIR]      # needs normpass[models] for the export

onnxscript's optimizer is a function (`onnxscript.optimizer.optimize_ir`, in place); the
`OnnxscriptOptimizer` pass below is the few lines that put it in a pipeline.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx_ir.passes.common import CheckerPass, TopologicalSortPass
from onnxscript.optimizer import optimize_ir

from normpass import FoldOptions, FoldPass


class OnnxscriptOptimizer(ir.passes.InPlacePass):
    """`onnxscript.optimizer.optimize_ir` as an in-place pass; modified when the nodes changed."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = [(node.op_type, node.name) for node in model.graph.all_nodes()]
        optimize_ir(model)
        after = [(node.op_type, node.name) for node in model.graph.all_nodes()]
        return ir.passes.PassResult(model, modified=before != after)


def pipeline(fold: FoldPass) -> ir.passes.PassManager:
    return ir.passes.PassManager(
        [OnnxscriptOptimizer(), fold, TopologicalSortPass(), CheckerPass(full_check=True)], steps=1
    )


def run(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)


def fold_in_pipeline(source: Path, workdir: Path) -> dict:
    """Run the pipeline on the GPT-2 at `source`, save the result in `workdir`, run both; what each step did."""
    model = ir.load(source)
    nodes_before = len(model.graph)
    fold = FoldPass(FoldOptions(target="onnx"), name=source.name)
    result = pipeline(fold)(model)
    out = workdir / f"{source.stem}.optimized.rms.onnx"
    ir.save(result.model, out)
    assert fold.result is not None  # set by the pass's latest call
    feeds = {"input_ids": np.random.default_rng(0).integers(0, 128, size=(3, 7), dtype=np.int64)}
    reference, folded = run(source, feeds), run(out, feeds)
    return {
        "modified": result.modified,
        "folded": fold.result.folded,
        "norms": fold.result.plan.total,
        "verified_max_rel_error": fold.result.comparison.max_rel_error if fold.result.comparison else None,
        "nodes_before": nodes_before,
        "nodes_after": len(result.model.graph),
        "ops": dict(collections.Counter(node.op_type for node in result.model.graph)),
        "opset": result.model.opset_imports[""],
        "max_rel_error": max(
            float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(reference, folded, strict=True)
        ),
    }


def main(workdir: Path) -> dict:
    from normpass import models

    return fold_in_pipeline(models.export_onnx("gpt2", workdir / "gpt2.onnx", form="torchscript"), workdir)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)), indent=2))
