"""The error contract under hostile inputs, through `normpass.cli.main.main(argv)` and the Python API.

Exit 0 success, 1 verification failed, 2 bad input with exactly one line on stderr; no traceback;
the input model is never modified; outputs are written atomically and only to regular files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import build, randn, rng
from onnx import TensorProto, helper, numpy_helper

from normpass import FoldOptions, fold_onnx, inspect_onnx, io
from normpass.cli.main import main
from normpass.errors import InputError, NormpassError
from normpass.onnx import frontend as onnx_frontend
from normpass import ReplaceOptions, replace_onnx

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
    assert (tmp_path / "big.onnx.data").stat().st_size > 0
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
    assert (tmp_path / "m.onnx.data").stat().st_size == 2 * D * D * 4
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


def test_fold_writes_through_a_symlink_and_refuses_a_fifo_weights_file(tmp_path, capsys, model_file):
    target, link = tmp_path / "target.onnx", tmp_path / "link.onnx"
    target.write_text("old")
    link.symlink_to(target)
    code, _, err = cli(capsys, "fold", model_file, "-o", link)
    assert code == 0, err
    assert link.is_symlink() and onnx.load(str(target)).graph.node
    os.mkfifo(tmp_path / "out.onnx.data")
    refused(capsys, "fold", model_file, "-o", tmp_path / "out.onnx")


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
    from normpass.onnx import frontend

    infer = frontend._infer

    def chatty_infer(light):
        print("[W] a library's warning on stdout")
        return infer(light)

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

    monkeypatch.setattr(verb, "make_plan", boom)
    line = refused(capsys, "inspect", model_file, code=3)
    assert "NORMPASS_DEBUG=1" in line and "ZeroDivisionError" in line
    monkeypatch.setenv("NORMPASS_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["inspect", str(model_file)])
