"""Loading and saving models: clear errors on bad input, atomic writes, nothing lost.

A model is written to a temporary file in the destination directory and renamed into place, so a
failed or interrupted write leaves any existing file untouched. Protobuf cannot serialize more
than 2 GB, so the size of a model is estimated from its tensors (never by serializing it), and a
model that may exceed the limit is written with its weights in `OUT.data` beside it, renamed into
place the same way. Writing external data copies no weights into a second proto and leaves the
caller's model as it was.

Outputs are checked before any work: each must be a regular file or not exist yet (never a FIFO,
device or directory), and no output may be the same file as an input or another output (same
path, symlinks and hard links included).
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from .errors import InputError

PROTO_LIMIT = 2**31 - 1
PROTO_HEADROOM = 2**28  # room for everything but the tensors' data (graph, names, shapes)
EXTERNAL_MIN_BYTES = 1024  # tensors at least this large go to OUT.data
LIGHT_INITIALIZER_LIMIT = 1024  # elements; larger initializers are stubs (type and dims, no data) in `skeleton`
STUB_LOCATION = "<normpass: data not included>"
WRITE_IN_FLIGHT_BYTES = 2**26  # weights read but not yet written, at most, while saving
DATA_ALIGNMENT = 4096  # tensors of ≥ 1 MiB start at a page boundary of OUT.data, so ONNX Runtime can map them


def _default_mode() -> int:
    """The mode a plainly created file gets (0666 less the umask); mkstemp's 0600 is for secrets."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _read(path: Path, reader):
    """`reader(path)`, with one-line errors for a missing, directory or unreadable model file."""
    if not path.exists():
        raise InputError(f"{path}: no such file; pass the path of an .onnx model")
    if path.is_dir():
        raise InputError(f"{path}: is a directory; pass the path of an .onnx model")
    try:
        return reader(path)
    except Exception as e:  # onnx raises DecodeError, OSError, ValidationError ...
        raise InputError(
            f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'parse error'})"
        ) from e


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    return checked_model(_read(Path(path), lambda p: onnx.load(str(p))), str(path))


def load_ir(path: str | os.PathLike) -> ir.Model:
    """The model at `path` as an `ir.Model` whose external tensors stay on disk (memory-mapped when read)."""
    path = Path(path)
    model = _read(path, ir.load)
    if not len(model.graph) and not model.graph.outputs:
        raise InputError(f"{path}: not an ONNX model (no graph found); pass an .onnx file")
    return model


def skeleton(model: ir.Model) -> onnx.ModelProto:
    """`model` as a ModelProto whose main-graph initializers of more than `LIGHT_INITIALIZER_LIMIT`
    elements are stubs: name, type and dims, marked external, no data (nothing is loaded or copied).
    Smaller ones keep their values, read from external data where they are stored there: shape
    inference needs them (a `Reshape`'s target shape, a `Slice`'s starts).

    For what reads a model's structure only: shape inference, signatures, verification inputs.
    """
    stubbed = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or not (isinstance(tensor, ir.ExternalTensor) or tensor.size > LIGHT_INITIALIZER_LIMIT):
            continue
        stubbed[value] = tensor
        if tensor.size > LIGHT_INITIALIZER_LIMIT:
            value.const_value = ir.ExternalTensor(
                STUB_LOCATION, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=value.name
            )
        else:
            value.const_value = ir.Tensor(_read_small(value.name, tensor), name=value.name)
    try:
        return ir.to_proto(model)
    finally:
        for value, tensor in stubbed.items():
            value.const_value = tensor


def _read_small(name: str, tensor) -> np.ndarray:
    """A copy of a small tensor's values, or a one-line error where its external data cannot be read."""
    try:
        return np.array(tensor.numpy())
    except OSError as e:
        raise InputError(
            f"initializer {name}: its data is in external file {getattr(tensor, 'path', '?')}, which cannot "
            f"be read ({e.strerror or e}); pass the model's path, or a ModelProto loaded with its external data"
        ) from e


def interface(model: ir.Model) -> onnx.ModelProto:
    """A ModelProto holding only `model`'s graph inputs and outputs (for signature checks)."""
    proto = onnx.ModelProto()
    for values, infos in ((model.graph.inputs, proto.graph.input), (model.graph.outputs, proto.graph.output)):
        for value in values:
            ir.serde.serialize_value_into(infos.add(), value)
    return proto


def checked_model(model, label: str = "model") -> onnx.ModelProto:
    """`model` itself if it is a ModelProto with a graph; a path is loaded with `load_onnx`."""
    if isinstance(model, (str, os.PathLike)):
        return load_onnx(model)
    if not isinstance(model, onnx.ModelProto):
        raise InputError(
            f"{label}: expected an onnx.ModelProto or the path of an .onnx file, got {type(model).__name__}"
        )
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{label}: not an ONNX model (no graph found); pass an .onnx file")
    return model


# --- output paths -----------------------------------------------------------------------------------


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_paths(inputs: dict[str, object], outputs: dict[str, object]) -> dict[str, Path]:
    """Refuse outputs that are not regular files, cannot be written, or are an input or each other.

    `inputs` and `outputs` map a label for messages (e.g. "the model", "-o") to a path or None
    (absent); inputs that are not existing files (e.g. "synthetic") are ignored. Returns the
    outputs given, as paths.
    """
    sources = {label: Path(p) for label, p in inputs.items() if p is not None and Path(p).exists()}
    checked: dict[str, Path] = {}
    for label, value in outputs.items():
        if value is None:
            continue
        out = Path(value)
        if out.exists() and not stat.S_ISREG(out.stat().st_mode):
            raise InputError(
                f"{out}: {label} exists and is not a regular file (a directory, FIFO or device); "
                f"choose another path for {label}"
            )
        for other, path in [*sources.items(), *checked.items()]:
            if _same_file(out, path):
                raise InputError(
                    f"{out}: {label} must not overwrite {other} ({path}), the same file; choose another path for {label}"
                )
        parent = out.resolve().parent
        if not parent.is_dir():
            raise InputError(f"{out}: directory {parent} does not exist; create it or choose another path for {label}")
        if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
            raise InputError(f"{out}: cannot write here; choose a writable {label} path")
        checked[label] = out
    return checked


# --- writing ----------------------------------------------------------------------------------------


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor stored in `graph`: initializers and node attributes, subgraphs included."""
    yield from graph.initializer
    yield from (s.values for s in graph.sparse_initializer)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for subgraph in [*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs]:
                yield from _tensors(subgraph)


def _data_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes `tensor`'s data takes in the proto (external data takes none)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return 0
    if tensor.raw_data:
        return len(tensor.raw_data)
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    count = int(np.prod(tensor.dims, dtype=np.int64))
    return count * 10 if tensor.int64_data or tensor.uint64_data else count * 8  # varints: at most 10 bytes


def may_exceed_proto_limit(model: onnx.ModelProto) -> bool:
    """Whether `model` may be too large to serialize in one protobuf (estimated from its tensors)."""
    return sum(_data_bytes(t) for t in _tensors(model.graph)) + PROTO_HEADROOM >= PROTO_LIMIT


def save_external(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to `path` with every main-graph initializer of ≥ 1 KiB in `path.name + ".data"`.

    The model written is a new proto sharing nothing with `model` but the small tensors; the
    weights go straight from `model`'s tensors to the data file, so `model` is not modified.
    """
    data_name = data_path(path).name
    skeleton = onnx.ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name != "graph":
            skeleton.MergeFrom(onnx.ModelProto(**{descriptor.name: value}))
    for descriptor, value in model.graph.ListFields():
        if descriptor.name != "initializer":
            skeleton.graph.MergeFrom(onnx.GraphProto(**{descriptor.name: value}))
    with open(data_path(path), "wb") as data:
        for tensor in model.graph.initializer:
            if _data_bytes(tensor) < EXTERNAL_MIN_BYTES or tensor.data_type == onnx.TensorProto.STRING:
                skeleton.graph.initializer.append(tensor)
                continue
            payload = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
            offset = data.tell()
            data.write(payload)
            stored = skeleton.graph.initializer.add(
                name=tensor.name,
                dims=tensor.dims,
                data_type=tensor.data_type,
                doc_string=tensor.doc_string,
                data_location=onnx.TensorProto.EXTERNAL,
            )
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(payload)))):
                stored.external_data.add(key=key, value=value)
    onnx.save_model(skeleton, str(path))


def ir_weight_bytes(model: ir.Model) -> int:
    """The bytes of `model`'s main-graph initializers (stored or external)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def keeps_external_data(model: ir.Model) -> bool:
    """Whether `model`'s weights go to a data file when written: it came with external data, or may exceed 2 GB."""
    tensors = [v.const_value for v in model.graph.initializers.values()]
    return (
        any(isinstance(t, ir.ExternalTensor) for t in tensors) or ir_weight_bytes(model) + PROTO_HEADROOM >= PROTO_LIMIT
    )


def save_ir(path: Path, model: ir.Model) -> None:
    """Write `model` to `path`, with its weights of ≥ 1 KiB in `path.name + ".data"` where `keeps_external_data`.

    The weights are written tensor by tensor, unchanged ones straight from their source (a
    memory-mapped file, say, whose pages are dropped once written); `model` is left as it was.
    """
    if not keeps_external_data(model):
        ir.save(model, path)
        return
    # Small tensors stored externally in the source are written inline. onnx-ir would load each and
    # close its memory map, which fails while the analysis still holds a view of it: copy them first.
    inlined = {
        value: value.const_value
        for value in model.graph.initializers.values()
        if isinstance(value.const_value, ir.ExternalTensor) and value.const_value.nbytes < EXTERNAL_MIN_BYTES
    }
    for value, tensor in inlined.items():
        value.const_value = ir.Tensor(_read_small(value.name, tensor), name=value.name)
    try:
        ir.save(
            model,
            path,
            external_data=data_path(path).name,
            size_threshold_bytes=EXTERNAL_MIN_BYTES,
            max_in_flight_bytes=WRITE_IN_FLIGHT_BYTES,
            alignment=DATA_ALIGNMENT,
            callback=_dropping_pages(),
        )
    finally:
        for value, tensor in inlined.items():
            value.const_value = tensor
    release_weights(model)


def drop_pages(tensor) -> None:
    """Drop what was read of a memory-mapped external tensor from memory (a read-only mapping: what is
    read again comes from the file); anything else is left alone."""
    raw = getattr(tensor, "raw", None) if isinstance(tensor, ir.ExternalTensor) else None
    if isinstance(raw, mmap.mmap):
        raw.madvise(mmap.MADV_DONTNEED)


def release_weights(model: ir.Model) -> None:
    """`drop_pages` of every initializer of `model`."""
    for value in model.graph.initializers.values():
        drop_pages(value.const_value)


def _dropping_pages():
    """An `ir.save` callback that drops the pages of each tensor once the next one is being written."""
    written = []

    def callback(tensor, info) -> None:
        if written:
            drop_pages(written.pop())
        written.append(tensor)

    return callback


def data_path(out_path: str | os.PathLike) -> Path:
    """Where the weights of a model written to `out_path` go when it may exceed 2 GB."""
    return Path(f"{out_path}.data")


def save_onnx_atomic(model: onnx.ModelProto | ir.Model, out_path: str | os.PathLike) -> None:
    """Write `model` to `out_path` via a temporary directory and rename, with `OUT.data` if it may
    exceed 2 GB (or, for an `ir.Model`, came with external data: `save_ir`).

    A symlink is written through: its target is replaced, the link stays.
    """
    out = Path(out_path)
    target = out.resolve()
    tmp_dir = None
    try:
        tmp_dir = tempfile.mkdtemp(prefix=".normpass-", dir=target.parent)
        tmp_model = Path(tmp_dir) / target.name
        if isinstance(model, ir.Model):
            save_ir(tmp_model, model)
        elif may_exceed_proto_limit(model):
            save_external(model, tmp_model)
        else:
            onnx.save_model(model, str(tmp_model))
        tmp_data = data_path(tmp_model)
        if tmp_data.exists():
            os.chmod(tmp_data, _default_mode())
            os.replace(tmp_data, data_path(target))
        os.chmod(tmp_model, _default_mode())
        os.replace(tmp_model, target)
    except OSError as e:
        raise InputError(f"{out}: could not write the model ({e.strerror or e}); choose a writable output path") from e
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def write_text_atomic(text: str, out_path: str | os.PathLike) -> None:
    out = Path(out_path)
    target = out.resolve()  # a symlink is written through
    try:
        fd, tmp = tempfile.mkstemp(prefix=".normpass-", dir=target.parent)
    except OSError as e:
        raise InputError(f"{out}: could not write ({e.strerror or e}); choose a writable path") from e
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, _default_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
