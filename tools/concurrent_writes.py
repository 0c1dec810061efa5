"""Do concurrent writers of one output, and readers meanwhile, see a model with another run's weights?

    python tools/concurrent_writes.py [--rounds 300] [--writers 2] [--readers 1] [--dim 1024]
    PYTHONPATH=OTHER_CHECKOUT python tools/concurrent_writes.py ...   # the same against another normpass

Two models of one architecture (`x → MatMul → Add → LayerNorm → MatMul → Add → MatMul`, width
`--dim`, about 12 MB of fp32 weights at 1024), with different weights stored in opposite orders in
their external data files, so that one's model file over the other's data file computes neither.
Each round, `--writers` processes (alternately the first and the second model, each loaded once
with `normpass.io.load_ir`) are released together by a barrier and write it to the same `out.onnx`
with `normpass.io.save_onnx_atomic`; then `out.onnx` is run in ONNX Runtime and compared with both
models. Meanwhile `--readers` processes run `out.onnx` in a loop. Prints the rounds that ended
mixed (matching neither model), the reads that computed neither model ("wrong": silently wrong)
or failed, and the data files left.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from normpass import io


def write_model(path: Path, seed: int, dim: int, reverse: bool) -> None:
    rng = np.random.default_rng(seed)
    weights = {
        "w0": rng.standard_normal((dim, dim)) / dim**0.5,
        "b0": rng.standard_normal(dim),
        "g": 1 + 0.1 * rng.standard_normal(dim),
        "bt": rng.standard_normal(dim),
        "w1": rng.standard_normal((dim, dim)) / dim**0.5,
        "b1": rng.standard_normal(dim),
        "w2": rng.standard_normal((dim, dim)) / dim**0.5,
    }
    tensors = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"]),
        helper.make_node("Add", ["m0", "b0"], ["h"]),
        helper.make_node("LayerNormalization", ["h", "g", "bt"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["z"]),
        helper.make_node("MatMul", ["z", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", dim])],
        tensors[::-1] if reverse else tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path, save_as_external_data=True, location=f"{path.name}.data", size_threshold=1024)


def run(path: Path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def matches(path: Path, x: np.ndarray, references: list[np.ndarray]) -> bool:
    got = run(path, x)
    return any(float(np.abs(got - r).max()) <= 1e-4 * float(np.abs(r).max()) for r in references)


def writer(source: Path, out: Path, rounds: int, barrier) -> None:
    model = io.load_ir(source)
    for _ in range(rounds):
        barrier.wait()
        io.save_onnx_atomic(model, out)
        barrier.wait()


def reader(out: Path, x: np.ndarray, references, stop, counts) -> None:
    while not stop.is_set():
        try:
            counts[0 if matches(out, x, references) else 1] += 1
        except Exception:  # the data file the model names is gone, say
            counts[2] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--readers", type=int, default=1)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        sources = [directory / "a.onnx", directory / "b.onnx"]
        for seed, source in enumerate(sources):
            write_model(source, seed, args.dim, reverse=bool(seed))
        x = np.random.default_rng(9).standard_normal((3, args.dim)).astype(np.float32)
        references = [run(source, x) for source in sources]
        out = directory / "out.onnx"
        barrier = multiprocessing.Barrier(args.writers + 1)
        stop, counts = multiprocessing.Event(), multiprocessing.Array("i", 3)
        writers = [
            multiprocessing.Process(target=writer, args=(sources[i % 2], out, args.rounds, barrier))
            for i in range(args.writers)
        ]
        readers = [
            multiprocessing.Process(target=reader, args=(out, x, references, stop, counts)) for _ in range(args.readers)
        ]
        start = time.perf_counter()
        for process in writers + readers:
            process.start()
        mixed = 0
        for _ in range(args.rounds):
            barrier.wait()
            barrier.wait()
            try:
                mixed += not matches(out, x, references)
            except Exception:
                mixed += 1
        stop.set()
        for process in writers + readers:
            process.join()
        left = [p.name for p in directory.iterdir() if p.name.startswith("out.onnx") and p.name.endswith("data")]
        print(
            f"normpass at {os.path.dirname(io.__file__)}: {args.rounds} rounds of {args.writers} writers: "
            f"{mixed} ended mixed; reads meanwhile: {counts[0]} right, {counts[1]} wrong, {counts[2]} failed; "
            f"data files left: {len(left)}; {time.perf_counter() - start:.0f} s"
        )


if __name__ == "__main__":
    main()
