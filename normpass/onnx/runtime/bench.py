"""Interleaved A/B timing of ONNX models in ONNX Runtime, with medians and ratios per point.

A *point* is one input shape: the batch size replaces a graph input's dynamic first axis and the
sequence length its other dynamic axes; inputs are built like `verify.make_inputs` (seeded, token
ids within the table they index). At each point every model gets an ORT session with all graph
optimizations on (`ORT_ENABLE_ALL`, what a deployment runs), its inputs and outputs bound once
through IO binding (on the GPU this keeps host↔device copies out of the timing; on the CPU it keeps
output allocation out), and then:

1. one reference run per model (on CUDA with TF32 off); a candidate whose outputs differ from the baseline's (the first
   model) beyond the dtype's tolerance (`verify.REL_TOLERANCE`) is refused with
   `VerificationError`, unless that model carries its own `bound` on the relative error (a
   surrogate model, which keeps an accuracy budget rather than the outputs) or is marked
   `check=False` (a bound on speed, not an equivalent: every norm deleted);
2. `warmup` untimed rounds, then `repeats` timed rounds (more if a time budget per point is
   given). A round runs every model once, in an order rotated every round, so drift in machine
   load (other processes, clock changes) hits all models alike instead of whichever ran last.

Run times are wall-clock (`clock="wall"`) or, on the CPU, the process's CPU time around each run
(`clock="cpu"`: with one intra-op thread, time spent waiting for a core while other processes
run is not counted, which makes a loaded machine's figures usable). Per model: the median and
quartiles of the run times. Per candidate: `ratio` = its median / the
baseline's median (below 1 is faster) and the quartiles of the per-round ratios, which show the
noise: a ratio whose quartile range contains 1 is not a difference this run could resolve.

`run_benchmark` returns a JSON-ready dict; `to_csv` and `plot` render it. The CUDA path
(`provider="cuda"`: CUDAExecutionProvider, inputs and outputs bound in GPU memory, outputs
synchronized after each run) differs from the CPU one in the device name and in the output check,
which runs each model once more with TF32 off (`_checked_outputs`): the timed sessions keep ORT's
default, TF32 matrix products in fp32 models.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from ... import __version__
from ...errors import InputError, VerificationError
from ...io import write_text_atomic
from . import decode
from .verify import compare_outputs, fixed_dim, make_inputs, ort_session

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# What ONNX Runtime raises when a model does not load or run (Fail, InvalidArgument, RuntimeException ...).
ORT_ERRORS = tuple(
    c for c in vars(ort.capi.onnxruntime_pybind11_state).values() if isinstance(c, type) and issubclass(c, Exception)
)
SWEEP_AXES = ("batch", "seq")
CSV_FIELDS = (
    "batch",
    "seq",
    "model",
    "median_ms",
    "p25_ms",
    "p75_ms",
    "min_ms",
    "runs",
    "ratio",
    "ratio_p25",
    "ratio_p75",
    "max_rel_error",
    "checked",
)


@dataclass
class Candidate:
    """A model to time: `path` of an .onnx file (external data beside it), `check` against the baseline.

    `bound`: the largest relative error against the baseline accepted instead of the dtype's
    tolerance (models whose outputs differ by design, e.g. `normpass replace` outputs).
    """

    label: str
    path: str
    check: bool = True
    bound: float | None = None
    proto: onnx.ModelProto | None = field(default=None, repr=False)  # loaded once, without external data

    def graph(self) -> onnx.ModelProto:
        if self.proto is None:
            self.proto = onnx.load(self.path, load_external_data=False)
        return self.proto


def point_shapes(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
    """Input shapes at a point: fixed dims kept, dynamic axis 0 → `batch`, other dynamic axes → `seq`; for a
    KV-cache graph (`decode.signature`) a decode step: one new token after a past of `seq` tokens."""
    sig = decode.signature(model)
    if sig is not None:
        return decode.input_shapes(model, sig, batch, 1, seq)
    initializers = {i.name for i in model.graph.initializer}
    shapes = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        dims = graph_input.type.tensor_type.shape.dim
        shapes[graph_input.name] = tuple(fixed_dim(d) or (batch if axis == 0 else seq) for axis, d in enumerate(dims))
    return shapes


def make_feeds(model: onnx.ModelProto, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    feeds = make_inputs(model, point_shapes(model, batch, seq), seed)
    sig = decode.signature(model)
    return feeds if sig is None else decode.set_values(sig, feeds, seq)


def open_session(
    model: str | bytes,
    provider: str = "cpu",
    threads: int = 0,
    optimized_model_path: str | None = None,
    tf32: bool = True,
) -> ort.InferenceSession:
    """An ORT session for a model path (or serialized model) with every graph optimization on.

    `threads` 0 leaves ORT's default; `optimized_model_path` saves the graph ORT actually runs;
    `tf32` False turns off the CUDA provider's TF32 matrix products (on by default there).
    """
    if provider not in PROVIDERS:
        raise InputError(f"provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    if PROVIDERS[provider] not in ort.get_available_providers():
        raise InputError(
            f"provider {provider}: this onnxruntime build has no {PROVIDERS[provider]} "
            f"(available: {', '.join(ort.get_available_providers())}); "
            "for CUDA: pip install 'normpass[gpu]'"
        )
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if optimized_model_path:
        options.optimized_model_filepath = optimized_model_path
    if provider == "cuda" and not tf32:
        return ort_session(model, options, [(PROVIDERS[provider], {"use_tf32": "0"})])
    return ort_session(model, options, [PROVIDERS[provider]])


class Runner:
    """One model in one session, inputs and outputs bound to the device once; `time_run` times one run."""

    def __init__(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray], provider: str, clock: str = "wall"):
        self.session = session
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self.device = provider  # OrtValue device names are the provider keys: "cpu", "cuda"
        names = [o.name for o in session.get_outputs()]
        self.outputs = dict(zip(names, session.run(names, feeds), strict=False))  # the reference run
        self.binding = session.io_binding()
        self._bound: list[ort.OrtValue] = []  # keeps the bound OrtValues (and the NumPy buffers under CPU ones) alive
        for name, value in feeds.items():
            self._bind(self.binding.bind_ortvalue_input, name, ort.OrtValue.ortvalue_from_numpy(value, self.device, 0))
        for name, value in self.outputs.items():
            self._bind(
                self.binding.bind_ortvalue_output,
                name,
                ort.OrtValue.ortvalue_from_shape_and_type(value.shape, value.dtype, self.device, 0),
            )

    def _bind(self, bind, name: str, value: ort.OrtValue) -> None:
        self._bound.append(value)
        bind(name, value)

    def time_run(self) -> float:
        start = self.clock()
        self.session.run_with_iobinding(self.binding)
        if self.device != "cpu":
            self.binding.synchronize_outputs()
        return self.clock() - start


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    p25, p50, p75 = statistics.quantiles(values, n=4, method="inclusive")
    return p25, p50, p75


def _check_signatures(candidates: list[Candidate]) -> None:
    """All models must take the same inputs and give the same outputs as the baseline."""

    def signature(model):
        initializers = {i.name for i in model.graph.initializer}
        return (
            [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input if i.name not in initializers],
            [(o.name, o.type.tensor_type.elem_type) for o in model.graph.output],
        )

    base = candidates[0]
    for other in candidates[1:]:
        if signature(other.graph()) != signature(base.graph()):
            raise InputError(
                f"{other.path}: its inputs/outputs {signature(other.graph())} differ from those of "
                f"{base.path} {signature(base.graph())}; compare two versions of the same model"
            )


def parse_sweep(spec: str) -> tuple[str, list[int]]:
    """`"seq=64,256"` → ("seq", [64, 256])."""
    axis, _, values = spec.partition("=")
    try:
        points = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        points = []
    if axis not in SWEEP_AXES or not points or min(points) < 1:
        raise InputError(
            f"sweep {spec!r}: expected AXIS=N,N,... with AXIS one of {', '.join(SWEEP_AXES)}, e.g. seq=64,256,1024"
        )
    return axis, points


def machine() -> dict:
    """Where and with what the figures were taken."""
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "normpass": __version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "numpy": np.__version__,
    }


def gpu_name() -> str | None:
    """The first GPU's name as `nvidia-smi` gives it (e.g. "NVIDIA H200"), or None without one."""
    import subprocess

    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = done.stdout.strip().splitlines()
    return first[0].split(",")[0].strip() if first else None


class _NoBar:
    """Stands in for a tqdm bar when there is none."""

    total = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def finish_tool_run(
    points: list, settings: dict, started: float, load_before, machine_info: dict, table: str, json_path: str | None
) -> None:
    """Record a benchmark tool's run (machine, settings, load, points) as JSON and print its table."""
    load_after = os.getloadavg()
    report: dict[str, Any] = {
        "machine": machine_info,
        "settings": settings
        | {"load_average_before": load_before, "load_average_after": load_after, "seconds": time.time() - started},
        "points": points,
    }
    if json_path:
        write_text_atomic(json.dumps(report, indent=2), json_path)
    print(table)
    print(
        f"\n{report['settings']['seconds']:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    )


def progress_bar(total: int, enabled: bool):
    """A tqdm bar on stderr if tqdm is installed and `enabled` (pip install 'normpass[bench]')."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="run", leave=False, dynamic_ncols=True) if enabled else _NoBar()


class Timed(Protocol):
    """What `interleave` times: a `Runner`, or another front end's runner (tools/bench_torch.py)."""

    def time_run(self) -> float: ...


def interleave(
    runners: Mapping[str, Timed], repeats: int, warmup: int, bar=None, budget_s: float = 0.0
) -> dict[str, list[float]]:
    """`warmup` untimed then `repeats` timed rounds; each round runs every runner once, order rotated.

    With `budget_s` (and a warm-up to measure a round by), the timed rounds are raised to fill
    about `budget_s` seconds: short points get more repeats, long ones keep `repeats`.
    """
    items = list(runners.items())
    times: dict[str, list[float]] = {label: [] for label in runners}
    bar = _NoBar() if bar is None else bar

    def one_round(index: int, keep: bool) -> None:
        shift = index % len(items)
        for label, runner in items[shift:] + items[:shift]:
            seconds = runner.time_run()
            if keep:
                times[label].append(seconds)
            bar.update()

    start = time.perf_counter()
    for index in range(warmup):
        one_round(index, keep=False)
    if budget_s and warmup:
        extra = max(repeats, int(budget_s * warmup / (time.perf_counter() - start))) - repeats
        bar.total += extra * len(items)
        repeats += extra
    for index in range(repeats):
        one_round(warmup + index, keep=True)
    return times


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """Median and quartiles (ms) per label; for all but `baseline`, the ratio and per-round ratio quartiles."""
    base = times[baseline]
    results = {}
    for label, runs in times.items():
        p25, median, p75 = _quartiles(runs)
        entry = {
            "median_ms": 1e3 * median,
            "p25_ms": 1e3 * p25,
            "p75_ms": 1e3 * p75,
            "min_ms": 1e3 * min(runs),
            "runs_ms": [1e3 * t for t in runs],
        }
        if label != baseline:
            r25, _, r75 = _quartiles([t / b for t, b in zip(runs, base, strict=False)])
            entry |= {"ratio": median / statistics.median(base), "ratio_p25": r25, "ratio_p75": r75}
        results[label] = entry
    return results


def bench_point(
    candidates: list[Candidate],
    batch: int,
    seq: int,
    *,
    provider: str = "cpu",
    threads: int = 0,
    repeats: int = 10,
    warmup: int = 2,
    budget_s: float = 0.0,
    seed: int = 0,
    bar=None,
    clock: str = "wall",
) -> dict:
    """Time every candidate at one point (see the module docstring); the first is the baseline."""
    feeds = make_feeds(candidates[0].graph(), batch, seq, seed)
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    outputs = _checked_outputs(candidates, feeds, provider, threads, (batch, seq))
    runners = {}
    for c in candidates:
        with _blamed(c, batch, seq):
            runners[c.label] = Runner(open_session(c.path, provider, threads), feeds, provider, clock)
    outputs = outputs or {label: runner.outputs for label, runner in runners.items()}
    base = candidates[0]
    checks = {}
    for candidate in candidates[1:]:
        comparison = compare_outputs(outputs[base.label], outputs[candidate.label], shapes)
        if candidate.bound is None:
            passed, failures = comparison.passed, comparison.failures()
        else:
            passed = comparison.max_rel_error <= candidate.bound
            failures = f"relative error {comparison.max_rel_error:.3g} > the bound {candidate.bound:g}"
        if candidate.check and not passed:
            raise VerificationError(
                f"{candidate.path} at batch {batch}, seq {seq}: outputs differ from {base.path}: {failures}; "
                "not comparing their speed (a model that differs by design needs an explicit bound: Candidate.bound)"
            )
        checks[candidate.label] = {
            "max_rel_error": comparison.max_rel_error,
            "checked": candidate.check,
            "bound": candidate.bound,
        }
    results = summarize(interleave(runners, repeats, warmup, bar, budget_s), base.label)
    for label, check in checks.items():
        results[label] |= check
    return {"batch": batch, "seq": seq, "input_shapes": shapes, "results": results}


@contextlib.contextmanager
def _blamed(candidate: Candidate, batch: int, seq: int):
    """ONNX Runtime's errors while `candidate` loads or runs become an `InputError` naming its file."""
    try:
        yield
    except ORT_ERRORS as e:
        raise InputError(
            f"{candidate.path}: ONNX Runtime cannot run it at batch {batch}, seq {seq}: {str(e).splitlines()[0]}; "
            "check that the model runs in ONNX Runtime at that size"
        ) from e


def _checked_outputs(
    candidates: list[Candidate], feeds: dict, provider: str, threads: int, point: tuple[int, int]
) -> dict | None:
    """On CUDA, each candidate's outputs from a session with TF32 off, to compare with the dtype's tolerance.

    ORT's CUDA provider computes fp32 MatMuls in TF32 by default (10-bit mantissas): an fp32 model and its
    exact rewrite then differ by ~5e-4 relative on GPT-2-small, above the fp32 tolerance, through no fault
    of the rewrite. The timed sessions keep TF32 on, as deployed. None on the CPU, and where no model has an
    fp32 weight matrix (TF32 touches nothing): the timed sessions' own reference runs are compared.
    """
    if provider != "cuda" or not any(_has_fp32_matrices(c.graph()) for c in candidates):
        return None
    outputs = {}
    for candidate in candidates:
        with _blamed(candidate, *point):
            session = open_session(candidate.path, provider, threads, tf32=False)
            outputs[candidate.label] = dict(
                zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)
            )
        del session
    return outputs


def _has_fp32_matrices(model: onnx.ModelProto) -> bool:
    return any(t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2 for t in model.graph.initializer)


def run_benchmark(
    candidates: list[Candidate],
    points: list[tuple[int, int]],
    *,
    provider: str = "cpu",
    threads: int = 0,
    repeats: int = 10,
    warmup: int = 2,
    budget_s: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    sweep: str | None = None,
    clock: str = "wall",
) -> dict:
    """`bench_point` at every (batch, seq) point; returns the JSON report."""
    if clock not in ("wall", "cpu") or (clock == "cpu" and provider != "cpu"):
        raise InputError(f"clock {clock!r}: wall, or cpu (CPU time, with the cpu provider only)")
    if len(candidates) < 2:
        raise InputError("give at least two models: a baseline and a candidate")
    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats {repeats} / warmup {warmup}: need at least one timed run and no negative warm-up")
    if threads < 0 or any(size < 1 for point in points for size in point):
        raise InputError(f"threads {threads}, points {points}: sizes of at least 1 and threads of at least 0")
    _check_signatures(candidates)
    bar = progress_bar(len(points) * len(candidates) * (repeats + warmup), progress)
    load_before = os.getloadavg()
    try:
        results = []
        for batch, seq in points:
            bar.set_postfix_str(f"batch {batch} seq {seq}")
            results.append(
                bench_point(
                    candidates,
                    batch,
                    seq,
                    provider=provider,
                    threads=threads,
                    repeats=repeats,
                    warmup=warmup,
                    budget_s=budget_s,
                    seed=seed,
                    bar=bar,
                    clock=clock,
                )
            )
    finally:
        bar.close()
    return {
        "machine": machine() | ({"device": gpu_name()} if provider == "cuda" else {}),
        "settings": {
            "provider": provider,
            "threads": threads,
            "repeats": repeats,
            "warmup": warmup,
            "budget_s": budget_s,
            "seed": seed,
            "sweep": sweep,
            "io_binding": True,
            "clock": clock,
            "graph_optimization": "ORT_ENABLE_ALL",
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "models": {c.label: {"path": str(c.path), "checked": c.check} for c in candidates},
        "baseline": candidates[0].label,
        "points": results,
    }


def profile_ops(
    paths: dict[str, str],
    feeds: dict[str, np.ndarray],
    provider: str = "cpu",
    threads: int = 0,
    runs: int = 3,
    statistic: str = "mean",
    config: dict[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    """ORT's profiler: kernel milliseconds per run by op type, for each labelled model.

    Less sensitive to other load on the machine than wall time, since it counts only the time
    inside each kernel. The models run in interleaved rounds; the first run of each is a warm-up
    whose events are dropped. `statistic` "mean" averages each node's kernel time over the runs;
    "min" takes each node's fastest run, then sums per op type: profiled durations are wall time,
    so on a loaded machine a kernel is preempted in some runs, and its fastest run is one that
    was not. `config`: session config entries (e.g. `{"session.set_denormal_as_zero": "1"}`).
    """
    if statistic not in ("mean", "min"):
        raise InputError(f"statistic {statistic!r}: mean or min")
    sessions: dict[str, ort.InferenceSession] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in paths.items():
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.intra_op_num_threads = threads
            options.log_severity_level = 3
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(tmp, f"profile-{len(sessions)}")
            for key, value in (config or {}).items():
                options.add_session_config_entry(key, value)
            sessions[label] = ort.InferenceSession(path, options, providers=[PROVIDERS[provider]])
        order = list(sessions)
        for round_index in range(runs + 1):
            shift = round_index % len(order)
            for label in order[shift:] + order[:shift]:
                sessions[label].run(None, feeds)
        result = {}
        for label, sess in sessions.items():
            with open(sess.end_profiling()) as handle:
                events = json.load(handle)
            model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[1:]
            per_node: dict[tuple[str, str], list[float]] = {}  # (op, node) → ms in each timed run
            for event in events:
                if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
                    continue
                index = next(
                    (i for i, r in enumerate(model_runs) if r["ts"] <= event["ts"] <= r["ts"] + r["dur"]), None
                )
                if index is not None:
                    durations = per_node.setdefault((event["args"]["op_name"], event["name"]), [0.0] * runs)
                    durations[index] += event["dur"] / 1e3
            per_op: dict[str, float] = {}
            for (op, _), durations in per_node.items():
                ms = min(durations) if statistic == "min" else sum(durations) / runs
                per_op[op] = per_op.get(op, 0.0) + ms
            result[label] = dict(sorted(per_op.items(), key=lambda item: -item[1]))
    return result


def rows(report: dict) -> list[dict]:
    """One flat row per point and model (the CSV's rows)."""
    out = []
    for point in report["points"]:
        for label, result in point["results"].items():
            row = {"batch": point["batch"], "seq": point["seq"], "model": label, "runs": len(result["runs_ms"])}
            row |= {k: result.get(k, "") for k in CSV_FIELDS if k not in row}
            out.append(row)
    return out


def to_csv(report: dict) -> str:
    handle = io.StringIO()
    writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows(report))
    return handle.getvalue()


def plot(report: dict, path: str | os.PathLike) -> None:
    """PNG: median time per model (left) and each candidate's ratio with its quartiles (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InputError(f"plotting needs matplotlib: pip install 'normpass[bench]' ({e})") from e
    axis = report["settings"]["sweep"] or "seq"
    points = report["points"]
    xs = [p[axis] for p in points]
    labels = list(report["models"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, label in enumerate(labels):
        results = [p["results"][label] for p in points]
        left.errorbar(
            xs,
            [r["median_ms"] for r in results],
            marker="o",
            label=label,
            color=f"C{index}",
            yerr=[[r["median_ms"] - r["p25_ms"] for r in results], [r["p75_ms"] - r["median_ms"] for r in results]],
        )
    for index, label in enumerate(labels[1:], start=1):
        ratios = [p["results"][label]["ratio"] for p in points]
        right.errorbar(
            xs,
            ratios,
            marker="o",
            label=f"{label} / {labels[0]}",
            capsize=3,
            color=f"C{index}",
            yerr=[
                [max(r - p["results"][label]["ratio_p25"], 0) for r, p in zip(ratios, points, strict=False)],
                [max(p["results"][label]["ratio_p75"] - r, 0) for r, p in zip(ratios, points, strict=False)],
            ],
        )
    right.axhline(1.0, color="grey", linewidth=1)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(axis)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("median ms per run (quartiles)")
    right.set_ylabel("time ratio (per-round quartiles); < 1 is faster")
    settings = report["settings"]
    fig.suptitle(
        f"{settings['provider']}, at least {settings['repeats']} interleaved runs per point, "
        f"onnxruntime {report['machine']['onnxruntime']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
