"""Benchmark the cost of the fold pass on GPT-2-small-shaped ONNX exports.

For each layer count (default 12 and 48; 12 is the 124M ``gpt2-small-shape`` registry model,
the others are the same shape with more layers) the script exports the model once into
``--cache`` (reused on later runs), loads it with ``onnx.load`` (not timed), and then runs
``fold_onnx(model, FoldOptions(verify=False))`` ``--repeats`` times. It reports:

* the median analysis, rewrite and total (= analysis + rewrite) wall seconds, as measured by
  ``fold_onnx`` itself with ``time.perf_counter`` (analysis = graphsurgeon import + shape
  inference + zero-mean graph + plan; rewrite = apply + export to ModelProto; load, save and
  verification are excluded), the fastest total, and the median process CPU seconds of the
  whole call (``time.process_time``, all threads; less disturbed by other load on the machine);
* ``rss_delta_mib``: growth of the process's peak resident set size (``getrusage`` max RSS)
  over the timed runs, relative to the peak after loading the model. It counts every
  allocation (protobuf C++, NumPy, Python) but is a lower bound: only memory above the
  earlier high-water mark shows. Each model is measured in a fresh process so that neither
  the export nor another model raises that mark;
* ``py_peak_mib``: the Python-heap peak during one extra, untimed run under ``tracemalloc``
  (Python objects and NumPy buffers; not protobuf's C++ allocations);
* the number of graph nodes and parameters, norms folded, and, once per model outside the
  timed runs, the max relative output error of a verified fold (``FoldOptions(verify=True)``).

It prints a Markdown table and the ratios last/first of node count, parameter count and time,
so linearity can be judged from time per node. Usage::

    python tools/bench_pass.py --layers 12 48 --repeats 5 --cache /tmp/normpass-bench --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import pathlib
import platform
import resource
import shutil
import statistics
import tempfile
import time
import tracemalloc

TARGET_SECONDS = 0.2
MIB = 1024 * 1024


def model_path(cache: pathlib.Path, layers: int) -> pathlib.Path:
    return cache / f"gpt2-small-shape-{layers}l" / "model.onnx"


def export(cache: str, layers: int) -> str:
    """Export the GPT-2-small-shaped model with `layers` layers into `cache`; return its path."""
    import normpass_models

    path = model_path(pathlib.Path(cache), layers)
    if layers == 12:
        entry = normpass_models.get("gpt2-small-shape")
    else:
        entry = normpass_models.gpt2_small_shape(f"gpt2-small-shape-{layers}l", n_layer=layers)
    partial = path.parent.with_name(path.parent.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    entry.export_onnx(partial / path.name)
    partial.rename(path.parent)  # the directory appears complete or not at all
    return str(path)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(path: str, repeats: int) -> dict:
    """Time, memory and fold counts of the pass on the model at `path` (run in a fresh process)."""
    import onnx

    from normpass.onnx.passes import FoldOptions, fold_onnx

    model = onnx.load(path)
    nodes = len(model.graph.node)
    params = sum(math.prod(init.dims) for init in model.graph.initializer)

    rss_before = max_rss_mib()
    runs = []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        result = fold_onnx(model, FoldOptions(verify=False))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        runs.append({**result.seconds, "total": result.seconds["analysis"] + result.seconds["rewrite"], "call": wall, "cpu": cpu})
        del result
    rss_delta = max_rss_mib() - rss_before

    tracemalloc.start()
    result = fold_onnx(model, FoldOptions(verify=False))
    py_peak = tracemalloc.get_traced_memory()[1] / MIB
    tracemalloc.stop()
    folded, total = result.folded, result.plan.total
    del result

    verified = fold_onnx(model, FoldOptions(verify=True))
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {
        "path": path,
        "nodes": nodes,
        "params": params,
        "folded": folded,
        "norms": total,
        "median_s": median,
        "min_total_s": min(run["total"] for run in runs),
        "runs_s": runs,
        "rss_after_load_mib": rss_before,
        "rss_delta_mib": rss_delta,
        "py_peak_mib": py_peak,
        "max_rel_error": verified.comparison.max_rel_error,
        "verify_s": verified.seconds["verify"],
    }


def in_fresh_process(func, *args):
    """Run `func(*args)` in a new spawned interpreter and return its result."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(func, *args).result()


def environment() -> dict:
    import numpy
    import onnx
    import onnx_graphsurgeon
    import onnxruntime
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kib / 1024**2, 1),
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx_graphsurgeon": onnx_graphsurgeon.__version__,
        "numpy": numpy.__version__,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48], help="layer counts (default: 12 48)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model (default: 5)")
    parser.add_argument("--cache", help="directory for the exported models (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    args = parser.parse_args()

    temp = None if args.cache else tempfile.TemporaryDirectory(prefix="normpass-bench-")
    cache = args.cache or temp.name
    env = environment()
    print("machine:", ", ".join(f"{k} {v}" for k, v in env.items()))

    results = {}
    for layers in args.layers:
        path = model_path(pathlib.Path(cache), layers)
        if path.exists():
            print(f"{layers} layers: reusing {path}")
        else:
            start = time.perf_counter()
            path = in_fresh_process(export, cache, layers)  # torch stays out of the measuring process
            print(f"{layers} layers: exported {path} in {time.perf_counter() - start:.1f} s")
        results[layers] = in_fresh_process(measure, str(path), args.repeats)

    print(f"\nfold_onnx(model, FoldOptions(verify=False)), median of {args.repeats} runs (load, save and verify excluded)\n")
    print("| layers | nodes | params | folded | analysis s | rewrite s | total s | min total s | CPU s | µs/node "
          "| RSS Δ MiB | Python peak MiB | max rel err |")
    print("|" + "---:|" * 13)
    for layers, r in results.items():
        m = r["median_s"]
        print(
            f"| {layers} | {r['nodes']} | {r['params'] / 1e6:.1f} M | {r['folded']}/{r['norms']} | {m['analysis']:.3f} "
            f"| {m['rewrite']:.3f} | {m['total']:.3f} | {r['min_total_s']:.3f} | {m['cpu']:.3f} "
            f"| {1e6 * m['total'] / r['nodes']:.0f} | {r['rss_delta_mib']:.0f} | {r['py_peak_mib']:.0f} "
            f"| {r['max_rel_error']:.1e} |"
        )
    ratios = {}
    if len(results) > 1:
        (small, a), (large, b) = list(results.items())[0], list(results.items())[-1]
        ratios = {"nodes": b["nodes"] / a["nodes"], "params": b["params"] / a["params"]}
        ratios.update({key: b["median_s"][key] / a["median_s"][key] for key in ("analysis", "rewrite", "total", "cpu")})
        print(f"\nratio {large}/{small}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    if 12 in results:
        total = results[12]["median_s"]["total"]
        print(f"target total ≤ {TARGET_SECONDS} s on 12 layers: {'met' if total <= TARGET_SECONDS else 'MISSED'} ({total:.3f} s)")

    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"environment": env, "repeats": args.repeats, "results": results, "ratios": ratios}, indent=2))
    if temp:
        temp.cleanup()


if __name__ == "__main__":
    main()
