"""An Olive workflow with normpass as one of its passes: `NormpassFold`, then Olive's ORT transformers optimization.

Olive resolves a pass type through its package configuration, which a workflow run may replace:
`normpass.olive.package_config()` is Olive's own with `NormpassFold` (`normpass/olive.py`) added.
The workflow below reads an ONNX model (here a small seeded GPT-2 exported by TorchScript), folds
it for the CPU execution provider the workflow targets, and hands the result to Olive's
`OrtTransformersOptimization`, which fuses the residual Adds into the folded norms.

    pip install "normpass[olive,models]"
    python examples/olive_workflow.py [WORKDIR]

From the command line the same workflow is `olive run --config workflow.json --package-config
normpass_olive.json`, with `normpass_olive.json` written from `package_config()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from _shared import cli, max_rel_error, op_counts, run, tiny_gpt2, token_ids

os.environ.setdefault("OLIVE_DISABLE_TELEMETRY", "1")


def workflow(model: Path, output_dir: Path) -> dict:
    """The workflow configuration: an ONNX model, NormpassFold, then ORT's transformers optimizer, on the CPU."""
    return {
        "input_model": {"type": "ONNXModel", "model_path": str(model)},
        "systems": {
            "local": {
                "type": "LocalSystem",
                "accelerators": [{"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}],
            }
        },
        "passes": {
            "fold": {"type": "NormpassFold"},
            "optimize": {
                "type": "OrtTransformersOptimization",
                "model_type": "gpt2",
                "num_heads": 4,
                "hidden_size": 64,
                "opt_level": 1,
            },
        },
        "host": "local",
        "target": "local",
        "output_dir": str(output_dir),
        "cache_dir": str(output_dir / "cache"),
        "log_severity_level": 3,
    }


def run_workflow(source: Path, workdir: Path) -> dict:
    """Run the workflow on the GPT-2 at `source` (output in `workdir/olive`), run its result; what it made."""
    from olive.workflows import run as olive_run

    from normpass.olive import package_config

    olive_run(workflow(source, workdir / "olive"), package_config=package_config())
    [out] = (workdir / "olive").glob("*.onnx")
    optimized = onnx.load(str(out))
    feeds = token_ids((2, 16))
    return {
        "output": str(out),
        "metadata": {p.key: p.value for p in optimized.metadata_props if p.key.startswith("normpass")},
        "ops": op_counts(optimized.graph.node),
        "max_rel_error": max_rel_error(run(source, feeds), run(out, feeds)),
    }


def main(workdir: Path) -> dict:
    return run_workflow(tiny_gpt2(workdir), workdir)


if __name__ == "__main__":
    cli(main)
