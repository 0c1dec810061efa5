"""Why a model with every norm deleted is not faster on ONNX Runtime's CPU provider: Softmax denormals.

Without its norms an encoder's residual stream grows, and so do its attention logits. ORT's CPU
Softmax computes exp(x − max) and runs 10× slower or more when most of those underflow: the
arithmetic passes through denormal numbers. ORT's session option `session.set_denormal_as_zero`
(flush-to-zero and denormals-are-zero) is set on the threads of its intra-op pool only; with one
thread the caller's thread computes and it has no effect.

Two measurements, CPU time per run (`time.process_time`, median):

* a lone Softmax over 12×128×128 logits (one attention layer of a 12-head model at 128 tokens),
  standard normal logits scaled by 1, 10, 100 and 1000, with and without denormals as zero, at one
  and two intra-op threads;
* with `--model PATH` (e.g. `tools/bench_e2e.py --surrogates`'s identity.onnx): that model's
  Softmax kernel time per run (ORT's profiler, all graph optimizations on, each node's fastest
  run), the same four settings.

    python tools/softmax_denormals.py --model /tmp/normpass-bench/minilm/identity.onnx --runs 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

from normpass.onnx.runtime.bench import make_feeds, profile_ops

SETTINGS = [(threads, daz) for threads in (1, 2) for daz in (False, True)]


def session(model: bytes, threads: int, daz: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if daz:
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def lone_softmax(runs: int) -> None:
    shape = [12, 128, 128]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Softmax", ["x"], ["y"], axis=-1)],
        "softmax",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]).SerializeToString()
    logits = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    print("lone Softmax, 12×128×128, CPU ms per run (median):")
    for threads, daz in SETTINGS:
        sess = session(model, threads, daz)
        cells = []
        for scale in (1, 10, 100, 1000):
            feeds = {"x": logits * scale}
            times = []
            for _ in range(runs):
                start = time.process_time()
                sess.run(None, feeds)
                times.append(time.process_time() - start)
            cells.append(f"×{scale} {1e3 * statistics.median(times):.3f}")
        print(f"  threads {threads}, denormals as zero {daz!s:5s}: " + ", ".join(cells))


def model_softmax(path: str, runs: int) -> None:
    feeds = make_feeds(onnx.load(path, load_external_data=False), 1, 128)
    print(f"{path}, 1×128: Softmax kernel ms per run (ORT profiler, each node's fastest of {runs} runs):")
    for threads, daz in SETTINGS:
        config = {"session.intra_op.allow_spinning": "0"} | ({"session.set_denormal_as_zero": "1"} if daz else {})
        per_op = profile_ops({"model": path}, feeds, "cpu", threads, runs, statistic="min", config=config)
        print(f"  threads {threads}, denormals as zero {daz!s:5s}: {per_op['model'].get('Softmax', 0.0):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="also profile this model's Softmax kernels")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    lone_softmax(args.runs)
    if args.model:
        model_softmax(args.model, args.runs)


if __name__ == "__main__":
    main()
