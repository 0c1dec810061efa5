"""What an ONNX model is made of on disk, read without reading its weights, and checked.

A model file may keep tensors in other files ("external data": a `location` relative to the
model's directory, an `offset` and a `length` per tensor). `light_model(path)` parses the file
with the data of the main graph's (sparse) initializers left out: protobuf's wire format is
walked over a memory map of the file, so a 2 GB model with its weights inline costs a walk over
its top-level fields, not a parse of its weights, and everything else (names, types, dims,
external-data entries, nodes, subgraphs, functions) is there.

`check_model(proto, path)` refuses, as one-line `InputError`s naming the file and the tensor,
what the readers (onnx-ir, ONNX Runtime, `onnx.load`) would refuse or misread:

* an external-data location outside the model's directory: an absolute path, one with `..`
  that leaves it, or a symbolic link to a file outside it (onnx-ir and ONNX Runtime refuse
  these as path traversal);
* a data file that is missing, not a regular file, or shorter than `offset + length` (a
  truncated copy); with `hard_links_ok=False` (onnx-ir's reader), one with several hard links,
  which onnx-ir refuses;
* two initializers of one graph with the same name (readers keep one of them silently).

`external_files(proto, path)` lists the data files a model reads (resolved against its
directory), for the output-path check; `densified(proto)` turns sparse initializers into dense
ones (onnx-ir has no sparse tensors and would drop them).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from onnx import numpy_helper

from .errors import InputError

# Field numbers of onnx.proto (ModelProto.graph, GraphProto.initializer ...).
MODEL_GRAPH = 7
GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER = 5, 15
SPARSE_VALUES, SPARSE_INDICES = 1, 2
TENSOR_DATA = (
    4,
    5,
    6,
    7,
    9,
    10,
    11,
)  # float_data, int32_data, string_data, int64_data, raw_data, double_data, uint64_data
LENGTH_DELIMITED = 2
TENSOR_RAW_DATA, TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 9, 13, 14
ENTRY_KEY, ENTRY_VALUE = 1, 2  # StringStringEntryProto


# --- reading a model file without its weights ------------------------------------------------------


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, start of its tag, start of its value, end) of each field of the message
    in `buf[start:end]`."""
    pos = start
    while pos < end:
        tag_start = pos
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            value_end = _varint(buf, pos)[1]
        elif wire == 1:
            value_end = pos + 8
        elif wire == LENGTH_DELIMITED:
            length, pos = _varint(buf, pos)
            value_end = pos + length
        elif wire == 5:
            value_end = pos + 4
        else:  # groups: not used by onnx.proto
            raise ValueError(f"wire type {wire} at byte {tag_start}")
        if value_end > end:
            raise ValueError(f"a field at byte {tag_start} runs past the end of its message")
        yield key >> 3, wire, tag_start, pos, value_end
        pos = value_end


def _rewritten(buf, start: int, end: int, rules: dict) -> bytes:
    """The message in `buf[start:end]` with each field named in `rules` dropped (rule None) or
    replaced by the rule applied to its sub-message."""
    parts = []
    for field, wire, tag_start, value_start, value_end in _fields(buf, start, end):
        if field not in rules:
            parts.append(buf[tag_start:value_end])
        elif rules[field] is not None and wire == LENGTH_DELIMITED:
            payload = rules[field](buf, value_start, value_end)
            parts += [_encode_varint(field << 3 | wire), _encode_varint(len(payload)), payload]
    return b"".join(parts)


def _tensor(buf, start: int, end: int) -> bytes:
    return _rewritten(buf, start, end, dict.fromkeys(TENSOR_DATA))


def _sparse(buf, start: int, end: int) -> bytes:
    return _rewritten(buf, start, end, {SPARSE_VALUES: _tensor, SPARSE_INDICES: _tensor})


def _graph(buf, start: int, end: int) -> bytes:
    return _rewritten(buf, start, end, {GRAPH_INITIALIZER: _tensor, GRAPH_SPARSE_INITIALIZER: _sparse})


def mapped_model(path: Path, min_bytes: int) -> onnx.ModelProto | None:
    """The model at `path` whose main-graph initializers with at least `min_bytes` of raw data leave it in the
    file: each becomes an external-data entry naming the model file itself, with the offset and length of its
    bytes there, which onnx-ir memory-maps as it does any external data. A model with its weights inline so
    loads as one with external data does: no weight is parsed or copied. None where the file is not a
    readable protobuf (the loader then says why)."""
    location = path.name.encode()

    def tensor(buf, start: int, end: int) -> bytes:
        raw = [(s, e) for field, wire, _, s, e in _fields(buf, start, end) if field == TENSOR_RAW_DATA]
        if len(raw) != 1 or raw[0][1] - raw[0][0] < min_bytes:
            return bytes(buf[start:end])
        (data_start, data_end) = raw[0]
        length = data_end - data_start
        entries = [(b"location", location), (b"offset", b"%d" % data_start), (b"length", b"%d" % length)]
        return (
            _rewritten(buf, start, end, {TENSOR_RAW_DATA: None})
            + b"".join(
                _length_delimited(
                    TENSOR_EXTERNAL_DATA, _length_delimited(ENTRY_KEY, key) + _length_delimited(ENTRY_VALUE, value)
                )
                for key, value in entries
            )
            + _encode_varint(TENSOR_DATA_LOCATION << 3)
            + _encode_varint(onnx.TensorProto.EXTERNAL)
        )

    def graph(buf, start: int, end: int) -> bytes:
        return _rewritten(buf, start, end, {GRAPH_INITIALIZER: tensor})

    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return onnx.ModelProto.FromString(_rewritten(buf, 0, len(buf), {MODEL_GRAPH: graph}))
    except (OSError, ValueError, IndexError, DecodeError):
        return None


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _encode_varint(field << 3 | LENGTH_DELIMITED) + _encode_varint(len(payload)) + payload


def light_model(path: Path) -> onnx.ModelProto | None:
    """The model at `path` without the data of its main graph's initializers, or None where the file
    is not a readable protobuf (the loader then says why)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return onnx.ModelProto.FromString(_rewritten(buf, 0, len(buf), {MODEL_GRAPH: _graph}))
    except (OSError, ValueError, IndexError, DecodeError):
        return None


# --- the tensors a model holds -----------------------------------------------------------------------


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    for attribute in node.attribute:
        label = f"attribute {attribute.name} of node {node.name or node.op_type}"
        sparse = [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []
        for tensor in [*([attribute.t] if attribute.HasField("t") else []), *attribute.tensors]:
            yield label, tensor
        for tensor in (t for s in [*sparse, *attribute.sparse_tensors] for t in (s.values, s.indices)):
            yield label, tensor
        for body in [*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs]:
            yield from _graph_tensors(body)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    for tensor in graph.initializer:
        yield f"initializer {tensor.name}", tensor
    for sparse in graph.sparse_initializer:
        yield f"sparse initializer {sparse.values.name}", sparse.values
        yield f"sparse initializer {sparse.values.name}", sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def model_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """(what it is, for messages; the tensor) of every tensor stored in `model`: initializers (sparse
    ones' values and indices too) and node attributes, in subgraphs and functions too."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph in it, at any depth."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for body in [*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs]:
                yield from _graphs(body)


# --- checks -------------------------------------------------------------------------------------------


def _external_entry(model_path: Path, label: str, tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of an external tensor."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    location = entries.get("location", "")
    if not location:
        raise InputError(f"{model_path}: {label} is marked as external data but names no file; re-export the model")
    try:
        offset = int(entries.get("offset") or 0)
        length = int(entries["length"]) if entries.get("length") else None
    except ValueError:
        raise InputError(
            f"{model_path}: {label} has an external-data offset or length that is not a number "
            f"({entries.get('offset')!r}, {entries.get('length')!r}); re-export the model"
        ) from None
    return location, offset, length


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _check_location(model_path: Path, label: str, location: str) -> Path:
    """The data file of `location`, refused where it lies outside the model's directory."""
    base = model_path.parent
    data = base / location
    fix = "move the file into the model's directory and give its location relative to it"
    if os.path.isabs(location) or not _within(os.path.normpath(os.path.abspath(data)), os.path.abspath(base)):
        raise InputError(
            f"{model_path}: {label} keeps its data in {location!r}, outside the model's directory "
            f"(ONNX Runtime and onnx-ir refuse such locations); {fix}"
        )
    if not _within(os.path.realpath(data), os.path.realpath(base)):
        raise InputError(
            f"{model_path}: {label} keeps its data in {location!r}, a symbolic link to {os.path.realpath(data)}, "
            f"outside the model's directory (ONNX Runtime and onnx-ir refuse such links); {fix}"
        )
    return data


def _expected_length(tensor: onnx.TensorProto) -> int | None:
    try:
        itemsize = ir.DataType(tensor.data_type).itemsize
    except ValueError:
        return None
    return int(np.ceil(np.prod(tensor.dims, dtype=np.int64) * itemsize))


def check_model(model: onnx.ModelProto, model_path: Path | None, hard_links_ok: bool = True) -> None:
    """Refuse (`InputError`) what the module docstring lists; external data is checked only where the
    model's path is known."""
    for graph in _graphs(model.graph):
        names = [t.name for t in graph.initializer] + [s.values.name for s in graph.sparse_initializer]
        duplicate = next((name for index, name in enumerate(names) if name in names[:index]), None)
        if duplicate is not None:
            raise InputError(
                f"{model_path or 'model'}: two initializers are named {duplicate!r}; a name must be unique "
                "(readers keep one of them silently): rename or remove one"
            )
    if model_path is None:
        return
    sizes: dict[Path, os.stat_result] = {}
    for label, tensor in model_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location, offset, length = _external_entry(model_path, label, tensor)
        data = _check_location(model_path, label, location)
        if data not in sizes:
            try:
                sizes[data] = data.stat()
            except OSError as e:
                raise InputError(
                    f"{model_path}: {label} keeps its data in {location!r}, which cannot be read "
                    f"({e.strerror or e}); a model with external data is its .onnx file and its data files: "
                    "keep them together"
                ) from e
        info = sizes[data]
        if not os.path.isfile(data):
            raise InputError(f"{model_path}: {label} keeps its data in {location!r}, which is not a regular file")
        if info.st_nlink > 1 and not hard_links_ok:
            raise InputError(
                f"{data}: the external data of {model_path} has {info.st_nlink} hard links, and onnx-ir, which "
                "reads it, refuses such files (a guard against hard-link attacks); give the model a copy of it"
            )
        needed = offset + (length if length is not None else _expected_length(tensor) or 0)
        if info.st_size < needed:
            raise InputError(
                f"{data}: {info.st_size} bytes, but {label} of {model_path} reads bytes {offset} to {needed}: "
                "the file is truncated or belongs to another model; restore the model's data file"
            )


def external_files(model: onnx.ModelProto, model_path: Path) -> list[Path]:
    """Every distinct file `model` (loaded from `model_path`) keeps tensors in, resolved against its directory."""
    files: dict[str, None] = {}
    for label, tensor in model_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = _external_entry(model_path, label, tensor)[0]
            files.setdefault(os.path.normpath(model_path.parent / location), None)
    return [Path(f) for f in files]


# --- sparse initializers ------------------------------------------------------------------------------


def _dense(sparse: onnx.SparseTensorProto, base_dir: Path | None, label: str) -> onnx.TensorProto:
    """A sparse tensor as the dense tensor it stands for (missing elements are zeros)."""
    name = sparse.values.name
    for part in (sparse.values, sparse.indices):
        if part.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None:
                raise InputError(
                    f"{label}: sparse initializer {name} keeps its data in an external file; pass the path"
                )
            part_copy = onnx.TensorProto()
            part_copy.CopyFrom(part)
            onnx.external_data_helper.load_external_data_for_tensor(part_copy, str(base_dir))
            part.CopyFrom(part_copy)
    values = numpy_helper.to_array(sparse.values).reshape(-1)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dims = tuple(int(d) for d in sparse.dims)
    dense = np.zeros(dims, values.dtype)
    try:
        flat = indices.reshape(-1) if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
        if flat.shape != values.shape:
            raise ValueError(f"{len(flat)} indices for {len(values)} values")
        dense.reshape(-1)[flat] = values
    except (ValueError, IndexError) as e:
        raise InputError(
            f"{label}: sparse initializer {name} has indices that do not fit its dims {list(dims)} ({e})"
        ) from e
    return numpy_helper.from_array(dense, name)


def densified(model: onnx.ModelProto, base_dir: Path | None, label: str = "model") -> onnx.ModelProto:
    """`model` itself if it has no sparse initializers, else a copy in which each is a dense initializer."""
    if not any(graph.sparse_initializer for graph in _graphs(model.graph)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for graph in _graphs(copy.graph):
        graph.initializer.extend(_dense(sparse, base_dir, label) for sparse in graph.sparse_initializer)
        del graph.sparse_initializer[:]
    return copy
