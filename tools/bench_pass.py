"""Benchmark what `normpass fold` costs on large models, as a user runs it, against the I/O floor.

Every measurement is one fresh process, timed from start to exit (wall seconds) and with its
peak resident set size read from `os.wait4`'s `ru_maxrss` (the process and anything it waited
for). Two commands are measured:

* **fold**: the console script, `normpass fold MODEL -o OUT --report R.json --no-verify`
  (without `--no-verify` where a target asks for verification); folds are read from the report;
* **floor**: `onnx.load(MODEL)` then `onnx.save(model, OUT, save_as_external_data=True)` in a
  fresh interpreter, the least any tool that reads and rewrites the model must do.

Targets (each printed as a row: figure, target, pass/fail):

1. `gpt2-12`: GPT-2-small shape, 12 layers (the registry's `gpt2-small-shape`, exported by
   `export()` below with external data): median fold wall ≤ 1.3 × median floor wall, and fold
   peak RSS ≤ 1.5 × weight bytes + 400 MiB;
2. `gpt2-48`: the same shape with 48 layers: the time ratio fold(48)/fold(12) within 10 % of
   the weight-byte ratio W(48)/W(12), i.e. cost linear in weight bytes;
3. `synthetic-2gb`: a 2.15 GB fp32 stack from `tools/synthetic_stack.py` (GPT-2-small width,
   65 layers) folds *and verifies* (exit 0) with peak RSS ≤ 1.5 × weight bytes + 400 MiB;
3b. `synthetic-500mb`: the same at 0.5 GB (fp32, GPT-2-small width, 11 layers; quick where the 2.15 GB one
   is not): folds *and verifies* with peak RSS ≤ 1.5 × weight bytes + 400 MiB; `synthetic-500mb-internal`:
   the same model with its weights inside the .onnx file (as exporters write models under 2 GB);
4. `synthetic-7b`: the 7B-parameter fp16 stack (13 GB; hidden 4096, 33 layers) folds with
   `--no-verify` (exit 0) on this machine; wall, peak RSS and folds are reported.

5. `centred-2gb`: `x → MatMul W0 + b0 → LayerNorm → MatMul W1 + b1`, W0 a 2.15 GB fp32 weight (262,400 × 2048,
   external data) that every verb changes: the fold centres it, rotation rotates it, slicing cuts it
   (`synthetic_stack.build_centred`). Each verb runs once as a fresh process: `fold` (verified), `rotate`
   (verified), `slice --ratio 0` (verified) and `slice --ratio 0.25` (judged on held-out data), slicing on 32
   samples of synthetic calibration data; each peak RSS ≤ 1.5 × weight bytes + 400 MiB. `centred-200mb` is the
   same at 0.2 GB (quick). `--verbs` chooses among them.

`--replace` also measures **replace** on each target: `normpass replace MODEL -o OUT --calib synthetic
--samples 16 --batch-size 4 --report R.json` (the surrogate pass: its exact fold, verified, the original's
reference outputs, a trial per candidate norm, the final model judged), reported as peak RSS over weight
bytes; no goal is set for it. `--baseline DIR` runs every normpass command a second time, interleaved,
with `PYTHONPATH=DIR` (another normpass source tree, e.g. `git archive REV | tar -x -C DIR`): before and
after side by side, on the same machine in the same hour.

Models are exported or built once into `--cache` and reused; outputs go to `--work` and are
deleted after each run. `--limit-as-gib N` runs every measured process under `RLIMIT_AS` = N GiB,
so that a run that would exhaust the machine's memory fails by itself (its exit code and last
line of stderr are recorded). Usage::

    python tools/bench_pass.py --targets gpt2-12 gpt2-48 --repeats 3 --cache /tmp/npb --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import math
import multiprocessing
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import synthetic_stack

MIB = 1024 * 1024
GIB = 1024 * MIB
TIME_FACTOR = 1.3  # fold wall ≤ this × floor wall
RSS_FACTOR, RSS_SLACK_MIB = 1.5, 400  # peak RSS ≤ RSS_FACTOR × weight bytes + RSS_SLACK_MIB
LINEARITY_TOLERANCE = 0.10
STDERR_LINES = 30  # kept in the JSON record (with NORMPASS_DEBUG=1 in the environment, a failure's traceback)
SYNTHETIC: dict[str, dict[str, Any]] = {  # name → synthetic_stack.build keyword arguments
    "synthetic-2gb": {"params": 2.15e9 / 4, "dtype": "float32", "hidden": 768, "heads": 12, "vocab": 50257},
    "synthetic-500mb": {"params": 0.5e9 / 4, "dtype": "float32", "hidden": 768, "heads": 12, "vocab": 50257},
    "synthetic-500mb-internal": {"params": 0.5e9 / 4, "dtype": "float32", "hidden": 768, "heads": 12, "vocab": 50257},
    "synthetic-7b": {"params": 7e9, "dtype": "float16"},
}
CENTRED = {"centred-2gb": 2.15e9, "centred-200mb": 0.2e9}  # name → W0's bytes (`synthetic_stack.build_centred`)
CENTRED_HIDDEN = 2048
SLICE = ["slice", "--calib", "synthetic", "--samples", "32", "--batch-size", "8"]
VERBS = {  # what runs on a CENTRED target: the verb's arguments after `normpass`, before MODEL
    "fold": ["fold"],
    "rotate": ["rotate"],
    "slice-0": [*SLICE, "--ratio", "0"],
    "slice-0.25": [*SLICE, "--ratio", "0.25"],
}
TARGETS = (
    "gpt2-12",
    "gpt2-48",
    "synthetic-2gb",
    "synthetic-500mb",
    "synthetic-500mb-internal",
    "synthetic-7b",
    *CENTRED,
)
VERIFIED = ("synthetic-2gb", "synthetic-500mb", "synthetic-500mb-internal")  # folded and verified, the others not
FLOOR_CODE = (
    "import os, sys, onnx; model = onnx.load(sys.argv[1]); "
    "onnx.save(model, sys.argv[2], save_as_external_data=True, all_tensors_to_one_file=True, "
    "location=os.path.basename(sys.argv[2]) + '.data')"
)


def model_path(cache: pathlib.Path, layers: int) -> pathlib.Path:
    return cache / f"gpt2-small-shape-{layers}l" / "model.onnx"


def export(cache: str, layers: int) -> str:
    """Export the GPT-2-small-shaped model with `layers` layers into `cache`; return its path."""
    from normpass import models as builtin_models

    path = model_path(pathlib.Path(cache), layers)
    if layers == 12:
        entry = builtin_models.get("gpt2-small-shape")
    else:
        entry = builtin_models.gpt2_small_shape(f"gpt2-small-shape-{layers}l", n_layer=layers)
    partial = path.parent.with_name(path.parent.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    entry.export_onnx(partial / path.name)
    partial.rename(path.parent)  # the directory appears complete or not at all
    return str(path)


def in_fresh_process(func, *args):
    """Run `func(*args)` in a new spawned interpreter and return its result."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(func, *args).result()


def prepare(name: str, cache: pathlib.Path) -> pathlib.Path:
    """The path of target `name`'s model in `cache`, exported or built first if missing."""
    path = model_path(cache, int(name.split("-")[1])) if name.startswith("gpt2-") else cache / name / "model.onnx"
    if path.exists():
        print(f"{name}: reusing {path}", flush=True)
        return path
    start = time.perf_counter()
    if name.startswith("gpt2-"):
        in_fresh_process(export, str(cache), int(name.split("-")[1]))  # torch stays out of this process
    elif name in CENTRED:
        partial = path.parent.with_name(path.parent.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        synthetic_stack.build_centred(partial / path.name, CENTRED[name], hidden=CENTRED_HIDDEN)
        partial.rename(path.parent)
    else:
        partial = path.parent.with_name(path.parent.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        synthetic_stack.build(partial / path.name, **SYNTHETIC[name])
        if name.endswith("-internal"):  # the weights into the .onnx file
            (partial / path.name).with_name("inline.onnx").unlink(missing_ok=True)
            onnx.save(onnx.load(str(partial / path.name)), str(partial / "inline.onnx"))
            for data in partial.glob("*.data"):
                data.unlink()
            (partial / "inline.onnx").rename(partial / path.name)
        partial.rename(path.parent)
    print(f"{name}: wrote {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def describe(path: pathlib.Path) -> dict:
    """Nodes, parameters and weight bytes (all initializers) of the model at `path`."""
    model = onnx.load(str(path), load_external_data=False)
    inits = model.graph.initializer
    params = sum(math.prod(init.dims) for init in inits)
    weight_bytes = sum(
        math.prod(init.dims) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize for init in inits
    )
    return {"path": str(path), "nodes": len(model.graph.node), "params": params, "weight_bytes": weight_bytes}


def measured(command: list[str], limit_as_gib: float | None, source: str | None = None) -> dict:
    """Run `command` in a fresh process (with `PYTHONPATH=source` where given): wall and CPU (user + system)
    seconds, peak RSS (MiB), exit code, last stderr line."""

    def limit():
        if limit_as_gib:
            size = int(limit_as_gib * GIB)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        env = None if source is None else {**os.environ, "PYTHONPATH": source}
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limit, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "rss_mib": usage.ru_maxrss / 1024,
        "rc": proc.returncode,
        "stderr": lines[-1] if lines else "",
        "stderr_tail": lines[-STDERR_LINES:],
    }


def normpass_script() -> str:
    """The `normpass` console script installed beside this interpreter, else the one on PATH."""
    script = pathlib.Path(sys.executable).with_name("normpass")
    found = str(script) if script.exists() else shutil.which("normpass")
    if not found:
        sys.exit(
            f"bench_pass: no normpass console script beside {sys.executable} or on PATH; "
            "install normpass into this environment"
        )
    return found


def run_fold(
    model: pathlib.Path, work: pathlib.Path, verify: bool, limit_as_gib: float | None, source: str | None = None
) -> dict:
    out, report = work / "fold.onnx", work / "fold.report.json"
    command = [normpass_script(), "fold", str(model), "-o", str(out), "--report", str(report)]
    result = measured(command + ([] if verify else ["--no-verify"]), limit_as_gib, source)
    if result["rc"] == 0:
        summary = json.loads(report.read_text())
        result.update(folded=summary["folded"], norms=summary["total"], max_rel_error=summary.get("max_rel_error"))
    clean(work)
    return result


def run_replace(model: pathlib.Path, work: pathlib.Path, limit_as_gib: float | None, source: str | None) -> dict:
    out, report = work / "replace.onnx", work / "replace.report.json"
    command = [normpass_script(), "replace", str(model), "-o", str(out), "--report", str(report)]
    command += ["--calib", "synthetic", "--samples", "16", "--batch-size", "4", "--no-progress"]
    result = measured(command, limit_as_gib, source)
    if result["rc"] == 0:
        summary = json.loads(report.read_text())
        result.update(exact=summary["exact"], replaced=summary["replaced"], norms=summary["total"])
    clean(work)
    return result


def run_verb(
    verb: str, model: pathlib.Path, work: pathlib.Path, limit_as_gib: float | None, source: str | None = None
) -> dict:
    """One `normpass` run of `VERBS[verb]` on `model` (verified, or judged: slicing above 0), as a user runs it."""
    out, report = work / "out.onnx", work / "report.json"
    command = [normpass_script(), *VERBS[verb][:1], str(model), *VERBS[verb][1:], "-o", str(out)]
    result = measured([*command, "--report", str(report)], limit_as_gib, source)
    if result["rc"] == 0:
        summary = json.loads(report.read_text())
        result["max_rel_error"] = summary.get("max_rel_error")
        result["written"] = sorted(path.name for path in work.iterdir() if path.name.startswith("out.onnx"))
    clean(work)
    return result


def measure_verbs(
    name: str, model: pathlib.Path, work: pathlib.Path, verbs: list[str], limit_as_gib: float | None
) -> dict:
    """One run of each verb on a CENTRED target, one after the other."""
    runs = {}
    for verb in verbs:
        runs[verb] = run_verb(verb, model, work, limit_as_gib)
        run = runs[verb]
        print(f"{name}: {verb} {run['wall_s']:.1f} s {run['rss_mib']:.0f} MiB rc {run['rc']}", flush=True)
    return {**describe(model), "verb_runs": runs}


def verb_rows(name: str, r: dict) -> list[dict]:
    """One row per verb run on a CENTRED target: peak RSS against 1.5 × weight bytes + 400 MiB."""
    bound, weights = rss_bound_mib(r["weight_bytes"]), r["weight_bytes"] / MIB
    rows = []
    for verb, run in r["verb_runs"].items():
        ratio = run["rss_mib"] / weights
        rows.append(
            {
                "target": f"5. {name} {verb}",
                "figure": f"exit {run['rc']}, {run['wall_s']:.0f} s, peak RSS {run['rss_mib']:.0f} MiB ({ratio:.2f}×)",
                "goal": f"≤ {bound:.0f} MiB (1.5 × weights + 400 MiB)",
                "pass": run["rc"] == 0 and run["rss_mib"] <= bound,
            }
        )
    return rows


def run_floor(model: pathlib.Path, work: pathlib.Path, limit_as_gib: float | None) -> dict:
    result = measured([sys.executable, "-c", FLOOR_CODE, str(model), str(work / "floor.onnx")], limit_as_gib)
    clean(work)
    return result


def clean(work: pathlib.Path) -> None:
    for path in work.iterdir():
        path.unlink()


def rss_bound_mib(weight_bytes: int) -> float:
    return RSS_FACTOR * weight_bytes / MIB + RSS_SLACK_MIB


def median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def measure_target(
    name: str,
    model: pathlib.Path,
    work: pathlib.Path,
    repeats: int,
    limit_as_gib: float | None,
    replace: bool = False,
    baseline: str | None = None,
) -> dict:
    """Fold (and, for the GPT-2 targets, floor; with `replace`, replace; with `baseline`, each normpass command
    with that source too) runs of one target, interleaved."""
    verify = name in VERIFIED
    with_floor = name.startswith("gpt2-")
    folds, floors, baseline_folds, replaces, baseline_replaces = [], [], [], [], []
    for _ in range(repeats if with_floor else 1):
        if replace:
            replaces.append(run_replace(model, work, limit_as_gib, None))
            if baseline:
                baseline_replaces.append(run_replace(model, work, limit_as_gib, baseline))
            print(
                f"{name}: replace {replaces[-1]['wall_s']:.1f} s {replaces[-1]['rss_mib']:.0f} MiB rc "
                f"{replaces[-1]['rc']}"
                + (f"; baseline {baseline_replaces[-1]['rss_mib']:.0f} MiB" if baseline_replaces else ""),
                flush=True,
            )
        if baseline:
            baseline_folds.append(run_fold(model, work, verify, limit_as_gib, baseline))
        if with_floor:
            floors.append(run_floor(model, work, limit_as_gib))
        folds.append(run_fold(model, work, verify, limit_as_gib))
        print(
            f"{name}: fold {folds[-1]['wall_s']:.2f} s {folds[-1]['rss_mib']:.0f} MiB rc {folds[-1]['rc']}"
            + (f"; floor {floors[-1]['wall_s']:.2f} s {floors[-1]['rss_mib']:.0f} MiB" if floors else ""),
            flush=True,
        )
    runs = {"fold_runs": folds, "floor_runs": floors, "baseline_fold_runs": baseline_folds}
    runs |= {"replace_runs": replaces, "baseline_replace_runs": baseline_replaces}
    return {**describe(model), "verify": verify, **runs}


def summarise(r: dict) -> dict:
    """Median figures of one target's runs."""
    ok = [run for run in r["fold_runs"] if run["rc"] == 0]
    last = r["fold_runs"][-1]
    figures = {
        "weight_mib": r["weight_bytes"] / MIB,
        "rc": last["rc"],
        "fold_s": median(r["fold_runs"], "wall_s"),
        "fold_cpu_s": median(r["fold_runs"], "cpu_s"),
        "fold_rss_mib": max(run["rss_mib"] for run in r["fold_runs"]),
        "rss_bound_mib": rss_bound_mib(r["weight_bytes"]),
        "folded": f"{ok[-1]['folded']}/{ok[-1]['norms']}" if ok else f"failed: {last['stderr']}",
        "max_rel_error": ok[-1]["max_rel_error"] if ok and r["verify"] else None,
    }
    for key in ("baseline_fold", "replace", "baseline_replace"):
        if r.get(f"{key}_runs"):
            figures[f"{key}_s"] = median(r[f"{key}_runs"], "wall_s")
            figures[f"{key}_rss_mib"] = max(run["rss_mib"] for run in r[f"{key}_runs"])
            figures[f"{key}_rc"] = r[f"{key}_runs"][-1]["rc"]
    if r["floor_runs"]:
        figures.update(
            floor_s=median(r["floor_runs"], "wall_s"),
            floor_cpu_s=median(r["floor_runs"], "cpu_s"),
            floor_rss_mib=max(run["rss_mib"] for run in r["floor_runs"]),
        )
    return figures


def verdicts(figures: dict) -> list[dict]:
    """One row per target: figure, target, pass."""
    rows = []

    def row(target, figure, goal, passed):
        rows.append({"target": target, "figure": figure, "goal": goal, "pass": bool(passed)})

    def rss_row(target, f):
        row(
            target,
            f"peak RSS {f['fold_rss_mib']:.0f} MiB",
            f"≤ {f['rss_bound_mib']:.0f} MiB (1.5 × weights + 400 MiB)",
            f["rc"] == 0 and f["fold_rss_mib"] <= f["rss_bound_mib"],
        )

    if "gpt2-12" in figures:
        f = figures["gpt2-12"]
        ratio = f["fold_s"] / f["floor_s"]
        row(
            "1. gpt2-12 time",
            f"fold {f['fold_s']:.2f} s / floor {f['floor_s']:.2f} s = {ratio:.2f}×",
            f"≤ {TIME_FACTOR}×",
            f["rc"] == 0 and ratio <= TIME_FACTOR,
        )
        rss_row("1. gpt2-12 memory", f)
    if "gpt2-12" in figures and "gpt2-48" in figures:
        a, b = figures["gpt2-12"], figures["gpt2-48"]
        time_ratio, byte_ratio = b["fold_s"] / a["fold_s"], b["weight_mib"] / a["weight_mib"]
        row(
            "2. linearity 48/12",
            f"time {time_ratio:.2f}× vs weights {byte_ratio:.2f}× ({time_ratio / byte_ratio:.2f})",
            f"within {LINEARITY_TOLERANCE:.0%}",
            a["rc"] == b["rc"] == 0 and abs(time_ratio / byte_ratio - 1) <= LINEARITY_TOLERANCE,
        )
    sizes = (
        ("synthetic-2gb", "3. 2.15 GB"),
        ("synthetic-500mb", "3b. 0.5 GB"),
        ("synthetic-500mb-internal", "3c. 0.5 GB inline"),
    )
    for name, label in sizes:
        if name not in figures:
            continue
        f = figures[name]
        error = f", max rel error {f['max_rel_error']:.1e}" if f["max_rel_error"] is not None else ""
        row(
            f"{label} fold + verify",
            f"exit {f['rc']}, {f['fold_s']:.0f} s, {f['folded']}{error}",
            "exit 0",
            f["rc"] == 0,
        )
        rss_row(f"{label} memory", f)
    if "synthetic-7b" in figures:
        f = figures["synthetic-7b"]
        row(
            "4. 7B fp16 fold",
            f"exit {f['rc']}, {f['fold_s']:.0f} s, peak RSS {f['fold_rss_mib']:.0f} MiB, {f['folded']}",
            "exit 0",
            f["rc"] == 0,
        )
    return rows


def environment() -> dict:
    import normpass

    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    meminfo = pathlib.Path("/proc/meminfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    mem_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal"))
    source = pathlib.Path(normpass.__file__).resolve().parent
    git = ["git", "-C", str(source)]
    commit, branch, changes = (
        subprocess.run(git + command, capture_output=True, text=True).stdout.strip()
        for command in (["rev-parse", "--short", "HEAD"], ["branch", "--show-current"], ["status", "--porcelain", "."])
    )
    versions: dict[str, str | None] = {}
    for package in ("onnx", "onnxruntime", "onnx-ir", "numpy", "protobuf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kib / 1024**2, 1),
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "normpass": f"{source} at {branch or '?'} {commit or '?'}{' with uncommitted changes' if changes else ''}",
        **versions,
    }


def print_tables(figures: dict, rows: list[dict]) -> None:
    print(
        "\n| model | weights MiB | fold s | fold CPU s | fold peak RSS MiB "
        "| floor s | floor CPU s | floor peak RSS MiB | folded |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, f in figures.items():
        floor = (
            f"{f['floor_s']:.2f} | {f['floor_cpu_s']:.2f} | {f['floor_rss_mib']:.0f}" if "floor_s" in f else "– | – | –"
        )
        print(
            f"| {name} | {f['weight_mib']:.0f} | {f['fold_s']:.2f} | {f['fold_cpu_s']:.2f} | {f['fold_rss_mib']:.0f} "
            f"| {floor} | {f['folded']} |"
        )
    compared = [(name, f) for name, f in figures.items() if "replace_s" in f or "baseline_fold_s" in f]
    if compared:
        print("\n| model | weights MiB | command | peak RSS MiB (× weights) | baseline: the same | wall s |")
        print("|---|---:|---|---:|---:|---:|")
    for name, f in compared:
        for verb in ("fold", "replace"):
            if f"{verb}_s" not in f:
                continue
            after = f"{f[f'{verb}_rss_mib']:.0f} ({f[f'{verb}_rss_mib'] / f['weight_mib']:.2f}×)"
            before = "–"
            if f"baseline_{verb}_rss_mib" in f:
                before = f"{f[f'baseline_{verb}_rss_mib']:.0f} ({f[f'baseline_{verb}_rss_mib'] / f['weight_mib']:.2f}×)"
            print(f"| {name} | {f['weight_mib']:.0f} | {verb} | {after} | {before} | {f[f'{verb}_s']:.1f} |")
    print("\n| target | figure | goal | result |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['figure']} | {r['goal']} | {'pass' if r['pass'] else 'FAIL'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--targets", nargs="+", choices=TARGETS, default=list(TARGETS[:2]), help="default: gpt2-12 gpt2-48"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="fold and floor runs per GPT-2 model (default 3; one for the others)"
    )
    parser.add_argument(
        "--cache", default="/tmp/npb", help="directory of the exported and built models (default /tmp/npb)"
    )
    parser.add_argument(
        "--work", help="directory for the outputs, emptied after each run (default: a temporary directory)"
    )
    parser.add_argument("--limit-as-gib", type=float, help="run each measured process under RLIMIT_AS of this many GiB")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--replace", action="store_true", help="also measure `normpass replace` on each target")
    parser.add_argument("--baseline", metavar="DIR", help="also run each normpass command with PYTHONPATH=DIR")
    parser.add_argument(
        "--verbs", nargs="+", choices=list(VERBS), default=list(VERBS), help="what runs on the centred-* targets"
    )
    args = parser.parse_args()

    env = environment()
    print("machine:", ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    cache = pathlib.Path(args.cache)
    with tempfile.TemporaryDirectory(prefix="normpass-bench-", dir=args.work) as work:
        models = {name: prepare(name, cache) for name in args.targets}
        results = {
            name: measure_verbs(name, models[name], pathlib.Path(work), args.verbs, args.limit_as_gib)
            if name in CENTRED
            else measure_target(
                name, models[name], pathlib.Path(work), args.repeats, args.limit_as_gib, args.replace, args.baseline
            )
            for name in args.targets
        }
    figures = {name: summarise(r) for name, r in results.items() if name not in CENTRED}
    rows = verdicts(figures) + [row for name, r in results.items() if name in CENTRED for row in verb_rows(name, r)]
    print_tables(figures, rows)
    if args.json:
        record = {
            "environment": env,
            "command": sys.argv,
            "limit_as_gib": args.limit_as_gib,
            "results": results,
            "figures": figures,
            "verdicts": rows,
        }
        pathlib.Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
