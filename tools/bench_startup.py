"""The CLI's start-up: wall time of `python -m normpass inspect MODEL` in a fresh process, per source tree.

Each tree is a checkout of normpass (`--tree LABEL=PATH`) or a git revision of this repository, extracted
into a temporary directory (`--rev LABEL=REV`); each runs from a directory outside it, with `PYTHONPATH` set
to it. The runs are interleaved (round by round, every tree and model once per round) and the medians
reported; a probe per tree and model says whether the verb imported torch. The models are two tiny ones
written here: `plain` (MatMul → LayerNorm) and `contrib` (MatMul → com.microsoft FastGelu → LayerNorm, whose
shapes need ONNX Runtime's symbolic inference).

    python tools/bench_startup.py --rev before=HEAD~1 --tree after=. --runs 5 -o startup.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
PROBE = "import sys; from normpass.cli.main import main; main(sys.argv[1:]); print('torch' in sys.modules)"


def tiny_model(path: Path, contrib: bool) -> Path:
    """x [batch, 4, 8] → MatMul (→ FastGelu, a contrib op) → LayerNorm."""
    weights = [
        numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
    ]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"])]
    if contrib:
        nodes.append(helper.make_node("FastGelu", ["h"], ["a"], domain="com.microsoft"))
    nodes.append(helper.make_node("LayerNormalization", [nodes[-1].output[0], "gamma", "beta"], ["y"], axis=-1))
    ends = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 4, 8]) for name in ("x", "y")]
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    model = helper.make_model(helper.make_graph(nodes, path.stem, ends[:1], ends[1:], weights), opset_imports=opsets)
    onnx.save(model, str(path))
    return path


def timed(argv: list[str], tree: Path, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    run = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} (PYTHONPATH={tree}) exited {run.returncode}: {run.stderr.strip()[-500:]}")
    return seconds, run


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("onnx", "onnxruntime", "onnx-ir", "numpy", "sympy", "torch"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a normpass checkout")
    parser.add_argument("--rev", action="append", default=[], help="LABEL=REV: a git revision of this repository")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        trees = {}
        for spec in args.tree:
            label, path = spec.split("=", 1)
            trees[label] = Path(path).resolve()
        for spec in args.rev:
            label, rev = spec.split("=", 1)
            trees[label] = work / f"tree-{label}"
            trees[label].mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(trees[label])], input=archive.stdout, check=True)
        models = {name: tiny_model(work / f"{name}.onnx", name == "contrib") for name in ("plain", "contrib")}
        times: dict[str, dict[str, list[float]]] = {label: {m: [] for m in models} for label in trees}
        for _ in range(args.runs):
            for label, tree in trees.items():
                for name, model in models.items():
                    seconds, _ = timed([sys.executable, "-m", "normpass", "inspect", str(model)], tree, work)
                    times[label][name].append(round(seconds, 3))
        torch = {
            label: {
                name: timed([sys.executable, "-c", PROBE, "inspect", str(model)], tree, work)[1]
                .stdout.strip()
                .splitlines()[-1]
                == "True"
                for name, model in models.items()
            }
            for label, tree in trees.items()
        }
    record = {
        "what": "wall time of `python -m normpass inspect MODEL` in a fresh process (seconds)",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_after": os.getloadavg()},
        "versions": versions(),
        "trees": {label: str(spec) for label, spec in zip(trees, args.tree + args.rev, strict=True)},
        "runs": args.runs,
        "results": {
            label: {
                name: {"median_s": statistics.median(runs), "runs_s": runs, "imports_torch": torch[label][name]}
                for name, runs in per_model.items()
            }
            for label, per_model in times.items()
        },
    }
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    for label, per_model in record["results"].items():
        for name, result in per_model.items():
            print(f"{label:>8} {name:>8}: median {result['median_s']:.2f} s, torch imported: {result['imports_torch']}")


if __name__ == "__main__":
    main()
