"""Time `normpass viz` on synthetic pre-LN models of growing depth: does drawing stay near-linear?

Two models, hidden size 8 (the weights do not matter, the graph does):

* `chain`: N blocks of `x ← x + LayerNorm(x)·W` (LayerNormalization → MatMul → Add, 3 nodes per
  block) after `x ← input·W₀` and before a final LayerNorm. Every norm folds and each norm's proof
  reaches back along the whole residual stream, so the fold plan itself lists N²/2 centrings: the
  worst case, a norm every 3 nodes.
* `stack`: `tools/synthetic_stack.py`'s transformer (attention, MLP, two LayerNorms per layer, 26
  nodes per layer): what an exported LLM looks like.

Each model is built once, then timed `--repeats` times in this process from the loaded model to the
rendered text (zero-mean graph, plan, view, layout, writer), as `normpass viz` runs it after
loading; the plan is also timed alone. Prints one row per size: size, nodes, norms, format, median
seconds of the plan and of the whole drawing (wall time, and the process's CPU time, which a machine
shared with other jobs inflates less), wall seconds per 1,000 nodes, and the size of the drawing.

`--baseline DIR` measures each size twice, in two fresh processes one after the other: this normpass, then
the one whose source is DIR (`PYTHONPATH=DIR`, e.g. `git archive REV | tar -x -C DIR`), each row labelled:
before and after side by side, in one run. Usage::

    python tools/bench_viz.py --model stack --sizes 10 40 160 385 --format html --repeats 3
    python tools/bench_viz.py --model stack --sizes 40 385 770 --baseline /tmp/normpass-base
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 8
OPSET = 17
IR_VERSION = 10


def pre_ln_chain(blocks: int, seed: int = 0) -> onnx.ModelProto:
    """`blocks` pre-LN blocks `x ← x + LayerNorm(x)·W` between an input projection and a final LayerNorm."""
    gen = np.random.default_rng(seed)
    nodes, weights = [], []

    def weight(name: str, *shape: int, mean: float = 0.0) -> str:
        weights.append(numpy_helper.from_array((mean + 0.1 * gen.standard_normal(shape)).astype(np.float32), name))
        return name

    def layer_norm(x: str, out: str) -> None:
        nodes.append(
            helper.make_node(
                "LayerNormalization",
                [x, weight(f"{out}.g", HIDDEN, mean=1.0), weight(f"{out}.b", HIDDEN)],
                [out],
                name=out,
                axis=-1,
                epsilon=1e-5,
            )
        )

    nodes.append(helper.make_node("MatMul", ["input", weight("w0", HIDDEN, HIDDEN)], ["x0"], name="embed"))
    x = "x0"
    for i in range(blocks):
        layer_norm(x, f"ln{i}")
        nodes.append(
            helper.make_node("MatMul", [f"ln{i}", weight(f"w{i + 1}", HIDDEN, HIDDEN)], [f"m{i}"], name=f"mm{i}")
        )
        nodes.append(helper.make_node("Add", [x, f"m{i}"], [f"x{i + 1}"], name=f"res{i}"))
        x = f"x{i + 1}"
    layer_norm(x, "output")
    graph = helper.make_graph(
        nodes,
        "pre_ln_chain",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", HIDDEN])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", HIDDEN])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def transformer_stack(layers: int) -> onnx.ModelProto:
    """`tools/synthetic_stack.py`'s model with `layers` layers, hidden size 8, 2 heads, a vocabulary of 16."""
    import synthetic_stack

    hidden, vocab = 8, 16
    params = synthetic_stack.fixed_params(hidden, vocab) + layers * synthetic_stack.layer_params(hidden)
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_stack.build(f"{tmp}/stack.onnx", params, "float32", hidden=hidden, heads=2, vocab=vocab)
        return onnx.load(f"{tmp}/stack.onnx")


MODELS: dict[str, Callable[[int], onnx.ModelProto]] = {"chain": pre_ln_chain, "stack": transformer_stack}


def analyse(model: onnx.ModelProto) -> tuple:
    """The zero-mean graph and fold plan, as `normpass viz` makes them."""
    from normpass.core.analysis import plan as make_plan
    from normpass.onnx.graph.frontend import build_zero_mean_graph, open_graph

    zmg = build_zero_mean_graph(open_graph(model, "synthetic"))
    return zmg, make_plan(zmg, True)


def draw(model: onnx.ModelProto, fmt: str, full: bool) -> str:
    """What `normpass viz` does after loading the model."""
    from normpass.viz import render

    zmg, fold_plan = analyse(model)
    return render(zmg, fold_plan, fmt, full=full)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="stack")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 40, 160, 385], help="blocks or layers")
    parser.add_argument("--format", choices=("html", "svg", "dot"), default="html")
    parser.add_argument("--full", action="store_true", help="draw every node (default: the collapsed view)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", metavar="DIR", help="also measure the normpass whose source is DIR, per size")
    parser.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.no_header:
        print(f"{'code':>8} " * bool(args.baseline), end="")
        print(f"{'size':>5} {'nodes':>6} {'norms':>5} {'format':>6} {'plan s':>7} {'viz s':>7}", end=" ")
        print(f"{'viz CPU s':>9} {'s/1k nodes':>10} {'MB':>7}", flush=True)
    if args.baseline:
        for size in args.sizes:
            for label, source in (("after", None), ("before", args.baseline)):
                command = [sys.executable, __file__, "--model", args.model, "--sizes", str(size), "--format"]
                command += [args.format, "--repeats", str(args.repeats), "--no-header"] + ["--full"] * args.full
                env = os.environ if source is None else {**os.environ, "PYTHONPATH": source}
                row = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                print(f"{label:>8} {row.strip()}", flush=True)
        return
    draw(MODELS[args.model](1), args.format, args.full)  # imports, once
    for size in args.sizes:
        model = MODELS[args.model](size)
        plans, draws, cpus = [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            norms = analyse(model)[1].total
            plans.append(time.perf_counter() - start)
            start, cpu = time.perf_counter(), time.process_time()
            drawing = draw(model, args.format, args.full)
            draws.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        nodes, median = len(model.graph.node), statistics.median(draws)
        print(
            f"{size:>5} {nodes:>6} {norms:>5} {args.format:>6} {statistics.median(plans):>7.2f} {median:>7.2f} "
            f"{statistics.median(cpus):>9.2f} {1000 * median / nodes:>10.3f} {len(drawing.encode()) / 1e6:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
