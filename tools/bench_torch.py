"""PyTorch speed of folded and surrogate models: eager and torch.compile, against the original and
every norm deleted, on the CPU or a CUDA GPU.

The same model shapes as tools/bench_e2e.py (GPT-2-small, BERT-base, ViT-B/16; seeded weights) and
all-MiniLM-L6-v2 (`minilm`: real weights, `normpass[minilm]`, mean-pooled; random token ids), fp32
by default (`--dtype fp16` on a GPU). Variants, timed in the same interleaved rounds
(`normpass.onnx.runtime.bench.interleave`, medians and per-round ratio quartiles), under
`torch.inference_mode()`, each run ending with `torch.cuda.synchronize()` on a GPU:

* `original`: the `transformers` module;
* `folded`: `normpass.torch.api.fold(model, example_inputs)` (LayerNorm modules replaced by
  RMSNorm modules on centred weights, γ/β migrated into the next Linear layers where possible);
  its outputs are checked against the original's at every point (fp32 tolerance);
* `identity`: every `nn.LayerNorm` replaced by `nn.Identity`: the bound (outputs differ);
* with `--surrogates KIND …`, `replaced-KIND`: what `normpass.replace` emits when it replaces every
  norm that does not fold exactly by a surrogate of that kind (`normpass.torch.replace.apply_surrogates`,
  terms migrated into adjacent layers where exact; seeded γ, β and α, not fitted: this measures
  speed, not accuracy). A pre-LN model folds all its norms but the last; a post-LN one (BERT) folds
  only the embedding norm, so every other norm becomes a surrogate, its γ carried along the residual
  stream (docs/surrogates.md) so that only the last keeps an op;
* with `--all-norms` also `all-KIND`: every norm replaced, the folded ones too
  (`ReplaceOptions(all_norms=True)`): the norm-free model `replace --all-norms` emits.

Modes: `eager`, and `compile` (`torch.compile`, inductor, `dynamic=False`, compiled once per
variant and shape during warm-up; compile time is reported, not timed; `original`, `folded` and
`identity` only). Compiling is slow on two
cores, so it runs at one point per model (`MODELS`), a subset of the eager points.

    python tools/bench_torch.py --models gpt2-small-shape --threads 1 --repeats 5 --budget 20 \\
        --json /tmp/torch-gpt2.json
    python tools/bench_torch.py --device cuda --dtype fp16 --surrogates affine dyt --json /tmp/torch-cuda.json
    python tools/bench_torch.py --models bert-base-shape vit-b16-shape minilm --modes eager --threads 2 \
        --surrogates affine dyt --all-norms --json /tmp/torch-cpu-surrogates.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from normpass import models as builtin_models
from normpass.core.replace import ReplaceOptions
from normpass.core.surrogates import Surrogate
from normpass.models import minilm, registry
from normpass.onnx.runtime import bench
from normpass.onnx.runtime.verify import compare_outputs
from normpass.torch.api import fold
from normpass.torch.replace import apply_surrogates, base

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TOLERANCE = {"fp32": None, "fp16": 1e-2}  # the folded model's check: the dtype's tolerance, or this relative bound


class MiniLM:
    """all-MiniLM-L6-v2 (real weights, `normpass[minilm]`) with sentence-transformers' mean pooling."""

    name = "minilm"

    def build_torch(self):
        return minilm.build_torch()

    def make_inputs(self, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1000, 30000, (batch, seq), generator=torch.Generator().manual_seed(seed))
        return ids, torch.ones_like(ids)


# name → (registry entry factory, sweep axis, eager points, compile points)
MODELS = {
    "gpt2-small-shape": (lambda: builtin_models.get("gpt2-small-shape"), "seq", [64, 256, 1024], [256]),
    "bert-base-shape": (registry.bert_base_shape, "seq", [64, 256, 512], [256]),
    "vit-b16-shape": (registry.vit_b16_shape, "batch", [1, 4], [1]),
    "minilm": (MiniLM, "seq", [128], [128]),
}


class TorchRunner:
    """A module (or its `torch.compile`d form) and its inputs; `time_run` times one forward pass (the
    interface `bench.interleave` uses)."""

    def __init__(self, module: Callable[..., torch.Tensor], inputs: tuple, device: str = "cpu"):
        self.module, self.inputs, self.cuda = module, inputs, device.startswith("cuda")

    def forward(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.module(*self.inputs)

    def time_run(self) -> float:
        start = time.perf_counter()
        self.forward()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def without_norms(model: nn.Module) -> nn.Module:
    bound = copy.deepcopy(model)
    for name, module in list(bound.named_modules()):
        if isinstance(module, nn.LayerNorm):
            bound.set_submodule(name, nn.Identity())
    return bound


def with_surrogates(model: nn.Module, example: tuple, kind: str, all_norms: bool = False, seed: int = 0) -> nn.Module:
    """`model` as `normpass.replace` emits it with every norm that does not fold exactly (`all_norms`: every
    norm) replaced by a `kind` surrogate (seeded terms, not fitted: for timing)."""
    options = ReplaceOptions(kind=kind, all_norms=all_norms)
    bound = dict(inspect.signature(model.forward).bind(*example).arguments)
    b = base(model, bound, options, type(model).__name__)
    rng = np.random.default_rng(seed)
    surrogates = {}
    for norm in b.candidates:
        shape = b.tg.zmg.shape(norm.input)
        assert shape is not None, f"{norm.name}: candidates have a known width"
        width = int(shape[-1])
        gamma = np.full(width, 0.9) if kind == "scalebias" else 1 + 0.1 * rng.standard_normal(width)
        surrogates[norm.name] = Surrogate(
            kind, gamma, 0.1 * rng.standard_normal(width), alpha=0.9 if kind == "scalebias" else 0.5
        )
    replaced, _ = apply_surrogates(model, example, surrogates, options)
    return replaced


def measure(name: str, args) -> list[dict]:
    factory, axis, eager_points, compile_points = MODELS[name]
    entry = factory()
    original, example = entry.build_torch()
    folded, report = fold(original, example, name=name)
    print(
        f"{name}: {report.folded} of {report.plan.total} norms folded ({report.capture}), "
        f"max rel error {report.max_rel_error:.2g} on the example inputs",
        flush=True,
    )
    variants = {"original": original, "folded": folded, "identity": without_norms(original)}
    variants |= {f"replaced-{kind}": with_surrogates(original, example, kind) for kind in args.surrogates}
    if args.all_norms:
        variants |= {f"all-{kind}": with_surrogates(original, example, kind, True) for kind in args.surrogates}
    dtype = DTYPES[args.dtype]
    variants = {label: module.to(args.device, dtype).eval() for label, module in variants.items()}
    results = []
    for mode, points in (("eager", eager_points), ("compile", compile_points)):
        if mode not in args.modes:
            continue
        for point in args.points or points:
            batch, seq = (point, 1) if axis == "batch" else (1, point)
            inputs = tuple(
                t.to(args.device, dtype) if t.is_floating_point() else t.to(args.device)
                for t in entry.make_inputs(batch, seq, 0)
            )
            compile_seconds = {}
            runners = {}
            timed = variants if mode == "eager" else {k: variants[k] for k in ("original", "folded", "identity")}
            for label, module in timed.items():
                if mode == "compile":
                    start = time.time()
                    runner = TorchRunner(torch.compile(module, dynamic=False), inputs, args.device)
                    runner.forward()  # compiles
                    compile_seconds[label] = time.time() - start
                else:
                    runner = TorchRunner(module, inputs, args.device)
                runners[label] = runner
            outputs = {label: {"output": runner.forward().float().cpu().numpy()} for label, runner in runners.items()}
            comparison = compare_outputs(outputs["original"], outputs["folded"])
            bound = TOLERANCE[args.dtype]
            if not (comparison.passed if bound is None else comparison.max_rel_error <= bound):
                raise SystemExit(f"{name} {mode} {batch}x{seq}: folded output differs: {comparison.failures()}")
            times = bench.interleave(runners, args.repeats, args.warmup, budget_s=args.budget)
            summary = bench.summarize(times, "original")
            summary["folded"]["max_rel_error"] = comparison.max_rel_error
            results.append(
                {
                    "model": name,
                    "mode": mode,
                    "input": list(inputs[0].shape),
                    "device": args.device,
                    "dtype": args.dtype,
                    "results": summary,
                    "compile_seconds": compile_seconds,
                }
            )
            print(markdown(results[-1:], header=False), flush=True)
            if compile_seconds:
                print("  compile s: " + ", ".join(f"{k} {v:.0f}" for k, v in compile_seconds.items()), flush=True)
    return results


def markdown(points: list[dict], header: bool = True) -> str:
    lines = (
        [
            (
                "| model | mode | input | original ms | folded ms | folded/original (quartiles) | identity ms "
                "| identity/original | gap to bound (% of original) | replaced: ratio (quartiles) |"
            ),
            "|---|---|---|---:|---:|---|---:|---:|---:|---|",
        ]
        if header
        else []
    )
    for point in points:
        o, f, i = (point["results"][k] for k in ("original", "folded", "identity"))
        shape = "×".join(str(d) for d in point["input"])
        replaced = ", ".join(
            f"{label.removeprefix('replaced-')} {r['ratio']:.3f} ({r['ratio_p25']:.3f}–{r['ratio_p75']:.3f})"
            for label, r in point["results"].items()
            if label.startswith(("replaced-", "all-"))
        )
        lines.append(
            f"| {point['model']} | {point['mode']} | {shape} | {o['median_ms']:.2f} | {f['median_ms']:.2f} "
            f"| {f['ratio']:.3f} ({f['ratio_p25']:.3f}–{f['ratio_p75']:.3f}) | {i['median_ms']:.2f} "
            f"| {i['ratio']:.3f} | {100 * (f['ratio'] - i['ratio']):.1f} | {replaced or '—'} |"
        )
    return "\n".join(lines)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (`tools/bench_gpu.py --torch` builds its run from them too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--points", type=int, nargs="+", help="override the sweep (seq, or batch for ViT), both modes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per point: more repeats for short points")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument(
        "--surrogates", nargs="*", default=[], choices=("affine", "scalebias", "dyt", "derf"), help="replaced-KIND"
    )
    parser.add_argument(
        "--all-norms", action="store_true", help="also all-KIND: every norm replaced, the folded ones too (norm-free)"
    )
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    parser.add_argument("--json", help="write every run time here")
    return parser.parse_args(argv)


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    start, load = time.time(), os.getloadavg()
    points = [point for name in args.models for point in measure(name, args)]
    machine = bench.machine() | {"torch": torch.__version__}
    if args.device.startswith("cuda"):
        machine["device"] = bench.gpu_name() or torch.cuda.get_device_name(args.device)
    bench.finish_tool_run(points, vars(args), start, load, machine, markdown(points), args.json)


if __name__ == "__main__":
    main()
