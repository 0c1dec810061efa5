"""Loading and saving models: clear errors on bad input, atomic writes, nothing lost.

A model is written to a temporary file in the destination directory and renamed into place, so a
failed or interrupted write leaves any existing file untouched. Models over 2 GB are written
with their weights in `OUT.data` beside them, renamed into place the same way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx

from .errors import InputError

PROTO_LIMIT = 2**31 - 1


def _default_mode() -> int:
    """The mode a plainly created file gets (0666 less the umask); mkstemp's 0600 is for secrets."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file; pass the path of an .onnx model")
    if path.is_dir():
        raise InputError(f"{path}: is a directory; pass the path of an .onnx model")
    try:
        model = onnx.load(str(path))
    except Exception as e:  # onnx raises DecodeError, OSError, ValidationError ...
        raise InputError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'parse error'})") from e
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{path}: not an ONNX model (no graph found); pass an .onnx file")
    return model


def check_output_path(model_path: str | os.PathLike | None, out_path: str | os.PathLike) -> Path:
    """Refuse an output that would overwrite the input or cannot be written; returns it resolved."""
    out = Path(out_path)
    if model_path is not None:
        source = Path(model_path)
        if out.resolve() == source.resolve() or out.exists() and source.exists() and os.path.samefile(out, source):
            raise InputError(f"{out}: the output must not overwrite the input model; choose another -o path")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise InputError(f"{out}: directory {parent} does not exist; create it or choose another -o path")
    if not os.access(parent, os.W_OK) or out.is_dir() or out.exists() and not os.access(out, os.W_OK):
        raise InputError(f"{out}: cannot write here; choose a writable -o path")
    return out


def save_onnx_atomic(model: onnx.ModelProto, out_path: str | os.PathLike) -> None:
    """Write `model` to `out_path` via a temporary file and rename (external data over 2 GB)."""
    out = Path(out_path)
    tmp_dir = None
    try:
        tmp_dir = tempfile.mkdtemp(prefix=".normpass-", dir=out.resolve().parent)
        tmp_model = Path(tmp_dir) / out.name
        external = model.ByteSize() >= PROTO_LIMIT
        data_name = out.name + ".data"
        if external:
            onnx.save_model(model, str(tmp_model), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
            os.replace(Path(tmp_dir) / data_name, out.with_name(data_name))
        else:
            onnx.save_model(model, str(tmp_model))
        os.chmod(tmp_model, _default_mode())
        os.replace(tmp_model, out)
    except OSError as e:
        raise InputError(f"{out}: could not write the model ({e.strerror or e}); choose a writable -o path") from e
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def write_text_atomic(text: str, out_path: str | os.PathLike) -> None:
    out = Path(out_path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".normpass-", dir=out.resolve().parent)
    except OSError as e:
        raise InputError(f"{out}: could not write ({e.strerror or e}); choose a writable path") from e
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, _default_mode())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
