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

from pathlib import Path

import onnx_ir as ir
from _shared import cli, max_rel_error, op_counts, run, tiny_gpt2, token_ids
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


def fold_in_pipeline(source: Path, workdir: Path) -> dict:
    """Run the pipeline on the GPT-2 at `source`, save the result in `workdir`, run both; what each step did."""
    model = ir.load(source)
    nodes_before = len(model.graph)
    fold = FoldPass(FoldOptions(target="onnx"), name=source.name)
    result = pipeline(fold)(model)
    out = workdir / f"{source.stem}.optimized.rms.onnx"
    ir.save(result.model, out)
    assert fold.result is not None  # set by the pass's latest call
    feeds = token_ids((3, 7))
    return {
        "modified": result.modified,
        "folded": fold.result.folded,
        "norms": fold.result.plan.total,
        "verified_max_rel_error": fold.result.comparison.max_rel_error if fold.result.comparison else None,
        "nodes_before": nodes_before,
        "nodes_after": len(result.model.graph),
        "ops": op_counts(result.model.graph),
        "opset": result.model.opset_imports[""],
        "max_rel_error": max_rel_error(run(source, feeds), run(out, feeds)),
    }


def main(workdir: Path) -> dict:
    return fold_in_pipeline(tiny_gpt2(workdir), workdir)


if __name__ == "__main__":
    cli(main)
