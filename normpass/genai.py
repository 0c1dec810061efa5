"""ONNX Runtime GenAI folders: a builder's folder in, a rewritten folder out.

A folder as `python -m onnxruntime_genai.models.builder` writes it holds `genai_config.json`, whose
`model.decoder.filename` names the decoder graph (`model.onnx`, its weights in `model.onnx.data`), the
tokenizer (`tokenizer.json`, `tokenizer_config.json`) and whatever else the builder copied. A verb given such
a folder reads its decoder; given `-o OUT_DIR` it writes a folder that ONNX Runtime GenAI loads as it is:

* every file but the decoder and its weights copied unchanged (subfolders too);
* the rewritten decoder under the name the config gives, its weights (where the original had external data,
  or the model may exceed 2 GB) in `<filename>.data` beside it, as the builder names them;
* `genai_config.json` copied byte for byte unless the rewrite changes what it says: slicing cuts the residual
  stream, whose width is `model.decoder.hidden_size` (head sizes and counts stay). ONNX Runtime GenAI sizes
  two tensors with it: the `inputs_embeds` it feeds a decoder whose embedding is a model of its own, and the
  `hidden_states` a decoder gives out (the builder's `include_hidden_states`: the final norm's output); the
  builder's decoders take `input_ids` and give `logits`, so it reads neither. A sliced folder's config gives
  the width at the stream's end, which the final norm and the head read (and where `hidden_states` come
  from): the width kept, or the full width where `--head full` leaves the end whole.

The folder is written as a temporary folder beside `OUT_DIR` and renamed into place, so `OUT_DIR` is either
absent or complete. An existing `OUT_DIR` must be an empty folder: normpass replaces files, never folders,
and never removes a user's files. The calibration text of a folder is tokenized with its own
`tokenizer.json` unless `--tokenizer` names another.

From Python, the passes take the decoder's path and `write_folder` writes their model as a folder::

    folder = open_folder("phi-2")
    result = rotate_onnx(str(folder.model))
    write_folder(folder, result.ir_model, Path("phi-2-rotated"))
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from . import io, modelfiles
from .errors import InputError

CONFIG = "genai_config.json"
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class Folder:
    """A GenAI folder: its path, its config (parsed) and the decoder's file name."""

    path: Path
    config: dict = field(repr=False)
    filename: str

    @property
    def model(self) -> Path:
        return self.path / self.filename

    @property
    def tokenizer(self) -> Path | None:
        found = self.path / TOKENIZER
        return found if found.is_file() else None

    def model_files(self) -> set[Path]:
        """The decoder and its external-data files: what a rewritten folder writes anew."""
        light = modelfiles.light_model(self.model)
        data = modelfiles.external_files(light, self.model) if light is not None else []
        return {self.model.resolve(), *(Path(p).resolve() for p in data)}


def is_folder(path: str | os.PathLike | None) -> bool:
    return path is not None and Path(path).is_dir()


def open_folder(path: str | os.PathLike) -> Folder:
    """The GenAI folder at `path`; `InputError` naming what is missing where it is not one."""
    root = Path(path)
    config_path = root / CONFIG
    if not config_path.is_file():
        raise InputError(
            f"{root}: a folder, but no {CONFIG} in it; give an .onnx file, or a folder ONNX Runtime GenAI's "
            "builder wrote"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{config_path}: not readable JSON ({e}); restore the file the builder wrote") from e
    decoder = config.get("model", {}).get("decoder", {}) if isinstance(config, dict) else {}
    filename = decoder.get("filename") if isinstance(decoder, dict) else None
    if not isinstance(filename, str) or not filename or Path(filename).name != filename:
        raise InputError(f"{config_path}: model.decoder.filename is missing or not a file name in the folder")
    if not (root / filename).is_file():
        raise InputError(f"{root / filename}: the decoder {CONFIG} names is missing; restore it")
    return Folder(root, config, filename)


def check_output(folder: Folder, out: str | os.PathLike) -> Path:
    """`OUT_DIR` for a rewritten `folder`: absent or an empty folder, not inside the input folder, its parent
    writable."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        what = "a folder that is not empty" if target.is_dir() else "a file"
        raise InputError(f"{target}: -o exists and is {what}; give a new folder for the rewritten GenAI folder")
    resolved = target.resolve()
    if resolved == folder.path.resolve() or folder.path.resolve() in resolved.parents:
        raise InputError(f"{target}: -o is inside the input folder {folder.path}; give a folder outside it")
    parent = resolved.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise InputError(f"{target}: cannot create a folder in {parent}; choose a writable place for -o")
    return target


def updated_config(config: dict, widths: dict[int, int] | None) -> dict | None:
    """`config` with the decoder's `hidden_size` d set to `widths[d]` (a stream of width d cut to it at its end),
    or None where nothing changes."""
    decoder = config.get("model", {}).get("decoder", {})
    width = (widths or {}).get(decoder.get("hidden_size"))
    if width is None or width == decoder["hidden_size"]:
        return None
    changed = json.loads(json.dumps(config))
    changed["model"]["decoder"]["hidden_size"] = width
    return changed


def sliced_widths(result) -> dict[int, int]:
    """A slice result's streams as {width: width at the stream's end} (`write_folder`'s `widths`): the width
    kept, or the stream's own where its end (final norm and head) was left whole (`SliceOptions.head` "full");
    {} where nothing was chosen."""
    kept = result.chosen.kept if result.chosen is not None else {}
    whole = set(result.whole)
    return {
        s.width: s.width if whole & set(result.pieces.get(s.name, ())) else kept[s.name]
        for s in result.slicing.sliceable
        if s.width and s.name in kept
    }


def write_folder(folder: Folder, model: ir.Model, out: Path, widths: dict[int, int] | None = None) -> None:
    """Write the GenAI folder `out`: `folder`'s files with `model` as its decoder (see the module docstring);
    `widths` maps a residual stream's width to the width it was cut to at its end (`sliced_widths`)."""
    target = out.resolve()
    tmp = None
    try:
        with io.signals_deferred():
            tmp = Path(tempfile.mkdtemp(prefix=".normpass-", dir=target.parent))
        skipped = folder.model_files()
        for entry in folder.path.iterdir():
            if entry.resolve() in skipped:
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        changed = updated_config(folder.config, widths)
        if changed is not None:
            (tmp / CONFIG).write_text(json.dumps(changed, indent=4) + "\n")
        external = io.keeps_external_data(model) or len(skipped) > 1
        io.save_ir(tmp / folder.filename, model, f"{folder.filename}.data", external=external)
        mode = io._default_mode()  # mkdtemp's 0700 is for secrets: a plain folder's mode, searchable where readable
        os.chmod(tmp, mode | (mode & 0o444) >> 2)
        with io.signals_deferred():
            if target.is_dir():
                target.rmdir()  # empty (checked): the rename needs its name free
            os.replace(tmp, target)
            tmp = None
            io.WRITTEN.append(out)
    except OSError as e:
        raise InputError(f"{out}: could not write the folder ({e.strerror or e}); choose a writable -o") from e
    finally:
        if tmp is not None:
            with io.signals_deferred():
                shutil.rmtree(tmp, ignore_errors=True)
