"""Calibration data, statistics of intermediate tensors, and the accuracy budget (ONNX Runtime).

* **Data** (`load_batches`): an `.npz` of input arrays (axis 0 = samples), a directory of `.npy`
  files named after the graph inputs, a Python callable (or iterable) yielding input dicts (each
  one batch), or `"synthetic"` — seeded random inputs from `verify.make_inputs`, for tests and
  demos only. Arrays are checked against the graph inputs and cast to their dtypes.
* **Splits** (`split_batches`): fit (statistics), validation (every selection decision) and test
  (the report, never used to decide). Equal-shaped batches are split by sample after a seeded
  shuffle; batches of different shapes (e.g. token batches padded to their own length) by batch.
* **Tensors** (`Runner`): a copy of the model whose wanted intermediate tensors are extra graph
  outputs, run batch by batch in ONNX Runtime on the CPU with graph optimizations off. Large
  weights are fed as inputs instead of being serialised into the session (see
  `surrogate/emit.py` `light_model`), so building a session per trial model is cheap.
* **Masks**: tokens whose attention mask is 0 are excluded from every statistic and from the
  budget (`token_rows`, `Metrics`). The mask input is found by name (`*mask*`, rank 2) unless
  given.
* **Budget** (`Budget`): `cos=` the minimum cosine similarity between the original's and the
  candidate's output vectors per sample (worst case over samples and float outputs), `rel=` the
  maximum relative error per sample (max |a − b| / max |a|), `top1=` the fraction of arg-max
  agreement (per sample, or per token for [batch, seq, classes] outputs).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..errors import InputError, UnsupportedModelError
from ..onnx.verify import fixed_dim, make_inputs, session
from .fit import Reservoir, Welford

Batch = dict  # graph input name -> np.ndarray, axis 0 = samples


# --- data ----------------------------------------------------------------------------------------


def graph_inputs(model: onnx.ModelProto) -> dict[str, tuple[np.dtype, int]]:
    """Graph inputs that are not initializers: name → (dtype, rank)."""
    initializers = {i.name for i in model.graph.initializer}
    out = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        out[value.name] = (
            np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)),
            len(tensor_type.shape.dim),
        )
    return out


def _checked(batch: dict, expected: dict[str, tuple[np.dtype, int]], where: str) -> Batch:
    if not isinstance(batch, dict):
        raise InputError(f"{where}: expected a dict of input arrays, got {type(batch).__name__}")
    missing = sorted(set(expected) - set(batch))
    unknown = sorted(set(batch) - set(expected))
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"not graph inputs: {', '.join(unknown)}"] if unknown else []
        )
        raise InputError(f"{where}: {'; '.join(parts)} (the model's inputs are {', '.join(expected)})")
    out = {}
    sizes = set()
    for name, (dtype, rank) in expected.items():
        value = np.asarray(batch[name])
        if value.ndim != rank:
            raise InputError(f"{where}: input {name} has rank {value.ndim}, the model expects {rank}")
        if value.dtype != dtype:
            if value.dtype.kind != dtype.kind and not (value.dtype.kind in "iub" and dtype.kind in "iub"):
                raise InputError(f"{where}: input {name} is {value.dtype}, the model expects {dtype}")
            value = value.astype(dtype)
        out[name] = np.ascontiguousarray(value)
        sizes.add(value.shape[0] if value.ndim else 1)
    if len(sizes) > 1:
        raise InputError(f"{where}: inputs disagree on the number of samples (axis 0): {sorted(sizes)}")
    return out


def _rebatch(arrays: dict[str, np.ndarray], batch_size: int) -> list[Batch]:
    count = next(iter(arrays.values())).shape[0]
    return [{k: v[i : i + batch_size] for k, v in arrays.items()} for i in range(0, count, batch_size)]


def load_batches(
    source,
    model: onnx.ModelProto,
    batch_size: int = 16,
    samples: int = 64,
    seed: int = 0,
    input_shapes: dict | None = None,
) -> list[Batch]:
    """Calibration batches from `source` (see the module docstring), checked against `model`."""
    expected = graph_inputs(model)
    if isinstance(source, str) and source == "synthetic":
        return synthetic_batches(model, samples, batch_size, seed, input_shapes)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise InputError(
                f"{path}: no such calibration data; pass an .npz file, a directory of .npy files or 'synthetic'"
            )
        if path.is_dir():
            files = {p.stem: p for p in sorted(path.glob("*.npy"))}
            if not files:
                raise InputError(f"{path}: no .npy files; name one file per graph input ({', '.join(expected)})")
            try:
                arrays = {name: np.load(p, allow_pickle=False) for name, p in files.items()}
            except (OSError, ValueError) as e:
                raise InputError(f"{path}: cannot read the .npy files ({e})") from e
        else:
            try:
                with np.load(path, allow_pickle=False) as data:
                    arrays = {name: data[name] for name in data.files}
            except (OSError, ValueError, EOFError) as e:
                raise InputError(f"{path}: not a readable .npz file ({e})") from e
        arrays = _checked(arrays, expected, str(path))
        return _rebatch(arrays, batch_size)
    if isinstance(source, dict):
        return _rebatch(_checked(source, expected, "calibration data"), batch_size)
    produced = source() if callable(source) else source
    if not isinstance(produced, Iterable):
        raise InputError("calibration data: a callable must return an iterable of input dicts")
    batches = [_checked(b, expected, f"calibration batch {i}") for i, b in enumerate(produced)]
    if not batches:
        raise InputError("calibration data: the source yielded no batches")
    return batches


def synthetic_batches(
    model: onnx.ModelProto, samples: int = 64, batch_size: int = 16, seed: int = 0, input_shapes: dict | None = None
) -> list[Batch]:
    """Seeded random inputs (randn floats, in-range indices, all-ones masks). Tests and demos only."""
    batches = []
    for index, start in enumerate(range(0, samples, batch_size)):
        size = min(batch_size, samples - start)
        shapes = dict(input_shapes or {})
        for name, (_dtype, _rank) in graph_inputs(model).items():
            if name not in shapes:
                value = next(v for v in model.graph.input if v.name == name)
                dims = value.type.tensor_type.shape.dim
                shapes[name] = tuple(fixed_dim(d) or (size if axis == 0 else 16) for axis, d in enumerate(dims))
            shapes[name] = (size,) + tuple(shapes[name][1:])
        batches.append(make_inputs(model, shapes, seed=seed * 100003 + index))
    return batches


def _uniform(batches: list[Batch]) -> bool:
    first = batches[0]
    return all({k: v.shape[1:] for k, v in b.items()} == {k: v.shape[1:] for k, v in first.items()} for b in batches)


def split_batches(
    batches: list[Batch], fractions: tuple[float, float, float], seed: int = 0, batch_size: int | None = None
) -> tuple[list[Batch], list[Batch], list[Batch]]:
    """(fit, validation, test) after a seeded shuffle; by sample when batches share shapes."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or not sum(fractions) > 0:
        raise InputError(f"split {fractions}: give three non-negative fractions fit,val,test")
    total = sum(fractions)
    rng = np.random.default_rng(seed)
    if _uniform(batches):
        arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        count = next(iter(arrays.values())).shape[0]
        order = rng.permutation(count)
        size = batch_size or max(b[next(iter(b))].shape[0] for b in batches)
        units, make = (
            count,
            lambda idx: _rebatch({k: v[np.sort(idx)] for k, v in arrays.items()}, size) if len(idx) else [],
        )
    else:
        order = rng.permutation(len(batches))
        units, make = len(batches), lambda idx: [batches[i] for i in sorted(idx)]
    needed = [f > 0 for f in fractions]
    if units < sum(needed):
        raise InputError(
            f"calibration data: {units} {'samples' if _uniform(batches) else 'batches'} cannot be split into "
            f"{sum(needed)} non-empty parts; give more data"
        )
    counts = [math.floor(units * f / total) for f in fractions]
    for i in range(3):  # every requested part gets at least one unit
        if needed[i] and counts[i] == 0:
            counts[i] = 1
    while sum(counts) > units:
        counts[int(np.argmax(counts))] -= 1
    counts[0] += units - sum(counts)
    bounds = np.cumsum([0] + counts)
    return tuple(make(order[bounds[i] : bounds[i + 1]]) for i in range(3))  # type: ignore[return-value]


def find_mask_input(model: onnx.ModelProto, name: str | None = None) -> str | None:
    """The attention-mask input: `name` if given, else the rank-2 input whose name contains 'mask'."""
    inputs = graph_inputs(model)
    if name is not None:
        if name not in inputs:
            raise InputError(f"mask input {name!r} is not a graph input ({', '.join(inputs)})")
        return name
    found = [n for n, (_, rank) in inputs.items() if "mask" in n.lower() and rank == 2]
    return found[0] if len(found) == 1 else None


def token_rows(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Rows of `values` along its last axis, without the tokens whose mask is 0."""
    values = np.asarray(values)
    width = values.shape[-1] if values.ndim else 1
    rows = values.reshape(-1, width)
    if mask is None:
        return rows
    if values.ndim >= 2 and values.shape[:-1] == mask.shape:
        return values[mask != 0]
    if rows.shape[0] == mask.size:
        return rows[mask.reshape(-1) != 0]
    return rows


# --- progress -----------------------------------------------------------------------------------


def progress(items: list, description: str, enabled: bool):
    """`items`, with a progress bar on stderr (tqdm when installed) when `enabled`."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is usually there
        return _plain_progress(items, description)
    return tqdm(items, desc=description, unit="batch", leave=False, file=sys.stderr)


def _plain_progress(items, description):
    for index, item in enumerate(items):
        print(f"\r{description}: batch {index + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)


# --- running ------------------------------------------------------------------------------------


class Runner:
    """An ONNX Runtime session (CPU, optimizations off) for a model whose large weights are inputs."""

    def __init__(self, model: onnx.ModelProto, weights: dict[str, np.ndarray] | None = None):
        try:
            self.session = session(model)  # models over 2 GB, duplicate node names
        except UnsupportedModelError as e:
            raise InputError(f"the model being calibrated: {e}") from e
        self.weights = weights or {}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, batch: Batch, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        names = outputs or self.outputs
        return dict(zip(names, self.session.run(names, {**batch, **self.weights}), strict=False))


# --- budget -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """How far a candidate's outputs are from the original's, over every sample of a split."""

    cos_min: float
    cos_mean: float
    rel_max: float
    top1: float | None
    samples: int
    cos_samples: np.ndarray | None = field(default=None, repr=False, compare=False)
    rel_samples: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "cos_min": self.cos_min,
            "cos_mean": self.cos_mean,
            "rel_max": self.rel_max,
            "top1": self.top1,
            "samples": self.samples,
        }


def _masked(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if mask is not None and values.ndim >= 3 and values.shape[:2] == mask.shape:
        return values * (mask != 0).reshape(mask.shape + (1,) * (values.ndim - 2))
    return values


def compare(
    references: list[dict[str, np.ndarray]],
    candidates: list[dict[str, np.ndarray]],
    masks: list[np.ndarray | None] | None = None,
) -> Metrics:
    """Per-sample cosine, relative error and arg-max agreement over every float output."""
    cosines, rels, agree, positions = [], [], 0, 0
    masks = masks or [None] * len(references)
    for reference, candidate, mask in zip(references, candidates, masks, strict=False):
        for name, ref in reference.items():
            if ref.dtype.kind != "f":
                continue
            got = candidate[name]
            a = _masked(ref.astype(np.float64), mask)
            b = _masked(got.astype(np.float64), mask)
            if a.ndim == 0:
                a, b = a.reshape(1, 1), b.reshape(1, 1)
            flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
            na, nb = np.linalg.norm(flat_a, axis=1), np.linalg.norm(flat_b, axis=1)
            dot = (flat_a * flat_b).sum(axis=1)
            both_zero = (na == 0) & (nb == 0)
            cos = np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-300))
            cos = np.where(np.isfinite(flat_b).all(axis=1), cos, -1.0)
            cosines.append(cos)
            scale = np.abs(flat_a).max(axis=1)
            diff = np.abs(flat_a - flat_b).max(axis=1)
            rel = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), diff)
            rels.append(np.where(np.isfinite(rel), rel, np.inf))
            if a.ndim >= 2 and a.shape[-1] > 1:
                top_a, top_b = a.argmax(axis=-1), b.argmax(axis=-1)
                keep = np.ones(top_a.shape, dtype=bool)
                if mask is not None and top_a.shape == mask.shape:
                    keep = mask != 0
                agree += int((top_a == top_b)[keep].sum())
                positions += int(keep.sum())
    cos_all = np.concatenate(cosines) if cosines else np.ones(1)
    rel_all = np.concatenate(rels) if rels else np.zeros(1)
    return Metrics(
        float(cos_all.min()),
        float(cos_all.mean()),
        float(rel_all.max()),
        None if positions == 0 else agree / positions,
        int(sum(len(c) for c in cosines)),
        cos_all,
        rel_all,
    )


@dataclass(frozen=True)
class Budget:
    """Accuracy the replaced model must keep; any of the three terms may be left out."""

    cos: float | None = None
    rel: float | None = None
    top1: float | None = None

    @classmethod
    def parse(cls, specs: str | list[str]) -> Budget:
        """`"cos=0.999"`, `"cos=0.999,top1=0.99"` or a list of such strings."""
        if isinstance(specs, str):
            specs = [specs]
        values: dict[str, float] = {}
        for spec in specs:
            for part in filter(None, (p.strip() for p in spec.split(","))):
                key, sep, text = part.partition("=")
                key = key.strip().lower()
                if not sep or key not in ("cos", "rel", "top1"):
                    raise InputError(f"budget {part!r}: expected cos=V, rel=V or top1=V (e.g. cos=0.999)")
                try:
                    value = float(text)
                except ValueError:
                    raise InputError(f"budget {part!r}: {text!r} is not a number") from None
                if (
                    (key in ("cos", "top1")
                    and not 0 < value <= 1)
                    or (key == "rel"
                    and not value >= 0)
                    or not math.isfinite(value)
                ):
                    raise InputError(f"budget {part!r}: {key} must be in {'(0, 1]' if key != 'rel' else '[0, ∞)'}")
                values[key] = value
        if not values:
            raise InputError("budget: give at least one of cos=, rel=, top1=")
        return cls(**values)

    def usage(self, metrics: Metrics) -> float:
        """The share of the allowance used (≤ 1 keeps the budget); the worst over the terms."""
        used = []
        if self.cos is not None:
            used.append(_share(1 - metrics.cos_min, 1 - self.cos))
        if self.rel is not None:
            used.append(_share(metrics.rel_max, self.rel))
        if self.top1 is not None and metrics.top1 is not None:
            used.append(_share(1 - metrics.top1, 1 - self.top1))
        return max(used) if used else 0.0

    def holds(self, metrics: Metrics, margin: float = 1.0) -> bool:
        return self.usage(metrics) <= margin

    def __str__(self) -> str:
        return ",".join(
            f"{k}={v:g}" for k, v in (("cos", self.cos), ("rel", self.rel), ("top1", self.top1)) if v is not None
        )


def _share(used: float, allowed: float) -> float:
    if not math.isfinite(used):
        return math.inf
    if allowed <= 0:
        return 0.0 if used <= 0 else math.inf
    return max(used, 0.0) / allowed


# --- statistics of one norm ---------------------------------------------------------------------


@dataclass
class NormStats:
    """What calibration collected for one norm: Welford moments of x and N(x), and a sample of x."""

    x: Welford  # of the norm's input
    y: Welford  # of the norm's exact output N(x)
    sample: np.ndarray  # [rows, width] float32, the inputs x of a uniform sample of tokens
    tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.sample.nbytes) + 4 * 8 * self.sample.shape[1]


def collect(
    runner: Runner,
    batches: list[Batch],
    tensors: dict[str, tuple[str, Callable, Callable[[np.ndarray], np.ndarray]]],
    mask_input: str | None,
    reservoir: int,
    seed: int = 0,
    show: bool = False,
    description: str = "calibrating",
) -> dict[str, NormStats]:
    """Stream `batches` through `runner` and collect, per key, statistics of one tensor.

    `tensors[key] = (tensor name, to_input, norm)`: `to_input(rows)` maps the rows of the tensor
    as observed to the norm's input x (e.g. undoing a migrated shift), `norm(x)` is the norm's
    exact output N(x). Tokens whose mask is 0 are skipped. Every reservoir is seeded alike, so
    passes over the same batches sample the same tokens: samples of one norm from different
    passes (the original model and a partly replaced one) are aligned row by row.
    """
    wanted = sorted({name for name, _, _ in tensors.values()})
    acc: dict[str, tuple] = {}
    for batch in progress(batches, description, show):
        out = runner.run(batch, wanted)
        mask = batch.get(mask_input) if mask_input else None
        for key, (name, to_input, norm) in tensors.items():
            rows = to_input(token_rows(out[name], mask).astype(np.float64))
            if key not in acc:
                width = rows.shape[1]
                acc[key] = (Welford(width), Welford(width), Reservoir(reservoir, width, seed))
            wx, wy, sample = acc[key]
            wx.update(rows)
            wy.update(norm(rows))
            sample.add(rows.astype(np.float32))
    return {key: NormStats(wx, wy, sample.sample.copy(), wx.count) for key, (wx, wy, sample) in acc.items()}
