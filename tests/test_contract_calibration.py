"""Calibration data under hostile input, for `replace`, `rotate` and `distill` (issue 37, items 1–7, and the
README's cases said but not decided): a file that cannot be read, data longer than the model's position table,
a split that leaves the test empty, a report redirected over a file, data of another dtype, a repeated
budget term. Each is one line on stderr and exit 2 naming the file, never exit 3 and never a pass on no data;
docs/contract.md, "Calibration files and budgets", states the decisions.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import randn, rng
from test_contract import D, cli, ln_model, refused

from normpass import RotateOptions, calibration, rotate_onnx
from normpass.calibration import InputSpec, load_batches
from normpass.errors import InputError
from normpass.io import to_proto
from normpass.onnx.graph.positions import position_limit

POSITIONS, VOCAB = 64, 128  # the registry's BERT and GPT-2


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(ln_model(), path)
    return path


def good_npz(path: Path, count: int = 16, seed: int = 1) -> Path:
    np.savez(path, x=randn(rng(seed), count, D))
    return path


def ids_npz(path: Path, length: int, count: int = 16, dtype=np.int64) -> Path:
    np.savez(path, input_ids=rng(2).integers(0, VOCAB, (count, length)).astype(dtype))
    return path


# --- 1. files that cannot be read ------------------------------------------------------------------


def _npz_member(path: Path, member: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", member)
    return path


def _header(shape: tuple, descr: str = "<f4") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def truncated(path: Path) -> Path:
    whole = good_npz(path).read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return path


def zeroed(path: Path) -> Path:
    """A compressed .npz with bytes zeroed inside its deflated stream."""
    np.savez_compressed(path, x=randn(rng(3), 64, D))
    data = bytearray(path.read_bytes())
    data[80:200] = bytes(120)
    path.write_bytes(bytes(data))
    return path


def unterminated_header(path: Path) -> Path:
    """An array header that NumPy's parser gives up on with tokenize's TokenError."""
    header = _header((16, D)).replace(b"'shape': (16, 8)", b"'shape': ((16, 8")
    return _npz_member(path, header + bytes(16 * D * 4))


def huge(path: Path) -> Path:
    """A header that claims 10¹²×16 float32 (58 TiB), followed by 64 bytes."""
    return _npz_member(path, _header((10**12, 16)) + bytes(64))


DAMAGED = {"truncated": truncated, "zeroed": zeroed, "TokenError": unterminated_header, "huge": huge}


@pytest.mark.parametrize(
    ("kind", "error"),
    [("truncated", "BadZipFile"), ("zeroed", "error"), ("TokenError", "TokenError"), ("huge", "MemoryError")],
)
def test_the_damaged_files_fail_numpy_itself(tmp_path, kind, error):
    """The cases are the issue's: NumPy's own loader fails on each, its own way (zlib's `error` for zeroed bytes)."""
    with pytest.raises(Exception) as caught, np.load(DAMAGED[kind](tmp_path / "bad.npz")) as data:
        data["x"]
    assert type(caught.value).__name__ == error


@pytest.mark.parametrize("option", ["--calib", "--holdout"])
@pytest.mark.parametrize("kind", DAMAGED)
def test_replace_refuses_a_damaged_npz_naming_it(tmp_path, capsys, model_file, kind, option):
    bad = DAMAGED[kind](tmp_path / "bad.npz")
    calib = bad if option == "--calib" else good_npz(tmp_path / "good.npz")
    holdout = ["--holdout", bad] if option == "--holdout" else []
    line = refused(capsys, "replace", model_file, "--calib", calib, *holdout, "-o", tmp_path / "o.onnx")
    assert str(bad) in line and not (tmp_path / "o.onnx").exists()
    if kind == "huge":
        assert "(1000000000000, 16)" in line and "truncated or damaged" in line


def test_arrays_larger_than_half_the_available_memory_are_refused_before_loading(tmp_path, monkeypatch):
    calib = good_npz(tmp_path / "calib.npz", count=64)  # 2 KiB of float32
    monkeypatch.setattr(calibration, "available_memory", lambda: 3000)
    spec = InputSpec({"x": (np.dtype(np.float32), 2)})
    with pytest.raises(InputError, match=r"calib\.npz: its arrays need 2\.0 KiB of memory, more than half"):
        load_batches(calib, spec)
    monkeypatch.setattr(calibration, "available_memory", lambda: 5000)
    assert calibration.sample_count(load_batches(calib, spec)) == 64


def test_a_single_npy_file_is_the_input_of_a_one_input_model(tmp_path, capsys, model_file):
    np.save(tmp_path / "calib.npy", randn(rng(1), 16, D))
    code, out, err = cli(capsys, "replace", model_file, "--calib", tmp_path / "calib.npy", "-o", tmp_path / "o.onnx")
    assert code == 0 and "1 of 1 norms folded exactly" in out, err
    # and for a model that takes two inputs, refused with what to pass instead
    spec = InputSpec({"a": (np.dtype(np.float32), 2), "b": (np.dtype(np.float32), 2)})
    with pytest.raises(InputError, match=r"calib\.npy: one array, but the model takes a, b: pass an \.npz"):
        load_batches(tmp_path / "calib.npy", spec)


@pytest.fixture()
def torch_factory(tmp_path, monkeypatch) -> str:
    """`distill --torch`'s argument for the registry's BERT (64 positions)."""
    (tmp_path / "calib_factory.py").write_text(
        "from normpass import models\n\n\ndef make():\n    return models.get('bert').build_torch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "calib_factory:make"


def test_distill_refuses_a_damaged_holdout_naming_it(tmp_path, capsys, torch_factory):
    np.savez(tmp_path / "calib.npz", x=rng(0).integers(0, VOCAB, (32, 16)))
    bad = truncated(tmp_path / "holdout.npz")
    args = ["distill", "--torch", torch_factory, "--calib", tmp_path / "calib.npz", "--holdout", bad]
    assert str(bad) in refused(capsys, *args, "-o", tmp_path / "o.onnx", "--steps", "1", "--no-progress")


# --- 2. sequences longer than the model's position table ------------------------------------------


@pytest.mark.parametrize(("name", "form"), [("bert", "dynamo"), ("bert", "torchscript"), ("gpt2", "dynamo")])
def test_the_position_table_is_read_from_the_graph(registry_model, name, form):
    limit = position_limit(ir.from_proto(registry_model(name, form)))
    assert limit is not None and limit.rows == POSITIONS


def test_a_model_without_a_position_table_has_no_limit():
    assert position_limit(ir.from_proto(ln_model())) is None


@pytest.mark.parametrize("verb", ["replace", "rotate-smooth"])
def test_sequences_longer_than_the_position_table_are_refused_with_the_number(registry_export, tmp_path, capsys, verb):
    model, out = registry_export("bert"), tmp_path / "o.onnx"
    calib = ids_npz(tmp_path / "long.npz", 200)
    args = ["replace", model] if verb == "replace" else ["rotate", model, "--smooth"]
    line = refused(capsys, *args, "--calib", calib, "-o", out)
    assert f"{calib}: input input_ids has 200 tokens; the model's position table has 64 rows" in line
    assert not out.exists()


@pytest.mark.parametrize("verb", ["replace", "rotate-smooth"])
def test_a_bound_the_graph_does_not_show_is_refused_before_the_pass(registry_export, tmp_path, capsys, verb):
    """OPT counts its positions from a mask (no table read from the graph): the original model is tried on the
    longest sample first, and ONNX Runtime's refusal is bad data, naming the file."""
    model, out = registry_export("opt"), tmp_path / "o.onnx"
    assert position_limit(ir.from_proto(onnx.load(str(model)))) is None
    calib = ids_npz(tmp_path / "long.npz", 200)
    args = ["replace", model] if verb == "replace" else ["rotate", model, "--smooth"]
    line = refused(capsys, *args, "--calib", calib, "-o", out)
    assert f"{calib}: the model does not run on the batch holding its longest sample (200 along axis 1)" in line
    assert not out.exists()


def test_distill_refuses_sequences_longer_than_the_modules_configuration_says(torch_factory, tmp_path, capsys):
    calib = tmp_path / "long.npz"
    np.savez(calib, x=rng(2).integers(0, VOCAB, (16, 200)))
    args = ["distill", "--torch", torch_factory, "--calib", calib, "-o", tmp_path / "o.onnx", "--no-progress"]
    assert f"{calib}: input x has 200 tokens; the model's position table has 64 rows" in refused(capsys, *args)


@pytest.mark.parametrize("words_per_line", [150, 20])
def test_text_longer_than_the_position_table_is_cut_there_with_a_warning(
    registry_export, tmp_path, capsys, words_per_line
):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    words = [f"w{i}" for i in range(VOCAB - 2)]
    tokenizer = Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1} | {w: i + 2 for i, w in enumerate(words)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    calib = tmp_path / "calib.txt"
    lines = (" ".join(words[(i + j) % len(words)] for j in range(words_per_line)) for i in range(8))
    calib.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "o.onnx"
    args = ["rotate", registry_export("bert"), "-o", out, "--calib", calib, "--tokenizer", tmp_path / "tokenizer.json"]
    code, _, err = cli(capsys, *args, "--smooth")  # --max-length 128 by default
    assert code == 0 and out.exists(), err
    warned = "sentences cut at 64 tokens, the rows of the model's position table (--max-length 128 is more)" in err
    assert warned == (words_per_line > POSITIONS)  # only where a sentence was cut


# --- 3. splits --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "says"), [("inf,1,1", "finite"), ("nan,1,1", "finite"), ("0.5,0.5,0", "judged on no data")]
)
def test_replace_refuses_a_split_that_cannot_be_judged(tmp_path, capsys, model_file, split, says):
    calib = good_npz(tmp_path / "calib.npz")
    line = refused(capsys, "replace", model_file, "--calib", calib, "--split", split, "-o", tmp_path / "o.onnx")
    assert "--split" in line and says in line and not (tmp_path / "o.onnx").exists()


def test_a_test_split_of_zero_is_fine_with_held_out_data(tmp_path, capsys, model_file):
    calib, holdout = good_npz(tmp_path / "calib.npz"), good_npz(tmp_path / "holdout.npz", seed=2)
    args = ["--split", "0.5,0.5,0", "--holdout", holdout, "-o", tmp_path / "o.onnx"]
    code, out, err = cli(capsys, "replace", model_file, "--calib", calib, *args)
    assert code == 0 and "test (16 samples)" in out, err


@pytest.mark.parametrize("verb", ["replace", "distill"])
def test_held_out_data_that_is_the_calibration_file_or_a_copy_is_refused(
    tmp_path, capsys, model_file, torch_factory, verb
):
    """The data that decides must be apart from the data that judges (`calibration.distinct_holdout`)."""
    calib = good_npz(tmp_path / "calib.npz")
    copy = good_npz(tmp_path / "copy.npz")  # the same bytes
    model = ["--torch", torch_factory] if verb == "distill" else [model_file]
    for holdout in (calib, copy):
        line = refused(capsys, verb, *model, "--calib", calib, "--holdout", holdout, "-o", tmp_path / "o.onnx")
        assert f"held-out data '{holdout}' is the calibration data" in line, line
    assert not (tmp_path / "o.onnx").exists()


# --- 4. a report redirected over a file ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/dev/stdout", "/proc/self/fd/1", "/dev/fd/1"])
def test_a_report_to_stdout_redirected_to_a_file_is_refused_and_the_file_kept(tmp_path, model_file, path):
    """`--report /dev/stdout >> log.txt`: a real process, since pytest captures stdout in-process."""
    log, out = tmp_path / "log.txt", tmp_path / "out.onnx"
    log.write_text("earlier lines\n")
    command = [sys.executable, "-m", "normpass", "replace", str(model_file), "--calib", "synthetic"]
    with log.open("a") as stdout:
        done = subprocess.run(
            [*command, "-o", str(out), "--report", path], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert done.returncode == 2 and "names an open file descriptor" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert log.read_text() == "earlier lines\n" and not out.exists()


def test_a_symlink_to_stdout_is_refused_too(tmp_path, capsys, model_file):
    link = tmp_path / "report.json"
    link.symlink_to("/dev/stdout")
    line = refused(capsys, "fold", model_file, "-o", tmp_path / "o.onnx", "--report", link)
    assert "open file descriptor" in line or "not a regular file" in line  # the file under it decides which


# --- 5. messages -------------------------------------------------------------------------------------


def test_an_id_beyond_int64_is_reported_as_itself(registry_export, tmp_path, capsys):
    calib = ids_npz(tmp_path / "ids.npz", 16, dtype=np.uint64)
    with np.load(calib) as data:
        ids = data["input_ids"].copy()
    ids[3, 4] = 2**63 + 5
    np.savez(calib, input_ids=ids)
    line = refused(capsys, "replace", registry_export("bert"), "--calib", calib, "-o", tmp_path / "o.onnx")
    assert "9223372036854775813" in line and "-9223372036854775803" not in line and str(calib) in line


def test_a_shape_error_names_the_calibration_file(tmp_path, capsys, model_file):
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=randn(rng(1), 16, D + 1))
    line = refused(capsys, "replace", model_file, "--calib", calib, "-o", tmp_path / "o.onnx")
    assert f"{calib}: calibration batch 0, input x: dimension 1 is {D + 1}, the model fixes it to {D}" in line


def test_a_model_that_fixes_its_batch_size_is_refused_by_replace(tmp_path, capsys):
    """The splits make parts of any size: a fixed batch of 16 failed in ONNX Runtime (exit 3) on the first part
    that was not 16 samples."""
    model = ln_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 16
    path = tmp_path / "fixed.onnx"
    onnx.save(model, path)
    calib = good_npz(tmp_path / "calib.npz", count=32)
    line = refused(capsys, "replace", path, "--calib", calib, "--batch-size", "16", "-o", tmp_path / "o.onnx")
    assert "input x fixes axis 0, the samples, to 16" in line


def test_the_run_check_takes_the_whole_batch_with_the_longest_sample():
    batches = [{"ids": np.zeros((16, 5))}, {"ids": np.ones((16, 9))}, {"ids": np.zeros((3, 7))}]
    batch, width = calibration.longest_batch(batches)
    assert width == 9 and batch["ids"].shape == (16, 9)
    assert calibration.longest_batch([{"x": np.zeros(4)}]) is None


# --- 6. rotate --calib reads the file even where nothing needs it --------------------------------------


@pytest.mark.parametrize("kind", ["missing", "garbage", "truncated", "empty", "wrong key"])
def test_rotate_checks_a_named_calibration_file_that_nothing_needs(tmp_path, capsys, model_file, kind):
    calib = tmp_path / "calib.npz"
    if kind == "garbage":
        calib.write_bytes(b"not an archive at all")
    elif kind == "truncated":
        truncated(calib)
    elif kind == "empty":
        calib.write_bytes(b"")
    elif kind == "wrong key":
        np.savez(calib, y=randn(rng(1), 4, D))
    out = tmp_path / "o.onnx"
    assert str(calib) in refused(capsys, "rotate", model_file, "-o", out, "--calib", calib)
    assert not out.exists()
    code, printed, err = cli(capsys, "rotate", model_file, "-o", out, "--calib", good_npz(tmp_path / "good.npz"))
    assert code == 0 and "wrote" in printed, err


# --- 7. the online rotation leaves no weight behind ----------------------------------------------------


def test_online_rotation_leaves_no_unused_initializer(registry_model):
    model = registry_model("gpt2")
    offline = to_proto(rotate_onnx(model, RotateOptions()).ir_model)
    online = rotate_onnx(model, RotateOptions(online_block=16))
    assert online.comparison.passed and len(online.online.sites) == 2
    proto = to_proto(online.ir_model)
    read = {name for node in proto.graph.node for name in node.input}
    assert [i.name for i in proto.graph.initializer if i.name not in read] == []
    # the down projections' weights are replaced, not added to: the 16×16 matrix, Reshape shapes, names and
    # metadata come to about 3 KiB more than the offline rotation; each down projection's weight is 64 KiB
    assert proto.ByteSize() - offline.ByteSize() < 16 * 1024


# --- undecided: budgets (--write-best: tests/test_replace.py) ----------------------------------------


def test_a_repeated_budget_term_is_refused(tmp_path, capsys, model_file):
    calib = good_npz(tmp_path / "calib.npz")
    for budget in (["--budget", "cos=0.99,cos=0.9"], ["--budget", "cos=0.99", "--budget", "cos=0.9"]):
        line = refused(capsys, "replace", model_file, "--calib", calib, *budget, "-o", tmp_path / "o.onnx")
        assert "cos is given twice" in line


def test_a_budget_is_printed_with_every_digit_given(tmp_path, capsys, model_file):
    calib = good_npz(tmp_path / "calib.npz")
    args = ["--budget", "cos=0.99999999,rel=0.00001", "-o", tmp_path / "o.onnx", "--report", tmp_path / "r.json"]
    code, out, err = cli(capsys, "replace", model_file, "--calib", calib, *args)
    assert code == 0 and "budget cos=0.99999999,rel=0.00001;" in out, err
    assert json.loads((tmp_path / "r.json").read_text())["budget"]["cos"] == 0.99999999


# --- undecided: other dtypes, long lines ------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected", "refusal"),
    [
        (np.arange(8, dtype=np.float16), np.float32, None),
        (np.arange(8, dtype=np.float64) / 4, np.float32, None),  # float32 holds these exactly
        (np.full(8, 0.1), np.float32, "holds 0.1, which float32 cannot hold exactly"),
        (np.full(8, 1e300), np.float32, "holds 1e+300"),
        (np.ones(8, dtype=bool), np.int64, None),
        (np.arange(8, dtype=np.uint8), np.int64, None),
        (np.full(8, 2**40, dtype=np.uint64), np.int32, "holds 1099511627776, which int32 cannot"),
        (np.arange(8, dtype=np.int64), np.float32, "is int64, the model expects float32"),
        (np.arange(8, dtype=np.float32), np.int64, "is float32, the model expects int64"),
    ],
)
def test_other_dtypes_are_cast_only_where_every_value_survives(values, expected, refusal):
    spec = InputSpec({"x": (np.dtype(expected), 2)})
    data = {"x": np.repeat(values.reshape(8, 1), 3, axis=1)}
    if refusal is None:
        (batch,) = load_batches(data, spec)
        assert batch["x"].dtype == expected and (batch["x"] == data["x"]).all()
    else:
        with pytest.raises(InputError, match=refusal.replace("(", r"\(").replace("+", r"\+")):
            load_batches(data, spec)


class CountingTokenizer:
    """A tokenizers `Tokenizer` that records the longest text it was asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def encode_batch(self, texts):
        self.longest = max([self.longest, *map(len, texts)])
        return self.tokenizer.encode_batch(texts)


def test_long_lines_are_tokenized_from_their_head_only_with_the_same_tokens():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {"[UNK]": 0, "a": 1, "bb": 2}
    tokenizer = Tokenizer(WordLevel(vocab, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.enable_truncation(8)
    gen = rng(4)
    texts = [
        " ".join(gen.choice(["a", "bb", "c" * int(gen.integers(1, 400))]) for _ in range(int(gen.integers(1, 80))))
        for _ in range(200)
    ] + ["x" * 3000]  # no whitespace: the head doubles until it is the whole text
    heads = calibration._encode_heads(tokenizer, texts, 8)
    assert [h.ids for h in heads] == [e.ids for e in tokenizer.encode_batch(texts)]
    counting = CountingTokenizer(tokenizer)
    (head,) = calibration._encode_heads(counting, ["a bb " * 1_000_000], 8)  # a 5 MB line
    assert head.ids == [1, 2] * 4 and counting.longest <= calibration.CHARS_PER_TOKEN * 8
