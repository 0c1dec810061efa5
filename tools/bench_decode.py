"""Decode speed of sliced and 4-bit models, where language models are served: ONNX Runtime GenAI and a plain ONNX
Runtime decode loop (issue 43, item 9).

Each variant is timed in interleaved rounds (every variant once per round, the order rotated each round), and
per variant the median over rounds of: **prefill** (the prompt's forward, to the first token's logits) and **ms
per token** at decode (greedy, each step one token with the growing KV cache), with its ratio to the original
measured in the same rounds. Beside each, the **bytes read per token** ratio: the bytes of the weights every
decode step reads (every initializer but the tables a `Gather` reads one row of), the bound at decode.

* `genai`: a seeded GenAI folder built by the builder (`models/genai.py`, `-p fp32 -e cpu`) of a Phi shape
  (`PHI`): `phi-1024x8`, d = 1024 × 8 layers, 16 heads, MLP 4096, a 256-word vocabulary (101 M parameters);
  `phi-1536x8` (24 heads, MLP 6144: 227 M); `phi-1024x1` (one layer: with `phi-1024x8` it splits a token's
  time into a per-layer and a fixed part), run by `onnxruntime_genai` (CPU). Variants: the original; `slice`
  at each ratio (`slice_onnx` on the folder's `model.onnx`, calibrated on 16 sequences of 33 tokens of the
  folder's sentences, each a decode step of 32 tokens after its first — past of one token, batch 1; the basis
  and head as `--basis`, `--head` say); `4bit` (ORT's `MatMulNBitsQuantizer` of every MatMul,
  `tools/eval_decode.four_bit`, in the builder's CPU int4 format: block 32, symmetric, accuracy level 4 —
  int8 activations); `4bit-asym-level0` (block 32, asymmetric, accuracy level 0 — fp32 compute — the format of
  the previous records); `rotate+4bit`; `slice-R+4bit` and `slice-R+rotate+4bit`. A variant is a copy of the
  folder with its `model.onnx` (and external data) replaced; `genai_config.json` is unchanged (it names head
  sizes and counts, not the stream's width).
* `ort`: the same folders' `model.onnx` in a plain ONNX Runtime loop (inputs fed, `present.*` fed back as
  `past_key_values.*`), and IgLM's with-past export (`tools/eval_decode.py`; d = 512 × 4 layers, 12.9 M
  parameters) with the same variants, calibrated on 16 sequences sampled from IgLM (the builder builds no
  GPT-2, so IgLM has no GenAI folder).

    python tools/bench_decode.py --json docs/results/cpu-2026-11-28/decode-speed.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import eval_decode

from normpass import RotateOptions, SliceOptions, rotate_onnx, slice_onnx
from normpass.onnx.runtime import bench

RATIOS = (0.1, 0.2, 0.25, 0.3)
PHI = {
    "phi-1024x8": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "intermediate_size": 4096},
    "phi-1536x8": {"hidden_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 24, "intermediate_size": 6144},
    "phi-1024x1": {"hidden_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 16, "intermediate_size": 4096},
}


# --- folders ---------------------------------------------------------------------------------------


def build_phi(root: pathlib.Path, name: str) -> pathlib.Path:
    """The seeded Phi shape `PHI[name]` as a GenAI folder, built once under `root`."""
    from models import genai

    out = root / "model"
    if (out / "genai_config.json").is_file():
        return out
    shape = PHI[name]

    def config(vocab: int):
        from transformers import PhiConfig

        heads = shape["num_attention_heads"]
        common = genai._common(shape["hidden_size"], shape["num_hidden_layers"], heads, heads, vocab)
        return PhiConfig(**(common | shape | {"max_position_embeddings": 512}))

    genai.FAMILIES[name] = config
    ckpt = genai.checkpoint(name, root / "ckpt")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out)]
    subprocess.run([*cmd, "-p", "fp32", "-e", "cpu", "-c", str(root / "cache")], check=True, capture_output=True)
    return out


def save_folder(original: pathlib.Path | None, model: onnx.ModelProto, out: pathlib.Path) -> pathlib.Path:
    """A copy of the GenAI folder `original` (None: an empty folder) with `model` as its model.onnx (weights in
    model.onnx.data)."""
    if out.exists():
        shutil.rmtree(out)
    if original is None:
        out.mkdir(parents=True)
    else:
        shutil.copytree(original, out, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data"))
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


def read_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the weights one decode step reads: every initializer but tables a Gather reads rows of."""
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    total = 0
    for tensor in model.graph.initializer:
        if tensor.name not in gathered:
            total += int(np.prod(tensor.dims)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def prompts(folder: pathlib.Path, count: int, length: int) -> list[np.ndarray]:
    """`count` prompts of `length` tokens: the folder's tokenizer on consecutive lines of the sentences file."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = (pathlib.Path(__file__).resolve().parent.parent / "models" / "data" / "sentences.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    ids = [i for line in lines for i in tokenizer.encode(line).ids]
    return [np.array([ids[i * length : (i + 1) * length]], np.int64) for i in range(count)]


# --- timing ---------------------------------------------------------------------------------------


class GenAIRun:
    """One folder in onnxruntime_genai (its own thread settings): prefill a prompt, then decode `tokens`
    greedily."""

    def __init__(self, folder: pathlib.Path):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(folder))
        config.clear_providers()
        self.model = og.Model(config)

    def time(self, prompt: np.ndarray, tokens: int) -> tuple[float, float]:
        og = self.og
        params = og.GeneratorParams(self.model)
        total = prompt.shape[1] + tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(tokens):
            generator.generate_next_token()
        return prefill, (time.perf_counter() - start) / tokens


class OrtRun:
    """A with-past model in a plain ONNX Runtime loop: prefill, then one token per step, present → past."""

    def __init__(self, path: pathlib.Path, threads: int, head_size: int):
        self.head_size = head_size
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.model = onnx.load(str(path), load_external_data=False)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]

    def time(self, prompt: np.ndarray, tokens: int) -> tuple[float, float]:
        feeds = eval_decode.prefill_feeds(prompt, self.model, self.head_size)
        start = time.perf_counter()
        results = self.session.run(self.outputs, feeds)
        prefill = time.perf_counter() - start
        length = prompt.shape[1]
        start = time.perf_counter()
        for _ in range(tokens):
            values = dict(zip(self.outputs, results, strict=True))
            token = values["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
            length += 1
            feeds = {"input_ids": token, "attention_mask": np.ones((1, length), np.int64)}
            feeds |= {n.replace("present", "past_key_values"): v for n, v in values.items() if n.startswith("present")}
            results = self.session.run(self.outputs, feeds)
        return prefill, (time.perf_counter() - start) / tokens


def interleaved(runs: dict[str, object], prompt: np.ndarray, tokens: int, rounds: int) -> dict[str, dict]:
    """Each run timed once per round, the order rotated every round; per run the medians and the median of the
    per-round ratios to the first run (the original)."""
    names = list(runs)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for name in names:  # one warm-up each
        runs[name].time(prompt, 4)  # type: ignore[attr-defined]
    for index in range(rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            times[name].append(runs[name].time(prompt, tokens))  # type: ignore[attr-defined]
        print(f"round {index + 1}/{rounds}", flush=True)
    base = names[0]
    found = {}
    for name in names:
        prefill = [t[0] for t in times[name]]
        decode = [t[1] for t in times[name]]
        ratios = [t[1] / b[1] for t, b in zip(times[name], times[base], strict=True)]
        prefill_ratios = [t[0] / b[0] for t, b in zip(times[name], times[base], strict=True)]
        found[name] = {
            "prefill_ms": 1e3 * float(np.median(prefill)),
            "ms_per_token": 1e3 * float(np.median(decode)),
            "ratio": float(np.median(ratios)),
            "ratio_p25": float(np.percentile(ratios, 25)),
            "ratio_p75": float(np.percentile(ratios, 75)),
            "prefill_ratio": float(np.median(prefill_ratios)),
            "ms_per_token_runs": [round(1e3 * d, 3) for d in decode],
        }
    return found


def records(report: dict) -> dict:
    """The report's measurements as records of docs/results/README.md's schema: one per loop and model,
    `median_ms` the ms per token at decode, `baseline` "builder" (a seeded shape: the builder's folder as
    written) or "export" (IgLM: its with-past export), with the prefill and the bytes read per token beside."""
    found = []
    for key, variants in report["results"].items():
        loop, model = key.split("-", 1)
        base = variants["original"]
        found.append(
            {
                "device": report["machine"]["cpu"],
                "provider": {"genai": "cpu-genai", "ort": "cpu"}[loop],
                "dtype": "fp32",
                "model": f"{model}-shape" if model in PHI else model,
                "batch": 1,
                "seq": report["prompt_tokens"],
                "decoded": report["decoded_tokens"],
                "baseline": "builder" if model in PHI else "export",
                "baseline_ms": base["ms_per_token"],
                "baseline_prefill_ms": base["prefill_ms"],
                "variants": {
                    name: {
                        "median_ms": entry["ms_per_token"],
                        "ratio": entry["ratio"],
                        "ratio_p25": entry["ratio_p25"],
                        "ratio_p75": entry["ratio_p75"],
                        "read_bytes_ratio": entry["read_bytes_ratio"],
                        "prefill_ms": entry["prefill_ms"],
                        "prefill_ratio": entry["prefill_ratio"],
                    }
                    for name, entry in variants.items()
                    if name != "original"
                },
            }
        )
    load = report["machine"].get("load_after")
    return {"command": report["command"], "load": load, "four_bit": report["four_bit"], "records": found}


# --- variants -------------------------------------------------------------------------------------


def variants(original: onnx.ModelProto, calibration: list[dict], shapes: dict, args, name: str) -> dict:
    """`original` and its variants (the module docstring), by label; `calibration`: decode steps to slice on."""
    rotate = RotateOptions(provider="cpu", input_shapes=shapes)
    found = {"original": original, "4bit": eval_decode.four_bit(original)}
    found["4bit-asym-level0"] = eval_decode.four_bit(original, symmetric=False, accuracy_level=0)
    found["rotate+4bit"] = eval_decode.four_bit(rotate_onnx(original, rotate, name).model)
    for ratio in args.ratios:
        options = SliceOptions(
            ratio=ratio, basis=args.basis, head=args.head, batch_size=1, provider="cpu", input_shapes=shapes
        )
        sliced = slice_onnx(original, calibration, options, name).model
        found[f"slice-{ratio:g}"] = sliced
        if ratio in args.quantized_ratios:
            found[f"slice-{ratio:g}+4bit"] = eval_decode.four_bit(sliced)
            try:
                rotated = rotate_onnx(sliced, rotate, name).model
            except Exception as e:  # a refusal is a finding
                print(f"slice-{ratio:g}+rotate: {e}", flush=True)
            else:
                found[f"slice-{ratio:g}+rotate+4bit"] = eval_decode.four_bit(rotated)
    return found


def reused(where: pathlib.Path) -> dict[str, pathlib.Path]:
    """The variant folders a previous run saved under `where`, the original first."""
    found = {path.parent.name: path.parent for path in sorted(where.glob("*/model.onnx"))}
    return {"original": found.pop("original"), **found}


def phi(
    name: str, cache: pathlib.Path, args, reuse: pathlib.Path | None = None
) -> tuple[dict, np.ndarray, int, pathlib.Path]:
    """The seeded Phi folder `name`'s variants (or the folders of `reuse`), a prompt from its sentences, its head
    size, the folder."""
    folder = build_phi(cache / name, name)
    head_size = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    if reuse is not None:
        return reused(reuse), prompts(folder, 1, args.prompt)[0], head_size, folder
    original = onnx.load(str(folder / "model.onnx"))
    reference = eval_decode.session(original)
    calibration = [eval_decode.calibration_feeds(p, original, reference, head_size) for p in prompts(folder, 16, 33)]
    del reference
    shapes = eval_decode.verification_shapes(original, head_size)
    return variants(original, calibration, shapes, args, "phi"), prompts(folder, 1, args.prompt)[0], head_size, folder


def iglm(name: str, cache: pathlib.Path, args, reuse: pathlib.Path | None = None) -> tuple[dict, np.ndarray, int, None]:
    """IgLM's with-past export and its variants (calibrated on 16 sequences sampled with seed 1), the first
    tokens of a sequence sampled with seed 2 as the prompt."""
    import eval_slice
    import transformers

    directory = eval_slice.iglm_directory()
    vocab = (directory / "vocab.txt").read_text().split()
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory / "IgLM")).eval()
    path = cache / "iglm-with-past.onnx"
    if not path.exists():
        eval_decode.export_with_past(model, path)
    prompt = eval_slice.iglm_sequences(model, vocab, 1, seed=2, length=eval_decode.LENGTH)[0][:, : args.prompt]
    if reuse is not None:
        return reused(reuse), prompt, 0, None
    original = onnx.load(str(path))
    reference = eval_decode.session(original)
    sequences = eval_slice.iglm_sequences(model, vocab, 16, seed=1, length=eval_decode.LENGTH)
    calibration = [eval_decode.calibration_feeds(s, original, reference) for s in sequences]
    shapes = eval_decode.verification_shapes(original)
    return variants(original, calibration, shapes, args, "iglm"), prompt, 0, None


MODELS = {**dict.fromkeys(PHI, phi), "iglm": iglm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["phi-1024x8", "iglm"])
    parser.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS), help="none: no sliced variants")
    parser.add_argument("--quantized-ratios", type=float, nargs="*", default=[0.25])
    parser.add_argument("--basis", choices=("layer", "stream"), default="stream")
    parser.add_argument("--head", choices=("cut", "full"), default="cut")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="the plain ORT loop's intra-op threads (0: ORT's default; GenAI keeps its own)",
    )
    parser.add_argument("--loops", nargs="+", choices=("genai", "ort"), default=["genai", "ort"])
    parser.add_argument("--cache", type=pathlib.Path, help="keep folders here (default: a temp dir)")
    parser.add_argument(
        "--only", nargs="+", help="time these variants alone (the original always), e.g. slice-0.25 rotate+4bit"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="time the variants a previous run left under --cache instead of making them",
    )
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--records", type=pathlib.Path, help="also write the records (docs/results/README.md)")
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    import onnxruntime_genai as og

    report: dict = {
        "machine": bench.machine() | {"onnxruntime_genai": og.__version__, "load_before": load},
        "command": "python tools/bench_decode.py " + " ".join(sys.argv[1:]),
        "four_bit": {"block_size": eval_decode.BLOCK, "symmetric": True, "accuracy_level": eval_decode.ACCURACY_LEVEL},
        "shapes": {
            **{name: f"seeded Phi (GenAI builder, fp32): {shape}, vocabulary 256" for name, shape in PHI.items()},
            "iglm": "IgLM (iglm 0.1.0), with-past torch.onnx export (dynamo), fp32; no GenAI folder (the builder "
            "builds no GPT-2)",
        },
        "prompt_tokens": args.prompt,
        "decoded_tokens": args.tokens,
        "rounds": args.rounds,
        "basis": args.basis,
        "head": args.head,
        "results": {},
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache or pathlib.Path(temporary)
        cache.mkdir(parents=True, exist_ok=True)
        for model in args.models:
            where = cache / "variants" / model
            if args.reuse:
                folders, prompt, head_size, folder = MODELS[model](model, cache, args, reuse=where)
            else:
                found_variants, prompt, head_size, folder = MODELS[model](model, cache, args)
                folders = {n: save_folder(folder, m, where / n) for n, m in found_variants.items()}
                del found_variants
            if args.only:
                folders = {n: f for n, f in folders.items() if n == "original" or n in args.only}
            structures = {n: onnx.load(str(f / "model.onnx"), load_external_data=False) for n, f in folders.items()}
            sizes = {name: read_bytes(m) for name, m in structures.items()}
            parameters = {n: sum(int(np.prod(t.dims)) for t in m.graph.initializer) for n, m in structures.items()}
            loops = [loop for loop in args.loops if folder is not None or loop == "ort"]
            for loop in loops:
                if loop == "genai":
                    runs: dict = {n: GenAIRun(f) for n, f in folders.items()}
                else:
                    runs = {n: OrtRun(f / "model.onnx", args.threads, head_size) for n, f in folders.items()}
                found = interleaved(runs, prompt, args.tokens, args.rounds)
                for name, entry in found.items():
                    entry |= {"read_bytes": sizes[name], "read_bytes_ratio": sizes[name] / sizes["original"]}
                    entry["parameters"] = parameters[name]
                report["results"][f"{loop}-{model}"] = found
                del runs
                save()
    report["machine"]["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    save()
    if args.records:
        args.records.write_text(json.dumps(records(report), indent=1) + "\n")


if __name__ == "__main__":
    main()
