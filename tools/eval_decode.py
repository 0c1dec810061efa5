"""What do slicing and 4-bit weights cost a language model served token by token? IgLM through a with-past export
(issue 43, items 6–8).

IgLM (`pip install --no-deps iglm==0.1.0`; a GPT-2 of 4 layers, d = 512, 33 tokens, trained on antibody
sequences; non-commercial licence: evaluated here, never bundled) is exported with past and present key/value
tensors (`export_with_past`: torch.onnx, dynamo, inputs `input_ids`, `attention_mask` (past + new),
`past_key_values.{i}.key|value`; outputs `logits`, `present.{i}.key|value`), the form a decode loop runs.
Sequences are sampled from IgLM itself as `tools/eval_slice.py` samples them, with disjoint seeds: the
calibration sequences are all `slice_onnx` sees (fitting and its own judging split), the held-out ones are all
that is judged here. Each held-out sequence is run with an empty past (its prefill); what is judged:

* **perplexity**: exp of the mean negative log-likelihood of each next token of the held-out sequences
  (positions 1 … L−1 given the tokens before them), and its rise over the original's;
* **next-token agreement**: the share of positions whose most likely next token is the original's.

Variants: `slice` at each ratio with the head cut and left at full width (`--head`), each without and with
recovery (`--recover SECONDS`); `fold` and `rotate` (exact, checked), each then quantized to 4 bits per weight
(ONNX Runtime's `MatMulNBitsQuantizer`, block 32, symmetric, accuracy level 4: the builder's CPU int4 format,
every MatMul; the export's `Gemm`s are first written as the `MatMul` + `Add` they compute), and the sliced models
quantized too.

    python tools/eval_decode.py --json docs/results/cpu-2026-11-28/decode-quality-iglm.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_slice

from normpass import FoldOptions, RotateOptions, SliceOptions, fold_onnx, rotate_onnx, slice_onnx
from normpass.onnx.runtime import bench

RATIOS = (0.1, 0.2, 0.3)
HEADS = ("cut", "full")
LENGTH = 120
BLOCK = 32
ACCURACY_LEVEL = 4  # the builder's on CPU: int8 activations in MatMulNBits


# --- the model and its data -----------------------------------------------------------------------


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def export_with_past(model, path: pathlib.Path) -> pathlib.Path:
    """`model` (a transformers causal LM) as a with-past ONNX file (torch.onnx, dynamo): batch, new length,
    past length and total length dynamic, one key and one value tensor per layer (batch, heads, past, head size)."""
    import torch
    from transformers.cache_utils import DynamicCache

    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_size = config.hidden_size // heads

    class WithPast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, past):
            cache = DynamicCache(config=config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            return (out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)))

    past = tuple(torch.randn(2, heads, 3, head_size) for _ in range(2 * layers))
    example = (torch.randint(0, config.vocab_size, (2, 5)), torch.ones(2, 8, dtype=torch.int64), past)
    names = past_names(layers)
    shapes = (
        {0: "batch", 1: "sequence"},
        {0: "batch", 1: "total_sequence"},
        tuple({0: "batch", 2: "past_sequence"} for _ in names),
    )
    outputs = ["logits", *(n.replace("past_key_values", "present") for n in names)]
    program = torch.onnx.export(
        WithPast().eval(),
        example,
        dynamo=True,
        input_names=["input_ids", "attention_mask", *names],
        output_names=outputs,
        dynamic_shapes=shapes,
        optimize=True,
    )
    assert program is not None  # dynamo=True returns the program
    program.save(str(path))
    return path


def cached_export(cache: pathlib.Path, name: str, export: Callable[[pathlib.Path], object]) -> onnx.ModelProto:
    """The model at `cache`/`name`, written there first by `export(path)` where it is not there yet."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / name
    if not path.exists():
        export(path)
    return onnx.load(str(path))


def recorder(report: dict, points: list[dict], path: pathlib.Path | None) -> Callable[[dict], None]:
    """`record(point)`: appends the point to `points`, prints it, and rewrites `report` (which holds `points`) at
    `path`, where one is given."""

    def record(found: dict) -> None:
        points.append(found)
        print(json.dumps(found), flush=True)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1) + "\n")

    return record


def past_shapes(model: onnx.ModelProto, batch: int, past: int, head_size: int = 0) -> dict[str, tuple[int, ...]]:
    """Each past tensor's shape: heads and head size as declared (`head_size` where the declaration names it,
    as GenAI's builder does: `kv_cache_dim`), `past` tokens."""
    shapes: dict[str, tuple[int, ...]] = {}
    for value in model.graph.input:
        if value.name.startswith("past_key_values."):
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            shapes[value.name] = (batch, dims[1], past, dims[3] or head_size)
    return shapes


def prefill_feeds(sequence: np.ndarray, model: onnx.ModelProto, head_size: int = 0) -> dict[str, np.ndarray]:
    """The inputs of a prefill of `sequence` ([B, L]): every past tensor empty, the mask over the L tokens."""
    feeds = {"input_ids": sequence, "attention_mask": np.ones_like(sequence)}
    shapes = past_shapes(model, sequence.shape[0], 0, head_size)
    return feeds | {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}


def calibration_feeds(sequence: np.ndarray, model: onnx.ModelProto, session, head_size: int = 0) -> dict:
    """A decode step's inputs for calibration: the first token's past (from `session`, the original) and the
    other L − 1 tokens new (normpass's calibration wants every dimension positive)."""
    first = prefill_feeds(sequence[:, :1], model, head_size)
    outputs = session.run(None, first)
    names = [o.name for o in session.get_outputs()]
    feeds = {"input_ids": sequence[:, 1:], "attention_mask": np.ones_like(sequence)}
    for name, value in zip(names, outputs, strict=True):
        if name.startswith("present."):
            feeds[name.replace("present", "past_key_values")] = value
    return feeds


def verification_shapes(model: onnx.ModelProto, head_size: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes for normpass's verification inputs: 1 sequence, 4 past tokens, 8 new (a decode step)."""
    return {"input_ids": (1, 8), "attention_mask": (1, 12), **past_shapes(model, 1, 4, head_size)}


# --- judging --------------------------------------------------------------------------------------


def session(model: onnx.ModelProto | pathlib.Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = str(model) if isinstance(model, pathlib.Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def logits_of(model: onnx.ModelProto, sequences: list[np.ndarray]) -> list[np.ndarray]:
    """Each sequence's logits from its prefill (an empty past)."""
    run = session(model)
    return [run.run(["logits"], prefill_feeds(s, model))[0][0] for s in sequences]


def judged(logits: list[np.ndarray], reference: list[np.ndarray], sequences: list[np.ndarray]) -> dict:
    """Perplexity of the next tokens of `sequences`, and the share of positions whose argmax is the reference's."""
    nll, agree, count = 0.0, 0, 0
    for got, ref, seq in zip(logits, reference, sequences, strict=True):
        shifted = got[:-1].astype(np.float64)
        shifted -= shifted.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(logp)), seq[0, 1:]].sum())
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        count += len(logp)
    return {"perplexity": float(np.exp(nll / count)), "top1_agree": agree / (count + len(logits)), "tokens": count}


def with_rise(found: dict, base: dict) -> dict:
    return found | {"perplexity_rise": found["perplexity"] / base["perplexity"] - 1}


# --- 4-bit ----------------------------------------------------------------------------------------


def gemm_as_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each `Gemm` (alpha = beta = 1, A not transposed, a constant B) as the `MatMul` (+ `Add`) it computes, B
    transposed where transB: the op ONNX Runtime's 4-bit quantizer rewrites (exact)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    weights = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
        if node.op_type != "Gemm" or not plain or node.input[1] not in weights:
            nodes.append(node)
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            transposed = numpy_helper.from_array(numpy_helper.to_array(weights[weight]).T.copy(), f"{weight}.T")
            model.graph.initializer.append(transposed)
            weight = transposed.name
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}.matmul" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight], [product], name=f"{node.name}.matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}.bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def four_bit(
    model: onnx.ModelProto, *, symmetric: bool = True, accuracy_level: int = ACCURACY_LEVEL, block_size: int = BLOCK
) -> onnx.ModelProto:
    """Every MatMul with a constant weight as `MatMulNBits` (ORT's RTN quantizer, 4 bits, blocks of `block_size`
    along the input dimension). The defaults are the format ONNX Runtime GenAI's builder serves on CPU: block 32,
    `symmetric` (each block is `scale · q`, q in −8 … 7, no zero point) and `accuracy_level` 4 (MatMulNBits
    quantizes its activations blockwise to int8 at run time and multiplies int8 by int4; 0 computes in fp32 from
    dequantized weights). `symmetric=False` gives each block a zero point (`scale · (q − z)`, q in 0 … 15)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        gemm_as_matmul(model), bits=4, block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level
    )
    quantizer.process()
    return quantizer.model.model


# --- the run --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    parser.add_argument("--basis", choices=("layer", "stream"), default="layer")
    parser.add_argument("--sequences", type=int, default=32, help="to calibrate, and as many others to judge")
    parser.add_argument("--recover", type=float, default=60.0, metavar="SECONDS", help="0: no recovered points")
    parser.add_argument("--quantized-ratios", type=float, nargs="*", default=[0.1, 0.2], help="sliced + 4-bit")
    parser.add_argument("--cache", type=pathlib.Path, help="keep the export here (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    import transformers

    directory = eval_slice.iglm_directory()
    vocab = (directory / "vocab.txt").read_text().split()
    torch_model = transformers.GPT2LMHeadModel.from_pretrained(str(directory / "IgLM")).eval()
    calibration = eval_slice.iglm_sequences(torch_model, vocab, args.sequences, seed=1, length=LENGTH)
    held_out = eval_slice.iglm_sequences(torch_model, vocab, args.sequences, seed=2, length=LENGTH)
    points: list[dict] = []
    report = {
        "machine": bench.machine(),
        "command": "python tools/eval_decode.py " + " ".join(sys.argv[1:]),
        "model": "iglm 0.1.0 trained_models/IgLM (GPT2LMHeadModel, 4 layers, d = 512), with-past torch.onnx export "
        "(dynamo), judged on prefills (empty past)",
        "calibration": f"{args.sequences} sequences of {LENGTH} tokens sampled from IgLM, seed 1",
        "judged": f"{args.sequences} sequences of {LENGTH} tokens sampled from IgLM, seed 2",
        "points": points,
    }

    record = recorder(report, points, args.json)
    with tempfile.TemporaryDirectory() as temporary:
        original = cached_export(
            args.cache or pathlib.Path(temporary), "iglm-with-past.onnx", lambda p: export_with_past(torch_model, p)
        )
        reference_session = session(original)
        calib = [calibration_feeds(s, original, reference_session) for s in calibration]
        reference = logits_of(original, held_out)
        base = judged(reference, reference, held_out)

        def score(model: onnx.ModelProto) -> dict:
            return with_rise(judged(logits_of(model, held_out), reference, held_out), base)

        record({"variant": "original", **score(original)})
        shapes = verification_shapes(original)
        rotate = RotateOptions(provider="cpu", input_shapes=shapes)
        exact = {
            "fold": fold_onnx(original, FoldOptions(provider="cpu", input_shapes=shapes), "iglm").model,
            "rotate": rotate_onnx(original, rotate, "iglm").model,
        }
        record({"variant": "original+4bit", **score(four_bit(original))})
        for label, model in exact.items():
            record({"variant": label, **score(model)})
            record({"variant": f"{label}+4bit", **score(four_bit(model))})
        for head in args.heads:
            for ratio in args.ratios:
                for seconds in [0.0] + ([args.recover] if args.recover else []):
                    start = time.perf_counter()
                    options = SliceOptions(
                        ratio=ratio,
                        basis=args.basis,
                        head=head,
                        holdout=calib[: max(2, len(calib) // 8)],
                        batch_size=1,
                        provider="cpu",
                        input_shapes=shapes,
                        recover=seconds,
                    )
                    result = slice_onnx(original, calib, options, "iglm")
                    took = time.perf_counter() - start
                    chosen = result.chosen
                    assert chosen is not None
                    point = {"ratio": ratio, "basis": args.basis, "head": head}
                    record(
                        {"variant": "slice", **point, "recover_s": seconds}
                        | {"kept": chosen.kept, "parameters": chosen.parameters}
                        | {"parameters_original": result.parameters, "slice_s": round(took, 1)}
                        | {"recovery": None if chosen.recovery is None else chosen.recovery.to_json()}
                        | score(result.model)
                    )
                    if ratio not in args.quantized_ratios or seconds:
                        continue
                    record({"variant": "slice+4bit", **point, **score(four_bit(result.model))})
                    try:
                        rotated = rotate_onnx(result.model, rotate, "iglm").model
                    except Exception as e:  # a refusal is a finding: recorded
                        record({"variant": "slice+rotate+4bit", **point, "refused": str(e)})
                    else:
                        record({"variant": "slice+rotate+4bit", **point, **score(four_bit(rotated))})


if __name__ == "__main__":
    main()
