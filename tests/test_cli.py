"""The `normpass` command line, run in-process through `normpass.cli.main.main` (and once as a real
subprocess through its console script).

Exit codes: 0 success, 1 verification failed, 2 bad input with exactly one line on stderr; on any
error nothing is written, and the input model is never modified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import (
    build,
    check_plain,
    check_structure,
    initializers,
    op_counts,
    randn,
    rms_nodes,
    rms_scale,
    rng,
    run_ort,
)
from test_patterns import post_ln, pre_ln_block, pre_ln_from_input

from normpass import __version__
from normpass.cli.main import main
from normpass.onnx.runtime.verify import make_inputs


def _command() -> list[str]:
    beside = Path(sys.executable).with_name("normpass")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("normpass")
    return [found] if found else [sys.executable, "-m", "normpass"]


NORMPASS = _command()
# What a fresh interpreter shows of the warnings a command raises (Python's default filters).
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@dataclasses.dataclass
class Result:
    returncode: int | str | None  # main's exit code, or SystemExit's (argparse exits 2)
    stdout: str
    stderr: str


@pytest.fixture
def normpass(capsys):
    """`normpass(*args)` → Result of `normpass ARGS` run in-process, its output captured.

    Argument-parser errors (and --version) leave `main` through SystemExit, as from the console
    script; the warnings a fresh interpreter would print are added to stderr.
    """

    def run(*args) -> Result:
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for category in HIDDEN_WARNINGS:
                warnings.simplefilter("ignore", category)
            code: int | str | None
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
        out, err = capsys.readouterr()
        shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
        return Result(code, out, err + shown)

    return run


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(directory: Path) -> dict[str, str]:
    """Every file under `directory` (hidden ones too) with its hash."""
    return {str(p.relative_to(directory)): (sha256(p) if p.is_file() else "dir") for p in sorted(directory.rglob("*"))}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_models")
    paths = {}
    for name, model in {
        "pre": pre_ln_block(rng(1)),
        "post": post_ln(rng(2)),
        "from_input": pre_ln_from_input(rng(3)),
        "noisy": noisy_model(rng(4)),
        "rms_only": rms_only_model(rng(5)),
    }.items():
        paths[name] = root / f"{name}.onnx"
        onnx.save(model, str(paths[name]))
    return paths


@pytest.fixture
def workdir(tmp_path, models):
    """A fresh directory holding a copy of each model."""
    for _name, path in models.items():
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def noisy_model(gen) -> onnx.ModelProto:
    """Foldable, but its output is random: verification must fail."""
    return build(
        """<ir_version: 10, opset_import: ["" : 18]>
agraph (float[B, 4, 6] x) => (float[B, 4, 8] y) {
  h = MatMul(x, W)
  n = LayerNormalization<axis=-1>(h, g1, b1)
  r = RandomNormalLike<scale=1.0>(n)
  y = Add(n, r)
}""",
        W=randn(gen, 6, 8),
        g1=1 + randn(gen, 8, scale=0.3),
        b1=randn(gen, 8, scale=0.3),
    )


def rms_only_model(gen) -> onnx.ModelProto:
    """A Llama-style decomposed RMSNorm after a linear layer: one norm, nothing to fold."""
    return build(
        """<ir_version: 10, opset_import: ["" : 18]>
agraph (float[B, 4, 6] x) => (float[B, 4, 8] y) {
  h = MatMul(x, W)
  sq = Pow(h, two)
  ms = ReduceMean(sq, ax)
  mse = Add(ms, eps)
  rms = Sqrt(mse)
  inv = Reciprocal(rms)
  xn = Mul(h, inv)
  y = Mul(xn, g1)
}""",
        W=randn(gen, 6, 8),
        two=np.array(2.0, np.float32),
        ax=np.array([-1], np.int64),
        eps=np.array(1e-6, np.float32),
        g1=1 + randn(gen, 8, scale=0.3),
    )


def assert_input_error(result: Result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --- inspect -------------------------------------------------------------------------------------------


def test_inspect_table(normpass, workdir):
    result = normpass("inspect", workdir / "pre.onnx", "--fold-with-beta-add")
    assert result.returncode == 0, result.stderr
    assert "2 of 2 norms" in result.stdout
    for name in ("n1", "out"):
        assert name in result.stdout
    post = normpass("inspect", workdir / "post.onnx")
    assert post.returncode == 0
    assert "1 of 2 norms" in post.stdout
    assert "post-LN" in post.stdout  # the refusal is explained


@pytest.mark.parametrize("more", [(), ("--fold-with-beta-add",), ("--provider", "cpu")])
def test_inspect_viz_and_fold_agree_on_what_folds(normpass, workdir, more):
    """pre.onnx's final norm is proven but its β could move nowhere: fold keeps it unless told otherwise, and
    inspect and viz say so too (they said "2 of 2 fold" where fold kept one)."""
    report_path = workdir / "r.json"
    fold = normpass("fold", workdir / "pre.onnx", "-o", workdir / "f.onnx", "--report", report_path, *more)
    assert fold.returncode == 0, fold.stderr
    report = json.loads(report_path.read_text())
    folded = {n["name"] for n in report["norms"] if n["foldable"]}
    assert len(folded) == (2 if more else 1)
    inspected = normpass("inspect", workdir / "pre.onnx", "--json", *more)
    assert {n["name"] for n in json.loads(inspected.stdout)["norms"] if n["foldable"]} == folded
    drawn = normpass("viz", workdir / "pre.onnx", "-o", workdir / "g.dot", *more)
    assert drawn.returncode == 0, drawn.stderr
    assert f"{len(folded)} of 2 norms fold;" in drawn.stdout
    assert f"{len(folded)} of 2 norms folded" in fold.stdout


def _check_schema(report: dict) -> None:
    assert isinstance(report["norms"], list)
    assert report["total"] == len(report["norms"])
    assert report["foldable"] == sum(1 for n in report["norms"] if n["foldable"])
    for norm in report["norms"]:
        assert {"name", "op", "foldable", "reason", "centred_layers"} <= set(norm), norm
        assert isinstance(norm["name"], str) and norm["name"]
        assert isinstance(norm["op"], str) and norm["op"]
        assert isinstance(norm["foldable"], bool)
        assert isinstance(norm["centred_layers"], list) and all(isinstance(c, str) for c in norm["centred_layers"])
        if norm["foldable"]:
            assert norm["reason"] is None
        else:
            assert isinstance(norm["reason"], str) and norm["reason"].strip()


def test_inspect_json_schema(normpass, workdir):
    result = normpass("inspect", workdir / "post.onnx", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    _check_schema(report)
    assert report["total"] == 2 and report["foldable"] == 1
    by_name = {n["name"]: n for n in report["norms"]}
    assert by_name["n1"]["foldable"] and by_name["n1"]["centred_layers"] == ["h"]
    assert not by_name["y"]["foldable"] and "n1" in by_name["y"]["reason"]
    assert by_name["y"]["centred_layers"] == []


def test_inspect_no_insert_centering(normpass, workdir):
    proofs = ("--json", "--fold-with-beta-add")  # every proven norm, one with a β that could move nowhere too
    with_insertion = json.loads(normpass("inspect", workdir / "from_input.onnx", *proofs).stdout)
    without = normpass("inspect", workdir / "from_input.onnx", *proofs, "--no-insert-centering")
    assert without.returncode == 0
    without = json.loads(without.stdout)
    _check_schema(with_insertion)
    _check_schema(without)
    assert with_insertion["foldable"] == 3 and without["foldable"] == 0
    assert all("graph input x" in n["reason"] for n in without["norms"])


# --- fold ------------------------------------------------------------------------------------------------


def test_fold_writes_model_and_report(normpass, workdir):
    model_path, out, report_path = workdir / "pre.onnx", workdir / "out.onnx", workdir / "report.json"
    before = sha256(model_path)
    result = normpass("fold", model_path, "-o", out, "--report", report_path)
    assert result.returncode == 0, result.stderr
    # the last norm writes the graph output: its β could only stay a separate Add, so it is kept
    assert "1 of 2" in result.stdout and "kept out: proven foldable, kept as a LayerNorm" in result.stdout
    assert sha256(model_path) == before
    folded = onnx.load(str(out))
    check_structure(folded)
    assert len(rms_nodes(folded)) == 1 and op_counts(folded)["LayerNormalization"] == 1
    report = json.loads(report_path.read_text())
    assert report["folded"] == 1 and report["total"] == 2
    assert report["target"] == "ort" and report["rms_op"] == "simplified" and report["skip_fused"] == 0
    assert isinstance(report["max_abs_error"], float) and 0 <= report["max_abs_error"] < 1e-4
    assert isinstance(report["max_rel_error"], float) and 0 <= report["max_rel_error"] <= 1e-5
    assert [(n["name"], n["foldable"], n["kept"]) for n in report["norms"]] == [
        ("n1", True, False),
        ("out", False, True),
    ]
    # the written model computes what the original does
    original = onnx.load(str(model_path))
    feeds = make_inputs(original, seed=5)
    expected, got = run_ort(original, feeds), run_ort(folded, feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5 * np.abs(expected[name]).max())
    # nothing else was left behind (no temporary files)
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".")) == []


def test_fold_partial_reports_refusals(normpass, workdir):
    out, report_path = workdir / "post_out.onnx", workdir / "r.json"
    result = normpass("fold", workdir / "post.onnx", "-o", out, "--report", report_path)
    assert result.returncode == 0, result.stderr
    assert "1 of 2" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["folded"] == 1 and report["total"] == 2
    refused = [n for n in report["norms"] if not n["foldable"]]
    assert [n["name"] for n in refused] == ["y"] and refused[0]["reason"]
    folded = onnx.load(str(out))
    assert op_counts(folded)["LayerNormalization"] == 1


def test_fold_names_replace_for_the_norms_the_proof_leaves(normpass, workdir):
    post = normpass("fold", workdir / "post.onnx", "-o", workdir / "p.onnx")
    assert post.returncode == 0, post.stderr
    assert post.stdout.splitlines()[-1] == (
        f"next: 1 norm cannot fold exactly; normpass replace {workdir / 'post.onnx'} --calib DATA -o OUT replaces "
        "it by calibrated surrogates within an accuracy budget (docs/surrogates.md)"
    )
    pre = normpass("fold", workdir / "pre.onnx", "-o", workdir / "q.onnx")  # keeps a proven norm for its β
    assert pre.returncode == 0 and "kept out:" in pre.stdout and "next:" not in pre.stdout


def test_rotate_says_what_would_let_a_stream_rotate(normpass, workdir):
    post = normpass("rotate", workdir / "post.onnx", "-o", workdir / "p.onnx")
    assert post.returncode == 0, post.stderr
    lines = post.stdout.splitlines()
    blocked = lines.index(
        "  not rotated: the stream of n1_3: LayerNormalization y subtracts the mean (not an RMSNorm), "
        "which a rotation does not keep"
    )
    assert lines[blocked + 1].startswith("    it would rotate if y were an RMSNorm: the fold cannot prove its input")
    pre = normpass("rotate", workdir / "pre.onnx", "-o", workdir / "q.onnx")  # the stream is the graph output
    assert pre.returncode == 0 and "would rotate" not in pre.stdout


@pytest.mark.parametrize("rms_op,op", [("onnx", "RMSNormalization"), ("decomposed", None)])
def test_fold_rms_op_choices(normpass, workdir, rms_op, op):
    out = workdir / f"{rms_op}.onnx"
    result = normpass(
        "fold", workdir / "pre.onnx", "-o", out, "--target", "onnx", "--rms-op", rms_op, "--fold-with-beta-add"
    )
    assert result.returncode == 0, result.stderr
    folded = onnx.load(str(out))
    check_plain(folded)
    counts = op_counts(folded)
    assert counts["LayerNormalization"] == 0 and not rms_nodes(folded)
    if op:
        assert counts[op] == 2
    else:
        assert counts["RMSNormalization"] == 0 and counts["Sqrt"] == 2


def test_fold_no_verify_and_no_migrate(normpass, workdir):
    out, report_path = workdir / "nv.onnx", workdir / "nv.json"
    result = normpass(
        "fold", workdir / "pre.onnx", "-o", out, "--report", report_path, "--no-verify", "--no-migrate-affine"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["verified"] is False
    assert report["max_abs_error"] is None and report["max_rel_error"] is None
    folded = onnx.load(str(out))
    # γ/β stay with the norms: both RMS ops keep a non-unit scale
    values = initializers(folded)
    assert len(rms_nodes(folded)) == 2
    for node in rms_nodes(folded):
        assert not np.all(values[rms_scale(node)] == 1)


def test_fold_no_fuse_skip(normpass, workdir):
    fused, unfused = workdir / "fused.onnx", workdir / "unfused.onnx"
    assert normpass("fold", workdir / "pre.onnx", "-o", fused, "--fold-with-beta-add").returncode == 0
    result = normpass("fold", workdir / "pre.onnx", "-o", unfused, "--no-fuse-skip", "--fold-with-beta-add")
    assert result.returncode == 0, result.stderr
    assert op_counts(onnx.load(str(fused)))["SkipSimplifiedLayerNormalization"] == 1
    counts = op_counts(onnx.load(str(unfused)))
    assert counts["SkipSimplifiedLayerNormalization"] == 0 and counts["SimplifiedLayerNormalization"] == 2


def test_fold_input_shape(normpass, workdir):
    report_path = workdir / "shape.json"
    result = normpass(
        "fold", workdir / "pre.onnx", "-o", workdir / "s.onnx", "--report", report_path, "--input-shape", "ids:3x4"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(report_path.read_text())["input_shapes"] == {"ids": [3, 4]}
    upper = normpass(
        "fold", workdir / "pre.onnx", "-o", workdir / "s2.onnx", "--report", report_path, "--input-shape", "ids:5X4"
    )
    assert upper.returncode == 0, upper.stderr
    assert json.loads(report_path.read_text())["input_shapes"] == {"ids": [5, 4]}


@pytest.mark.parametrize(
    "spec,fragment", [("ids:3xq", "ids:3xq"), ("nope:3x4", "nope"), (":3x4", "name"), ("ids", "ids")]
)
def test_fold_bad_input_shape(normpass, workdir, spec, fragment):
    before = listing(workdir)
    result = normpass("fold", workdir / "pre.onnx", "-o", workdir / "bad.onnx", "--input-shape", spec)
    assert_input_error(result, fragment)
    assert listing(workdir) == before


# --- errors: exit 2, one line, nothing written -------------------------------------------------------------


def test_missing_model_file(normpass, workdir):
    before = listing(workdir)
    result = normpass("fold", workdir / "missing.onnx", "-o", workdir / "out.onnx")
    assert_input_error(result, "missing.onnx")
    assert listing(workdir) == before
    assert_input_error(normpass("inspect", workdir / "missing.onnx"), "missing.onnx")


@pytest.mark.parametrize("content", [b"hello, I am not a model\n", b"", bytes(range(256)) * 4])
def test_not_an_onnx_file(normpass, workdir, content):
    bogus = workdir / "bogus.onnx"
    bogus.write_bytes(content)
    before = listing(workdir)
    result = normpass("fold", bogus, "-o", workdir / "out.onnx")
    assert_input_error(result, "bogus.onnx")
    assert listing(workdir) == before
    assert_input_error(normpass("inspect", bogus), "bogus.onnx")


def test_model_is_a_directory(normpass, workdir):
    (workdir / "adir.onnx").mkdir()
    assert_input_error(normpass("inspect", workdir / "adir.onnx"), "adir.onnx")


@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink"])
def test_output_must_not_overwrite_input(normpass, workdir, spelling):
    model_path = workdir / "pre.onnx"
    if spelling == "same":
        out = model_path
    elif spelling == "dotted":
        out = workdir / "." / "sub" / ".." / "pre.onnx"
        (workdir / "sub").mkdir()
    else:
        out = workdir / "link.onnx"
        out.symlink_to(model_path)
    before = listing(workdir)
    result = normpass("fold", model_path, "-o", out)
    assert_input_error(result, "overwrite")
    assert listing(workdir) == before


def test_report_must_not_overwrite_input(normpass, workdir):
    before = listing(workdir)
    result = normpass("fold", workdir / "pre.onnx", "-o", workdir / "o.onnx", "--report", workdir / "pre.onnx")
    assert_input_error(result)
    assert listing(workdir) == before


def test_report_must_not_overwrite_output(normpass, workdir):
    before = listing(workdir)
    result = normpass("fold", workdir / "pre.onnx", "-o", workdir / "o.onnx", "--report", workdir / "o.onnx")
    assert_input_error(result)
    assert listing(workdir) == before


def test_output_directory_missing(normpass, workdir):
    before = listing(workdir)
    assert_input_error(normpass("fold", workdir / "pre.onnx", "-o", workdir / "nowhere" / "o.onnx"), "nowhere")
    assert_input_error(normpass("fold", workdir / "pre.onnx", "-o", workdir / "pre.onnx" / "o.onnx"))
    assert listing(workdir) == before


def test_output_is_a_directory(normpass, workdir):
    (workdir / "outdir").mkdir()
    before = listing(workdir)
    assert_input_error(normpass("fold", workdir / "pre.onnx", "-o", workdir / "outdir"), "outdir")
    assert listing(workdir) == before


def test_report_directory_missing_writes_nothing(normpass, workdir):
    before = listing(workdir)
    result = normpass("fold", workdir / "pre.onnx", "-o", workdir / "o.onnx", "--report", workdir / "no" / "r.json")
    assert_input_error(result)
    assert listing(workdir) == before


ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def test_unwritable_output_directory(normpass, workdir, tmp_path_factory):
    if ROOT:  # root may write anywhere os.access can see; /proc takes no new files, even from root
        out_dir = Path("/proc")
        before_dir = None
    else:
        out_dir = tmp_path_factory.mktemp("readonly")
        out_dir.chmod(0o555)
        before_dir = listing(out_dir)
    before = listing(workdir)
    try:
        result = normpass("fold", workdir / "pre.onnx", "-o", out_dir / "o.onnx", "--report", workdir / "r.json")
        assert_input_error(result)
        assert listing(workdir) == before
        assert not (out_dir / "o.onnx").exists()
        if before_dir is not None:
            assert listing(out_dir) == before_dir
    finally:
        if not ROOT:
            out_dir.chmod(0o755)


def test_model_and_builtin_are_exclusive(normpass, workdir):
    assert_input_error(normpass("inspect", workdir / "pre.onnx", "--builtin", "gpt2"), "exactly one")
    assert_input_error(normpass("inspect"), "exactly one")


@pytest.mark.parametrize(
    "args, suggestion",
    [
        (("fold", "m.onnx", "--provder", "cpu"), "did you mean --provider?"),  # before the missing -o
        (("fold", "m.onnx", "-o", "x.onnx", "--provder=cpu"), "did you mean --provider?"),
        (("inspect", "m.onnx", "--jsn"), "did you mean --json?"),
        (("fold", "m.onnx", "-o", "x.onnx", "--zzzzzz"), "(see normpass fold --help)"),
        (("fold", "m.onnx", "-o", "x.onnx", "second.onnx"), "(see normpass fold --help)"),
    ],
)
def test_mistyped_option_gets_the_verbs_usage_and_the_closest_option(normpass, workdir, args, suggestion):
    result = normpass(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"usage: normpass {args[0]} "), "the verb's usage, not the top-level one"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"normpass {args[0]}: error: unrecognized argument") and last.endswith(suggestion), last
    assert list(workdir.glob("x.onnx")) == []


def test_abbreviated_options_still_parse(normpass, workdir):
    result = normpass("fold", workdir / "pre.onnx", "-o", workdir / "x.onnx", "--no-verif", "--prov", "cpu")
    assert result.returncode == 0, result.stderr
    assert (workdir / "x.onnx").exists()


# --- exit 1: verification failed ------------------------------------------------------------------------------


def test_verification_failure_exits_1_and_writes_nothing(normpass, workdir):
    out, report_path = workdir / "noisy_out.onnx", workdir / "noisy.json"
    out.write_bytes(b"previous content")  # an existing output must survive a failed run
    before = listing(workdir)
    result = normpass("fold", workdir / "noisy.onnx", "-o", out, "--report", report_path, "--fold-with-beta-add")
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not match" in lines[0] and "Traceback" not in result.stderr
    assert listing(workdir) == before
    assert out.read_bytes() == b"previous content"
    # without verification the same fold is written
    ok = normpass("fold", workdir / "noisy.onnx", "-o", out, "--no-verify")
    assert ok.returncode == 0 and out.read_bytes() != b"previous content"


# --- nothing to fold --------------------------------------------------------------------------------------------


def test_rms_only_model_folds_nothing(normpass, workdir):
    out = workdir / "rms_out.onnx"
    result = normpass("fold", workdir / "rms_only.onnx", "-o", out)
    assert result.returncode == 0, result.stderr
    assert "0 of 1" in result.stdout
    inspected = normpass("inspect", workdir / "rms_only.onnx")
    assert inspected.returncode == 0 and "0 of 1" in inspected.stdout and "already an RMSNorm" in inspected.stdout
    original, folded = onnx.load(str(workdir / "rms_only.onnx")), onnx.load(str(out))
    assert op_counts(folded) == op_counts(original)
    feeds = make_inputs(original, seed=3)
    expected, got = run_ort(original, feeds), run_ort(folded, feeds)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


def test_llama_folds_nothing(normpass, tmp_path, registry_export):
    llama = registry_export("llama")
    before = sha256(llama)
    out, report_path = tmp_path / "llama_out.onnx", tmp_path / "llama.json"
    result = normpass("fold", llama, "-o", out, "--report", report_path)
    assert result.returncode == 0, result.stderr
    assert "0 of 5" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["folded"] == 0 and report["total"] == 5 and report["max_abs_error"] == 0.0
    assert sha256(llama) == before
    assert out.exists()


# --- built-in models --------------------------------------------------------------------------------------------


def test_builtin_gpt2(normpass, tmp_path, registry_export, monkeypatch):
    from normpass import models as builtin_models

    exported = registry_export("gpt2")  # before the patch below: the cache exports through normpass.models

    def export_onnx(name, path, form="dynamo"):  # the registry's own export, taken from the session's cache
        assert (name, form) == ("gpt2", "dynamo")
        return Path(shutil.copy(exported, path))

    monkeypatch.setattr(builtin_models, "export_onnx", export_onnx)
    out, report_path = tmp_path / "gpt2.onnx", tmp_path / "gpt2.json"
    result = normpass("fold", "--builtin", "gpt2", "-o", out, "--report", report_path)
    assert result.returncode == 0, result.stderr
    assert "4 of 5" in result.stdout  # the final LN's β has nowhere to go (tied LM head, no bias): kept
    report = json.loads(report_path.read_text())
    assert report["folded"] == 4 and report["total"] == 5 and report["max_rel_error"] <= 1e-5
    assert [n["kept"] for n in report["norms"]] == [False] * 4 + [True]
    folded = onnx.load(str(out))
    check_structure(folded)
    assert len(rms_nodes(folded)) == 4
    assert op_counts(folded)["LayerNormalization"] == 1


# --- the console script ---------------------------------------------------------------------------------------


def test_console_script_runs(workdir):
    """The installed `normpass` script itself, in a subprocess: --version and one fold."""
    version = subprocess.run(NORMPASS + ["--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"normpass {__version__}", version
    out = workdir / "script.onnx"
    result = subprocess.run(
        NORMPASS + ["fold", str(workdir / "pre.onnx"), "-o", str(out)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "1 of 2" in result.stdout and f"wrote {out}" in result.stdout
    folded = onnx.load(str(out))
    check_structure(folded)
    assert len(rms_nodes(folded)) == 1
