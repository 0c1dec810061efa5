"""Where a decode step's time goes, fp32 against 4-bit (issue 43, item 9): why `MatMulNBits` weights, read at
0.16× the bytes, decode at 0.24–0.45× the time (accuracy level 4 to 0).

Two measurements, both ONNX Runtime's CPU provider (the kernels onnxruntime-genai runs):

* **kernels**: one op at decode shape (M = 1 row of activations) for each projection shape of the seeded
  Phi 1024 × 8 (`tools/bench_decode.PHI`): K × N = 1024 × 3072 (QKV), 1024 × 1024 (attention output),
  1024 × 4096 and 4096 × 1024 (MLP), 1024 × 256 (LM head). Each format is a model of `COPIES` independent
  copies of the op with distinct weights, all reading the same row, so that a run reads `COPIES` weight
  matrices and the per-run overhead is shared; timed in interleaved rounds (every format once a round),
  the medians per op. Formats: fp32 `MatMul`, and `MatMulNBits` (`tools/eval_decode.four_bit`) at block 32
  and 128, symmetric and asymmetric, accuracy level 0 (fp32 compute: MLAS dequantizes B in registers and
  multiplies by the fp32 row) and 4 (int8 compute: the row is quantized blockwise to int8 at run time and
  multiplied by the int4 weights with VNNI). The effective bandwidth (weight bytes / time) says which are
  bound by the bytes and which by the arithmetic.
* **profile**: ORT's per-op profile (`enable_profiling`) of decode steps of the models given (a plain ORT loop,
  as `tools/bench_decode.OrtRun`: a prompt's prefill, then single-token steps), summed per op type and
  divided by the number of steps, with the step's wall time beside: what is MatMul, what is attention, norms
  and the rest, and what is neither (the session run's own work: its time minus the ops' time).

    python tools/profile_decode.py --folders CACHE/variants/phi-1024x8/{original,4bit,4bit-asym-level0} \\
        --json docs/results/cpu-2026-11-28/decode-profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import eval_decode

from normpass.onnx.runtime import bench

SHAPES = {"qkv": (1024, 3072), "attention-out": (1024, 1024), "fc1": (1024, 4096), "fc2": (4096, 1024)}
HEAD = {"lm-head": (1024, 256)}
COPIES = 8
# label → None (fp32 MatMul) or (block, symmetric, accuracy level)
FORMATS: dict[str, tuple[int, bool, int] | None] = {
    "fp32": None,
    "b32-sym-level4": (32, True, 4),
    "b32-asym-level4": (32, False, 4),
    "b32-sym-level0": (32, True, 0),
    "b32-asym-level0": (32, False, 0),
    "b128-sym-level4": (128, True, 4),
    "b128-sym-level0": (128, True, 0),
}


# --- kernels --------------------------------------------------------------------------------------


def copies_model(k: int, n: int, seed: int = 0) -> onnx.ModelProto:
    """`COPIES` MatMuls [1, K] × [K, N], each its own Gaussian weight, all reading input `x`."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{i}") for i in range(COPIES)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"proj{i}") for i in range(COPIES)]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]) for i in range(COPIES)]
    graph = helper.make_graph(
        nodes, "copies", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])], outputs, weights
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def in_format(model: onnx.ModelProto, form: tuple[int, bool, int] | None) -> onnx.ModelProto:
    if form is None:
        return model
    block, symmetric, level = form
    return eval_decode.four_bit(model, symmetric=symmetric, accuracy_level=level, block_size=block)


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(
        int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize for t in model.graph.initializer
    )


def new_session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def kernels(shapes: dict, threads: int, rounds: int, runs: int) -> dict:
    """Per shape and format: the median µs per op (a run's time over `COPIES`) and the effective GB/s."""
    found: dict = {}
    for name, (k, n) in shapes.items():
        base = copies_model(k, n)
        models = {label: in_format(base, form) for label, form in FORMATS.items()}
        sessions = {label: new_session(m, threads) for label, m in models.items()}
        x = {"x": np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)}
        times: dict[str, list[float]] = {label: [] for label in sessions}
        for s in sessions.values():
            for _ in range(5):
                s.run(None, x)
        for index in range(rounds):
            labels = list(sessions)
            for label in labels[index % len(labels) :] + labels[: index % len(labels)]:
                start = time.perf_counter()
                for _ in range(runs):
                    sessions[label].run(None, x)
                times[label].append((time.perf_counter() - start) / runs / COPIES)
        found[name] = {}
        for label, values in times.items():
            seconds = float(np.median(values))
            size = weight_bytes(models[label]) / COPIES
            found[name][label] = {
                "us_per_op": round(1e6 * seconds, 2),
                "ratio_to_fp32": None,
                "weight_bytes": int(size),
                "gb_per_s": round(size / seconds / 1e9, 2),
            }
        fp32 = found[name]["fp32"]["us_per_op"]
        for entry in found[name].values():
            entry["ratio_to_fp32"] = round(entry["us_per_op"] / fp32, 3)
        print(name, json.dumps(found[name]), flush=True)
    return found


# --- profile --------------------------------------------------------------------------------------


def profile(folder: pathlib.Path, threads: int, prompt: np.ndarray, steps: int) -> dict:
    """ORT's per-op profile of `steps` single-token decode steps after a prefill of `prompt`: ms per step per
    op type, the ops' total and the step's wall time (medians are not what a profile gives: these are means)."""
    path = folder / "model.onnx"
    config = json.loads((folder / "genai_config.json").read_text())
    head_size = config["model"]["decoder"]["head_size"]
    model = onnx.load(str(path), load_external_data=False)
    with tempfile.TemporaryDirectory() as temporary:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = str(pathlib.Path(temporary) / "profile")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        outputs = [o.name for o in session.get_outputs()]
        results = session.run(outputs, eval_decode.prefill_feeds(prompt, model, head_size))
        length = prompt.shape[1]
        walls = []
        for _ in range(steps):
            values = dict(zip(outputs, results, strict=True))
            token = values["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
            length += 1
            feeds = {"input_ids": token, "attention_mask": np.ones((1, length), np.int64)}
            feeds |= {n.replace("present", "past_key_values"): v for n, v in values.items() if n.startswith("present")}
            start = time.perf_counter()
            results = session.run(outputs, feeds)
            walls.append(time.perf_counter() - start)
        events = json.loads(pathlib.Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    first_step = runs[1]["ts"]  # runs[0] is the prefill
    per_op: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_step:
            per_op[event["args"]["op_name"]] += event["dur"] / 1e3 / steps
    ops = sum(per_op.values())
    run_ms = float(np.mean([e["dur"] for e in runs[1:]])) / 1e3
    return {
        "steps": steps,
        "past_tokens": f"{prompt.shape[1]} … {prompt.shape[1] + steps - 1}",
        "wall_ms_per_step": round(1e3 * float(np.mean(walls)), 3),
        "model_run_ms_per_step": round(run_ms, 3),
        "ops_ms_per_step": round(ops, 3),
        "outside_ops_ms_per_step": round(run_ms - ops, 3),
        "by_op_ms_per_step": {op: round(ms, 3) for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1])},
        "nodes": collections.Counter(n.op_type for n in model.graph.node),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", type=pathlib.Path, nargs="*", default=[], help="GenAI folders to profile")
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="ORT intra-op threads (0: default)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=20, help="runs per format per round")
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    import bench_decode

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report: dict = {
        "machine": bench.machine() | {"load_before": uptime, "cpu_flags": cpu_flags()},
        "command": "python tools/profile_decode.py " + " ".join(sys.argv[1:]),
        "copies": COPIES,
        "kernels": {},
        "profiles": {},
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    for threads in args.threads:
        key = f"threads-{threads or 'default'}"
        if not args.no_kernels:
            report["kernels"][key] = kernels(SHAPES | HEAD, threads, args.rounds, args.runs)
            save()
        for folder in args.folders:
            prompt = bench_decode.prompts(folder, 1, 32)[0]
            found = profile(folder, threads, prompt, args.steps)
            report["profiles"].setdefault(key, {})[folder.name] = found
            print(folder.name, json.dumps(found), flush=True)
            save()
    report["machine"]["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    save()


def cpu_flags() -> list[str]:
    """The CPU's vector-instruction flags that decide MLAS's kernels (AVX2, AVX-512, VNNI, AMX)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512", "vnni", "amx")
    return sorted(f for f in flags if any(w in f for w in wanted))


if __name__ == "__main__":
    main()
