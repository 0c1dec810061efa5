"""The fuzzing oracle: every fold of a generated model is exact on the generator's feeds, or refused.

`check(case)` inspects and folds `case.model` three ways (default options, `verify=False`,
`target="onnx"`) and returns the failures found, as `Failure(kind, mode, detail)`:

* "exception": something other than a `NormpassError` escaped (a `NormpassError` is a refusal,
  fine if its message is one line; `VerificationError` is normpass refusing its own rewrite);
* "message": a `NormpassError` or a decline reason that is empty or spans several lines;
* "count": the plan does not list every norm the generator built (subgraphs included);
* "mutated": the caller's model was modified;
* "signature": the folded model's inputs or outputs differ (names, element types, ranks);
* "rejected": the folded model fails on feeds the original accepts;
* "mismatch": an output differs beyond its dtype's tolerance — a silently wrong model. Ids (an `ArgMax`
  head's int64 output) must be equal, except where the original's two largest logits there are within the
  dtype's tolerance of each other (a tie the rounding may break either way).

Both models run in ONNX Runtime with graph optimizations off, on the generator's feeds (both
values of the bool input, a second shape for dynamic dims, overrides of overridable
initializers), not on normpass's own verification inputs.

`check_from_file(case, directory, size_threshold)` does the same for the path a file takes: the
model saved with external data, folded from its path with and without verification, the written
result compared with the original, and the input files checked unchanged. With `hostile=True`
(`tools/fuzz.py --from-files`) the model files are then attacked, through the command line where a
user would:

* "aimed": every output of `fold` and `replace` aimed at each file the input reads (the model,
  its data file) must be refused with exit 2 before any work;
* "damaged": a copy whose data file is short (cut at a random byte) or missing must be refused
  with an `InputError`, never read;
* "shared": a second model file reading the same data file; folding either one to the other's
  name must leave the one that is not written computing what it computed;
* "concurrent": two folds (two structures: γ/β migrated or not) written to one path by two
  threads at once must leave one whole model, its own data file and no other;
* "signal": `normpass fold` in this process, stopped by SIGINT, SIGTERM or SIGHUP at a random
  moment of its run (seeded by the case), must exit 0 or 128 + the signal with one line, leave
  no temporary file, and leave the old output (the line says "nothing written") or the whole new
  one with its own data file ("wrote only").

A failure of these is `file-<what> [mode]`.

`check_replace(case)` (`tools/fuzz.py --replace`) checks the surrogate pass's emission: on replace's
own prepared base with every norm a candidate (`all_norms`), seeded surrogates (once of mixed kinds,
once of linear kinds only, so that writers' biases go along pre-LN streams) emitted as `replace`
writes them (γ of linear ones carried along the residual stream, biases into β) must
compute what the same surrogates emitted one at a time compute ("mismatch [replace]"); a refusal is a
one-line `NormpassError`.

`check_rotate(case)` (`tools/fuzz.py --rotate`) checks `rotate_onnx` with calibration inputs (the
generator's first feeds), so that keys are centred and norm outputs smoothed too, its own verification
off: the rotated model must compute what the original computes on the generator's feeds ("mismatch
[rotate]"), keep its signature, leave the caller's model as it was, or be refused in one line.

`check_slice(case)` (`tools/fuzz.py --slice`) checks `slice_onnx` at ratios 0 and 0.5, with one basis per
stream and one per layer, with the generator's feeds that
set no initializer as calibration and held-out data: at ratio 0 the result must compute what the original
computes ("mismatch [slice]"); above it every sliced stream must be narrower, the model must keep its
signature, pass the checker and give finite outputs wherever the original does ("structure [slice]");
a refusal is a one-line `NormpassError`. The held-out figures it reports are recomputed here from both models'
outputs ("figures [slice]"): the number of samples, the agreement of ids and of the float outputs' arg-max
(`top1`), and a cosine claimed only where a float output exists.
"""

from __future__ import annotations

import contextlib
import io as text_io
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from conftest import check_structure
from onnx import helper

from normpass import (
    FoldOptions,
    InputError,
    NormpassError,
    ReplaceOptions,
    RotateOptions,
    SliceOptions,
    VerificationError,
    fold_onnx,
    inspect_onnx,
    io,
    rotate_onnx,
    slice_onnx,
)
from normpass.cli.main import main

# Relative tolerance (max |a − b| / max |a| per output) by dtype: a fold may only change rounding.
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
TOLERANCE = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 1e-2}
MODES = {
    "default": FoldOptions(),
    "no-verify": FoldOptions(verify=False),
    "onnx": FoldOptions(target="onnx"),
}
FILE_MODES = {"file": FoldOptions(), "file-no-verify": FoldOptions(verify=False)}  # `check_from_file`
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Failure:
    kind: str
    mode: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} [{self.mode}]: {self.detail}"


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_all(model: onnx.ModelProto, feed_sets) -> list[dict[str, np.ndarray]]:
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(names, feeds), strict=False)) for feeds in feed_sets]


def _argmax_inputs(model: onnx.ModelProto) -> dict[str, str]:
    """Graph output made by an `ArgMax` → the tensor it reads (its logits)."""
    outputs = {o.name for o in model.graph.output}
    return {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "ArgMax" and n.output[0] in outputs}


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of `model` that also returns the tensors `names` (of the model's float dtype)."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    elem_type = next(i.data_type for i in copy.graph.initializer if i.data_type in FLOAT_TYPES)
    copy.graph.output.extend(helper.make_tensor_value_info(name, elem_type, None) for name in names)
    return copy


def _ids_error(reference: np.ndarray, candidate: np.ndarray, logits: np.ndarray | None) -> float:
    """The share of ids that differ where the original's logits (if known) have no tie within their dtype's
    tolerance: 0 when every difference is such a tie."""
    if reference.shape != candidate.shape:
        return float("inf")
    differ = reference != candidate
    if logits is not None and differ.any():
        top = np.sort(logits.astype(np.float64), axis=-1)
        gap = top[..., -1] - top[..., -2]
        differ &= gap > TOLERANCE[logits.dtype] * max(float(np.abs(logits).max()), 1e-30)
    return float(differ.mean()) if differ.size else 0.0


def relative_error(reference: np.ndarray, candidate: np.ndarray) -> float:
    ref, got = reference.astype(np.float64), candidate.astype(np.float64)
    if ref.shape != got.shape:
        return float("inf")
    if not np.array_equal(np.isfinite(ref), np.isfinite(got)):
        return float("inf")
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(ref[finite]).max()), 1e-30)
    return float(np.abs(ref[finite] - got[finite]).max()) / scale


def describe(error: Exception) -> str:
    """'TypeName: first line of the message'."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def signature(model: onnx.ModelProto) -> tuple:
    def entries(values):
        return [(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in values]

    return entries(model.graph.input), entries(model.graph.output)


def check(case) -> list[Failure]:
    """Every failure of the invariant on `case` (a `graphgen.Case`); [] when all is well."""
    failures = []
    original = case.model.SerializeToString()
    try:
        plan = inspect_onnx(case.model)
        if plan.total != len(case.norms):
            failures.append(
                Failure("count", "inspect", f"the plan lists {plan.total} norms, the model has {len(case.norms)}")
            )
        failures += [
            Failure("message", "inspect", f"{d.name}: reason {d.reason!r}")
            for d in plan.decisions
            if not d.foldable and (not d.reason or "\n" in d.reason)
        ]
    except NormpassError as e:
        failures += _one_line(e, "inspect")
    except Exception as e:
        failures.append(Failure("exception", "inspect", describe(e)))
    failures += _restored(case.model, original, "inspect")
    expected = run_all(case.model, case.feeds)
    for mode, options in MODES.items():
        failures += _check_mode(case, mode, options, expected)
        failures += _restored(case.model, original, mode)
    return failures


def _restored(model: onnx.ModelProto, original: bytes, mode: str) -> list[Failure]:
    """A failure if normpass modified `model`, which is then restored so the next mode sees it as generated."""
    if model.SerializeToString() == original:
        return []
    model.ParseFromString(original)
    return [Failure("mutated", mode, "normpass modified the caller's model")]


def _one_line(error: NormpassError, mode: str) -> list[Failure]:
    message = str(error)
    if message.strip() and "\n" not in message:
        return []
    return [Failure("message", mode, f"{type(error).__name__} with message {message!r}")]


def check_rotate(case) -> list[Failure]:
    """Failures of the rotation with keys centred and norm outputs smoothed on `case` (the module docstring)."""
    mode, original = "rotate", case.model.SerializeToString()
    declared = {i.name for i in case.model.graph.input}
    calibration = [feeds for feeds in case.feeds if set(feeds) <= declared][:1]
    try:
        result = rotate_onnx(case.model, RotateOptions(calib=calibration, smooth=0.5, verify=False))
    except NormpassError as e:  # a refusal
        return _one_line(e, mode) + _restored(case.model, original, mode)
    except Exception as e:
        return [Failure("exception", mode, describe(e))] + _restored(case.model, original, mode)
    failures = _restored(case.model, original, mode)
    smoothed = 0 if result.smoothing is None else len(result.smoothing.sites)
    keys = 0 if result.keys is None else len(result.keys.sites)
    note = f"{result.rotated} streams rotated, {keys} keys centred, {smoothed} outputs smoothed"
    return failures + _compare(case, mode, result.model, run_all(case.model, case.feeds), note)


def check_slice(case, ratios: tuple[float, ...] = (0.0, 0.5)) -> list[Failure]:
    """Failures of the slicing of `case` at each of `ratios`, with either basis (the module docstring)."""
    return [
        failure for ratio in ratios for basis in ("stream", "layer") for failure in _check_slice(case, ratio, basis)
    ]


def _check_slice(case, ratio: float, basis: str) -> list[Failure]:
    """`check_slice` at one ratio and basis; `round_to` 2, so that D = 8 slices."""
    mode, original = f"slice-{basis}", case.model.SerializeToString()
    initializers = {i.name for i in case.model.graph.initializer}
    inputs = {i.name for i in case.model.graph.input} - initializers
    calibration = [feeds for feeds in case.feeds if set(feeds) <= inputs]
    options = SliceOptions(ratio=ratio, round_to=2, basis=basis, holdout=calibration, verify=False)
    try:
        result = slice_onnx(case.model, calibration, options)
    except NormpassError as e:  # a refusal
        return _one_line(e, mode) + _restored(case.model, original, mode)
    except Exception as e:
        return [Failure("exception", mode, describe(e))] + _restored(case.model, original, mode)
    failures = _restored(case.model, original, mode)
    expected = run_all(case.model, calibration)
    note = f"{len(result.slicing.sliceable)} streams sliced at {ratio}"
    if ratio == 0:
        return failures + _compare(case, mode, result.model, run_all(case.model, case.feeds), note)
    failures += _signature_change(case.model, result.model, mode)
    kept = {} if result.chosen is None else result.chosen.kept
    failures += [
        Failure("structure", mode, f"stream {s.name} keeps {kept.get(s.name)} of {s.width} columns ({note})")
        for s in result.slicing.sliceable
        if not kept.get(s.name, 0) < (s.width or 0)
    ]
    try:
        check_structure(result.model)
        got = run_all(result.model, calibration)
    except Exception as e:
        return failures + [Failure("structure", mode, f"{describe(e)} ({note})")]
    for reference, candidate in zip(expected, got, strict=True):
        for name, value in reference.items():
            if np.isfinite(value).all() and not np.isfinite(candidate[name]).all():
                failures.append(Failure("structure", mode, f"output {name} is not finite ({note})"))
    return failures + [Failure("figures", mode, f"{problem} ({note})") for problem in _figures(result, expected, got)]


def _figures(result, expected, got) -> list[str]:
    """What the held-out figures `slice_onnx` reports get wrong, recomputed from both models' outputs on the
    held-out feeds: samples (not samples × outputs), the agreement of ids and of float outputs' arg-max over
    their last axis, and a cosine claimed exactly where a float output exists."""
    held = result.held_out
    if held is None:
        return ["no held-out figures"]
    samples = sum(max((v.shape[0] for v in outputs.values() if v.ndim), default=1) for outputs in expected)
    agree, positions, floats = 0, 0, False
    for reference, candidate in zip(expected, got, strict=True):
        for name, value in reference.items():
            if value.dtype.kind in "iub":
                agree, positions = agree + int((value == candidate[name]).sum()), positions + value.size
            elif value.dtype.kind == "f":
                floats = True
                if value.ndim >= 2 and value.shape[-1] > 1:
                    same = value.argmax(-1) == candidate[name].argmax(-1)
                    agree, positions = agree + int(same.sum()), positions + same.size
    top1 = agree / positions if positions else None
    problems = []
    if held.samples != samples:
        problems.append(f"held out: {held.samples} samples reported, {samples} judged")
    if (top1 is None) != (held.top1 is None) or (top1 is not None and abs(top1 - held.top1) > 1e-9):
        problems.append(f"held out: top1 {held.top1} reported, {top1} recomputed")
    if floats != (held.cos_min is not None):
        problems.append(f"held out: cosine {held.cos_min} reported for {'some' if floats else 'no'} float output")
    return problems


def _check_mode(case, mode: str, options: FoldOptions, expected) -> list[Failure]:
    try:
        result = fold_onnx(case.model, options)
    except VerificationError as e:  # normpass refused its own rewrite: allowed
        return _one_line(e, mode)
    except NormpassError as e:
        return _one_line(e, mode)
    except Exception as e:
        return [Failure("exception", mode, describe(e))]
    return _compare(case, mode, result.model, expected, f"{result.folded} of {result.plan.total} norms folded")


def _compare(case, mode: str, folded: onnx.ModelProto, expected, note: str) -> list[Failure]:
    """Failures of `folded` against the original's outputs `expected` on the case's feeds."""
    failures = _signature_change(case.model, folded, mode)
    declared = {i.name for i in folded.graph.input}
    runnable = [i for i, feeds in enumerate(case.feeds) if set(feeds) <= declared]  # not overrides it dropped
    try:
        got = dict(zip(runnable, run_all(folded, [case.feeds[i] for i in runnable]), strict=False))
    except Exception as e:
        return failures + [Failure("rejected", mode, describe(e))]
    heads = _argmax_inputs(case.model)
    logits = run_all(_with_outputs(case.model, list(heads.values())), case.feeds) if heads else None
    worst: tuple[float, str | None, int | None] = (0.0, None, None)
    for index, candidate in got.items():
        for name, value in expected[index].items():
            if value.dtype.kind in "iu":
                error = _ids_error(value, candidate[name], None if logits is None else logits[index][heads[name]])
                if error and error > worst[0]:
                    worst = (error, name, index)
                continue
            error = relative_error(value, candidate[name])
            if error > TOLERANCE[value.dtype] and error > worst[0]:
                worst = (error, name, index)
    error, worst_name, worst_index = worst
    if worst_name is None or worst_index is None:
        return failures
    feeds = case.feeds[worst_index]
    described = {
        k: (v.tolist() if v.ndim == 0 else list(v.shape)) for k, v in feeds.items() if k in ("x", "ids", "cond")
    }
    overrides = len(set(feeds) - set(described))
    return failures + [
        Failure(
            "mismatch",
            mode,
            f"output {name}: relative error {error:.3g} on {described}"
            f"{f' with {overrides} overrides' if overrides else ''} ({note})",
        )
    ]


def check_from_file(case, directory: Path, size_threshold: int = 0, hostile: bool = False) -> list[Failure]:
    """Fold `case.model` from a file whose tensors of `size_threshold` bytes or more are external data
    (the lazy path: memory-mapped weights, changed ones computed when written), with and without
    verification; compare the written result with the original, attack the files (`hostile`: see
    the module docstring) and check that the input files are untouched."""
    expected = run_all(case.model, case.feeds)
    source = directory / "model.onnx"
    onnx.save(
        onnx.ModelProto.FromString(case.model.SerializeToString()),
        source,
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=size_threshold,
    )
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    failures = []
    results = {}
    for mode, options in FILE_MODES.items():
        written = directory / f"{mode}.onnx"
        try:
            results[mode] = fold_onnx(source, options)
            results[mode].save(written)
        except NormpassError as e:  # a refusal (ONNX Runtime cannot load every such file, say)
            failures += _one_line(e, mode)
            continue
        except Exception as e:
            failures.append(Failure("exception", mode, describe(e)))
            continue
        failures += _compare(
            case,
            mode,
            onnx.load(str(written)),
            expected,
            f"{results[mode].folded} of {results[mode].plan.total} norms folded",
        )
    if hostile and "file-no-verify" in results:
        rng = np.random.default_rng(case.seed)
        failures += _aimed_at_inputs(source, directory)
        failures += _damaged_data(source, directory, rng)
        failures += _shared_data(case, source, directory, expected)
        failures += _concurrent_writers(case, source, directory, expected)
        failures += _stopped_by_a_signal(case, source, directory, expected, rng)
    if any(p.read_bytes() != before[p.name] for p in directory.iterdir() if p.name in before):
        failures.append(Failure("mutated", "file", "normpass modified the input files"))
    return failures


def _cli(*argv) -> tuple[int, str]:
    """`normpass ARGV` in this process: (exit code, stderr)."""
    err = text_io.StringIO()
    with contextlib.redirect_stdout(text_io.StringIO()), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def _data_files(directory: Path, model_name: str) -> set[Path]:
    return {p for p in directory.iterdir() if p.name.startswith(f"{model_name}.") and p.name.endswith(".data")}


def _whole(case, path: Path, expected, mode: str, note: str) -> list[Failure]:
    """`path` computes what the original computes, and the only data file written for it is the one it reads."""
    read = set(io.model_files("out", path).values()) - {path}
    stray = _data_files(path.parent, path.name) - read
    failures = (
        [Failure(f"file-{mode}", "file", f"data files left beside {path.name}: {sorted(stray)}")] if stray else []
    )
    return failures + _compare(case, f"file-{mode}", onnx.load(str(path)), expected, note)


def _aimed_at_inputs(source: Path, directory: Path) -> list[Failure]:
    failures = []
    for target in io.model_files("model", source).values():
        for argv in (
            ["fold", source, "-o", target, "--no-verify"],
            ["fold", source, "-o", directory / "aimed.onnx", "--no-verify", "--report", target],
            ["replace", source, "--calib", "synthetic", "-o", target],
        ):
            code, err = _cli(*argv)
            if code != 2 or "must not overwrite" not in err or len(err.strip().splitlines()) != 1:
                failures.append(
                    Failure(
                        "file-aimed",
                        "file",
                        f"{' '.join(map(str, argv[:1] + argv[2:]))}: exit {code}, {err.strip()[:200]!r}",
                    )
                )
    if (directory / "aimed.onnx").exists():
        failures.append(Failure("file-aimed", "file", "a refused command wrote its output"))
    return failures


def _damaged_data(source: Path, directory: Path, rng: np.random.Generator) -> list[Failure]:
    data = directory / "model.onnx.data"
    if not data.exists() or data.stat().st_size == 0:
        return []
    failures = []
    for damage in ("short", "missing"):
        copy = directory / damage
        copy.mkdir()
        shutil.copy(source, copy / "model.onnx")
        if damage == "short":
            shutil.copy(data, copy / data.name)
            os.truncate(copy / data.name, int(rng.integers(0, data.stat().st_size)))
        try:
            fold_onnx(copy / "model.onnx", FoldOptions(verify=False))
            failures.append(Failure("file-damaged", damage, "a model whose data file is damaged was folded"))
        except InputError as e:
            failures += _one_line(e, f"file-damaged {damage}")
        except Exception as e:
            failures.append(Failure("file-damaged", damage, describe(e)))
    return failures


def _shared_data(case, source: Path, directory: Path, expected) -> list[Failure]:
    """other.onnx reads model.onnx's data file: folding one of them to the other's name leaves the other's weights."""
    if not (directory / "model.onnx.data").exists():
        return []
    failures = []
    shared = directory / "shared"
    shared.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(directory / name, shared / name)
    shutil.copy(shared / "model.onnx", shared / "other.onnx")
    for reader, written in (("model.onnx", "other.onnx"), ("other.onnx", "model.onnx")):
        code, err = _cli("fold", shared / reader, "-o", shared / written, "--no-verify")
        if code not in (0, 1, 2) or len(err.strip().splitlines()) > 1:
            failures.append(Failure("file-shared", reader, f"exit {code}, {err.strip()[:200]!r}"))
        failures += _compare(case, f"file-shared {reader}", onnx.load(str(shared / reader)), expected, "the model read")
    return failures


def _concurrent_writers(case, source: Path, directory: Path, expected) -> list[Failure]:
    """Two folds of two structures, written to one path at once by two threads."""
    out = directory / "concurrent.onnx"
    try:
        results = [fold_onnx(source, FoldOptions(verify=False, migrate_affine=m)) for m in (True, False)]
    except NormpassError:
        return []
    errors: list[Exception] = []

    def write(result) -> None:
        try:
            for _ in range(3):
                result.save(out)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(result,)) for result in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        return [Failure("file-concurrent", "file", describe(errors[0]))]
    return _whole(case, out, expected, "concurrent", "two writers")


def _stopped_by_a_signal(case, source: Path, directory: Path, expected, rng: np.random.Generator) -> list[Failure]:
    """`normpass fold` stopped by a signal at a random moment of a run as long as an unstopped one."""
    out = directory / "stopped.onnx"
    argv = ["fold", source, "-o", out, "--no-verify", "--report", directory / "stopped.json"]
    start = time.perf_counter()
    _cli(*argv)
    duration = time.perf_counter() - start
    old = b"the old output"
    out.write_bytes(old)
    for stale in _data_files(directory, out.name):
        stale.unlink()
    (directory / "stopped.json").unlink(missing_ok=True)
    signum = STOPPING_SIGNALS[int(rng.integers(len(STOPPING_SIGNALS)))]
    delay = float(rng.uniform(0, duration))
    ignored = {s: signal.signal(s, signal.SIG_IGN) for s in STOPPING_SIGNALS}  # a signal after the run: nothing
    try:
        timer = threading.Timer(delay, os.kill, (os.getpid(), signum))
        timer.start()
        code, err = _cli(*argv)
        timer.cancel()
        timer.join()
    finally:
        for s, handler in ignored.items():
            signal.signal(s, handler)
    mode = f"signal {signal.Signals(signum).name} after {delay:.3f} of {duration:.3f} s"
    failures = []
    if code not in (0, 128 + signum) or len(err.strip().splitlines()) > (0 if code == 0 else 1):
        failures.append(Failure("file-signal", mode, f"exit {code}, {err.strip()[:200]!r}"))
    if [p for p in directory.iterdir() if p.name.startswith(".normpass-")]:
        failures.append(Failure("file-signal", mode, "temporary files left"))
    if code == 0 or "wrote only" in err:
        failures += _whole(case, out, expected, "signal", mode)
    elif out.read_bytes() != old or _data_files(directory, out.name):
        failures.append(Failure("file-signal", mode, f"the old output was changed ({err.strip()[:120]!r})"))
    return failures


def _signature_change(original: onnx.ModelProto, folded: onnx.ModelProto, mode: str) -> list[Failure]:
    (inputs, outputs), (new_inputs, new_outputs) = signature(original), signature(folded)
    changes = [
        f"{what} {sorted(set(old) - set(new))} became {sorted(set(new) - set(old))}"
        for what, old, new in (("inputs", inputs, new_inputs), ("outputs", outputs, new_outputs))
        if old != new
    ]
    return [Failure("signature", mode, "; ".join(changes))] if changes else []


# --- the surrogate pass's emission ----------------------------------------------------------------

REPLACE_KINDS = ("affine", "affine", "scalebias", "dyt", "rms")  # affine twice: most streams carry
LINEAR_KINDS = ("affine", "scalebias")  # every norm linear: writers' biases go along pre-LN streams


def _seeded_surrogates(bench, seed: int, kinds: tuple[str, ...] = REPLACE_KINDS) -> list:
    from normpass.core.surrogates import Surrogate

    rng = np.random.default_rng(seed)
    found = []
    for norm in bench.norms:
        width, kind = bench.width(norm.name), str(rng.choice(kinds))
        gamma = np.full(width, 0.8) if kind == "scalebias" else 1 + 0.3 * rng.standard_normal(width)
        beta, shift = 0.2 * rng.standard_normal(width), float(rng.choice([0.0, 0.1]))
        alpha = 0.8 if kind == "scalebias" else 0.5
        found.append((norm.name, Surrogate(kind, gamma, beta, shift=shift, alpha=alpha, epsilon=1e-5)))
    return found


def emitted_both_ways(prepared, surrogates: list) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """`surrogates` on `prepared` (`normpass.onnx.replace.driver.prepare`) as `replace` emits them (`emit_all`: γ
    and biases carried along the stream), one norm at a time (nothing carried), and the first's emissions."""
    from normpass.onnx.replace.surrogates import Emitter, export_model, working_graph

    bench = prepared.bench
    ctx, emitter, emissions = bench.build(surrogates)
    carried = export_model(ctx, prepared.folded, emitter.docs, {})
    alone_ctx = working_graph(bench.base, bench.shapes, bench.name, bench.dtypes)
    alone = Emitter(alone_ctx, bench.rms_op)
    for name, surrogate in surrogates:
        alone.emit(alone.norms[name], surrogate)
    return carried, export_model(alone_ctx, prepared.folded, alone.docs, {}), emissions


def check_replace(case) -> list[Failure]:
    """Failures of the surrogate emission on `case` (the module docstring); [] when all is well."""
    from normpass.onnx.calibrate import Runner
    from normpass.onnx.replace.driver import prepare

    mode = "replace"
    options = ReplaceOptions(kind="auto", all_norms=True, samples=8, budget="cos=0.01", check=0.0)
    try:
        prepared = prepare(case.model, "synthetic", options)
    except NormpassError as e:
        return _one_line(e, mode)
    except Exception as e:
        return [Failure("exception", mode, describe(e))]
    bench, failures = prepared.bench, []
    for kinds in (REPLACE_KINDS, LINEAR_KINDS):
        try:
            carried, plain, emissions = emitted_both_ways(prepared, _seeded_surrogates(bench, case.seed, kinds))
        except NormpassError as e:
            return _one_line(e, mode)
        except Exception as e:
            return [Failure("exception", mode, describe(e))]
        streams = sum(e.gamma.startswith("carried") for e in emissions.values())
        biases = sum("along the residual stream" in e.shift for e in emissions.values())
        for batch in prepared.search.splits.batches["test"][:2]:
            want, got = Runner(plain).run(batch), Runner(carried).run(batch)
            for name, value in want.items():
                ids = value.dtype.kind in "iu"
                error = _ids_error(value, got[name], None) if ids else relative_error(value, got[name])
                if error > (0.0 if ids else TOLERANCE[value.dtype]):
                    carried_what = f"{streams} γ and {biases} biases carried, kinds {'/'.join(sorted(set(kinds)))}"
                    failures.append(
                        Failure("mismatch", mode, f"output {name}: relative error {error:.3g} ({carried_what})")
                    )
    return failures
