"""Reading a CTranslate2 ``model.bin``: the variables of a converted model, without CTranslate2.

The format (binary version 6, written by ``ctranslate2.specs.ModelSpec._serialize``), little-endian::

    uint32 version; string spec name; uint32 spec revision; uint32 variable count
    per variable: string name; uint8 rank; uint32 dims[rank]; uint8 dtype; uint32 byte count; bytes
    uint32 alias count; per alias: string alias; string variable name

where a string is a uint16 length (the NUL included), the UTF-8 bytes and a NUL, and dtype indexes
(float32, int8, int16, int32, float16, bfloat16) (CTranslate2's ``DataType``). A scalar (rank 0) holds a
configuration value (a flag, a head count, an activation's enum). Only the unquantized types are read: an
``int8`` weight matrix would need its ``weight_scale`` and is refused by the caller that maps names.
"""

from __future__ import annotations

import pathlib
import struct
from dataclasses import dataclass

import numpy as np

VERSIONS = (6,)  # the version read and checked here (CTranslate2 4.x writes 6)
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # bfloat16 (index 5) is not read


@dataclass(frozen=True)
class CT2Model:
    """A ``model.bin``: its spec's name and revision, its variables by name, its aliases (name → variable)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.variables[self.aliases.get(name, name)]

    def scalar(self, name: str) -> int:
        """A configuration value (a rank-0 variable) as an int."""
        return int(self.variables[name])


class _Reader:
    def __init__(self, data: bytes, path: pathlib.Path):
        self.data, self.offset, self.path = data, 0, path

    def unpack(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        except struct.error as e:
            raise ValueError(f"{self.path}: truncated at byte {self.offset}") from e
        self.offset += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.unpack("H")
        raw = self.data[self.offset : self.offset + length]
        if length == 0 or len(raw) != length or raw[-1] != 0:
            raise ValueError(f"{self.path}: a malformed string at byte {self.offset}")
        self.offset += length
        return raw[:-1].decode("utf-8")

    def array(self, name: str) -> np.ndarray:
        shape = tuple(self.unpack("I") for _ in range(self.unpack("B")))
        code = self.unpack("B")
        dtype = DTYPES[code] if code < len(DTYPES) else None
        if dtype is None:
            raise ValueError(f"{self.path}: {name} has data type {code}, which this reader does not read")
        count = self.unpack("I")
        if count != int(np.prod(shape)) * np.dtype(dtype).itemsize or self.offset + count > len(self.data):
            raise ValueError(f"{self.path}: {name}: {count} bytes do not hold {shape} of {np.dtype(dtype)}")
        value = np.frombuffer(self.data, dtype, int(np.prod(shape)), self.offset).reshape(shape)
        self.offset += count
        return value


def read(path: str | pathlib.Path) -> CT2Model:
    """The variables of the ``model.bin`` at `path` (arrays over the file's bytes, read-only, in their stored
    dtype). Raises ``ValueError`` naming the file on an unknown version, a malformed record or trailing bytes."""
    path = pathlib.Path(path)
    reader = _Reader(path.read_bytes(), path)
    version = reader.unpack("I")
    if version not in VERSIONS:
        raise ValueError(f"{path}: CTranslate2 binary version {version}; this reader reads {VERSIONS}")
    spec, revision = reader.string(), reader.unpack("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        variables[name] = reader.array(name)
    aliases = {}
    for _ in range(reader.unpack("I")):
        alias = reader.string()
        aliases[alias] = reader.string()
    if reader.offset != len(reader.data):
        raise ValueError(f"{path}: {len(reader.data) - reader.offset} bytes after the last record")
    missing = sorted(set(aliases.values()) - set(variables))
    if missing:
        raise ValueError(f"{path}: aliases name variables the file lacks: {missing}")
    return CT2Model(spec, revision, variables, aliases)
