"""Calibration data for the surrogate pass, whatever the front end: files, text, checks and splits.

* **Sources** (`load_batches`): an `.npz` of input arrays (axis 0 = samples), a directory of
  `.npy` files named after the inputs, one `.npy` file (the model's first input, refused where it
  requires several), a `.txt` (one sentence per line; blank lines and lines
  starting with `#` skipped) or `.jsonl` (one JSON object per line with a `"text"` field) file
  together with a tokenizer (`tokenizers`' `tokenizer.json`), a dict of arrays, or an iterable
  (or a callable returning one) of input dicts, each one batch.
* **Text**: each sentence is tokenized on its own (truncated at `max_length` tokens) into the
  inputs the model has among `input_ids`, `attention_mask` and `token_type_ids`; sentences become
  batches only after the split, padded with zeros to the longest sentence of their batch.
* **Reading** an array file never trusts its header: every header is read first, and the bytes it
  claims must follow it in the file and fit in half the memory available, before any array is
  allocated; any failure of the zip or `.npy` format is one `InputError` naming the file.
* **Checks** (`InputSpec`): names, ranks and dtypes against the model's inputs (a dtype is cast
  only where every value comes back unchanged: float16 → float32, bool or uint8 → int64, float64
  that holds float32 values; else refused, `_cast`), the same number of samples in every input of
  a batch, finite float values, token ids inside the embedding table they index (`check_indices`),
  sequences no longer than the model's position table (text is cut there instead, with a
  warning), and at least `MIN_SAMPLES` samples. Each failure is an `InputError` naming the file
  and what to do.
* **Splits** (`split_batches`): a seeded shuffle of samples, then consecutive shares. Batches of
  equal shapes are split by sample and rebatched; single sentences of different lengths by
  sentence, then collated; other batches of different shapes (e.g. each padded to its own
  length) by batch.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from .errors import InputError, missing_extra

Batch = dict  # input name -> np.ndarray, axis 0 = samples
TOKENIZER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TEXT_SUFFIXES = (".txt", ".jsonl")
CHARS_PER_TOKEN = 16  # a text's head read for each token kept, at first (`_encode_heads` doubles it as needed)
LAST_SPACE = re.compile(r"\s\S*\Z")
MIN_SAMPLES = 8  # fit, selection, check and test need two samples each
MEMORY_SHARE = 0.5  # of the memory available, the most calibration arrays may claim (the pass copies them)


@dataclass(frozen=True)
class InputSpec:
    """What a model takes: per input its dtype and rank (None where the front end cannot tell),
    the inputs that may be left out (those with a default), for integer inputs used as indices
    into a table, the table's size, and the most positions along axis 1 of its integer inputs
    (the rows of its position table; None where the front end cannot tell)."""

    inputs: dict[str, tuple[np.dtype | None, int | None]]
    index_bounds: dict[str, int] = field(default_factory=dict)
    optional: frozenset = frozenset()
    positions: int | None = None

    @property
    def names(self) -> list[str]:
        return list(self.inputs)


# --- loading -------------------------------------------------------------------------------------


def load_batches(
    source,
    spec: InputSpec,
    batch_size: int = 16,
    tokenizer: str | os.PathLike | None = None,
    max_length: int = 128,
    minimum: int = MIN_SAMPLES,
) -> list[Batch]:
    """Checked calibration batches from `source` (see the module docstring), at least `minimum` samples (a pass
    that only collects statistics, such as `rotate --calib`, needs one)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise InputError(
                f"{path}: no such calibration data; pass an .npz file, a directory of .npy files, "
                "or a .txt/.jsonl file with a tokenizer"
            )
        if path.suffix.lower() in TEXT_SUFFIXES and path.is_file():
            positions = spec.positions if spec.positions is not None and spec.positions < max_length else None
            batches = tokenize(read_texts(path), tokenizer, spec, positions or max_length, str(path))
            cut = positions is not None and any(b["input_ids"].shape[1] == positions for b in batches)
            if cut:
                warnings.warn(
                    f"{path}: sentences cut at {positions} tokens, the rows of the model's position table "
                    f"(--max-length {max_length} is more)",
                    stacklevel=2,
                )
            check_indices(batches, spec.index_bounds, str(path), tokenizer)
            return _enough(batches, str(path), "sentences", minimum)
        if tokenizer is not None:
            raise InputError(f"{path}: a tokenizer is only for .txt or .jsonl text files; this is not one")
        batches = _rebatch(_checked(_read_arrays(path, spec), spec, str(path)), batch_size)
        where = str(path)
    elif isinstance(source, dict):
        batches, where = _rebatch(_checked(source, spec, "calibration data"), batch_size), "calibration data"
    else:
        produced = source() if callable(source) else source
        if not isinstance(produced, Iterable):
            raise InputError("calibration data: expected a file, a dict of arrays or an iterable of input dicts")
        batches, where = (
            [_checked(b, spec, f"calibration batch {i}") for i, b in enumerate(produced)],
            "calibration data",
        )
        if not batches:
            raise InputError("calibration data: the source yielded no batches")
    check_indices(batches, spec.index_bounds, where)
    return _enough(batches, where, "samples", minimum)


def _read_arrays(path: Path, spec: InputSpec) -> dict[str, np.ndarray]:
    """The arrays of an .npz, a directory of NAME.npy, or one .npy (the model's first input, its only required one)."""
    if path.is_dir():
        files = {p.stem: p for p in sorted(path.glob("*.npy"))}
        if not files:
            raise InputError(f"{path}: no .npy files; name one file per model input ({', '.join(spec.names)})")
        return _read_all(path, {name: _npy_file(p) for name, p in files.items()})
    if path.suffix.lower() == ".npy":
        required = [name for name in spec.names if name not in spec.optional]
        if len(required) > 1 or not spec.names:
            raise InputError(
                f"{path}: one array, but the model takes {', '.join(required) or 'no input'}: pass an .npz with "
                "one array per input (np.savez(path, name=array, ...)) or a directory of NAME.npy files"
            )
        name = required[0] if required else spec.names[0]
        return _read_all(path, {name: _npy_file(path)})
    try:
        archive = zipfile.ZipFile(path)
    except Exception as e:  # zipfile raises BadZipFile, OSError, ValueError ...
        raise _unreadable(path, e) from e
    with archive:
        members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
        return _read_all(path, {name: _npz_member(archive, info) for name, info in members.items()})


@dataclass(frozen=True)
class _StoredArray:
    """One .npy array in a file or an .npz member: how to open a binary stream of it, and the bytes it holds."""

    open: Callable[[], IO[bytes]]
    size: int


def _npy_file(path: Path) -> _StoredArray:
    return _StoredArray(lambda: open(path, "rb"), path.stat().st_size)


def _npz_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> _StoredArray:
    return _StoredArray(lambda: archive.open(info), info.file_size)


def _read_all(path: Path, stored: dict[str, _StoredArray]) -> dict[str, np.ndarray]:
    """Each array, once every header has been read and the sizes they claim checked against the bytes
    the file holds and the memory available (`_claimed_bytes`): a damaged header never allocates."""
    try:
        claimed = {}
        for name, array in stored.items():
            with array.open() as stream:
                claimed[name] = _claimed_bytes(stream, array.size, f"{path}: array {name}")
        total, available = sum(claimed.values()), available_memory()
        if available is not None and total > available * MEMORY_SHARE:
            raise InputError(
                f"{path}: its arrays need {_bytes(total)} of memory, more than half the {_bytes(available)} "
                "available (the pass copies them); give fewer samples"
            )
        arrays = {}
        for name, array in stored.items():
            with array.open() as stream:
                arrays[name] = np.lib.format.read_array(stream, allow_pickle=False)
        return arrays
    except InputError:
        raise
    except Exception as e:  # zipfile, zlib, NumPy's header parser: BadZipFile, error, TokenError, ValueError ...
        raise _unreadable(path, e) from e


def _claimed_bytes(stream, size: int, where: str) -> int:
    """The bytes the .npy array at the start of `stream` (`size` bytes in all) claims in its header; a claim
    larger than what follows the header is a damaged or truncated file."""
    version = np.lib.format.read_magic(stream)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(stream)
    claimed = math.prod(shape) * dtype.itemsize
    present = size - stream.tell()
    if claimed > present:
        raise InputError(
            f"{where}: its header claims {dtype} of shape {shape} ({_bytes(claimed)}) but {_bytes(present)} "
            "follow: the file is truncated or damaged; write it again"
        )
    return claimed


def _unreadable(path: Path, error: Exception) -> InputError:
    first = str(error).splitlines()[0] if str(error) else ""
    kind = ".npy" if path.suffix.lower() == ".npy" or path.is_dir() else ".npz"
    return InputError(
        f"{path}: not a readable {kind} file ({type(error).__name__}: {first}); write it again with NumPy "
        "(np.savez, np.save), or pass .txt or .jsonl text with --tokenizer"
    )


def available_memory() -> int | None:
    """The bytes of memory available now (Linux's MemAvailable; elsewhere the free pages), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _bytes(count: int) -> str:
    """`count` bytes in the largest binary unit that leaves at least 1 (1.5 GiB, 116.4 TiB)."""
    exponent = min(int(math.log(count, 1024)), 4) if count > 0 else 0
    return f"{count} B" if exponent == 0 else f"{count / 1024**exponent:.1f} {' KMGT'[exponent]}iB"


def source_label(source) -> str:
    """How messages name calibration data: its path, or "calibration data" for arrays given in Python."""
    return str(source) if isinstance(source, (str, os.PathLike)) else "calibration data"


def longest_batch(batches: list[Batch]) -> tuple[Batch, int] | None:
    """The batch holding the sample longest along axis 1 (a sequence), and that length; None where no input has
    an axis 1. The whole batch, as the model may fix the batch size."""
    found = [
        (max(v.shape[1] for v in batch.values() if v.ndim >= 2), batch)
        for batch in batches
        if any(v.ndim >= 2 for v in batch.values())
    ]
    if not found:
        return None
    width, batch = max(found, key=lambda item: item[0])
    return batch, width


def sample_count(batches: list[Batch]) -> int:
    """The number of samples (axis 0) in `batches`."""
    return int(sum(next(iter(b.values())).shape[0] for b in batches if b))


def _enough(batches: list[Batch], where: str, unit: str, minimum: int) -> list[Batch]:
    count = sample_count(batches)
    if count < minimum:
        why = " (fitting, selection, its check and the final test take a share each)" if minimum == MIN_SAMPLES else ""
        raise InputError(f"{where}: {count} {unit}; the pass needs at least {minimum}{why}: give more")
    return batches


def _checked(batch, spec: InputSpec, where: str) -> Batch:
    if not isinstance(batch, dict):
        raise InputError(f"{where}: expected a dict of input arrays, got {type(batch).__name__}")
    missing = sorted(set(spec.inputs) - spec.optional - set(batch))
    unknown = sorted(set(batch) - set(spec.inputs))
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"not model inputs: {', '.join(unknown)}"] if unknown else []
        )
        raise InputError(f"{where}: {'; '.join(parts)} (the model's inputs are {', '.join(spec.inputs)})")
    out = {}
    sizes = set()
    for name, (dtype, rank) in spec.inputs.items():
        if name not in batch:
            continue
        value = np.asarray(batch[name])
        if rank is not None and value.ndim != rank:
            raise InputError(f"{where}: input {name} has rank {value.ndim}, the model expects {rank}")
        if dtype is not None and value.dtype != dtype:
            value = _cast(value, dtype, f"{where}: input {name}")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int((~np.isfinite(value)).sum())
            raise InputError(
                f"{where}: input {name} has {bad} non-finite values (NaN or ±inf); remove those samples or fix the data"
            )
        positions = spec.positions
        if positions is not None and value.dtype.kind in "iu" and value.ndim >= 2 and value.shape[1] > positions:
            raise InputError(
                f"{where}: input {name} has {value.shape[1]} tokens; the model's position table has {positions} "
                f"rows: cut the sequences to at most {positions} tokens (text: --max-length {positions})"
            )
        out[name] = np.ascontiguousarray(value)
        sizes.add(value.shape[0] if value.ndim else 1)
    if len(sizes) > 1:
        raise InputError(f"{where}: inputs disagree on the number of samples (axis 0): {sorted(sizes)}")
    return out


def _cast(value: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """`value` as `dtype` where the cast is exact (every value comes back unchanged: float16 to float32, bool or
    uint8 to int64, float64 that holds float32 values); refused where it would change a value or is between
    floats and integers."""
    if value.dtype.kind != dtype.kind and not (value.dtype.kind in "iub" and dtype.kind in "iub"):
        raise InputError(f"{where} is {value.dtype}, the model expects {dtype}")
    if dtype.kind == "f":
        with np.errstate(all="ignore"):
            cast = value.astype(dtype)
            changed = (cast.astype(value.dtype) != value) & np.isfinite(value)  # NaN and ±inf are refused by name
        bad = value[changed][0].item() if changed.any() else None
    else:
        cast = value.astype(dtype)
        low, high = (int(value.min()), int(value.max())) if value.size else (0, 0)
        lowest, highest = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        bad = high if high > highest else low if low < lowest else None
    if bad is not None:
        raise InputError(
            f"{where} is {value.dtype} and holds {bad!r}, which {dtype} cannot hold exactly; the model expects "
            f"{dtype}: convert the data with the rounding you want (array.astype(np.{dtype}))"
        )
    return cast


def _rebatch(arrays: dict[str, np.ndarray], batch_size: int) -> list[Batch]:
    count = next(iter(arrays.values())).shape[0]
    return [{k: v[i : i + batch_size] for k, v in arrays.items()} for i in range(0, count, batch_size)]


# --- text ----------------------------------------------------------------------------------------


def read_texts(path: str | os.PathLike) -> list[str]:
    """Sentences of a `.txt` (one per line) or `.jsonl` (`"text"` fields) file."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read it as UTF-8 text ({e})") from e
    texts = []
    if path.suffix.lower() == ".jsonl":
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{number}: not a JSON object ({e.msg}); write one object per line") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise InputError(f'{path}:{number}: no "text" field holding a string; write {{"text": "..."}} per line')
            if text.strip():
                texts.append(text.strip())
    else:
        texts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not texts:
        raise InputError(f'{path}: no sentences in it; write one sentence per line (.txt) or a "text" field (.jsonl)')
    return texts


def tokenize(
    texts: list[str], tokenizer: str | os.PathLike | None, spec: InputSpec, max_length: int = 128, where: str = "text"
) -> list[Batch]:
    """One batch of one sentence per text, with the inputs the model takes (see the module docstring)."""
    if tokenizer is None:
        raise InputError(
            f"{where}: text needs a tokenizer: pass the model's tokenizer.json (--tokenizer, ReplaceOptions.tokenizer)"
        )
    path = Path(tokenizer)
    if not path.is_file():
        raise InputError(f"{path}: no such tokenizer file; pass the model's tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise missing_extra(f"{where}: reading text", "the tokenizers library", "text") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type for malformed files
        raise InputError(f"{path}: not a tokenizers tokenizer.json ({str(e).splitlines()[0] if str(e) else e})") from e
    others = [name for name in spec.names if name not in TOKENIZER_INPUTS and name not in spec.optional]
    if "input_ids" not in spec.inputs or others:
        what = "has no input named input_ids" if "input_ids" not in spec.inputs else f"also needs {', '.join(others)}"
        raise InputError(
            f"{path}: the model {what} (its inputs: {', '.join(spec.names)}), so a tokenizer cannot feed it; "
            "give the inputs as an .npz instead"
        )
    tok.no_padding()
    tok.enable_truncation(max_length)
    batches = []
    for encoding in _encode_heads(tok, texts, max_length):
        made = {
            "input_ids": encoding.ids,
            "attention_mask": encoding.attention_mask,
            "token_type_ids": encoding.type_ids,
        }
        arrays = {name: np.asarray([made[name]], dtype=np.int64) for name in spec.names if name in made}
        batches.append(arrays)
    return [_checked(b, spec, where) for b in batches]


def _encode_heads(tok, texts: list[str], max_length: int) -> list:
    """Each text's encoding (truncated at `max_length` tokens), read from its head only: a text longer than
    `CHARS_PER_TOKEN`·`max_length` characters is cut at its last whitespace before that length (`_head`), and the
    length doubled until the head's own encoding is truncated, or the head is the whole text. Tokenizers split
    at whitespace before they tokenize, so a truncated head holds the text's first `max_length` tokens; and a
    50 MB line costs milliseconds, not the minutes its whole encoding takes."""
    encodings: list = [None] * len(texts)
    pending, limit = list(range(len(texts))), CHARS_PER_TOKEN * max_length
    while pending:
        heads = [_head(texts[i], limit) for i in pending]
        again = []
        for i, head, encoding in zip(pending, heads, tok.encode_batch(heads), strict=True):
            if len(head) < len(texts[i]) and not encoding.overflowing:
                again.append(i)
            else:
                encodings[i] = encoding
        pending, limit = again, 2 * limit
    return encodings


def _head(text: str, limit: int) -> str:
    """`text` up to its last whitespace before `limit` characters (all of it if shorter; the first `limit`
    characters if no whitespace is there)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    last = LAST_SPACE.search(head)
    return head[: last.start()] if last and last.start() > 0 else head


def check_indices(batches: list[Batch], bounds: dict[str, int], where: str, tokenizer=None) -> None:
    """Refuse integer inputs that index outside the table they index (`bounds`: input → rows)."""
    for name, bound in bounds.items():
        values = [b[name] for b in batches if name in b and b[name].size and b[name].dtype.kind in "iu"]
        if not values:
            continue
        low, high = min(int(v.min()) for v in values), max(int(v.max()) for v in values)
        if low >= 0 and high < bound:
            continue
        bad = high if high >= bound else low
        if tokenizer is not None:
            raise InputError(
                f"{tokenizer}: token id {bad} is outside the model's embedding table ({bound} rows): this tokenizer "
                "does not fit the model; use the model's own tokenizer.json"
            )
        raise InputError(
            f"{where}: input {name} holds index {bad}, outside the table of {bound} rows it indexes; "
            "the data was made for another model"
        )


# --- splits --------------------------------------------------------------------------------------


def _uniform(batches: list[Batch]) -> bool:
    first = {k: v.shape[1:] for k, v in batches[0].items()}
    return all({k: v.shape[1:] for k, v in b.items()} == first for b in batches)


def _ragged_samples(batches: list[Batch]) -> bool:
    """Single samples whose arrays differ only along axis 1 (sentences of different lengths)."""
    return all(sample_count([b]) == 1 for b in batches) and all(
        v.ndim == 2 and v.dtype.kind in "iub" for b in batches for v in b.values()
    )


def collate(samples: list[Batch], batch_size: int) -> list[Batch]:
    """Single samples, sorted by length, in batches padded with zeros to their longest sample."""
    order = sorted(range(len(samples)), key=lambda i: next(iter(samples[i].values())).shape[1])
    batches = []
    for start in range(0, len(order), batch_size):
        group = [samples[i] for i in order[start : start + batch_size]]
        width = max(next(iter(s.values())).shape[1] for s in group)
        batch = {}
        for name, first in group[0].items():
            out = np.zeros((len(group), width), dtype=first.dtype)
            for row, sample in enumerate(group):
                out[row, : sample[name].shape[1]] = sample[name][0]
            batch[name] = out
        batches.append(batch)
    return batches


def split_batches(
    batches: list[Batch], fractions: tuple[float, ...], seed: int = 0, batch_size: int | None = None
) -> tuple[list[Batch], ...]:
    """One list of batches per fraction, after a seeded shuffle (see the module docstring).

    Every part with a positive fraction gets at least one unit (sample, sentence or batch).
    """
    if not fractions or not all(math.isfinite(f) and f >= 0 for f in fractions) or not sum(fractions) > 0:
        raise InputError(f"split {tuple(fractions)}: give finite non-negative fractions, at least one positive")
    total = sum(fractions)
    rng = np.random.default_rng(seed)
    size = batch_size or max(sample_count([b]) for b in batches)
    if _uniform(batches):
        arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        units, unit = sample_count(batches), "samples"

        def make(idx):
            return _rebatch({k: v[np.sort(idx)] for k, v in arrays.items()}, size) if len(idx) else []

    elif _ragged_samples(batches):
        units, unit = len(batches), "sentences"

        def make(idx):
            return collate([batches[i] for i in sorted(idx)], size)

    else:
        units, unit = len(batches), "batches"

        def make(idx):
            return [batches[i] for i in sorted(idx)]

    order = rng.permutation(units)
    needed = [f > 0 for f in fractions]
    if units < sum(needed):
        raise InputError(
            f"calibration data: {units} {unit} cannot be split into {sum(needed)} non-empty parts; give more data"
        )
    counts = [math.floor(units * f / total) for f in fractions]
    for i, need in enumerate(needed):  # every requested part gets at least one unit
        if need and counts[i] == 0:
            counts[i] = 1
    while sum(counts) > units:
        counts[int(np.argmax(counts))] -= 1
    counts[0] += units - sum(counts)
    bounds = np.cumsum([0] + counts)
    return tuple(make(order[bounds[i] : bounds[i + 1]]) for i in range(len(fractions)))


def find_mask_input(spec: InputSpec, name: str | None = None, batches: list[Batch] | None = None) -> str | None:
    """The attention-mask input: `name` if given, else the rank-2 input whose name contains 'mask'.

    A mask marks each token kept (non-zero) or padding (0), so its values in `batches` must be 0 or 1:
    a `name` whose data holds other values (token ids, an additive mask of 0 and −∞) is refused, and a
    found input whose data does so is not taken as a mask. An input indexing a table (`index_bounds`:
    token ids) is never a mask."""
    if name is not None:
        if name not in spec.inputs:
            raise InputError(f"mask input {name!r} is not a model input ({', '.join(spec.inputs)})")
        seen = _non_binary(batches or [], name)
        if name in spec.index_bounds or seen is not None:
            what = "indexes a table (token ids)" if name in spec.index_bounds else f"holds {seen!r}"
            raise InputError(
                f"mask input {name!r} {what}: a mask is 1 for each token kept and 0 for padding; name the "
                "attention-mask input, or none"
            )
        return name
    found = [
        n
        for n, (_, rank) in spec.inputs.items()
        if "mask" in n.lower() and rank in (2, None) and n not in spec.index_bounds
    ]
    return found[0] if len(found) == 1 and _non_binary(batches or [], found[0]) is None else None


def _non_binary(batches: list[Batch], name: str) -> float | int | None:
    """A value of input `name` in `batches` other than 0 and 1, or None."""
    for batch in batches:
        values = np.asarray(batch[name]) if name in batch else np.zeros(0)
        odd = values[(values != 0) & (values != 1)]
        if odd.size:
            return odd.ravel()[0].item()
    return None


def distinct_holdout(calibration, holdout) -> None:
    """Refuse held-out data that is the calibration data's own file (the same path, a link to it, or a copy
    of the same bytes): the data that decides must be apart from the data that judges."""
    if not isinstance(calibration, (str, os.PathLike)) or not isinstance(holdout, (str, os.PathLike)):
        return
    fit, held = Path(calibration), Path(holdout)
    if not (fit.exists() and held.exists()):
        return
    if fit.samefile(held) or (fit.is_file() and held.is_file() and _same_bytes(fit, held)):
        raise InputError(
            f"held-out data {str(held)!r} is the calibration data {str(fit)!r}: judging a model on the data that "
            "fitted it claims what it does not know; give held-out data apart from it, or leave --holdout out "
            "to split the calibration data"
        )


def _same_bytes(a: Path, b: Path, chunk: int = 1 << 20) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True
