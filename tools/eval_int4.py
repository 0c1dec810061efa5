"""Where does IgLM's 4-bit perplexity gap come from, with and without rotation? (issue 43, item 8)

`tools/eval_decode.py` measured weight-only 4-bit on IgLM (its with-past export, judged on prefills of
held-out sequences sampled from IgLM): +1.48 % perplexity unrotated, +2.90 % rotated. This separates the
effects, each on the same held-out sequences:

* **the model**: the original; the fold alone (every LayerNorm an RMS op, γ and β moved into the linear
  layers that read it: the fold `rotate` starts from, verified); the fold rotated (`rotate`, randomised
  Hadamard or random orthogonal, several seeds);
* **which weights**: every MatMul with a constant weight, or one group at a time (attention: QKV and output
  projections; MLP: up and down projections; the LM head). The export's head reads the tied embedding
  through a `Transpose`, which ONNX Runtime's quantizer does not see: it stays fp32 unless the transpose is
  first written as the constant it computes (`quantizable`, exact), as GenAI's builder writes the head;
* **the format** (`quantize`): ONNX Runtime's `MatMulNBitsQuantizer`, 4 bits, block 32 or 128, asymmetric
  with accuracy level 0 (fp32 activations: `eval_decode.four_bit`'s format) or symmetric with accuracy level
  0 or 4 (level 4: activations quantized blockwise to int8 at run time: GenAI's builder's CPU format); RTN
  by default, ORT's GPTQ (calibrated on prefills of the calibration sequences, never the judged ones) or HQQ.

The gap is the held-out perplexity over the fp32 original's, minus one. Its spread: the 5th and 95th
percentiles of the same ratio over sequences resampled with replacement (paired: each resample judges the
fp32 and the 4-bit model on the same sequences), and the gap on each half of the held-out sequences. Beside
it, the mean KL divergence from the original's next-token distribution (nats per prediction), which unlike
the gap cannot fall below zero by chance. `main` runs seven stages (`--stages`): which weights carry the gap;
the rotation's seed; the other formats and block 128; GPTQ and HQQ; sliced and sliced + rotated; attention's
two projections apart and online rotation; the KL divergence at block 32 and 128.

    python tools/eval_int4.py --json docs/results/cpu-2026-11-28/int4-quality-iglm.json
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
import tempfile

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_decode
import eval_slice

from normpass import RotateOptions, SliceOptions, fold_onnx, rotate_onnx, slice_onnx
from normpass.onnx.rotate.online import METADATA_KEY as KEEP_FP32
from normpass.onnx.runtime import bench

GROUPS = ("attention", "mlp", "head")
PARTS = ("qkv", "out")  # attention's two projections, each alone
FORMATS = {"asym-0": (False, 0), "sym-0": (True, 0), "sym-4": (True, 4)}  # is_symmetric, accuracy_level
BOOTSTRAP = 2000


# --- the weights the quantizer sees -----------------------------------------------------------------


def quantizable(model: onnx.ModelProto) -> onnx.ModelProto:
    """`eval_decode.gemm_as_matmul(model)` with each MatMul whose weight is a `Transpose` of a constant given
    the transposed constant itself (exact; the transpose is left for its other readers): ONNX Runtime's 4-bit
    quantizer rewrites only a MatMul whose weight is an initializer."""
    model = eval_decode.gemm_as_matmul(model)
    weights = {t.name: t for t in model.graph.initializer}
    transposed = {
        node.output[0]: node
        for node in model.graph.node
        if node.op_type == "Transpose" and node.input[0] in weights and len(weights[node.input[0]].dims) == 2
    }
    for node in model.graph.node:
        source = transposed.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if source is None:
            continue
        perm = [a.ints for a in source.attribute if a.name == "perm"]
        if perm and list(perm[0]) != [1, 0]:
            continue
        name = f"{source.input[0]}.T"
        if name not in weights:
            array = numpy_helper.to_array(weights[source.input[0]]).T.copy()
            weights[name] = numpy_helper.from_array(array, name)
            model.graph.initializer.append(weights[name])
        node.input[1] = name
    return model


def groups(model: onnx.ModelProto, inner: int, vocab: int, width: int) -> dict[str, str]:
    """Each MatMul with a constant weight of a GPT-2 (after `quantizable`) by group: the head writes the
    vocabulary, the MLP's projections read or write its inner width, the others are attention's: `qkv`
    writes three times its width, `out` the others. MatMuls named in the model's `normpass.keep_fp32`
    metadata (online rotations) are no group: a quantizer leaves them in floating point."""
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    kept = next((p.value for p in model.metadata_props if p.key == KEEP_FP32), "").split(",")
    found = {}
    for node in model.graph.node:
        shape = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if shape is None or len(shape) != 2 or node.name in kept:
            continue
        found[node.name] = (
            "head" if shape[1] == vocab else "mlp" if inner in shape else "qkv" if shape[1] == 3 * width else "out"
        )
    return found


def quantize(
    model: onnx.ModelProto,
    form: str,
    block: int,
    only: list[str] | None = None,
    algorithm: str = "rtn",
    calibration: list[dict] | None = None,
) -> onnx.ModelProto:
    """`model`'s MatMuls (those named in `only`, else every one with a constant weight) as `MatMulNBits`:
    4 bits, `block` weights per scale, the format `form` of FORMATS, by RTN, GPTQ (on `calibration`) or HQQ.
    `model` is not modified (ONNX Runtime's quantizer rewrites the model it is given)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    model = onnx.ModelProto.FromString(model.SerializeToString())

    symmetric, level = FORMATS[form]
    names = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    exclude = [] if only is None else [n for n in names if n not in only]
    config = None
    if algorithm == "gptq":
        assert calibration is not None and only is None  # ORT's GPTQ quantizes every MatMul
        config = nbits.GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(calibration))
    elif algorithm == "hqq":
        assert not symmetric  # HQQ fits a zero point
        config = nbits.HQQWeightOnlyQuantConfig(block_size=block, bits=4)
    quantizer = nbits.MatMulNBitsQuantizer(
        model,
        bits=4,
        block_size=block,
        is_symmetric=symmetric,
        accuracy_level=level,
        nodes_to_exclude=exclude,
        algo_config=config,
    )
    quantizer.process()
    return quantizer.model.model


class _Reader:
    """ONNX Runtime's `CalibrationDataReader` over a list of feeds (GPTQ's Hessians)."""

    def __init__(self, feeds: list[dict]):
        self.feeds = feeds
        self.index = 0

    def get_next(self) -> dict | None:
        self.index += 1
        return self.feeds[self.index - 1] if self.index <= len(self.feeds) else None

    def __iter__(self):
        return iter(self.feeds)

    def rewind(self) -> None:
        self.index = 0


# --- judging ----------------------------------------------------------------------------------------


def per_sequence(model: onnx.ModelProto, sequences: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sequence's negative log-likelihood of its next tokens (summed), its logits' argmax, and the
    log-probabilities of its next tokens ([sequences, positions, vocabulary])."""
    run = eval_decode.session(model)
    nll, top, logps = [], [], []
    for s in sequences:
        logits = run.run(["logits"], eval_decode.prefill_feeds(s, model))[0][0].astype(np.float64)
        shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll.append(-logp[np.arange(len(logp)), s[0, 1:]].sum())
        top.append(logits.argmax(-1))
        logps.append(logp)
    return np.array(nll), np.stack(top), np.stack(logps)


def gap(nll: np.ndarray, base: np.ndarray, tokens: int) -> float:
    """Perplexity over the reference's, minus one, on the sequences of `nll` (each of `tokens` predictions)."""
    return float(np.exp((nll.sum() - base.sum()) / (tokens * len(nll))) - 1)


def judged(found: tuple, base: tuple, tokens: int) -> dict:
    """The gap to the reference, its spread (bootstrap over sequences, paired; each half), the agreement, and
    the mean KL divergence from the reference's next-token distribution to this one (nats per prediction)."""
    nll, top, logp = found
    draws = np.random.default_rng(0).integers(0, len(nll), size=(BOOTSTRAP, len(nll)))
    spread = [gap(nll[d], base[0][d], tokens) for d in draws]
    half = len(nll) // 2
    return {
        "perplexity": float(np.exp(nll.sum() / (tokens * len(nll)))),
        "gap": gap(nll, base[0], tokens),
        "gap_p5_p95": [float(np.percentile(spread, 5)), float(np.percentile(spread, 95))],
        "gap_halves": [gap(nll[:half], base[0][:half], tokens), gap(nll[half:], base[0][half:], tokens)],
        "top1_agree": float((top == base[1]).mean()),
        "kl": float((np.exp(base[2]) * (base[2] - logp)).sum(-1).mean()),
    }


# --- the run ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=64, help="held-out sequences (seed 2)")
    parser.add_argument("--calibration", type=int, default=24, help="calibration sequences (seed 1)")
    parser.add_argument("--seeds", type=int, default=3, help="rotation seeds of each kind")
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--forms", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--algorithms", nargs="*", choices=("gptq", "hqq"), default=["gptq", "hqq"])
    parser.add_argument("--slice", type=float, nargs="*", default=[0.2], help="sliced (+ rotated) + 4-bit")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="of main's 1-7")
    parser.add_argument("--online-block", type=int, default=64, help="stage 6's online rotation")
    parser.add_argument("--cache", type=pathlib.Path, help="keep the export here (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    import transformers

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # a line per node otherwise

    directory = eval_slice.iglm_directory()
    vocab = (directory / "vocab.txt").read_text().split()
    torch_model = transformers.GPT2LMHeadModel.from_pretrained(str(directory / "IgLM")).eval()
    inner = torch_model.config.n_inner or 4 * torch_model.config.n_embd
    length = eval_decode.LENGTH
    calibration = eval_slice.iglm_sequences(torch_model, vocab, args.calibration, seed=1, length=length)
    held_out = eval_slice.iglm_sequences(torch_model, vocab, args.sequences, seed=2, length=length)
    points: list[dict] = []
    report = {
        "machine": bench.machine(),
        "command": "python tools/eval_int4.py " + " ".join(sys.argv[1:]),
        "load_start": os.getloadavg(),
        "model": "iglm 0.1.0 trained_models/IgLM (GPT2LMHeadModel, 4 layers, d = 512, vocabulary 33), with-past "
        "torch.onnx export (dynamo, eval_decode.export_with_past), judged on prefills (empty past)",
        "calibration": f"{args.calibration} sequences of {length} tokens sampled from IgLM, seed 1 (GPTQ, slice)",
        "judged": f"{args.sequences} sequences of {length} tokens sampled from IgLM, seed 2",
        "gap": "held-out perplexity / the fp32 original's − 1; gap_p5_p95: bootstrap over sequences "
        f"({BOOTSTRAP} paired resamples); gap_halves: on the first and second half of the sequences",
        "points": points,
    }

    write = eval_decode.recorder(report, points, args.json)

    def record(found: dict) -> None:
        report["load_end"] = os.getloadavg()
        write(found)

    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache or pathlib.Path(temporary)
        original = eval_decode.cached_export(
            cache, "iglm-with-past.onnx", lambda p: eval_decode.export_with_past(torch_model, p)
        )
        tokens = length - 1
        base = per_sequence(original, held_out)
        shapes = eval_decode.verification_shapes(original)

        def rotated(model: onnx.ModelProto, kind: str = "hadamard", seed: int = 0) -> onnx.ModelProto:
            options = RotateOptions(rotation=kind, rotation_seed=seed, provider="cpu", input_shapes=shapes)
            return rotate_onnx(model, options, "iglm").model

        def measure(label: str, model: onnx.ModelProto, forms: list[str], blocks: list[int], sets: list[str]):
            """`model` in fp32, then quantized in each format and block size, each set of weights in turn."""
            exact = quantizable(model)
            kinds = groups(exact, inner, len(vocab), torch_model.config.n_embd)
            chosen = {
                "all": list(kinds),
                "all but head": [n for n, g in kinds.items() if g != "head"],
                "attention": [n for n, g in kinds.items() if g in PARTS],
                **{g: [n for n, k in kinds.items() if k == g] for g in (*GROUPS[1:], *PARTS)},
            }
            record({"model": label, "quantized": "none", **judged(per_sequence(exact, held_out), base, tokens)})
            for form in forms:
                for block in blocks:
                    for which in sets:
                        quantized = quantize(exact, form, block, chosen[which])
                        point = {"model": label, "quantized": which, "format": form, "block": block}
                        record(point | judged(per_sequence(quantized, held_out), base, tokens))
            return exact

        fold = RotateOptions(provider="cpu", input_shapes=shapes).fold_options()
        fold.verify = True
        main_forms = [f for f in ("asym-0", "sym-4") if f in args.forms]
        every_set = ["all", "all but head", *GROUPS]
        # 1. which weights carry the gap, in the two formats, block 32
        models = {
            "original": original,
            "fold": fold_onnx(original, fold, "iglm").model,
            "rotate-hadamard-0": rotated(original),
            "rotate-orthogonal-0": rotated(original, "orthogonal"),
        }
        for label, model in models.items() if 1 in args.stages else ():
            measure(label, model, main_forms, [32], every_set)
        # 2. the rotation's seed
        for kind in ("hadamard", "orthogonal") if 2 in args.stages else ():
            for seed in range(1, args.seeds):
                turned = rotated(original, kind, seed)
                measure(f"rotate-{kind}-{seed}", turned, main_forms, [32], ["all", "all but head"])
        # 3. the other formats and block sizes
        for label in ("original", "fold", "rotate-hadamard-0") if 3 in args.stages else ():
            others = [f for f in args.forms if f not in main_forms]
            measure(label, models[label], others, [32], ["all", "all but head"])
            measure(label, models[label], args.forms, [b for b in args.blocks if b != 32], ["all", "all but head"])
        # 4. calibrated (GPTQ, on the calibration sequences' prefills) and HQQ
        prefills = [eval_decode.prefill_feeds(s, original) for s in calibration]
        for algorithm in args.algorithms if 4 in args.stages else ():
            form = "asym-0" if algorithm == "hqq" else "sym-4"
            for label in ("original", "rotate-hadamard-0"):
                point = {"model": label, "quantized": "all", "format": form, "block": 32, "algorithm": algorithm}
                quantized = quantize(quantizable(models[label]), form, 32, None, algorithm, prefills)
                record(point | judged(per_sequence(quantized, held_out), base, tokens))
        # 5. sliced, sliced and rotated
        calib = [eval_decode.calibration_feeds(s, original, eval_decode.session(original)) for s in calibration]
        for ratio in args.slice if 5 in args.stages else ():
            options = SliceOptions(
                ratio=ratio,
                holdout=calib[: max(2, len(calib) // 8)],
                batch_size=1,
                provider="cpu",
                input_shapes=shapes,
            )
            sliced = slice_onnx(original, calib, options, "iglm").model
            onnx.save(sliced, str(cache / f"iglm-slice-{ratio}.onnx"))
            measure(f"slice-{ratio}", sliced, main_forms, [32], ["all", "all but head"])
            measure(f"slice-{ratio}+rotate-hadamard-0", rotated(sliced), main_forms, [32], ["all", "all but head"])

        # 6. attention's two projections apart; the MLP's down projections reading their input rotated online
        for label in ("original", "fold", "rotate-hadamard-0") if 6 in args.stages else ():
            measure(label, models[label], main_forms, [32], list(PARTS))
        if 6 in args.stages:
            turning = RotateOptions(provider="cpu", input_shapes=shapes, online_block=args.online_block)
            online = rotate_onnx(original, turning, "iglm").model
            measure(f"rotate-hadamard-0+online-{args.online_block}", online, main_forms, [32], ["all", "all but head"])
        # 7. the KL divergence beside the gap, block 32 and 128
        for label in ("original", "fold", "rotate-hadamard-0") if 7 in args.stages else ():
            measure(label, models[label], main_forms, [32, 128], ["all"])


if __name__ == "__main__":
    main()
