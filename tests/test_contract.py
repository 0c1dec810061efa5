"""The error contract under hostile inputs, through `normpass.cli.main.main(argv)` and the Python API.

Exit 0 success, 1 verification failed, 2 bad input with exactly one line on stderr; no traceback;
the input model is never modified; outputs are written atomically and only to regular files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import build, randn, rng
from onnx import TensorProto, helper, numpy_helper

from normpass import FoldOptions, ReplaceOptions, fold_onnx, inspect_onnx, io, replace_onnx
from normpass.cli.main import main
from normpass.errors import InputError, NormpassError, WeightOverflowError
from normpass.onnx.fold import targets
from normpass.onnx.graph import frontend as onnx_frontend

D = 8


def ln_model(seed: int = 0) -> onnx.ModelProto:
    """x → MatMul → Add → LayerNorm → MatMul → Add → y: one norm that folds."""
    gen = rng(seed)
    return build(
        f"""<ir_version: 10, opset_import: ["" : 17]>
agraph (float[B, {D}] x) => (float[B, {D}] y) {{
  m0 = MatMul(x, w0)
  h = Add(m0, b0)
  n = LayerNormalization<axis=-1, epsilon=1e-5>(h, g, bt)
  m1 = MatMul(n, w1)
  y = Add(m1, b1)
}}""",
        w0=randn(gen, D, D),
        b0=randn(gen, D),
        g=1 + randn(gen, D, scale=0.1),
        bt=randn(gen, D),
        w1=randn(gen, D, D),
        b1=randn(gen, D),
    )


def ort_outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Run `model` in ONNX Runtime directly (optimizations off), independently of normpass."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def data_file(model_path) -> Path:
    """The one external-data file of the model at `model_path`."""
    (data,) = [path for path in io.model_files("model", model_path).values() if path != model_path]
    return data


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(capsys, *argv, code: int = 2) -> str:
    """Run the CLI, expect exit `code` with exactly one line on stderr; return that line."""
    got, _, err = cli(capsys, *argv)
    assert got == code, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(ln_model(), path)
    return path


# --- 4. models over 2 GB --------------------------------------------------------------------------


def test_large_models_go_to_external_data_without_serializing_or_mutating(tmp_path, monkeypatch, capsys, model_file):
    """With the 2 GB limit lowered, fold writes OUT + OUT.data, verifies, and leaves the caller's proto intact."""
    monkeypatch.setattr(io, "PROTO_LIMIT", 1024)
    monkeypatch.setattr(io, "EXTERNAL_MIN_BYTES", 100)
    monkeypatch.setattr(onnx_frontend, "LIGHT_INITIALIZER_LIMIT", 16)  # shape inference sees no large weight
    serialize = onnx.ModelProto.SerializeToString

    def guarded(self, *args, **kwargs):
        assert all(len(t.raw_data) < 100 for t in self.graph.initializer), "serialized a model with its weights"
        return serialize(self, *args, **kwargs)

    def refuse(self, *args, **kwargs):
        raise AssertionError("measured a model that may exceed the protobuf limit")

    monkeypatch.setattr(onnx.ModelProto, "ByteSize", refuse)
    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", guarded)
    out = tmp_path / "big.onnx"
    code, stdout, err = cli(capsys, "fold", model_file, "-o", out, "--provider", "cpu")
    monkeypatch.undo()
    assert code == 0, err
    assert "1 of 1 norms folded" in stdout and "max abs error" in stdout
    assert data_file(out).stat().st_size > 0 and data_file(out).name.startswith("big.onnx.")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".normpass-")]
    folded = onnx.load(str(out))
    assert all(not t.raw_data or t.data_location == TensorProto.DEFAULT for t in folded.graph.initializer)
    x = randn(rng(5), 3, D) * 3 + 1
    np.testing.assert_allclose(
        ort_outputs(folded, {"x": x})[0], ort_outputs(ln_model(), {"x": x})[0], rtol=1e-4, atol=1e-4
    )


def test_writing_external_data_leaves_the_callers_model_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "PROTO_LIMIT", 1024)
    monkeypatch.setattr(io, "EXTERNAL_MIN_BYTES", 100)
    model = ln_model()
    before = model.SerializeToString()
    io.save_onnx_atomic(model, tmp_path / "m.onnx")
    assert model.SerializeToString() == before
    assert data_file(tmp_path / "m.onnx").stat().st_size == 2 * D * D * 4 + len(
        io._mark(data_file(tmp_path / "m.onnx").name)
    )
    np.testing.assert_array_equal(
        numpy_helper.to_array(onnx.load(str(tmp_path / "m.onnx")).graph.initializer[0]),
        numpy_helper.to_array(model.graph.initializer[0]),
    )


# --- 5. output paths ------------------------------------------------------------------------------


def test_fold_refuses_a_fifo_output_and_leaves_it_a_fifo(tmp_path, capsys, model_file):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert "not a regular file" in refused(capsys, "fold", model_file, "-o", fifo)
    assert not os.path.isfile(fifo) and os.path.exists(fifo)


def test_fold_refuses_a_symlink_to_a_fifo(tmp_path, capsys, model_file):
    fifo, link = tmp_path / "pipe", tmp_path / "link.onnx"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    refused(capsys, "fold", model_file, "-o", link)
    assert link.is_symlink()


def test_report_on_a_fifo_is_refused_before_the_model_is_written(tmp_path, capsys, model_file):
    fifo, out = tmp_path / "pipe", tmp_path / "out.onnx"
    os.mkfifo(fifo)
    refused(capsys, "fold", model_file, "-o", out, "--report", fifo)
    assert not out.exists()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_fold_refuses_an_output_that_is_the_input_through_a_link(tmp_path, capsys, model_file, link):
    alias = tmp_path / "alias.onnx"
    (alias.symlink_to if link == "symlink" else alias.hardlink_to)(model_file)
    digest = sha256(model_file)
    refused(capsys, "fold", model_file, "-o", alias)
    refused(capsys, "fold", model_file, "-o", tmp_path / "out.onnx", "--report", alias)
    assert sha256(model_file) == digest


def test_fold_refuses_a_report_that_is_the_output_through_a_hard_link(tmp_path, capsys, model_file):
    out, alias = tmp_path / "out.onnx", tmp_path / "alias.json"
    out.write_text("old")
    alias.hardlink_to(out)
    refused(capsys, "fold", model_file, "-o", out, "--report", alias)
    assert out.read_text() == "old"


def test_bench_refuses_outputs_that_are_models_or_unsupported_plots(tmp_path, capsys, model_file):
    digest = sha256(model_file)
    for flag in ("--json", "--csv", "--plot"):
        refused(capsys, "bench", model_file, model_file, flag, model_file, "--repeats", 1, "--no-progress")
    assert sha256(model_file) == digest
    assert "png" in refused(capsys, "bench", model_file, model_file, "--plot", tmp_path / "x.html", "--no-progress")
    refused(capsys, "bench", model_file, model_file, "--json", tmp_path / "r", "--csv", tmp_path / "r", "--no-progress")


def test_replace_refuses_an_output_equal_to_the_calibration_data(tmp_path, capsys, model_file):
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=randn(rng(1), 8, D))
    digest = sha256(calib)
    refused(capsys, "replace", model_file, "--calib", calib, "-o", calib)
    refused(capsys, "replace", model_file, "--calib", calib, "-o", tmp_path / "o.onnx", "--report", calib)
    assert sha256(calib) == digest


def test_viz_refuses_a_fifo(tmp_path, capsys, model_file):
    fifo = tmp_path / "pipe.html"
    os.mkfifo(fifo)
    refused(capsys, "viz", model_file, "-o", fifo)


def test_fold_writes_through_a_symlink(tmp_path, capsys, model_file):
    target, link = tmp_path / "target.onnx", tmp_path / "link.onnx"
    target.write_text("old")
    link.symlink_to(target)
    code, _, err = cli(capsys, "fold", model_file, "-o", link)
    assert code == 0, err
    assert link.is_symlink() and onnx.load(str(target)).graph.node


def test_report_to_a_piped_stdout_is_refused_before_the_model_is_written(tmp_path, model_file):
    """`--report /dev/stdout` with stdout a pipe: a real process, since pytest captures stdout in-process."""
    out = tmp_path / "out.onnx"
    done = subprocess.run(
        [sys.executable, "-m", "normpass", "fold", str(model_file), "-o", str(out), "--report", "/dev/stdout"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "not a regular file" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()


# --- 6. one line instead of a traceback -----------------------------------------------------------


def bf16_model() -> onnx.ModelProto:
    """`ln_model` in bfloat16: inputs, outputs and weights."""
    model = ln_model()
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.BFLOAT16
    weights = [
        helper.make_tensor(t.name, TensorProto.BFLOAT16, t.dims, numpy_helper.to_array(t).ravel().tolist())
        for t in model.graph.initializer
    ]
    del model.graph.initializer[:]
    model.graph.initializer.extend(weights)
    return model


def test_bf16_models_are_verified_in_fp32(tmp_path, capsys):
    path, out = tmp_path / "bf16.onnx", tmp_path / "out.onnx"
    onnx.save(bf16_model(), path)
    code, _stdout, err = cli(capsys, "fold", path, "-o", out, "--report", tmp_path / "r.json")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verified"] and report["folded"] == 1
    assert [o["dtype"] for o in report["outputs"]] == ["bfloat16"] and report["outputs"][0]["tolerance"] == 5e-2
    assert onnx.load(str(out)).graph.output[0].type.tensor_type.elem_type == TensorProto.BFLOAT16


def custom_op_model() -> onnx.ModelProto:
    model = ln_model()
    model.graph.node.append(helper.make_node("Frobnicate", ["x"], ["z"], name="frob", domain="com.example"))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", D]))
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


def test_custom_op_folds_but_is_not_verified(tmp_path, capsys):
    path, out = tmp_path / "custom.onnx", tmp_path / "out.onnx"
    onnx.save(custom_op_model(), path)
    line = refused(capsys, "fold", path, "-o", out)
    assert "could not be verified" in line and "Frobnicate" in line
    assert not out.exists()
    code, stdout, err = cli(capsys, "fold", path, "-o", out, "--no-verify")
    assert code == 0 and "1 of 1 norms folded" in stdout, err
    assert [n.op_type for n in onnx.load(str(out)).graph.node].count("Frobnicate") == 1


def test_duplicate_node_names_are_verified_on_renamed_copies(tmp_path, capsys):
    model = ln_model()
    for node in model.graph.node:
        node.name = "same"
    path, out = tmp_path / "dup.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    code, stdout, err = cli(capsys, "fold", path, "-o", out)
    assert code == 0 and "max abs error" in stdout, err
    assert [n.name for n in onnx.load(str(path)).graph.node] == ["same"] * 5


@pytest.mark.parametrize(
    "spec, says",
    [
        ("x:2x8x1", "rank"),
        ("x:2x9", "8"),
        ("x:-2x8", "positive"),
        ("x:0x8", "positive"),
        ("x:99999999999x8", "elements"),
        ("nope:2x8", "nope"),
        ("x:2xabc", "NAME:DxD"),
        (":2x8", "name"),
    ],
)
def test_malformed_input_shapes_are_refused(tmp_path, capsys, model_file, spec, says):
    assert says in refused(capsys, "fold", model_file, "-o", tmp_path / "o.onnx", "--input-shape", spec)
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize(
    "arrays, says",
    [
        ({"x": np.zeros((8, D + 1), np.float32)}, "8"),
        ({"x": np.zeros((8, D), np.int64)}, "int64"),
        ({"y": np.zeros((8, D), np.float32)}, "missing"),
    ],
)
def test_replace_refuses_calibration_arrays_that_do_not_fit(tmp_path, capsys, model_file, arrays, says):
    calib = tmp_path / "calib.npz"
    np.savez(calib, **arrays)
    assert says in refused(capsys, "replace", model_file, "--calib", calib, "-o", tmp_path / "o.onnx")


def test_python_api_accepts_paths_and_refuses_empty_models(model_file):
    assert fold_onnx(str(model_file)).folded == 1
    assert inspect_onnx(model_file).total == 1
    for call in (fold_onnx, inspect_onnx, lambda m: replace_onnx(m, "synthetic", ReplaceOptions())):
        with pytest.raises(InputError):
            call(onnx.ModelProto())
        with pytest.raises(InputError):
            call(str(model_file) + ".missing")
        with pytest.raises(NormpassError):
            call(42)


def test_python_api_checks_input_shapes(model_file):
    with pytest.raises(InputError, match="rank"):
        fold_onnx(ln_model(), FoldOptions(input_shapes={"x": (2, 8, 1)}))


# --- 7. machine-readable output -------------------------------------------------------------------


def test_inspect_json_is_pure_json_when_a_library_prints_warnings(tmp_path, capsys, monkeypatch):
    from normpass.onnx.graph import frontend

    infer = frontend._infer

    def chatty_infer(*args):
        print("[W] a library's warning on stdout")
        return infer(*args)

    monkeypatch.setattr(frontend, "_infer", chatty_infer)
    path = tmp_path / "bf16.onnx"
    onnx.save(bf16_model(), path)
    code, stdout, err = cli(capsys, "inspect", path, "--json")
    assert code == 0, err
    assert json.loads(stdout)["total"] == 1


# --- the guard ------------------------------------------------------------------------------------


def test_unexpected_errors_print_one_line_with_a_hint(tmp_path, capsys, monkeypatch, model_file):
    import normpass.cli.inspect as verb

    def boom(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(verb, "fold_decisions_of", boom)
    line = refused(capsys, "inspect", model_file, code=3)
    assert "NORMPASS_DEBUG=1" in line and "ZeroDivisionError" in line
    monkeypatch.setenv("NORMPASS_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["inspect", str(model_file)])


# --- 8. model files: one unit, inputs never overwritten, bad files are bad input -------------------


def external_ln_model(path: Path, seed: int = 0, location: str | None = None, reverse: bool = False) -> Path:
    """`ln_model(seed)` at `path` with every tensor in one external data file (`location`, default
    PATH.data); `reverse` stores the tensors in the opposite order, so that a model file and another
    model's data file, mixed, compute something else."""
    model = ln_model(seed)
    if reverse:
        tensors = list(model.graph.initializer)[::-1]
        del model.graph.initializer[:]
        model.graph.initializer.extend(tensors)
    onnx.save(model, path, save_as_external_data=True, location=location or f"{path.name}.data", size_threshold=0)
    return path


@pytest.fixture()
def small_external(monkeypatch):
    """Tensors of 16 bytes or more go to a model's data file when it is written (the test models are tiny)."""
    monkeypatch.setattr(io, "EXTERNAL_MIN_BYTES", 16)


def ort_file_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    """`y` of the model file at `path`, run by ONNX Runtime from the file (its external data as the file names it)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


X = randn(rng(9), 3, D)


def computes_like(path: Path, reference: np.ndarray) -> bool:
    return bool(np.abs(ort_file_outputs(path, X) - reference).max() <= 1e-4 * np.abs(reference).max())


def listing(directory: Path) -> dict[str, str]:
    return {p.name: sha256(p) if p.is_file() else "dir" for p in sorted(directory.iterdir())}


def test_two_writers_of_one_output_leave_a_model_and_its_own_weights(tmp_path, small_external, monkeypatch):
    """Run B writes OUT while run A is between putting its weights in place and its model: OUT is
    then A's or B's model with that run's weights, never A's model over B's weights (a model that
    matches neither, which two fixed names, OUT and OUT.data, allow)."""
    a = external_ln_model(tmp_path / "a.onnx", seed=1)
    b = external_ln_model(tmp_path / "b.onnx", seed=2, reverse=True)
    expected = {name: ort_file_outputs(path, X) for name, path in (("a", a), ("b", b))}
    out = tmp_path / "out.onnx"
    models = {"a": io.load_ir(a), "b": io.load_ir(b)}
    replace = os.replace
    other = threading.Thread(target=io.save_onnx_atomic, args=(models["b"], out))

    def first_rename_then_b(src, dst):
        replace(src, dst)
        if Path(dst).parent == tmp_path and other.ident is None:  # A's first rename into place: B runs now
            other.start()
            other.join(timeout=1.0)  # B either finishes now (no lock) or waits for A's commit

    monkeypatch.setattr(io.os, "replace", first_rename_then_b)
    io.save_onnx_atomic(models["a"], out)
    other.join()
    monkeypatch.setattr(io.os, "replace", replace)
    assert computes_like(out, expected["a"]) or computes_like(out, expected["b"])
    assert len(list(tmp_path.glob("out.onnx.*data"))) == 1 and not list(tmp_path.glob(".normpass-*"))


def test_concurrent_writers_leave_one_consistent_model(tmp_path, small_external):
    paths = [external_ln_model(tmp_path / f"m{i}.onnx", seed=i, reverse=bool(i % 2)) for i in range(2)]
    expected = [ort_file_outputs(path, X) for path in paths]
    out = tmp_path / "out.onnx"

    def write(path: Path) -> None:
        model = io.load_ir(path)
        for _ in range(5):
            io.save_onnx_atomic(model, out)

    threads = [threading.Thread(target=write, args=(paths[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert any(computes_like(out, reference) for reference in expected)
    assert len(list(tmp_path.glob("out.onnx.*data"))) == 1 and not list(tmp_path.glob(".normpass-*"))


def test_stale_data_files_go_and_nothing_else(tmp_path, small_external, capsys):
    """Data files earlier runs wrote for OUT are removed once OUT is replaced; a file of the same
    shape of name without normpass's mark, a data file of another name and one an input reads stay."""
    source = external_ln_model(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert cli(capsys, "fold", source, "-o", out, "--no-verify", "--no-migrate-affine")[0] == 0
    first = data_file(out)
    users = {name: tmp_path / name for name in ("out.onnx.data", "out.onnx.0123abcd.data", "out.onnx.x.data")}
    for path in users.values():
        path.write_bytes(b"the user's")
    os.mkfifo(tmp_path / "out.onnx.89abcdef.data")  # named like one, never opened (a read would block)
    (tmp_path / "out.onnx.456789ab.data").symlink_to(first)  # a link to one: not a file normpass wrote
    assert cli(capsys, "fold", source, "-o", out, "--no-verify", "--no-migrate-affine")[0] == 0
    assert data_file(out) != first and not first.exists()
    assert all(path.read_bytes() == b"the user's" for path in users.values())
    assert (tmp_path / "out.onnx.89abcdef.data").exists() and (tmp_path / "out.onnx.456789ab.data").is_symlink()
    # an input that reads OUT's current data file: folding it to OUT keeps that file (the input still loads)
    reader = tmp_path / "reader.onnx"
    shutil.copy(out, reader)
    reads = data_file(reader)
    assert cli(capsys, "fold", reader, "-o", out, "--no-verify", "--no-migrate-affine")[0] == 0
    assert reads.exists() and data_file(out) != reads
    np.testing.assert_allclose(ort_file_outputs(reader, X), ort_outputs(ln_model(), {"x": X})[0], rtol=1e-4, atol=1e-4)


def test_an_output_named_after_another_models_weights_leaves_them_alone(tmp_path, small_external, capsys):
    """a.onnx keeps its weights in b.onnx.data: `fold a.onnx -o b.onnx` must not overwrite them."""
    a = external_ln_model(tmp_path / "a.onnx", location="b.onnx.data")
    before = ort_file_outputs(a, X)
    digest = sha256(tmp_path / "b.onnx.data")
    code, _, err = cli(capsys, "fold", a, "-o", tmp_path / "b.onnx", "--no-migrate-affine")
    assert code == 0, err
    assert sha256(tmp_path / "b.onnx.data") == digest
    np.testing.assert_array_equal(ort_file_outputs(a, X), before)
    assert computes_like(tmp_path / "b.onnx", before)


def two_data_files(tmp_path: Path) -> Path:
    """model.onnx with w0, b0, g in w.bin and the rest in rest.bin."""
    model = ln_model()
    for tensor in model.graph.initializer:
        location = "w.bin" if tensor.name in ("w0", "b0", "g") else "rest.bin"
        onnx.external_data_helper.set_external_data(tensor, location)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)  # writes each tensor to its file
    return path


def hostile_outputs(tmp_path: Path, model: Path) -> list[tuple[str, list]]:
    """(what is aimed at, argv) of commands that aim an output at a file the input model or its
    calibration data reads."""
    calib_file = tmp_path / "calib.npz"
    np.savez(calib_file, x=randn(rng(1), 8, D))
    calib_dir = tmp_path / "calib"
    calib_dir.mkdir()
    np.save(calib_dir / "x.npy", randn(rng(1), 8, D))
    data = tmp_path / "w.bin"
    hard, soft = tmp_path / "hard.bin", tmp_path / "soft.bin"
    hard.hardlink_to(tmp_path / "rest.bin")
    soft.symlink_to(data)
    out = tmp_path / "o.onnx"
    cases = []
    for target in (model, data, tmp_path / "rest.bin", hard, soft):
        cases += [
            (target.name, ["fold", model, "-o", target]),
            (target.name, ["fold", model, "-o", out, "--report", target]),
            (target.name, ["replace", model, "--calib", "synthetic", "-o", target]),
            (target.name, ["replace", model, "--calib", "synthetic", "-o", out, "--report", target]),
            (target.name, ["viz", model, "-o", target, "--format", "html"]),
            (target.name, ["inspect", model, "--graph", target]),
            (target.name, ["bench", model, model, "--json", target, "--no-progress"]),
            (target.name, ["slice", model, "--calib", calib_file, "--ratio", "0.25", "-o", target]),
            (target.name, ["slice", model, "--calib", calib_file, "--ratio", "0.25", "-o", out, "--report", target]),
        ]
    for target in (calib_file, calib_dir / "x.npy"):
        calib = calib_file if target == calib_file else calib_dir
        cases += [
            (target.name, ["replace", model, "--calib", calib, "-o", target]),
            (
                target.name,
                ["replace", model, "--calib", "synthetic", "--holdout", calib, "-o", out, "--report", target],
            ),
            (target.name, ["slice", model, "--calib", calib, "--ratio", "0.25", "-o", target]),
            (
                target.name,
                [
                    "slice",
                    model,
                    "--calib",
                    calib_file,
                    "--holdout",
                    calib,
                    "-o",
                    out,
                    "--ratio",
                    "0.25",
                    "--report",
                    target,
                ],
            ),
        ]
    return cases


def test_no_output_may_overwrite_a_file_an_input_reads(tmp_path, capsys):
    """The model, each of its external-data files (through hard and symbolic links too) and the
    calibration data are refused as every output of every verb, before any work."""
    model = two_data_files(tmp_path)
    cases = hostile_outputs(tmp_path, model)
    before = listing(tmp_path)
    for aimed_at, argv in cases:
        line = refused(capsys, *argv)
        assert "must not overwrite" in line and aimed_at.split(".")[0] in line, (argv, line)
    assert listing(tmp_path) == before


def test_a_fold_result_is_not_saved_over_the_weights_it_reads(tmp_path):
    path = external_ln_model(tmp_path / "m.onnx")
    before = listing(tmp_path)
    result = fold_onnx(path, FoldOptions(migrate_affine=False))  # γ stays the file's tensor
    with pytest.raises(InputError, match="reads its weights"):
        result.save(tmp_path / "m.onnx.data")
    assert listing(tmp_path) == before


def test_fold_torch_refuses_to_overwrite_its_factory(tmp_path, capsys, monkeypatch):
    factory = tmp_path / "my_factory.py"
    factory.write_text("def make():\n    raise AssertionError('the factory must not run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused(capsys, "fold", "--torch", "my_factory:make", "-o", factory)
    assert "--torch's module" in line and "raise AssertionError" in factory.read_text()


@pytest.mark.parametrize(
    "location, says",
    [("../outside.bin", "outside the model's directory"), ("ABSOLUTE", "outside"), ("link.bin", "symbolic link")],
)
def test_external_data_outside_the_models_directory_is_bad_input(tmp_path, capsys, location, says):
    directory = tmp_path / "model"
    directory.mkdir()
    external_ln_model(tmp_path / "outside.onnx", location="outside.bin")
    (directory / "link.bin").symlink_to(tmp_path / "outside.bin")
    model = onnx.load(str(tmp_path / "outside.onnx"), load_external_data=False)
    for entry in (e for tensor in model.graph.initializer for e in tensor.external_data if e.key == "location"):
        entry.value = str(tmp_path / "outside.bin") if location == "ABSOLUTE" else location
    path = directory / "model.onnx"
    onnx.save(model, path)
    for argv in (["inspect", path], ["fold", path, "-o", tmp_path / "o.onnx"], ["viz", path, "-o", tmp_path / "v.svg"]):
        line = refused(capsys, *argv)
        assert str(path) in line and says in line, line
    with pytest.raises(InputError, match="outside"):
        fold_onnx(path)


@pytest.mark.parametrize("damage", ["truncated", "missing", "hard-linked"])
def test_damaged_external_data_is_bad_input(tmp_path, capsys, damage):
    path = external_ln_model(tmp_path / "m.onnx")
    data = tmp_path / "m.onnx.data"
    if damage == "truncated":
        os.truncate(data, data.stat().st_size - 5)
    elif damage == "missing":
        data.unlink()
    else:  # onnx-ir refuses data files with several links
        (tmp_path / "copy.data").hardlink_to(data)
    for argv in (["inspect", path], ["fold", path, "-o", tmp_path / "o.onnx"]):
        line = refused(capsys, *argv)
        assert (
            "m.onnx" in line
            and {"truncated": "truncated", "missing": "keep them together"}.get(damage, "hard link") in line
        )
    assert not (tmp_path / "o.onnx").exists()


def test_a_data_file_shared_by_two_models_stays_theirs(tmp_path, capsys):
    """Two models read one data file (each its own tensors): folding one, to a file named after the
    other, changes neither."""
    first = external_ln_model(tmp_path / "first.onnx", seed=1, location="shared.bin")
    second_model = ln_model(2)
    offset = (tmp_path / "shared.bin").stat().st_size
    with open(tmp_path / "shared.bin", "ab") as shared:
        for tensor in second_model.graph.initializer:
            payload = numpy_helper.to_array(tensor).tobytes()
            onnx.external_data_helper.set_external_data(tensor, "shared.bin", offset=offset, length=len(payload))
            tensor.ClearField("float_data")
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            shared.write(payload)
            offset += len(payload)
    second = tmp_path / "second.onnx"
    onnx.save(second_model, second)
    expected = {p: ort_file_outputs(p, X) for p in (first, second)}
    for target in (second, tmp_path / "shared.bin.onnx"):
        code, _, err = cli(capsys, "fold", first, "-o", target, "--no-migrate-affine")
        assert code == 0, err
    refused(capsys, "fold", first, "-o", tmp_path / "shared.bin")
    assert computes_like(first, expected[first]) and computes_like(second, expected[first])
    np.testing.assert_array_equal(ort_file_outputs(first, X), expected[first])


def test_sparse_initializers_are_kept_as_dense_ones(tmp_path, capsys):
    model = ln_model()
    weight = next(t for t in model.graph.initializer if t.name == "w1")
    values = numpy_helper.to_array(weight).copy()
    values[np.abs(values) < 0.5] = 0
    where = np.flatnonzero(values)
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(values.ravel()[where], "w1"), numpy_helper.from_array(where.astype(np.int64)), [D, D]
    )
    model.graph.initializer.remove(weight)
    model.graph.sparse_initializer.append(sparse)
    path = tmp_path / "sparse.onnx"
    onnx.save(model, path)
    reference = ort_file_outputs(path, X)
    for options in ([], ["--no-verify"]):
        out = tmp_path / f"out{len(options)}.onnx"
        code, stdout, err = cli(capsys, "fold", path, "-o", out, *options)
        assert code == 0 and "1 of 1 norms folded" in stdout, err
        assert computes_like(out, reference)
    code, _, err = cli(capsys, "replace", path, "--calib", "synthetic", "-o", tmp_path / "r.onnx")
    assert code == 0 and computes_like(tmp_path / "r.onnx", reference), err
    assert inspect_onnx(path).total == 1 and fold_onnx(model).folded == 1


def test_duplicate_initializer_names_are_bad_input(tmp_path, capsys):
    model = ln_model()
    again = onnx.TensorProto()
    again.CopyFrom(model.graph.initializer[0])
    again.raw_data = np.ones(D * D, np.float32).tobytes()
    model.graph.initializer.append(again)
    path = tmp_path / "dup.onnx"
    onnx.save(model, path)
    for argv in (
        ["fold", path, "-o", tmp_path / "o.onnx"],
        ["inspect", path],
        ["replace", path, "--calib", "synthetic", "-o", tmp_path / "o.onnx"],
    ):
        assert "'w0'" in refused(capsys, *argv)
    with pytest.raises(InputError, match="'w0'"):
        fold_onnx(model)


@pytest.mark.parametrize("declared", [["B", D // 2], ["B", D, 3]])
def test_value_info_contradicting_the_computed_shapes_is_dropped_with_a_warning(tmp_path, capsys, declared):
    """A `value_info` is a hint ONNX Runtime ignores: one that contradicts its node is dropped, the shape
    re-inferred (the proof reads the inferred one), one `warning:` line; the written model does not carry it."""
    model = ln_model()
    reference = ort_outputs(model, {"x": X})[0]
    model.graph.value_info.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, declared))
    path = tmp_path / "vi.onnx"
    onnx.save(model, path)
    out = tmp_path / "o.onnx"
    code, stdout, err = cli(capsys, "fold", path, "-o", out)
    assert code == 0 and "1 of 1 norms folded" in stdout, err
    warned = [line for line in err.splitlines() if "warning:" in line and "value_info" in line]
    assert len(warned) == 1 and "of h," in warned[0], err
    assert computes_like(out, reference)
    kept = [v.type.tensor_type for v in onnx.load(out).graph.value_info if v.name == "h"]
    assert all(not t.HasField("shape") or [d.dim_value for d in t.shape.dim][1:] == [D] for t in kept), kept
    code, _, err = cli(capsys, "inspect", path)
    assert code == 0 and "value_info" in err


def test_a_graph_output_contradicting_its_node_is_bad_input(tmp_path, capsys):
    model = ln_model()
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", D, 3]))
    path = tmp_path / "out.onnx"
    onnx.save(model, path)
    for argv in (["fold", path, "-o", tmp_path / "o.onnx"], ["inspect", path]):
        line = refused(capsys, *argv)
        assert "graph output" in line and "(Add)" in line, line


def decomposed_ln_model(absent: str) -> onnx.ModelProto:
    """A decomposed LayerNorm whose mean's axes are shape arithmetic, with the input `absent` (node:index)
    written as "" (an invalid model: each of these inputs is required)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h"], name="m0"),
        helper.make_node("Identity", ["h"], ["hi"], name="hi"),
        helper.make_node("Shape", ["hi"], ["shape"], name="shape"),
        helper.make_node("Size", ["shape"], ["rank"], name="size"),
        helper.make_node("Sub", ["rank", "one"], ["last"], name="last"),
        helper.make_node("Range", ["last", "rank", "one"], ["axes"], name="range"),
        helper.make_node("ReduceMean", ["hi", "axes"], ["mu"], name="mean"),
        helper.make_node("Sub", ["hi", "mu"], ["d"], name="sub"),
        helper.make_node("Mul", ["d", "d"], ["p"], name="square"),
        helper.make_node("ReduceMean", ["p", "axes"], ["v"], name="variance"),
        helper.make_node("Add", ["v", "eps"], ["ve"], name="add_eps"),
        helper.make_node("Sqrt", ["ve"], ["r"], name="root"),
        helper.make_node("Div", ["d", "r"], ["y"], name="normalize"),
    ]
    name, index = absent.split(":")
    node = next(n for n in nodes if n.name == name)
    node.input[int(index)] = ""
    weights = {"w0": randn(rng(0), D, D), "one": np.array(1, np.int64), "eps": np.array(1e-5, np.float32)}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", D])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("absent", ["mean:0", "sub:0", "square:1", "hi:0", "shape:0"])
def test_an_absent_required_input_is_no_internal_error(tmp_path, capsys, absent):
    """The matchers read only the inputs that are there: `inspect` lists what it can, `fold` is refused
    by ONNX Runtime naming the node (before: an internal error, exit 3)."""
    path = tmp_path / "absent.onnx"
    onnx.save(decomposed_ln_model(absent), path)
    code, out, err = cli(capsys, "inspect", path)
    assert code == 0 and "absent.onnx" in out, err
    node = absent.split(":")[0]
    assert f"({node})" in refused(capsys, "fold", path, "-o", tmp_path / "o.onnx")


def test_a_layer_norm_op_without_its_input_is_no_internal_error(tmp_path, capsys):
    model = ln_model()
    next(n for n in model.graph.node if n.op_type == "LayerNormalization").input[0] = ""
    path = tmp_path / "absent.onnx"
    onnx.save(model, path)
    code, _, err = cli(capsys, "inspect", path)
    assert code == 0, err
    assert "(n)" in refused(capsys, "fold", path, "-o", tmp_path / "o.onnx")


def test_a_module_on_the_meta_device_is_bad_input(tmp_path, capsys, monkeypatch):
    import torch

    import normpass

    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.LayerNorm(D), torch.nn.Linear(D, D)).eval()
    with pytest.raises(InputError, match="meta device"):
        normpass.fold(module, (torch.randn(2, D),))
    factory = tmp_path / "meta_factory.py"
    factory.write_text(
        "import torch\n\ndef make():\n    with torch.device('meta'):\n"
        f"        m = torch.nn.Sequential(torch.nn.Linear({D}, {D}), torch.nn.LayerNorm({D}))\n"
        f"    return m.eval(), (torch.randn(2, {D}),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "meta device" in refused(capsys, "fold", "--torch", "meta_factory:make", "-o", tmp_path / "o.onnx")


# --- 9. one line means one line ---------------------------------------------------------------------


def fp16_ln_model(**replaced: np.ndarray) -> onnx.ModelProto:
    """`ln_model` in fp16, with the initializers `replaced` (name → values)."""
    model = ln_model()
    for tensor in model.graph.initializer:
        values = numpy_helper.to_array(tensor).astype(np.float16)
        tensor.CopyFrom(numpy_helper.from_array(replaced.get(tensor.name, values).astype(np.float16), tensor.name))
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


def fp16_overflowing_model() -> onnx.ModelProto:
    """`ln_model` in fp16 with a first weight near fp16's largest value (65504) whose centred values overflow."""
    w0 = np.full((D, D), -60000, np.float16)
    w0[:, 0] = 60000
    return fp16_ln_model(w0=w0)


def test_library_warnings_join_the_one_line(tmp_path, capfd):
    path = tmp_path / "fp16.onnx"
    onnx.save(fp16_overflowing_model(), path)
    assert main(["fold", str(path), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "RuntimeWarning: overflow encountered" in err, err


def test_onnx_runtime_log_lines_do_not_print(tmp_path, capfd):
    """ONNX Runtime prints its own coloured error line (on file descriptor 2) when a run fails: here a
    Reshape to a shape of the wrong size, when verification runs the original."""
    model = ln_model()
    model.graph.node.append(helper.make_node("Reshape", ["x", "wrong"], ["z"], name="reshape"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([3, 5], np.int64), "wrong"))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    path = tmp_path / "bad_reshape.onnx"
    onnx.save(model, path)
    for argv in (["fold", path, "-o", tmp_path / "o.onnx"], ["bench", path, path, "--repeats", 1, "--no-progress"]):
        assert main([str(a) for a in argv]) == 2
        err = capfd.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "[E:onnxruntime" not in err and "\x1b[" not in err, err
        assert "Reshape" in err or "reshape" in err, err


def test_a_layer_norm_whose_scale_does_not_fit_is_bad_input(tmp_path, capsys):
    model = ln_model()
    gamma = next(t for t in model.graph.initializer if t.name == "g")
    gamma.CopyFrom(numpy_helper.from_array(np.ones(D - 1, np.float32), "g"))
    path = tmp_path / "bad_gamma.onnx"
    onnx.save(model, path)
    for argv in (["fold", path, "-o", tmp_path / "o.onnx"], ["inspect", path], ["viz", path, "-o", tmp_path / "v.svg"]):
        assert "scale g has shape [7]" in refused(capsys, *argv)


# --- 10. signals ----------------------------------------------------------------------------------

# Runs `normpass ARGS` with a pause at STAGE (`tensor`: after the first tensor of the weights is
# written to the temporary directory; `commit`: while the output is renamed into place, with
# signals deferred; `report`: after the model is written, before the report), having created the
# file READY there; the test sends a signal once READY exists.
PAUSING_NORMPASS = """
import contextlib, pathlib, sys, time
from normpass import io
from normpass.cli import common
from normpass.cli.main import main

stage, ready = sys.argv[1], pathlib.Path(sys.argv[2])
io.EXTERNAL_MIN_BYTES = 16

def pause(seconds):
    ready.touch()
    time.sleep(seconds)

if stage == "tensor":
    make = io._dropping_pages
    def pausing_callback():
        callback = make()
        def call(tensor, info):
            callback(tensor, info)
            pause(60)
        return call
    io._dropping_pages = pausing_callback
elif stage == "commit":
    remove = io._remove_stale_data
    def pausing_removal(*args):
        pause(0.5)
        remove(*args)
    io._remove_stale_data = pausing_removal
else:
    write = common.write_text_atomic  # the verbs write their report through common.save_result
    def pausing_write(*args):
        pause(60)
        write(*args)
    common.write_text_atomic = pausing_write
sys.exit(main(sys.argv[3:]))
"""


def test_signals_during_a_write_leave_the_old_output_or_the_whole_new_one(tmp_path):
    """SIGTERM and SIGHUP behave like SIGINT: the temporary files go, the old output stays (or, once
    the output is renamed into place, the new one is whole), one line says what was written, and the
    exit code is 128 + the signal's number."""
    import signal as signals
    import time

    cases = [
        (signals.SIGTERM, "tensor", "terminated (SIGTERM); nothing written"),
        (signals.SIGHUP, "tensor", "hung up (SIGHUP); nothing written"),
        (signals.SIGINT, "tensor", "interrupted; nothing written"),
        (signals.SIGTERM, "commit", "terminated (SIGTERM); wrote only"),
        (signals.SIGTERM, "report", "terminated (SIGTERM); wrote only"),
    ]
    runs = []
    for index, (_, stage, _) in enumerate(cases):
        directory = tmp_path / str(index)
        directory.mkdir()
        model = external_ln_model(directory / "m.onnx")
        (directory / "out.onnx").write_text("the old output")
        before = listing(directory)
        argv = ["fold", model, "-o", directory / "out.onnx", "--no-verify", "--no-migrate-affine"]
        argv += ["--report", directory / "r.json"]
        process = subprocess.Popen(
            [sys.executable, "-c", PAUSING_NORMPASS, stage, str(tmp_path / f"ready{index}"), *map(str, argv)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        runs.append((process, directory, before))
    deadline = time.monotonic() + 120
    pending = dict(enumerate(cases))
    while pending and time.monotonic() < deadline:
        for index in [i for i in pending if (tmp_path / f"ready{i}").exists()]:
            runs[index][0].send_signal(pending.pop(index)[0])
        time.sleep(0.02)
    for (signum, stage, says), (process, directory, before) in zip(cases, runs, strict=True):
        _, err = process.communicate(timeout=120)
        assert process.returncode == 128 + signum, (stage, err)
        assert len(err.strip().splitlines()) == 1 and says in err, err
        assert not [p for p in directory.iterdir() if p.name.startswith(".normpass-")]
        assert not (directory / "r.json").exists()
        if stage == "tensor":
            assert listing(directory) == before
        else:
            assert computes_like(directory / "out.onnx", ort_outputs(ln_model(), {"x": X})[0])
            assert "out.onnx" in err and len(list(directory.glob("out.onnx.*.data"))) == 1


def test_a_signal_during_the_commit_waits_until_the_output_is_in_place(tmp_path, capsys, monkeypatch):
    """Python runs a signal handler in the main thread whichever thread the signal reached: a signal
    another thread takes while the output is renamed into place is held until the commit is done,
    and the line says the output was written (found by the file-level fuzzer: "nothing written",
    while the output had been replaced)."""
    import signal as signals

    model_file = external_ln_model(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    out.write_text("the old output")
    replace = os.replace

    def replace_then_signal(src, dst):
        replace(src, dst)
        if Path(dst) == out:
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signals.SIGTERM))
            sender.start()
            sender.join()
            for _ in range(1000):  # bytecodes, at one of which the main thread runs the handler
                pass

    def unhandled(signum, frame):  # where nothing handles SIGTERM, fail instead of ending the test run
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(io.os, "replace", replace_then_signal)
    previous = signals.signal(signals.SIGTERM, unhandled)
    try:
        code, _, err = cli(capsys, "fold", model_file, "-o", out, "--no-verify")
    finally:
        signals.signal(signals.SIGTERM, previous)
        monkeypatch.setattr(io.os, "replace", replace)
    assert code == 143 and "terminated (SIGTERM); wrote only" in err and str(out) in err, err
    assert computes_like(out, ort_outputs(ln_model(), {"x": X})[0])


@pytest.mark.parametrize("size_threshold", (0, 64))
def test_generated_models_survive_attacks_on_their_files(tmp_path, size_threshold):
    """The fuzzer's file-level oracle (`fuzzcheck.check_from_file(hostile=True)`) on a few generated
    models: outputs aimed at the inputs, damaged and shared data files, concurrent writers, a signal
    at a random moment (tools/fuzz.py --from-files runs it on thousands)."""
    import fuzzcheck
    import graphgen

    failures = []
    for seed in range(4):
        directory = tmp_path / str(seed)
        directory.mkdir()
        case = graphgen.generate(seed)
        failures += [f"seed {seed}: {f}" for f in fuzzcheck.check_from_file(case, directory, size_threshold, True)]
    assert not failures, "\n".join(failures)


# --- 11. new weights that overflow their dtype -------------------------------------------------------


@pytest.mark.parametrize("verified", [True, False], ids=["verified", "not-verified"])
@pytest.mark.parametrize("stored", ["now", "when-written", "when-written-external"])
def test_a_centred_weight_that_overflows_is_refused_and_nothing_written(
    tmp_path, capsys, monkeypatch, stored, verified
):
    """An fp16 weight whose centred values overflow (finite before, ±inf after) is refused naming it, exit 2,
    verified or not (before: written with inf weights, exit 0, without verification). Weights of ≥ 1 MiB are
    computed as the model is written (here every changed weight is), also by verification: refused there,
    with nothing left of the output (plain or with external data)."""
    if stored != "now":
        monkeypatch.setattr(targets, "LAZY_MIN_BYTES", 0)
    path = tmp_path / "fp16.onnx"
    external = stored == "when-written-external"
    onnx.save(fp16_overflowing_model(), path, save_as_external_data=external, location="w.data", size_threshold=0)
    out = tmp_path / "out"
    out.mkdir()
    line = refused(
        capsys, "fold", path, "-o", out / "o.onnx", "--report", out / "r.json", *([] if verified else ["--no-verify"])
    )
    assert "initializer w0 centred for n overflows float16" in line and "convert the model to float32" in line, line
    with pytest.raises(WeightOverflowError, match="initializer w0 centred for n"):
        fold_onnx(path, FoldOptions(verify=verified)).save(out / "o.onnx")
    assert not list(out.iterdir())


@pytest.mark.parametrize(
    "changed, says",
    [("g", "initializer w1 multiplied by a folded norm's γ"), ("bt", "the bias of m1 plus a folded norm's β·W")],
)
def test_a_migrated_weight_that_overflows_is_refused_and_folds_without_migration(tmp_path, capsys, changed, says):
    """γ·W (or β·W added to the next bias) overflows fp16 where one γ (or β) is 2000 and W's row 40: refused,
    with the way out, which then folds (γ and β stay in the norm)."""
    w1 = randn(rng(1), D, D)
    w1[0] = 40
    vector = np.ones(D, np.float32) if changed == "g" else np.zeros(D, np.float32)
    vector[0] = 2000
    path = tmp_path / "fp16.onnx"
    onnx.save(fp16_ln_model(w1=w1, **{changed: vector}), path)
    line = refused(capsys, "fold", path, "-o", tmp_path / "o.onnx", "--no-verify")
    assert says in line and "overflows float16" in line and "fold without affine migration" in line, line
    assert not (tmp_path / "o.onnx").exists()
    code, out, err = cli(capsys, "fold", path, "-o", tmp_path / "o.onnx", "--no-verify", "--no-migrate-affine")
    assert code == 0 and "1 of 1 norms folded" in out, err


def test_replace_refuses_a_model_with_a_scalar_input_naming_it(tmp_path, capsys):
    """Calibration arrays are split into samples along axis 0; a rank-0 input has none (an If's condition)."""
    path = tmp_path / "cond.onnx"
    model = build(
        f"""<ir_version: 10, opset_import: ["" : 17]>
agraph (float[B, {D}] x, bool c) => (float[B, {D}] y) {{
  n = LayerNormalization<axis=-1>(x, g, b)
  y = If(c) <then_branch = t () => (float[B, {D}] o) {{ o = Identity(n) }},
              else_branch = e () => (float[B, {D}] o) {{ o = Relu(n) }}>
}}""",
        g=np.ones(D, np.float32),
        b=np.zeros(D, np.float32),
    )
    onnx.save(model, str(path))
    out = tmp_path / "o.onnx"
    assert "input c is a scalar (rank 0)" in refused(capsys, "replace", path, "--calib", "synthetic", "-o", out)
    assert not out.exists()
