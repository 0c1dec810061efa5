"""The GPU benchmark of record: normpass against ONNX Runtime's own pipeline on CUDA, and in PyTorch.

Two steps, so that the GPU machine only times:

    python tools/bench_gpu.py prepare --cache /tmp/gpu-cache            # on any CPU: exports, optimizer, folds
    python tools/bench_gpu.py run --cache /tmp/gpu-cache --out docs/results/gpu-DATE   # on the GPU machine
    python tools/bench_gpu.py run --cache /tmp/gpu-cache --out OUT --provider cpu --dtypes fp32 --points 1x128

`prepare` builds, per model (`MODELS`: the registry's GPT-2-small shape with 4096 positions, BERT-base
shape, ViT-B/16 shape, and ViT-B/16 with its classification head, `vit-b16-shape-head`, whose stream
slices; seeded weights) from its TorchScript export (as HF Optimum exports), in fp32 and fp16 (ORT's
`convert_float_to_float16(keep_io_types=True)` as the last step, as ORT's documentation does it), the
`--variants` asked (all of `VARIANTS` by default; `ort-opt` always):

* `raw`: the export as it is, and `raw-folded`: `normpass fold --provider cuda` of it;
* `ort-opt`: ORT's transformers optimizer (`optimize_model(model_type, use_gpu=True, opt_level=0)`):
  what users deploy;
* `opt-fold`: the optimizer, then the fold (`normpass fold --ort-optimizer TYPE`);
* `fold-opt`: the fold, then the optimizer;
* `opt-identity`: every LayerNorm deleted, then the optimizer: the bound on what any norm removal
  buys (its outputs differ; not checked);
* `opt-affine`: what `normpass replace --with affine --all-norms` writes (`norm_free`: seeded terms,
  speed only; outputs not checked), then the optimizer: every norm gone, γ carried along the residual
  stream, the residual writers' bias Adds taken into the surrogates' β;
* `slice-R` (`SLICE_RATIOS`): `normpass slice --ratio R` (one basis per stream, k a multiple of 16) fitted on
  seeded random inputs (`SLICE_CALIBRATION` batches: speed only — which directions are cut does not change
  the time; the outputs differ, not checked; accuracy on real weights: `tools/eval_slice.py`), then the
  optimizer; `opt-slice-R` (only when asked): the optimizer, then the slice — the other order, which fuses
  no better (docs/benchmarks/slice.md);
* fp16 only, weight-only 4- and 8-bit (ORT's `MatMulNBitsQuantizer`, block 32, symmetric, the LM head
  kept; `WEIGHT_BITS`): `opt-int4`, `opt-int8w`: `ort-opt` quantized; `rot-opt`: `normpass rotate
  --provider cuda`, then the optimizer; `rot-opt-int4`, `rot-opt-int8w`: that quantized. Seeded weights:
  their errors are recorded, not bounded (speed only; accuracy on real weights: `tools/bench_rotation.py`).

Beside them it writes what ORT's optimizer fused in each variant (`structure.json`: nodes, fused ops,
MatMul/Gemm) and, for the sliced ones, the multiply-accumulates of the linear layers (constant-weight
MatMul, Gemm, Conv: what slicing cuts to k/d) and of the attention cores (QKᵀ, PV: kept) at each of the
model's points, from ORT's symbolic shape inference (`macs.json`): what bounds a sliced model's speed-up. `run`
copies both into its reports. `prepare --provider cpu` builds the CPU twin (the fold's CPU emission, the
optimizer without `use_gpu`), timed with `run --provider cpu --dtypes fp32 --threads 1 --clock cpu`.
`--cpu-dry-run` (both steps) builds the same names from the registry's small models (`SMALL_TWINS`) and
times them on the CPU at small points: the GPU round tried end to end in about a minute, before a GPU
session spends its minutes (`tools/gpu_slice_round.sh`).

`run` times them on ORT's CUDA provider (`normpass.onnx.runtime.bench.run_benchmark`: IO binding, interleaved
rounds, ORT_ENABLE_ALL, outputs checked against `ort-opt` with TF32 off: fp32 at the fp32 tolerance,
fp16 within a relative error of 0.05) and, with `--torch`, `normpass.fold` in PyTorch eager and
compiled (`tools/bench_torch.py`, fp16). It writes `records.json`: one record per model, dtype,
point and baseline, each naming the device as `nvidia-smi` does, the provider, dtype, model, batch,
seq, the baseline (`ort-opt` or `raw`) and per variant `median_ms` and `ratio` (the median of the
per-round ratios' run, as `bench.summarize` gives it) with the quartiles of the per-round ratios;
and the full reports beside it (`ort-MODEL.DTYPE.json`, `torch.json`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import pathlib
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_e2e

from normpass.core.replace import ReplaceOptions
from normpass.core.surrogates import Surrogate
from normpass.models import forms, registry
from normpass.onnx.fold.driver import FoldOptions, fold_onnx
from normpass.onnx.replace.driver import prepare as replace_prepare
from normpass.onnx.replace.surrogates import export_model
from normpass.onnx.rotate.driver import RotateOptions, rotate_onnx
from normpass.onnx.runtime import bench
from normpass.onnx.runtime.ortopt import MS_DOMAIN, OrtOptimizer, optimize
from normpass.onnx.slice import SliceOptions, slice_onnx

# name → (registry entry factory, points as (batch, seq), fp32 points)
MODELS = {
    "gpt2-small-shape-4k": (
        lambda: registry.gpt2_small_shape("gpt2-small-shape-4k", n_positions=4096),
        [(1, 1), (1, 128), (1, 1024), (1, 4096), (8, 1024)],
        [(1, 1024)],
    ),
    "bert-base-shape": (registry.bert_base_shape, [(1, 128), (8, 512)], [(8, 512)]),
    "vit-b16-shape": (registry.vit_b16_shape, [(1, 1), (64, 1), (256, 1)], [(64, 1)]),
    "vit-b16-shape-head": (lambda: registry.vit_b16_shape(head=True), [(1, 1), (64, 1), (256, 1)], [(64, 1)]),
}
# `--cpu-dry-run`: the same names built as the registry's small models, timed on the CPU at small points, so the
# whole GPU round (prepare, then run) is tried here before a GPU session spends its minutes on it
SMALL_TWINS = {
    "gpt2-small-shape-4k": (lambda: registry.gpt2_entry("gpt2"), [(1, 16)], [(1, 16)]),
    "bert-base-shape": (lambda: registry.get("bert"), [(1, 16)], [(1, 16)]),
    "vit-b16-shape": (lambda: registry.get("vit"), [(2, 1)], [(2, 1)]),
    "vit-b16-shape-head": (lambda: registry.vit_entry("vit-head", head=True), [(2, 1)], [(2, 1)]),
}
SLICE_RATIOS = (0.25,)  # `slice-R` variants: the GPU targets are at R = 0.25
SLICED = tuple(f"slice-{ratio:g}" for ratio in SLICE_RATIOS)  # the slice, then the optimizer
OPT_SLICED = tuple(f"opt-{label}" for label in SLICED)  # the optimizer, then the slice (`--variants`: the order)
SLICE_CALIBRATION, SLICE_SEQ = 4, 64  # seeded batches of 2×64 tokens (or 2 images) fit the bases, one more judges
VARIANTS = ("ort-opt", "opt-fold", "fold-opt", "opt-identity", "opt-affine", *SLICED, "raw", "raw-folded")
BUILT = (*VARIANTS, *OPT_SLICED)  # what `prepare --variants` can build (all of VARIANTS by default)
WEIGHT_BITS = {"-int4": 4, "-int8w": 8}  # a weight-only variant's label suffix → its `MatMulNBits` bits
QUANTIZED = ("opt-int4", "rot-opt", "rot-opt-int4", "opt-int8w", "rot-opt-int8w")  # fp16 only
BASELINES = {
    "ort-opt": ("opt-fold", "fold-opt", "opt-identity", "opt-affine", *SLICED, *OPT_SLICED, *QUANTIZED),
    "raw": ("raw-folded",),
}
UNCHECKED = (
    "opt-identity",
    "opt-affine",
    *SLICED,
    *OPT_SLICED,
)  # norm-free or sliced: their outputs differ from the original's
MATMULS = ("MatMul", "Gemm")
FP16_BOUND = 0.05  # relative error of an fp16 variant against the fp16 `ort-opt`
NBITS_BOUND = 10.0  # a weight-only (`WEIGHT_BITS`) variant's relative error is recorded, not bounded


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's fp16 conversion of a copy of `model`, inputs and outputs kept fp32, as its documentation's
    pipeline ends (ORT's converter rewrites the model it is given)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    wrapped = OnnxModel(copy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped.convert_float_to_float16(keep_io_types=True)
    return wrapped.model


def norm_free(raw: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """`raw` as `normpass replace --with affine --all-norms` writes it, with seeded terms (speed, not
    accuracy): every norm an affine surrogate, γ carried along the residual stream, the biases summed
    into the norms' inputs taken into β."""
    options = ReplaceOptions(kind="affine", all_norms=True, samples=8, budget="cos=0.01", check=0.0)
    prepared = replace_prepare(raw, "synthetic", options, name)
    rng = np.random.default_rng(0)
    surrogates = []
    for norm in prepared.bench.norms:
        width = prepared.bench.width(norm.name)
        gamma, beta = 1 + 0.1 * rng.standard_normal(width), 0.1 * rng.standard_normal(width)
        surrogates.append((norm.name, Surrogate("affine", gamma, beta)))
    ctx, emitter, _ = prepared.bench.build(surrogates)
    return export_model(ctx, prepared.folded, emitter.docs, {})


def sliced(raw: onnx.ModelProto, name: str, ratio: float, provider: str = "cuda") -> onnx.ModelProto:
    """`normpass slice --ratio R --provider PROVIDER` of `raw`, its bases fitted on seeded random inputs
    (`SLICE_CALIBRATION`): the sliced model's shapes, for speed (which directions are cut does not change
    the time; accuracy on real weights: `tools/eval_slice.py`)."""
    feeds = [bench.make_feeds(raw, 2, SLICE_SEQ, seed) for seed in range(SLICE_CALIBRATION + 1)]
    options = SliceOptions(ratio=ratio, basis="stream", provider=provider, holdout=feeds[-1:], verify=False)
    result = slice_onnx(raw, feeds[:-1], options, name=name)
    print(
        f"{name}: {len(result.slicing.sliceable)} of {result.slicing.to_json()['total']} streams sliced "
        f"at R = {ratio:g} ({result.chosen.kept if result.chosen else {}})",
        flush=True,
    )
    return result.model


def structure(model: onnx.ModelProto) -> dict:
    """What ORT's optimizer left: the node count, the fused (com.microsoft) ops and the MatMul/Gemm counts."""
    ops = collections.Counter(n.op_type for n in model.graph.node if n.domain == MS_DOMAIN or n.op_type in MATMULS)
    return {"nodes": len(model.graph.node), "ops": dict(sorted(ops.items()))}


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose linear layers' weights keep their shape and not their values (no shape depends
    on them): shape inference of a large model without a second copy of its weights."""
    weights = {node.input[1] for node in model.graph.node if node.op_type in (*MATMULS, "Conv")}
    copy = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    for field in ("node", "input", "output", "value_info"):
        getattr(copy.graph, field).extend(getattr(model.graph, field))
    for tensor in model.graph.initializer:
        if tensor.name in weights:
            copy.graph.initializer.add(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type)
        else:
            copy.graph.initializer.append(tensor)
    return copy


def linear_macs(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, int]:
    """Multiply-accumulates of `model` (standard ops: before ORT's optimizer) at one input shape, from ORT's
    symbolic shape inference: `linear`, the layers with a constant weight (MatMul, Gemm, Conv: what slicing
    cuts to k/d), and `attention`, the MatMuls of two activations (QKᵀ and PV: the heads' width, which
    slicing keeps)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    shaped = weightless(model)
    for value in shaped.graph.input:
        shape = bench.point_shapes(model, batch, seq)[value.name]
        for dim, size in zip(value.type.tensor_type.shape.dim, shape, strict=True):
            dim.dim_value = size
    shaped = SymbolicShapeInference.infer_shapes(shaped, auto_merge=True)
    dims = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*shaped.graph.input, *shaped.graph.value_info, *shaped.graph.output)
    }
    weights = {i.name for i in shaped.graph.initializer}
    found = {"linear": 0, "attention": 0}
    for node in shaped.graph.node:
        if node.op_type in (*MATMULS, "Conv"):
            out = math.prod(dims[node.output[0]])
            if node.op_type == "Conv":
                depth = math.prod(next(i.dims for i in shaped.graph.initializer if i.name == node.input[1])[1:])
            else:
                trans_a = any(a.name == "transA" and a.i for a in node.attribute)
                depth = dims[node.input[0]][0 if trans_a else -1]
            kind = "linear" if weights & set(node.input[:2]) else "attention"
            found[kind] += out * depth
    return found


def nbits_weights(source: pathlib.Path, out: pathlib.Path, bits: int) -> pathlib.Path:
    """`source` with every constant-weight MatMul but the LM head in `bits` bits (`bench_rotation`'s
    weight-only recipe at `bits`: symmetric, blocks of 32), built afresh."""
    import bench_rotation

    out.unlink(missing_ok=True)  # its source is rebuilt on every `prepare`
    recipe = bench_rotation.Recipe("nbits", bits=bits)
    return bench_rotation.quantize(source, recipe, [], out, bench_rotation.lm_head(source))


def rotated_optimized(raw: onnx.ModelProto, settings: OrtOptimizer, name: str) -> onnx.ModelProto:
    """`normpass rotate --provider cuda` of `raw`, then ORT's optimizer, in fp16."""
    rotated = rotate_onnx(raw, RotateOptions(provider="cuda"), name=name)
    print(f"{name}: {rotated.rotated} of {len(rotated.rotation.streams)} streams rotated", flush=True)
    return to_fp16(optimize(rotated.model, settings)[0])


def prepare_quantized(rotated: onnx.ModelProto, root: pathlib.Path) -> dict[str, str]:
    """The fp16 weight-only variants (`QUANTIZED`), from `rotated` and the saved `ort-opt.fp16.onnx` under `root`."""
    bench_e2e.save(rotated, root / "rot-opt.fp16.onnx")
    paths = {"rot-opt": str(root / "rot-opt.fp16.onnx")}
    for suffix, bits in WEIGHT_BITS.items():
        for base, source in (("opt", "ort-opt"), ("rot-opt", "rot-opt")):
            out = root / f"{base}{suffix}.fp16.onnx"
            paths[base + suffix] = str(nbits_weights(root / f"{source}.fp16.onnx", out, bits))
    return paths


def prepare(
    name: str, cache: pathlib.Path, quantized: bool, variants: tuple[str, ...] = VARIANTS, provider: str = "cuda"
) -> dict[str, dict[str, str]]:
    """`variants` of `name` (the module docstring; `ort-opt` always, the baseline), in fp32 and fp16, written
    under `cache/name`, with what ORT's optimizer fused in each (`structure.json`) and the linear layers'
    multiply-accumulates of the sliced models against the original's (`macs.json`). `provider`: the fold's
    emission and the optimizer's `use_gpu` (cpu: the CPU twin)."""
    entry = MODELS[name][0]()
    root = cache / name
    root.mkdir(parents=True, exist_ok=True)
    export = forms.export_form(entry, root / "export.onnx", "torchscript")
    raw = onnx.load(str(export))
    settings = OrtOptimizer(entry.ort_model_type, entry.num_heads, entry.hidden_size, use_gpu=provider == "cuda")
    wanted = dict.fromkeys(("ort-opt", *variants, *(("raw",) if "raw-folded" in variants else ())))
    folded = functools.cache(lambda: fold_onnx(raw, FoldOptions(provider=provider), name=name))
    original = functools.cache(lambda: optimize(raw, settings)[0])
    cuts = functools.cache(lambda ratio: sliced(raw, name, ratio, provider))
    builders: dict[str, Callable[[], onnx.ModelProto]] = {
        "raw": lambda: raw,
        "raw-folded": lambda: folded().model,
        "ort-opt": original,
        "opt-fold": lambda: fold_onnx(raw, FoldOptions(provider=provider, ort_optimizer=settings), name=name).model,
        "fold-opt": lambda: optimize(folded().model, settings)[0],
        "opt-identity": lambda: optimize(bench_e2e.without_norms(raw), settings)[0],
        "opt-affine": lambda: optimize(norm_free(raw, name), settings)[0],
    }
    for label, ratio in zip(SLICED, SLICE_RATIOS, strict=True):
        builders[label] = functools.partial(lambda r: optimize(cuts(r), settings)[0], ratio)
        builders[f"opt-{label}"] = functools.partial(lambda r: sliced(original(), name, r, provider), ratio)
    models = {label: builders[label]() for label in wanted}
    sliced_ratios = [r for r in SLICE_RATIOS if any(label.endswith(f"slice-{r:g}") for label in wanted)]
    macs: dict[tuple[int, int], dict[str, dict[str, int]]] = {
        (batch, seq): {"original": linear_macs(raw, batch, seq)}
        | {f"slice-{ratio:g}": linear_macs(cuts(ratio), batch, seq) for ratio in sliced_ratios}
        for batch, seq in (sorted({*MODELS[name][1], *MODELS[name][2]}) if sliced_ratios else [])
    }
    rotated = rotated_optimized(raw, settings, name) if quantized else None  # before `raw`'s weights move out
    paths: dict[str, dict[str, str]] = {"fp32": {}, "fp16": {}}
    for label in wanted:
        half = to_fp16(models[label])  # before the fp32 model is saved: saving moves its weights out
        for dtype, model in (("fp32", models[label]), ("fp16", half)):
            path = root / f"{label}.{dtype}.onnx"
            bench_e2e.save(model, path)
            paths[dtype][label] = str(path)
    if rotated is not None:
        paths["fp16"] |= prepare_quantized(rotated, root)
    fused = {label: structure(model) for label, model in models.items()}
    (root / "structure.json").write_text(json.dumps(fused, indent=1) + "\n")
    if macs:
        found = [{"batch": batch, "seq": seq} | counts for (batch, seq), counts in macs.items()]
        (root / "macs.json").write_text(json.dumps(found, indent=1) + "\n")
    for label, built in fused.items():
        print(f"{name} {label}: {built['nodes']} nodes, {built['ops']}", flush=True)
    for (batch, seq), counts in macs.items():
        total = {label: sum(kinds.values()) for label, kinds in counts.items()}
        shares = ", ".join(f"{label} {n / total['original']:.3f}" for label, n in total.items() if label != "original")
        print(f"{name} {batch}x{seq}: MACs {counts['original']}, sliced/original {shares}", flush=True)
    print(f"{name}: variants in {root}", flush=True)
    return paths


def records(report: dict, device: str, provider: str, name: str, dtype: str) -> list[dict]:
    """The benchmark's points as records, one per baseline (`BASELINES`), ratios from the same rounds."""
    out = []
    for point in report["points"]:
        for baseline, labels in BASELINES.items():
            labels = tuple(label for label in labels if label in point["results"])
            if baseline not in point["results"] or not labels:  # `prepare --variants` built neither side
                continue
            times = {label: [t / 1e3 for t in point["results"][label]["runs_ms"]] for label in (baseline, *labels)}
            summary = bench.summarize(times, baseline)
            out.append(
                {
                    "device": device,
                    "provider": provider,
                    "dtype": dtype,
                    "model": name,
                    "batch": point["batch"],
                    "seq": point["seq"],
                    "baseline": baseline,
                    "baseline_ms": summary[baseline]["median_ms"],
                    "variants": {
                        label: {
                            "median_ms": summary[label]["median_ms"],
                            "ratio": summary[label]["ratio"],
                            "ratio_p25": summary[label]["ratio_p25"],
                            "ratio_p75": summary[label]["ratio_p75"],
                            "max_rel_error": point["results"][label].get("max_rel_error"),
                        }
                        for label in labels
                    },
                }
            )
    return out


def run_ort(args: argparse.Namespace, manifest: dict, device: str) -> list[dict]:
    found = []
    for name, by_dtype in manifest.items():
        for dtype in args.dtypes:
            paths = by_dtype[dtype]
            bounded = dtype == "fp16"
            candidates = [
                bench.Candidate(
                    label,
                    paths[label],
                    check=label not in UNCHECKED,
                    bound=(NBITS_BOUND if label.endswith(tuple(WEIGHT_BITS)) else FP16_BOUND)
                    if bounded and label not in UNCHECKED
                    else None,
                )
                for label in (*BUILT, *QUANTIZED)
                if label in paths
            ]
            points = args.points or (MODELS[name][1] if dtype == "fp16" else MODELS[name][2])
            if all(seq == 1 for _, seq in MODELS[name][1]):  # an image model: `--points 1x128` is batch 1
                points = sorted({(batch, 1) for batch, _ in points})
            start = time.time()
            report = bench.run_benchmark(
                candidates,
                points,
                provider=args.provider,
                repeats=args.repeats,
                warmup=args.warmup,
                budget_s=args.budget,
                threads=args.threads,
                clock=args.clock,
                progress=False,
            )
            root = pathlib.Path(paths["ort-opt"]).parent
            for extra in ("structure", "macs"):  # what `prepare` found: ORT's fusions, the linear layers' MACs
                if (root / f"{extra}.json").exists():
                    report[extra] = json.loads((root / f"{extra}.json").read_text())
            if args.ran_ops:
                report["ran_ops"] = {
                    c.label: bench_e2e.ran_ops(pathlib.Path(c.path), args.provider, 0) for c in candidates
                }
            (args.out / f"ort-{name}.{dtype}.json").write_text(json.dumps(report, indent=1) + "\n")
            got = records(report, device, args.provider, name, dtype)
            found += got
            (args.out / "records.partial.json").write_text(json.dumps(found, indent=1) + "\n")
            for record in got:
                cells = ", ".join(f"{k} {v['ratio']:.3f}" for k, v in record["variants"].items())
                print(
                    f"{name} {dtype} {record['batch']}x{record['seq']} vs {record['baseline']} "
                    f"{record['baseline_ms']:.2f} ms: {cells}",
                    flush=True,
                )
            print(f"  ({time.time() - start:.0f} s)", flush=True)
    return found


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((args.cache / "manifest.json").read_text()) if args.models else {}
    manifest = {name: paths for name, paths in manifest.items() if name in args.models}
    device = (bench.gpu_name() or "unknown GPU") if args.provider == "cuda" else bench.machine()["cpu"]
    found = run_ort(args, manifest, device) if manifest else []
    machine = bench.machine() | {"device": device, "threads": args.threads, "clock": args.clock}
    if args.torch:
        import bench_torch
        import torch

        machine["torch"] = torch.__version__
        torch_args = bench_torch.arguments(
            ["--device", "cuda", "--dtype", "fp16", "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
            + ["--budget", str(args.budget), "--surrogates", *args.surrogates]
            + (["--all-norms"] if args.surrogates else [])
            + ["--modes", *args.torch_modes]
        )
        points = []
        for name, (eager, compiled) in TORCH_POINTS.items():
            bench_torch.MODELS[name] = (*bench_torch.MODELS[name][:2], eager, compiled)
            points += bench_torch.measure(name, torch_args)
        (args.out / "torch.json").write_text(json.dumps({"machine": machine, "points": points}, indent=1) + "\n")
        print(bench_torch.markdown(points), flush=True)
        found += [
            {
                "device": device,
                "provider": f"torch-{p['mode']}",
                "dtype": "fp16",
                "model": p["model"],
                "batch": p["input"][0],
                "seq": p["input"][1] if len(p["input"]) == 2 else 1,
                "baseline": "original",
                "baseline_ms": p["results"]["original"]["median_ms"],
                "variants": {
                    label: {k: r.get(k) for k in ("median_ms", "ratio", "ratio_p25", "ratio_p75", "max_rel_error")}
                    for label, r in p["results"].items()
                    if label != "original"
                },
            }
            for p in points
        ]
    (args.out / "records.json").write_text(json.dumps({"machine": machine, "records": found}, indent=1) + "\n")


# PyTorch points (eager, compiled): batch for ViT, sequence length otherwise
TORCH_POINTS = {
    "vit-b16-shape": ([8, 64, 256], [64]),
    "gpt2-small-shape": ([256, 1024], [1024]),
    "bert-base-shape": ([512], []),
}


def _point(text: str) -> tuple[int, int]:
    """ "8x128" → (8, 128); the sequence length is ignored for ViT."""
    batch, _, seq = text.partition("x")
    return int(batch), int(seq or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    prep = sub.add_parser("prepare", help="build every variant (CPU)")
    prep.add_argument("--cache", type=pathlib.Path, required=True)
    prep.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    prep.add_argument("--quantized", action="store_true", help="also the fp16 weight-only variants (QUANTIZED)")
    prep.add_argument(
        "--variants", nargs="+", choices=BUILT, default=list(VARIANTS), help="only these (and ort-opt, the baseline)"
    )
    prep.add_argument(
        "--provider",
        choices=tuple(bench.PROVIDERS),
        default="cuda",
        help="fold emission, optimizer use_gpu",
    )
    timing = sub.add_parser("run", help="time the prepared variants (GPU)")
    timing.add_argument("--cache", type=pathlib.Path, required=True)
    timing.add_argument("--out", type=pathlib.Path, required=True)
    timing.add_argument("--models", nargs="*", choices=tuple(MODELS), default=list(MODELS), help="none: PyTorch only")
    timing.add_argument("--dtypes", nargs="+", choices=("fp16", "fp32"), default=["fp16", "fp32"])
    timing.add_argument("--provider", choices=tuple(bench.PROVIDERS), default="cuda", help="cpu: to try it here")
    timing.add_argument(
        "--points", nargs="+", type=_point, metavar="BATCHxSEQ", help="these points for every model and dtype"
    )
    timing.add_argument("--repeats", type=int, default=20)
    timing.add_argument("--warmup", type=int, default=3)
    timing.add_argument("--budget", type=float, default=3.0, help="seconds per point: more repeats for short points")
    timing.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: ORT's default)")
    timing.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="cpu: this process's CPU time (a shared machine)"
    )
    timing.add_argument("--ran-ops", action="store_true", help="also count the ops ORT runs (a session more each)")
    timing.add_argument("--torch", action="store_true", help="also PyTorch eager and compiled (fp16, CUDA)")
    timing.add_argument("--torch-modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    timing.add_argument(
        "--surrogates", nargs="*", default=[], help="with --torch: replaced-KIND and all-KIND (norm-free) variants"
    )
    for step in (prep, timing):
        step.add_argument(
            "--cpu-dry-run",
            action="store_true",
            help="the same models as the registry's small ones (SMALL_TWINS), timed on the CPU at small points",
        )
    args = parser.parse_args()
    if args.cpu_dry_run:
        MODELS.update(SMALL_TWINS)
        if args.step == "run":
            args.provider, args.repeats, args.warmup, args.budget = "cpu", min(args.repeats, 3), 1, 0.0
    if args.step == "prepare":
        args.cache.mkdir(parents=True, exist_ok=True)
        manifest_path = args.cache / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        for name in args.models:
            manifest[name] = prepare(name, args.cache, args.quantized, tuple(args.variants), args.provider)
            manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        (args.cache / "DONE").write_text("\n".join(sorted(manifest)) + "\n")
    else:
        run(args)


if __name__ == "__main__":
    main()
