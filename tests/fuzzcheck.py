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
* "mismatch": an output differs beyond its dtype's tolerance — a silently wrong model.

Both models run in ONNX Runtime with graph optimizations off, on the generator's feeds (both
values of the bool input, a second shape for dynamic dims, overrides of overridable
initializers), not on normpass's own verification inputs.

`check_from_file(case, directory, size_threshold)` does the same for the path a file takes: the
model saved with external data, folded from its path with and without verification, the written
result compared with the original, and the input files checked unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from normpass import FoldOptions, NormpassError, VerificationError, fold_onnx, inspect_onnx

# Relative tolerance (max |a − b| / max |a| per output) by dtype: a fold may only change rounding.
TOLERANCE = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 1e-2}
MODES = {
    "default": FoldOptions(),
    "no-verify": FoldOptions(verify=False),
    "onnx": FoldOptions(target="onnx"),
}
FILE_MODES = {"file": FoldOptions(), "file-no-verify": FoldOptions(verify=False)}  # `check_from_file`


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
    worst = (0.0, None, None)
    for index, candidate in got.items():
        for name, value in expected[index].items():
            error = relative_error(value, candidate[name])
            if error > TOLERANCE[value.dtype] and error > worst[0]:
                worst = (error, name, index)
    if worst[1] is None:
        return failures
    error, name, index = worst
    feeds = case.feeds[index]
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


def check_from_file(case, directory: Path, size_threshold: int = 0) -> list[Failure]:
    """Fold `case.model` from a file whose tensors of `size_threshold` bytes or more are external data
    (the lazy path: memory-mapped weights, changed ones computed when written), with and without
    verification; compare the written result with the original, and check the files are untouched."""
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
    for mode, options in FILE_MODES.items():
        written = directory / f"{mode}.onnx"
        try:
            result = fold_onnx(source, options)
            result.save(written)
        except NormpassError as e:  # a refusal (ONNX Runtime cannot load every such file, say)
            failures += _one_line(e, mode)
            continue
        except Exception as e:
            failures.append(Failure("exception", mode, describe(e)))
            continue
        failures += _compare(
            case, mode, onnx.load(str(written)), expected, f"{result.folded} of {result.plan.total} norms folded"
        )
    if any(p.read_bytes() != before[p.name] for p in directory.iterdir() if p.name in before):
        failures.append(Failure("mutated", "file", "normpass modified the input files"))
    return failures


def _signature_change(original: onnx.ModelProto, folded: onnx.ModelProto, mode: str) -> list[Failure]:
    (inputs, outputs), (new_inputs, new_outputs) = signature(original), signature(folded)
    changes = [
        f"{what} {sorted(set(old) - set(new))} became {sorted(set(new) - set(old))}"
        for what, old, new in (("inputs", inputs, new_inputs), ("outputs", outputs, new_outputs))
        if old != new
    ]
    return [Failure("signature", mode, "; ".join(changes))] if changes else []
