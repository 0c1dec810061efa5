"""The error contract of the verbs added after fold and inspect (issue 37, items 8–15): `fold --ort-optimizer`,
`bench`, `distill`, `viz` and stopping signals. Each case is a test that fails without its fix.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import build, calls_made, load_module
from test_contract import D, cli, ln_model, refused

from normpass import FoldOptions, fold_onnx
from normpass.cli.main import build_parser
from normpass.errors import InputError
from normpass.onnx.runtime.ortopt import OrtOptimizer
from normpass.viz import build_view

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(ln_model(), path)
    return path


@pytest.fixture()
def no_ort_optimizer(monkeypatch):
    """ONNX Runtime's transformers optimizer fails the test if it is called."""
    from onnxruntime.transformers import optimizer

    def refuse(*args, **kwargs):
        raise AssertionError("ORT's optimizer ran on settings that should have been refused")

    monkeypatch.setattr(optimizer, "optimize_model", refuse)


# --- 8–10. fold --ort-optimizer -----------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, says",
    [
        ("gpt2:5:64", "5 heads do not divide the hidden size 64"),
        ("gpt2:0:64", "0 heads and hidden size 64: give each from 1"),
        ("gpt2:4:0", "4 heads and hidden size 0: give each from 1"),
        (f"gpt2:{10**20}:64", f"{10**20} heads and hidden size 64: give each from 1"),
        (f"gpt2:{10**20}:{10**20}", "(an ONNX int64)"),
    ],
)
def test_ort_optimizer_heads_that_do_not_divide_the_hidden_size_are_refused_before_it_runs(
    capsys, tmp_path, model_file, no_ort_optimizer, spec, says
):
    line = refused(capsys, "fold", model_file, "-o", tmp_path / "o.onnx", "--ort-optimizer", spec)
    assert says in line and spec in line and not (tmp_path / "o.onnx").exists()


def test_ort_optimizer_settings_are_checked_through_the_api_too(no_ort_optimizer):
    with pytest.raises(InputError, match="5 heads do not divide the hidden size 64"):
        fold_onnx(ln_model(), FoldOptions(ort_optimizer=OrtOptimizer("gpt2", 5, 64)))


def test_ort_optimizer_report_says_what_was_detected_not_zeros(capsys, tmp_path, registry_export):
    """GPT-2 of the registry: hidden size 64 (its fused norms' width); no attention fused, so no heads."""
    report = tmp_path / "r.json"
    args = ["fold", registry_export("gpt2"), "-o", tmp_path / "o.onnx", "--provider", "cpu", "--report", report]
    code, _, err = cli(capsys, *args, "--ort-optimizer", "gpt2")
    assert code == 0, err
    settings = json.loads(report.read_text())["ort_optimizer"]
    assert settings["hidden_size"] == 64 and settings["num_heads"] is None and settings["detected"] is True
    assert settings["fused"]["SkipLayerNormalization"] > 0


def test_fold_torch_refuses_ort_optimizer_and_help_says_so(capsys, tmp_path, monkeypatch):
    (tmp_path / "untouched_factory.py").write_text("def make():\n    raise AssertionError('must not run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused(
        capsys, "fold", "--torch", "untouched_factory:make", "--ort-optimizer", "bert", "-o", tmp_path / "o.onnx"
    )
    assert "--ort-optimizer does not apply to --torch" in line and not (tmp_path / "o.onnx").exists()
    (fold_parser,) = [p for name, p in build_parser()._subparsers._group_actions[0].choices.items() if name == "fold"]
    helps = {option: action.help for action in fold_parser._actions for option in action.option_strings}
    assert "--ort-optimizer is refused" in helps["--torch"] and "not with --torch" in helps["--ort-optimizer"]


def test_ort_optimizer_progress_bars_stay_off_stderr(capsys, tmp_path, model_file):
    """The unet optimizer draws tqdm bars; after a success stderr holds nothing (or `warning:` lines)."""
    code, _, err = cli(
        capsys, "fold", model_file, "-o", tmp_path / "o.onnx", "--provider", "cpu", "--ort-optimizer", "unet"
    )
    assert code == 0, err
    assert all(line.startswith("normpass fold: warning: ") for line in err.splitlines()), err
    assert "it/s" not in err and "\r" not in err


# --- 14. viz: near-linear in the graph's size ----------------------------------------------------


def test_viz_work_grows_with_the_graph_and_plan_not_with_their_product():
    """On a pre-LN chain every norm's proof region reaches back along the residual stream: a walk per norm
    (and per centred layer) made the view cubic in the depth. Its work per unit of input (nodes, edges and
    the plan's centrings) stays flat from 10 to 40 blocks."""
    bench_viz = load_module(TOOLS / "bench_viz.py")
    per_unit = []
    for blocks in (10, 40):
        zmg, fold_plan = bench_viz.analyse(bench_viz.pre_ln_chain(blocks))
        size = (
            len(zmg.nodes)
            + sum(len(n.inputs) for n in zmg.nodes.values())
            + sum(len(d.centrings) for d in fold_plan.decisions)
        )
        for full in (False, True):
            per_unit.append(calls_made(build_view, zmg, fold_plan, full=full) / size)
    small_default, small_full, large_default, large_full = per_unit
    assert large_default < 1.5 * small_default and large_full < 1.5 * small_full, per_unit


# --- 11. bench -------------------------------------------------------------------------------------


def _failing_at_run_time() -> onnx.ModelProto:
    """`ln_model`'s signature (x: float[B, 8] → y), but a Reshape to [3, -1]: fails unless 3 divides 8·B."""
    return build(
        f"""<ir_version: 10, opset_import: ["" : 17]>
agraph (float[B, {D}] x) => (float[B, {D}] y) {{
  shape = Constant<value = int64[2] {{3, -1}}>()
  y = Reshape(x, shape)
}}"""
    )


@pytest.mark.parametrize(
    "option, value",
    [
        ("--batch", "0"),
        ("--seq", "0"),
        ("--threads", "-3"),
        ("--repeats", "0"),
        ("--warmup", "-1"),
        ("--budget", "nan"),
    ],
)
def test_bench_refuses_sizes_below_one_as_bad_options(capsys, tmp_path, model_file, option, value):
    line = refused(capsys, "bench", model_file, model_file, "--no-progress", "--repeats", "1", option, value)
    assert f"{option} {value}: give a number of at least" in line and str(model_file) not in line


def test_bench_names_the_one_model_that_does_not_run(capsys, tmp_path, model_file):
    failing = tmp_path / "failing.onnx"
    onnx.save(_failing_at_run_time(), failing)
    line = refused(capsys, "bench", model_file, failing, "--no-progress", "--repeats", "1", "--batch", "1")
    assert f"{failing}: ONNX Runtime cannot run it at batch 1" in line and str(model_file) not in line


# --- 12. distill ----------------------------------------------------------------------------------

FACTORIES = """
import sys

import torch


class Coloured(torch.nn.Linear):
    def forward(self, x):
        raise ValueError("\\x1b[96mshapes\\x1b[0m do not fit")


def pair_with_int():
    return torch.nn.Linear(4, 4).eval(), 5


def exits():
    sys.exit(7)


def wrong_inputs():
    return torch.nn.Linear(4, 4).eval(), (torch.zeros(2, 3),)


def coloured_error():
    return Coloured(4, 4).eval(), (torch.zeros(2, 4),)


def linear():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).eval(), (torch.zeros(2, 4),)
"""


@pytest.fixture()
def factories(tmp_path, monkeypatch):
    (tmp_path / "verb_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    np.savez(tmp_path / "calib.npz", x=np.zeros((32, 4), dtype=np.float32))
    return tmp_path


@pytest.fixture()
def no_training(monkeypatch):
    import normpass.torch.distill

    def refuse(*args, **kwargs):
        raise AssertionError("distill trained on a factory it should have refused")

    monkeypatch.setattr(normpass.torch.distill, "distill", refuse)


def _distill(capsys, directory, factory, *more):
    out = directory / "o.onnx"
    line = refused(
        capsys, "distill", "--torch", f"verb_factories:{factory}", "--calib", directory / "calib.npz", "-o", out, *more
    )
    assert not out.exists()
    return line


@pytest.mark.parametrize(
    "factory, says",
    [
        (
            "pair_with_int",
            "example_inputs must be a tensor or a tuple of arguments, got int",
        ),
        ("exits", "the factory exited (sys.exit(7))"),
        (
            "wrong_inputs",
            "the module does not run on its example inputs: RuntimeError: mat1 and mat2 shapes cannot be multiplied",
        ),
        ("coloured_error", "the module does not run on its example inputs: ValueError: shapes do not fit"),
    ],
)
def test_distill_refuses_a_bad_factory_before_training_in_one_plain_line(capsys, factories, no_training, factory, says):
    line = _distill(capsys, factories, factory)
    assert f"factory 'verb_factories:{factory}': " in line and says in line and "\x1b" not in line


@pytest.mark.parametrize("limit", ["-1", "0", "nan"])
def test_distill_refuses_a_time_limit_that_is_not_positive(capsys, factories, no_training, limit):
    assert f"--time-limit {limit}: give seconds > 0" in _distill(capsys, factories, "linear", "--time-limit", limit)


def test_torch_export_logs_no_torchvision_lines(tmp_path):
    """torch.onnx's exporter logs four `torchvision is not installed` lines through its own stderr handler on
    the first export of a process (where torchvision is missing): a fresh process shows whether they pass."""
    (tmp_path / "verb_factories.py").write_text(FACTORIES)
    command = [
        sys.executable,
        "-m",
        "normpass",
        "fold",
        "--torch",
        "verb_factories:linear",
        "-o",
        str(tmp_path / "o.onnx"),
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(tmp_path)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "torchvision" not in done.stderr and (tmp_path / "o.onnx").exists()


# --- 15. a signal once the work is done ------------------------------------------------------------

# `normpass ARGS` (as the program: `main()` reads sys.argv) that sends itself a signal once the work is
# done: `guard`, when the verb has returned (model and report written, summary printed) and the guard
# is putting away what it set up around it; `program`, when the guard has returned, before the
# interpreter exits.
SIGNAL_WHEN_DONE = """
import contextlib, os, signal, sys
from normpass.cli import guard
from normpass.cli.main import main

when, signum = sys.argv[1], getattr(signal, sys.argv[2])
sys.argv = ["normpass", *sys.argv[3:]]
if when == "guard":
    caught = guard._caught_messages

    @contextlib.contextmanager
    def then_signal(notes):
        with caught(notes):
            yield
            os.kill(os.getpid(), signum)

    guard._caught_messages = then_signal
else:
    run = guard.run

    def then_signal(*args, **kwargs):
        code = run(*args, **kwargs)
        os.kill(os.getpid(), signum)
        return code

    guard.run = then_signal
sys.exit(main())
"""


def test_a_signal_after_the_work_is_done_changes_nothing(tmp_path, model_file):
    """A SIGTERM, SIGHUP or SIGINT after both outputs are written and the summary printed: exit 0, no line
    (it was 143 / 129 with no line after the guard, a `terminated` line and 143 / 129 / 130 inside it)."""
    cases = [(when, name) for when in ("guard", "program") for name in ("SIGTERM", "SIGHUP", "SIGINT")]
    runs = []
    for index, (when, name) in enumerate(cases):
        out, report = tmp_path / f"o{index}.onnx", tmp_path / f"r{index}.json"
        argv = ["fold", str(model_file), "-o", str(out), "--report", str(report), "--provider", "cpu"]
        command = [sys.executable, "-c", SIGNAL_WHEN_DONE, when, name, *argv]
        runs.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out, report))
    for (when, name), (process, out, report) in zip(cases, runs, strict=True):
        stdout, stderr = process.communicate(timeout=300)
        assert (process.returncode, stderr) == (0, ""), (when, name, process.returncode, stderr)
        assert f"wrote {out}" in stdout and out.exists() and json.loads(report.read_text())["output"] == str(out)
