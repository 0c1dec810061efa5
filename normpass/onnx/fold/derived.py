"""A large changed weight computed slab by slab, from its source's slab, when it is written.

The passes change weights by maps that act on each fibre along one axis alone: centring the output
features (each row of a MatMul weight minus its mean), rotating or cutting them (W·Q, W·Q_k), rotating
the input features back (Qᵀ·W, each column alone), scaling along an axis. For such a map f along axis a,
f(W) restricted to indices [i, j) along any other axis s is f(W restricted to [i, j) along s): the new
weight can be computed, written and released one slab along s at a time, reading only that slab of its
source. A `DerivedTensor` is that weight: `tofile` (what `ir.save` writes external data with) computes one
slab of at most `SLAB_BYTES`, writes it at its place in the file, and drops what it read of a
memory-mapped source (`io.drop_pages`) before the next. Its source may itself be derived (a fold's
centring under a rotation's W·Q): a slab of it is computed from the same slab of its own source, so no
weight of the chain is ever held whole. `numpy()` assembles the whole array slab by slab (the result
once, no float64 copy of it), for the callers that need the values.

A source computed whole when read (a lazily derived weight without an axis, or one derived along the axis
this one would split) makes no `DerivedTensor` (`compatible`): the caller computes that weight whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from ...io import drop_pages

SLAB_BYTES = 2**25  # of a derived weight (and of its source) computed at a time

Check = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (new values, source values) → new values, or raises


class DerivedTensor(ir.LazyTensor):
    """`make(source)` for a `make` acting on each fibre along `axis` alone (the module docstring). `check`
    sees each slab with its source's slab (`targets.refuse_overflow`). Its shape and dtype are found from the
    first slab (`make` may change the size along `axis`: a cut)."""

    def __init__(self, source: ir.TensorProtocol, make, axis: int, name: str, check: Check | None = None):
        rank = len(source.shape)
        self.source, self.make, self.check = source, make, check
        self.axis = axis % rank
        self.split = 1 if self.axis == 0 else 0
        first = self.slab(0, 1)
        dims = list(first.shape)
        dims[self.split] = source.shape[self.split]
        super().__init__(
            self._whole, dtype=ir.DataType.from_numpy(first.dtype), shape=ir.Shape(dims), name=name, cache=False
        )

    def __repr__(self) -> str:  # LazyTensor's names its function, this tensor's own method: itself again
        return f"DerivedTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, axis={self.axis})"

    def slab(self, start: int, stop: int) -> np.ndarray:
        """The values at [start, stop) along `split`, from the source's values there."""
        values = source_slab(self.source, self.split, start, stop)
        result = np.ascontiguousarray(self.make(values))
        if self.check is not None:
            self.check(result, values)
        if isinstance(self.source, ir.ExternalTensor):
            drop_pages(self.source)
        return result

    def slabs(self) -> list[tuple[int, int]]:
        """[start, stop) along `split` of each slab: at most `SLAB_BYTES` of the result or of the source each."""
        count = int(self.shape.numpy()[self.split])
        per_index = max(self.nbytes, self.source.nbytes) // max(count, 1)
        step = max(1, SLAB_BYTES // max(per_index, 1))
        return [(start, min(start + step, count)) for start in range(0, count, step)]

    def _whole(self) -> ir.Tensor:
        values = np.empty(self.shape.numpy(), self.dtype.numpy())
        for start, stop in self.slabs():
            index = [slice(None)] * values.ndim
            index[self.split] = slice(start, stop)
            values[tuple(index)] = self.slab(start, stop)
        return ir.Tensor(values, name=self.name)

    def tofile(self, file) -> None:
        """Write the values in C order at the file's position, slab by slab (see the module docstring)."""
        base = file.tell()
        dims = [int(d) for d in self.shape.numpy()]
        outer = math.prod(dims[: self.split])  # 1 for split 0: a slab is one contiguous run
        inner = math.prod(dims[self.split + 1 :]) * self.dtype.numpy().itemsize  # bytes per index along split
        for start, stop in self.slabs():
            runs = self.slab(start, stop).reshape(outer, -1)
            for index, run in enumerate(runs):
                file.seek(base + (index * dims[self.split] + start) * inner)
                file.write(run.data.cast("B"))
        file.seek(base + self.nbytes)

    def tobytes(self) -> bytes:
        return self.numpy().tobytes()


def compatible(source: ir.TensorProtocol, axis: int) -> bool:
    """Whether a `DerivedTensor` along `axis` can read `source` slab by slab: a memory-mapped or in-memory
    array of rank ≥ 2 (no other lazy tensor), or a `DerivedTensor` that slabs along the same axis as this one
    would."""
    rank = len(source.shape)
    if rank < 2:
        return False
    if isinstance(source, DerivedTensor):
        return source.split == (1 if axis % rank == 0 else 0)
    return not isinstance(source, ir.LazyTensor)


def source_slab(tensor: ir.TensorProtocol, split: int, start: int, stop: int) -> np.ndarray:
    """`tensor`'s values at [start, stop) along axis `split`: from the same slab of a `DerivedTensor` that
    slabs along `split`, else a slice of its array (a view of a memory-mapped one: only its pages are read)."""
    if isinstance(tensor, DerivedTensor):
        assert tensor.split == split  # `compatible`
        return tensor.slab(start, stop)
    index = [slice(None)] * len(tensor.shape)
    index[split] = slice(start, stop)
    return tensor.numpy()[tuple(index)]
