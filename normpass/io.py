"""Loading and saving models: clear errors on bad input, atomic writes, nothing lost.

**Reading.** A model file is checked before it is read (`modelfiles.check_model`: external data
inside the model's directory, present and long enough; unique initializer names), and its
sparse initializers are made dense (onnx-ir has none). Every such refusal is an `InputError`.
`load_ir` reads no weight: external data is memory-mapped, and so are weights stored inline in the
model file (`modelfiles.mapped_model` makes each an external-data entry pointing into the file itself);
such a model is marked `INLINE_WEIGHTS` and written inline again, one weight at a time (`save_ir`).

**The output check.** `check_paths` runs before any work: each output must be a regular file
or not exist yet (never a FIFO, device or directory), must not name an open file descriptor
(`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`, directly or through symlinks: redirected to a
file, the atomic write would replace that file, not append to it), and no output may be the same file as
another output or as any file an input reads (`model_files`: the model and each of its external
data files; `calibration_files`: an .npz, or the .npy files of a directory) — same path,
symlinks and hard links included.

**Writing.** A model is written into a temporary directory beside its destination and renamed
into place, so a failed or interrupted write leaves any existing file untouched. Protobuf cannot
serialize more than 2 GB, so the size of a model is estimated from its tensors (never by
serializing it); a model that may exceed the limit, or came with external data (an `ir.Model` loaded
from such a file is marked `EXTERNAL_WEIGHTS`, which stays true when a pass changes every weight it
mapped; the CLI also says so for any verb: `came_with_external_data`), keeps its weights in a data file
beside it. That file is named for the run, `OUT.<8 hex
digits>.data`, and `OUT` records the name: it is renamed into place first, then `OUT` in one
atomic rename, so `OUT` names either the previous weights or the new ones, never a mix, however
many runs write `OUT` at once and whenever a reader opens it (a fixed `OUT.data` beside `OUT`
cannot be: two renames leave a moment, and two concurrent runs an order, in which `OUT` and
`OUT.data` come from different runs). Every data file ends with a mark naming it (past the
tensors' bytes, where no reader looks). Once `OUT` is replaced, the data files that earlier runs
wrote for `OUT` — a name `OUT.<8 hex digits>.data` *and* normpass's mark inside — are removed,
unless an input of this run reads them; no other file is ever removed. The renames and that
clean-up hold an exclusive `flock` on the destination directory (so a run never removes the data
file of another run's `OUT` in flight) and run with SIGINT, SIGTERM and SIGHUP deferred, as
does the removal of the temporary directory: a signal interrupts the writing of the temporary
files only, which are then removed. Writing external data copies no weights into a second proto
and leaves the caller's model as it was.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from . import modelfiles
from .errors import InputError, NormpassError

PROTO_LIMIT = 2**31 - 1
PROTO_HEADROOM = 2**28  # room for everything but the tensors' data (graph, names, shapes)
EXTERNAL_MIN_BYTES = 1024  # tensors at least this large go to the data file
LIGHT_INITIALIZER_LIMIT = 1024  # elements; larger initializers are stubs (type and dims, no data) in `skeleton`
STUB_LOCATION = "<normpass: data not included>"
INLINE_WEIGHTS = "normpass.inline_weights"  # ir.Model.meta: its weights are inline in its file, mapped from there
EXTERNAL_WEIGHTS = "normpass.external_weights"  # ir.Model.meta: it came with external data (written so again)
STORAGE = (INLINE_WEIGHTS, EXTERNAL_WEIGHTS)  # how a model's weights were stored, carried to what is made of it
WRITE_IN_FLIGHT_BYTES = 2**26  # weights read but not yet written, at most, while saving
DATA_ALIGNMENT = 4096  # tensors of ≥ 1 MiB start at a page boundary of the data file, so ONNX Runtime can map them
DATA_MARK = b"\n# written by normpass as the external data of "  # + the model's file name, at the end of a data file
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PathArgument = str | os.PathLike[str] | None
MAX_SYMLINKS = 40  # links followed to find where an output path leads, as the kernel does


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
    except InputError:
        raise
    except Exception as e:  # onnx raises DecodeError, OSError, ValidationError ...
        why = str(e).splitlines()[0] if str(e) else "parse error"
        raise InputError(f"{path}: not a readable ONNX model ({type(e).__name__}: {why})") from e


def _checked_file(path: Path, hard_links_ok: bool) -> None:
    """`modelfiles.check_model` on the file at `path`, read without its weights (a file that is no
    readable model is left for the loader to refuse)."""
    light = modelfiles.light_model(path) if path.is_file() else None
    if light is not None:
        modelfiles.check_model(light, path, hard_links_ok)


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """The model at `path` with every weight in memory (external data read in), checked; sparse initializers dense."""
    path = Path(path)
    _checked_file(path, hard_links_ok=True)
    model = _read(path, lambda p: modelfiles.densified(onnx.load(str(p)), p.parent, str(p)))
    return checked_model(model, str(path))


def _ir_load(path: Path) -> ir.Model:
    """`ir.load`, with sparse initializers made dense first, and weights stored inline mapped from the file
    (`modelfiles.mapped_model`: none is parsed or copied; the model is marked `INLINE_WEIGHTS`, so that it
    is written with its weights inline again)."""
    mapped = modelfiles.mapped_model(path, EXTERNAL_MIN_BYTES)
    if mapped is None:  # onnx.load says why
        mapped = onnx.load(str(path), load_external_data=False)
    proto = modelfiles.densified(mapped, path.parent, str(path))
    locations = {
        entry.value
        for tensor in proto.graph.initializer
        for entry in tensor.external_data
        if tensor.data_location == onnx.TensorProto.EXTERNAL and entry.key == "location"
    }
    model = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(model.graph, os.path.dirname(path))
    if locations == {path.name}:
        model.meta[INLINE_WEIGHTS] = True
    elif locations:
        model.meta[EXTERNAL_WEIGHTS] = True
    return model


def load_ir(path: str | os.PathLike) -> ir.Model:
    """The model at `path` as an `ir.Model` whose external tensors stay on disk (memory-mapped when read)."""
    path = Path(path)
    _checked_file(path, hard_links_ok=False)  # onnx-ir refuses data files with several hard links
    model = _read(path, _ir_load)
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
                STUB_LOCATION,
                0,
                tensor.nbytes,
                tensor.dtype,
                shape=ir.Shape(tensor.shape.numpy()),
                name=str(value.name),
            )
        else:
            value.const_value = ir.Tensor(_read_small(str(value.name), tensor), name=value.name)
    try:
        return to_proto(model)
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
    """`model` if it is a ModelProto with a graph and unique initializer names (a copy where sparse
    initializers had to be made dense); a path is loaded with `load_onnx`."""
    if isinstance(model, (str, os.PathLike)):
        return load_onnx(model)
    if not isinstance(model, onnx.ModelProto):
        raise InputError(
            f"{label}: expected an onnx.ModelProto or the path of an .onnx file, got {type(model).__name__}"
        )
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{label}: not an ONNX model (no graph found); pass an .onnx file")
    modelfiles.check_model(model, None)
    return modelfiles.densified(model, None, label)


# --- output paths -----------------------------------------------------------------------------------


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def model_files(label: str, path) -> dict[str, Path]:
    """The files a model at `path` reads, labelled for messages: the model file and each of its
    external-data files (checked with `modelfiles.check_model`). None or a missing file: nothing."""
    if path is None or not Path(path).is_file():
        return {}
    path = Path(path)
    files = {label: path}
    light = modelfiles.light_model(path)
    if light is not None:
        modelfiles.check_model(light, path)
        files |= {f"{label}'s external data file {data.name}": data for data in modelfiles.external_files(light, path)}
    return files


def calibration_files(label: str, path) -> dict[str, Path]:
    """The files calibration data at `path` is read from: an .npz, or the .npy files of a directory."""
    if path is None or not Path(path).exists():
        return {}
    path = Path(path)
    if path.is_dir():
        return {f"{label}'s file {npy.name}": npy for npy in sorted(path.glob("*.npy"))}
    return {label: path}


def _descriptor_link(path: Path) -> Path | None:
    """The link on `path`'s chain of symlinks that names an open file descriptor (`/dev/stdout`, `/dev/fd/1`,
    `/proc/self/fd/1`), or None."""
    current = Path(os.path.abspath(path))
    for _ in range(MAX_SYMLINKS):
        parts = current.parts
        if parts[1:3] in (("dev", "stdout"), ("dev", "stderr"), ("dev", "fd")) or (
            parts[1:2] == ("proc",) and parts[3:4] == ("fd",)
        ):
            return current
        if not current.is_symlink():
            return None
        current = Path(os.path.abspath(current.parent / os.readlink(current)))
    return None


def check_paths(inputs: Mapping[str, PathArgument], outputs: Mapping[str, PathArgument]) -> dict[str, Path]:
    """Refuse outputs that are not regular files, name an open file descriptor, cannot be written, or are an input
    or each other.

    `inputs` and `outputs` map a label for messages (e.g. "the model", "-o") to a path or None
    (absent); inputs that are not existing files (e.g. "synthetic") are ignored: give every file an
    input reads (`model_files`, `calibration_files`). Returns the outputs given, as paths.
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
        descriptor = _descriptor_link(out)
        if descriptor is not None:
            raise InputError(
                f"{out}: {label} names an open file descriptor ({descriptor}), whose file (a shell redirection's) "
                f"an atomic write would replace, not write to; give {label} a file path"
            )
        for other, path in [*sources.items(), *checked.items()]:
            if _same_file(out, path):
                raise InputError(
                    f"{out}: {label} must not overwrite {other} ({path}), the same file; "
                    f"choose another path for {label}"
                )
        parent = out.resolve().parent
        if not parent.is_dir():
            raise InputError(f"{out}: directory {parent} does not exist; create it or choose another path for {label}")
        if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
            raise InputError(f"{out}: cannot write here; choose a writable {label} path")
        checked[label] = out
    return checked


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
    return sum(_data_bytes(t) for _, t in modelfiles.model_tensors(model)) + PROTO_HEADROOM >= PROTO_LIMIT


def save_external(model: onnx.ModelProto, path: Path, data_name: str | None = None) -> None:
    """Write `model` to `path` with every main-graph initializer of ≥ 1 KiB in `data_name` beside it
    (default `path.name + ".data"`).

    The model written is a new proto sharing nothing with `model` but the small tensors; the
    weights go straight from `model`'s tensors to the data file, so `model` is not modified.
    """
    data_name = data_name or f"{path.name}.data"
    skeleton = onnx.ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name != "graph":
            skeleton.MergeFrom(onnx.ModelProto(**{descriptor.name: value}))
    for descriptor, value in model.graph.ListFields():
        if descriptor.name != "initializer":
            skeleton.graph.MergeFrom(onnx.GraphProto(**{descriptor.name: value}))
    with open(path.parent / data_name, "wb") as data:
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


def maps_weights(model: ir.Model) -> bool:
    """Whether some of `model`'s weights are read from a file when used (external data, or inline weights mapped)."""
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def unmapped(model: ir.Model) -> ir.Model:
    """`model` with the weights `load_ir` mapped from inside its own file (`INLINE_WEIGHTS`) read into memory, for
    a writer other than `save_ir` (onnx-ir's `ir.save`, Olive's): those would keep a mapped weight as a reference
    to the input file. Weights that came as external data are left as they are."""
    if model.meta.get(INLINE_WEIGHTS):
        for value in model.graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value = ir.Tensor(value.const_value.numpy(), name=value.name)
        model.meta[INLINE_WEIGHTS] = False
    return model


def keeps_external_data(model: ir.Model) -> bool:
    """Whether `model`'s weights go to a data file when written: it came with external data (`EXTERNAL_WEIGHTS`,
    also when the rewrite changed every weight it mapped; or it maps some, not its weights inline, mapped from
    its file: `INLINE_WEIGHTS`), or may exceed 2 GB."""
    external = model.meta.get(EXTERNAL_WEIGHTS) or (not model.meta.get(INLINE_WEIGHTS) and maps_weights(model))
    return bool(external) or ir_weight_bytes(model) + PROTO_HEADROOM >= PROTO_LIMIT


def stored_like(model: ir.Model, source: ir.Model) -> ir.Model:
    """`model` (made from `source`: a clone, a copy through a proto) marked as `source` is for writing: with
    external data where `source` came with it, inline where `source` had its weights inline (`STORAGE`)."""
    for key in STORAGE:
        if source.meta.get(key):
            model.meta[key] = True
    return model


def save_ir(path: Path, model: ir.Model, data_name: str | None = None, external: bool | None = None) -> None:
    """Write `model` to `path`, with its weights of ≥ 1 KiB in `data_name` beside it (default
    `path.name + ".data"`) where `external` (default: where `keeps_external_data`).

    The weights are written tensor by tensor, unchanged ones straight from their source (a
    memory-mapped file, say, whose pages are dropped once written); `model` is left as it was.
    """
    if not (keeps_external_data(model) if external is None else external):
        _save_inline(path, model)
        return
    # Small tensors stored externally in the source are written inline. onnx-ir would load each and
    # close its memory map, which fails while the analysis still holds a view of it: copy them first.
    inlined = {
        value: value.const_value
        for value in model.graph.initializers.values()
        if isinstance(value.const_value, ir.ExternalTensor) and value.const_value.nbytes < EXTERNAL_MIN_BYTES
    }
    for value, tensor in inlined.items():
        value.const_value = ir.Tensor(_read_small(str(value.name), tensor), name=value.name)
    try:
        with _errors_of_lazy_weights():
            ir.save(
                model,
                path,
                external_data=data_name or f"{path.name}.data",
                size_threshold_bytes=EXTERNAL_MIN_BYTES,
                max_in_flight_bytes=WRITE_IN_FLIGHT_BYTES,
                alignment=DATA_ALIGNMENT,
                callback=_dropping_pages(),
            )
    finally:
        for value, tensor in inlined.items():
            value.const_value = tensor
    release_weights(model)


def _save_inline(path: Path, model: ir.Model) -> None:
    """Write `model` with its weights inside the file, serializing one large weight at a time (never the
    whole model in memory, twice, as `ir.save` would: as a proto and as its bytes). Protobuf parses
    concatenated messages as one message, merged (repeated fields appended): the file is `skeleton(model)`
    without its stubs, then one `ModelProto` per stubbed initializer holding only that initializer."""
    shape = skeleton(model)
    stubbed = [tensor.name for tensor in shape.graph.initializer if _is_stub(tensor)]
    kept = [tensor for tensor in shape.graph.initializer if not _is_stub(tensor)]
    del shape.graph.initializer[:]
    shape.graph.initializer.extend(kept)
    with open(path, "wb") as file, _errors_of_lazy_weights():
        file.write(shape.SerializeToString())
        for name in stubbed:
            tensor = model.graph.initializers[name].const_value
            assert tensor is not None, name  # skeleton stubs initializers with values only
            piece = onnx.ModelProto()
            if isinstance(tensor, ir.ExternalTensor):  # mapped from a file (the input's): its bytes go inline
                piece.graph.initializer.append(ir.serde.serialize_tensor(ir.Tensor(tensor.numpy(), name=name)))
                drop_pages(tensor)
            else:
                piece.graph.initializer.append(ir.serde.serialize_tensor(tensor))
            file.write(piece.SerializeToString())


def _is_stub(tensor: onnx.TensorProto) -> bool:
    """Whether `tensor` is one of `skeleton`'s stubs (no data)."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        entry.key == "location" and entry.value == STUB_LOCATION for entry in tensor.external_data
    )


def in_memory_proto(model: ir.Model) -> onnx.ModelProto:
    """`model` as a ModelProto with every weight inside it (external data read in)."""
    proto = to_proto(model)
    tensors = [v.const_value for v in model.graph.initializers.values()]
    base_dirs = {t.base_dir for t in tensors if isinstance(t, ir.ExternalTensor)}
    for base_dir in base_dirs:
        onnx.external_data_helper.load_external_data_for_model(proto, str(base_dir))
    return proto


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """`ir.to_proto(model)`; a normpass error raised by a weight computed as it is read is raised as itself."""
    with _errors_of_lazy_weights():
        return ir.to_proto(model)


@contextlib.contextmanager
def _errors_of_lazy_weights() -> Iterator[None]:
    """onnx-ir wraps what a tensor raises while it serializes a model in its `SerdeError`: a `NormpassError`
    of a weight computed when written (`onnx.targets.derived_initializer`) is raised as itself."""
    try:
        yield
    except ir.serde.SerdeError as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, NormpassError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


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


# --- atomic writes --------------------------------------------------------------------------------


WRITTEN: list[Path] = []  # every output this process has put in place, in order (for the CLI's last word)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT, SIGTERM and SIGHUP are held back until the block ends, then delivered: what the block
    does is done whole. Python runs signal handlers in the main thread whichever thread the signal
    reached, so the handlers are swapped for ones that only take note (a signal mask would not do:
    another thread would take the signal). Only the main thread can swap them; elsewhere nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    try:
        for signum in DEFERRED_SIGNALS:
            previous[signum] = signal.signal(signum, lambda signum, frame: held.append(signum))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)  # to the handler now in place


@contextlib.contextmanager
def _directory_lock(directory: Path):
    """An exclusive `flock` on `directory` (yields whether it was taken: some file systems have no locks)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _data_name(target: Path) -> str:
    """A name for the data file of a model written to `target`: `target`'s name, 8 random hex digits, `.data`;
    one that no file has yet."""
    while (target.parent / (name := f"{target.name}.{secrets.token_hex(4)}.data")).exists():
        pass
    return name


def _mark(data_name: str) -> bytes:
    return DATA_MARK + data_name.encode() + b"\n"


def _written_by_normpass(path: Path, model_name: str) -> bool:
    """Whether `path` is a data file normpass wrote for a model named `model_name`: its name and its mark say so."""
    if not re.fullmatch(re.escape(model_name) + r"\.[0-9a-f]{8}\.data", path.name):
        return False
    mark = _mark(path.name)
    try:
        info = path.lstat()  # a link, FIFO or device is no file normpass wrote (and a FIFO would block a read)
        if not stat.S_ISREG(info.st_mode) or info.st_size < len(mark):
            return False
        with open(path, "rb") as file:
            file.seek(-len(mark), os.SEEK_END)
            return file.read() == mark
    except OSError:
        return False


def _remove_stale_data(target: Path, current: str | None, keep: Iterable[Path]) -> None:
    """Remove the data files earlier runs wrote for `target` (see the module docstring), except
    `current` and the files in `keep`."""
    keep = list(keep)
    for path in target.parent.iterdir():
        if path.name == current or not _written_by_normpass(path, target.name):
            continue
        if any(_same_file(path, kept) for kept in keep):
            continue
        path.unlink(missing_ok=True)


def _external_paths(model) -> list[Path]:
    """The files an `ir.Model`'s external tensors read."""
    if not isinstance(model, ir.Model):
        return []
    return [
        Path(t.path) for v in model.graph.initializers.values() if isinstance(t := v.const_value, ir.ExternalTensor)
    ]


def came_with_external_data(path: PathArgument) -> bool:
    """Whether the model file at `path` keeps weights in external data files (None or no file: False)."""
    if path is None or not Path(path).is_file():
        return False
    light = modelfiles.light_model(Path(path))
    return light is not None and bool(modelfiles.external_files(light, Path(path)))


def save_onnx_atomic(
    model: onnx.ModelProto | ir.Model, out_path: str | os.PathLike, keep: Iterable[Path] = (), external: bool = False
) -> None:
    """Write `model` to `out_path` atomically, with its weights in a data file of its own where it
    may exceed 2 GB, or it came with external data (`external`, or an `ir.Model` marked so: `save_ir`); see
    the module docstring.

    `keep`: files this run reads (its inputs), never removed as stale data; the files an `ir.Model`
    reads its weights from are kept too, and are refused as `out_path`. A symlink is written
    through: its target is replaced, the link stays.
    """
    out = Path(out_path)
    target = out.resolve()
    keep = [*keep, *_external_paths(model)]
    if any(_same_file(target, kept) for kept in keep):
        raise InputError(f"{out}: the model reads its weights from this file; choose another output path")
    data_name = _data_name(target)
    tmp_dir = None
    try:
        with signals_deferred():  # the directory exists once its name is known, to be removed below
            tmp_dir = tempfile.mkdtemp(prefix=".normpass-", dir=target.parent)
        tmp_model = Path(tmp_dir) / target.name
        if isinstance(model, ir.Model):
            save_ir(tmp_model, model, data_name, external=True if external else None)
        elif external or may_exceed_proto_limit(model):
            save_external(model, tmp_model, data_name)
        else:
            onnx.save_model(model, str(tmp_model))
        tmp_data = tmp_model.parent / data_name
        written_data = tmp_data.exists() and tmp_data.stat().st_size > 0  # else left with the temporary directory
        if written_data:
            with open(tmp_data, "ab") as data:
                data.write(_mark(data_name))
            os.chmod(tmp_data, _default_mode())
        os.chmod(tmp_model, _default_mode())
        with _directory_lock(target.parent) as locked, signals_deferred():
            if written_data:
                os.replace(tmp_data, target.parent / data_name)
            try:
                os.replace(tmp_model, target)
            except OSError:
                if written_data:
                    (target.parent / data_name).unlink(missing_ok=True)
                raise
            WRITTEN.append(out)
            if locked:  # without the lock, a data file another run is putting in place could look stale
                _remove_stale_data(target, data_name if written_data else None, keep)
    except OSError as e:
        raise InputError(f"{out}: could not write the model ({e.strerror or e}); choose a writable output path") from e
    finally:
        if tmp_dir is not None:
            with signals_deferred():
                shutil.rmtree(tmp_dir, ignore_errors=True)


@contextlib.contextmanager
def replacing(out_path: str | os.PathLike):
    """A temporary path beside `out_path` (same suffix) to write to; renamed to `out_path` when the
    block ends without an error, removed otherwise. A symlink is written through."""
    out = Path(out_path)
    target = out.resolve()
    tmp = None
    try:
        with signals_deferred():  # the file exists once its name is known, to be removed below
            try:
                fd, tmp = tempfile.mkstemp(prefix=".normpass-", suffix=target.suffix, dir=target.parent)
            except OSError as e:
                raise InputError(f"{out}: could not write ({e.strerror or e}); choose a writable path") from e
            os.close(fd)
        yield Path(tmp)
        os.chmod(tmp, _default_mode())
        with signals_deferred():
            os.replace(tmp, target)
            WRITTEN.append(out)
    finally:
        if tmp is not None:
            with signals_deferred():
                Path(tmp).unlink(missing_ok=True)


def write_text_atomic(text: str, out_path: str | os.PathLike) -> None:
    with replacing(out_path) as tmp:
        tmp.write_text(text)
