"""One-norm kernels in ONNX Runtime (CPU or CUDA): what does an RMSNorm save over a LayerNorm, per call?

Each variant is a tiny ONNX model over x (and, for the skip variants, a residual `skip`) of shape
[tokens, d], with γ and β as initializers:

* LayerNorm: ONNX `LayerNormalization` (stash_type 1);
* SkipLayerNorm: ORT `com.microsoft.SkipLayerNormalization(x, skip, γ, β)` → (y, sum);
* SimplifiedLayerNorm: ORT `SimplifiedLayerNormalization` (what `normpass fold` emits), γ only;
* SkipSimplifiedLayerNorm: ORT `com.microsoft.SkipSimplifiedLayerNormalization(x, skip, γ)` → (y, sum);
* RMSNormalization: ONNX opset-23 `RMSNormalization` (`fold --rms-op onnx`);
* SimplifiedLayerNorm + Add(β): a folded norm whose β could not migrate into a linear layer;
* Add + LayerNorm → (y, sum): what ORT runs for a pre-LN residual stream (GPT-2, ViT) whose sum
  also feeds the next residual Add: its session optimizer fuses Add + LayerNormalization into
  SkipLayerNormalization only when the sum has no other consumer;
* Add + SimplifiedLayerNorm → (y, sum): the residual Add left unfused, as ORT's optimizer
  leaves it (what normpass's SkipSimplifiedLayerNormalization emission avoids);
* Add(bias) + SkipSimplifiedLayerNorm and SkipSimplifiedLayerNorm(bias): a linear layer's bias
  Add before the skip op, separate or in the op's bias input (what `fold` emits);
* SkipSimplifiedLayerNorm + Add(β): a folded last norm of a residual stack whose β could not
  migrate, against the SkipLayerNorm ORT runs when that norm is kept;
* affine (Mul+Add): `x·γ + β`, the cost of a calibrated affine surrogate that did not fold away;
* Identity: a copy of x, the floor for any op that reads and writes [tokens, d];
* one op each, the prices of `core/cost.py`: Mul(γ), Add(β), Tanh, Erf, Add (two run-time tensors), and
  DyT as it is emitted with γ and β kept (Mul, Tanh, Mul, Add) or migrated (Mul, Tanh);
* Add(bias) + Add(residual) → sum: what a deleted norm leaves where ORT fused it with both Adds,
  against SkipLayerNorm(bias), the fused norm it replaces.

Skip variants write the residual sum as a second output, as they do inside a transformer. Two
token counts by default: 256 (x fits in L2 cache: the kernels' arithmetic matters) and 8192
(memory-bound: bytes moved matter).
For every dtype and width d, all variants run in the same interleaved rounds (`normpass.onnx.runtime.bench`:
IO binding, outputs preallocated, ORT_ENABLE_ALL; the ops ORT actually ran are listed, to show
that nothing was fused or cast behind the benchmark's back). `--provider cuda` runs them on ORT's
CUDA provider (inputs and outputs in GPU memory). Ratios: non-skip variants against
LayerNorm, skip variants against SkipLayerNorm, with the quartiles of the per-round ratios.

    python tools/bench_kernels.py --tokens 256 8192 --widths 768 1024 4096 --dtypes fp32 fp16 \\
        --repeats 30 --threads 1 --json /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from normpass.onnx.runtime import bench

DTYPES = {"fp32": (np.float32, TensorProto.FLOAT), "fp16": (np.float16, TensorProto.FLOAT16)}
EPS = 1e-5
MS = "com.microsoft"
# label → (node builder, graph inputs, graph outputs, opset); SKIP_GROUP is compared with SkipLayerNorm
VARIANTS = {
    "LayerNorm": (
        lambda: [
            helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1, epsilon=EPS, stash_type=1)
        ],
        ["x"],
        ["y"],
        17,
    ),
    "SimplifiedLayerNorm": (
        lambda: [
            helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], axis=-1, epsilon=EPS, stash_type=1)
        ],
        ["x"],
        ["y"],
        17,
    ),
    "RMSNormalization (opset 23)": (
        lambda: [helper.make_node("RMSNormalization", ["x", "gamma"], ["y"], axis=-1, epsilon=EPS, stash_type=1)],
        ["x"],
        ["y"],
        23,
    ),
    "SimplifiedLayerNorm + Add(β)": (
        lambda: [
            helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["r"], axis=-1, epsilon=EPS, stash_type=1),
            helper.make_node("Add", ["r", "beta"], ["y"]),
        ],
        ["x"],
        ["y"],
        17,
    ),
    "affine (Mul+Add)": (
        lambda: [helper.make_node("Mul", ["x", "gamma"], ["m"]), helper.make_node("Add", ["m", "beta"], ["y"])],
        ["x"],
        ["y"],
        17,
    ),
    "Identity": (lambda: [helper.make_node("Identity", ["x"], ["y"])], ["x"], ["y"], 17),
    "Mul(γ)": (lambda: [helper.make_node("Mul", ["x", "gamma"], ["y"])], ["x"], ["y"], 17),
    "Add(β)": (lambda: [helper.make_node("Add", ["x", "beta"], ["y"])], ["x"], ["y"], 17),
    "Tanh": (lambda: [helper.make_node("Tanh", ["x"], ["y"])], ["x"], ["y"], 17),
    "Erf": (lambda: [helper.make_node("Erf", ["x"], ["y"])], ["x"], ["y"], 17),
    "DyT (Mul, Tanh, Mul, Add)": (
        lambda: [
            helper.make_node("Mul", ["x", "alpha"], ["a"]),
            helper.make_node("Tanh", ["a"], ["t"]),
            helper.make_node("Mul", ["t", "gamma"], ["m"]),
            helper.make_node("Add", ["m", "beta"], ["y"]),
        ],
        ["x"],
        ["y"],
        17,
    ),
    "DyT, γ β migrated (Mul, Tanh)": (
        lambda: [helper.make_node("Mul", ["x", "alpha"], ["a"]), helper.make_node("Tanh", ["a"], ["y"])],
        ["x"],
        ["y"],
        17,
    ),
    "SkipLayerNorm": (
        lambda: [
            helper.make_node(
                "SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y", "", "", "sum"], domain=MS, epsilon=EPS
            )
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "SkipSimplifiedLayerNorm": (
        lambda: [
            helper.make_node(
                "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "sum"], domain=MS, epsilon=EPS
            )
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "Add + LayerNorm": (
        lambda: [
            helper.make_node("Add", ["x", "skip"], ["sum"]),
            helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=EPS, stash_type=1),
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "Add + SimplifiedLayerNorm": (
        lambda: [
            helper.make_node("Add", ["x", "skip"], ["sum"]),
            helper.make_node(
                "SimplifiedLayerNormalization", ["sum", "gamma"], ["y"], axis=-1, epsilon=EPS, stash_type=1
            ),
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "Add(bias) + SkipSimplifiedLayerNorm": (
        lambda: [
            helper.make_node("Add", ["x", "beta"], ["xb"]),
            helper.make_node(
                "SkipSimplifiedLayerNormalization",
                ["xb", "skip", "gamma"],
                ["y", "", "", "sum"],
                domain=MS,
                epsilon=EPS,
            ),
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "SkipSimplifiedLayerNorm(bias)": (
        lambda: [
            helper.make_node(
                "SkipSimplifiedLayerNormalization",
                ["x", "skip", "gamma", "beta"],
                ["y", "", "", "sum"],
                domain=MS,
                epsilon=EPS,
            )
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "SkipSimplifiedLayerNorm + Add(β)": (
        lambda: [
            helper.make_node(
                "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["r", "", "", "sum"], domain=MS, epsilon=EPS
            ),
            helper.make_node("Add", ["r", "beta"], ["y"]),
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "SkipLayerNorm(bias)": (
        lambda: [
            helper.make_node(
                "SkipLayerNormalization",
                ["x", "skip", "gamma", "beta", "bias"],
                ["y", "", "", "sum"],
                domain=MS,
                epsilon=EPS,
            )
        ],
        ["x", "skip"],
        ["y", "sum"],
        17,
    ),
    "Add (residual)": (lambda: [helper.make_node("Add", ["x", "skip"], ["sum"])], ["x", "skip"], ["sum"], 17),
    "Add(bias) + Add(residual)": (
        lambda: [helper.make_node("Add", ["x", "bias"], ["xb"]), helper.make_node("Add", ["xb", "skip"], ["sum"])],
        ["x", "skip"],
        ["sum"],
        17,
    ),
}
SKIP_GROUP = (
    "SkipLayerNorm",
    "SkipSimplifiedLayerNorm",
    "Add + LayerNorm",
    "Add + SimplifiedLayerNorm",
    "Add(bias) + SkipSimplifiedLayerNorm",
    "SkipSimplifiedLayerNorm(bias)",
    "SkipSimplifiedLayerNorm + Add(β)",
    "SkipLayerNorm(bias)",
    "Add (residual)",
    "Add(bias) + Add(residual)",
)


def build(label: str, dtype: str, tokens: int, width: int, rng: np.random.Generator) -> onnx.ModelProto:
    make_nodes, inputs, outputs, opset = VARIANTS[label]
    np_type, elem = DTYPES[dtype]
    nodes = make_nodes()
    used = {name for node in nodes for name in node.input}
    initializers = [
        numpy_helper.from_array((1 + 0.2 * rng.standard_normal(width)).astype(np_type), "gamma"),
        numpy_helper.from_array((0.2 * rng.standard_normal(width)).astype(np_type), "beta"),
        numpy_helper.from_array((0.2 * rng.standard_normal(width)).astype(np_type), "bias"),
        numpy_helper.from_array(np.array(0.5, np_type), "alpha"),
    ]
    graph = helper.make_graph(
        nodes,
        label,
        [helper.make_tensor_value_info(name, elem, [1, tokens, width]) for name in inputs],
        [helper.make_tensor_value_info(name, elem, [1, tokens, width]) for name in outputs],
        [i for i in initializers if i.name in used],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=11 if opset >= 23 else 8)


def ran_ops(model: onnx.ModelProto, provider: str, threads: int) -> list[str]:
    """The op types of the graph ORT runs after its optimizations."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        bench.open_session(model.SerializeToString(), provider, threads, optimized_model_path=path)
        return [node.op_type for node in onnx.load(path).graph.node]


def measure(dtype: str, tokens: int, width: int, args, bar) -> dict:
    rng = np.random.default_rng(width)
    np_type = DTYPES[dtype][0]
    feeds = {name: rng.standard_normal((1, tokens, width)).astype(np_type) for name in ("x", "skip")}
    runners, ops = {}, {}
    for label in args.variants:
        model = build(label, dtype, tokens, width, rng)
        ops[label] = ran_ops(model, args.provider, args.threads)
        session = bench.open_session(model.SerializeToString(), args.provider, args.threads)
        wanted = {i.name for i in session.get_inputs()}
        runners[label] = bench.Runner(session, {k: v for k, v in feeds.items() if k in wanted}, args.provider)
    times = bench.interleave(runners, args.repeats, args.warmup, bar)
    results = bench.summarize(times, "LayerNorm") if "LayerNorm" in times else bench.summarize(times, next(iter(times)))
    skips = [k for k in SKIP_GROUP if k in times]
    skip_ratios = bench.summarize({k: times[k] for k in skips}, "SkipLayerNorm") if "SkipLayerNorm" in skips else {}
    for label in skip_ratios:
        results[label] |= {key: skip_ratios[label].get(key) for key in ("ratio", "ratio_p25", "ratio_p75")}
    return {"dtype": dtype, "d": width, "tokens": tokens, "ran_ops": ops, "results": results}


def markdown(points: list[dict]) -> str:
    widths = sorted({p["d"] for p in points})
    lines = []
    for dtype, tokens in dict.fromkeys((p["dtype"], p["tokens"]) for p in points):
        by_width = {p["d"]: p for p in points if p["dtype"] == dtype and p["tokens"] == tokens}
        lines += [
            (
                f"\n{dtype}, [{tokens}, d], median ms (ratio to LayerNorm, or to SkipLayerNorm for the skip "
                "variants; quartiles of the per-round ratio)\n"
            ),
            "| variant | ORT ran | " + " | ".join(f"d={w}" for w in widths) + " |",
            "|---|---|" + "---:|" * len(widths),
        ]
        for label in by_width[widths[0]]["results"]:
            cells = []
            for width in widths:
                r = by_width[width]["results"][label]
                ratio = (
                    "" if r.get("ratio") is None else f" ({r['ratio']:.2f}, {r['ratio_p25']:.2f}–{r['ratio_p75']:.2f})"
                )
                cells.append(f"{r['median_ms']:.3f}{ratio}")
            ran = " + ".join(by_width[widths[0]]["ran_ops"][label])
            lines.append(f"| {label} | {ran} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--widths", type=int, nargs="+", default=[768, 1024, 4096])
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32", "fp16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (0: ORT's default)")
    parser.add_argument("--provider", choices=tuple(bench.PROVIDERS), default="cpu")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), help="only these (default: all)")
    parser.add_argument("--json", help="write every run time here")
    args = parser.parse_args()
    args.variants = args.variants or list(VARIANTS)
    start, load = time.time(), os.getloadavg()
    total = len(args.dtypes) * len(args.tokens) * len(args.widths) * len(args.variants) * (args.repeats + args.warmup)
    bar = bench.progress_bar(total, True)
    points = [
        measure(dtype, tokens, width, args, bar)
        for dtype in args.dtypes
        for tokens in args.tokens
        for width in args.widths
    ]
    bar.close()
    machine = bench.machine() | ({"device": bench.gpu_name()} if args.provider == "cuda" else {})
    bench.finish_tool_run(points, vars(args), start, load, machine, markdown(points), args.json)


if __name__ == "__main__":
    main()
