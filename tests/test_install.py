"""normpass without PyTorch: the ONNX path never imports it, and what needs it says which extra to install.

The first tests run normpass in a subprocess where `import torch` fails (`sys.modules["torch"] =
None`). The last installs the built wheel alone into a fresh virtual environment and uses it
there; it needs the wheel's path in `NORMPASS_WHEEL` (`.ci/run` builds the wheel and sets it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; "  # then `import torch` raises ModuleNotFoundError
CLI = "from normpass.cli.main import main; sys.exit(main(sys.argv[1:]))"
TORCH_EXTRA = "pip install 'normpass[torch]'"


def pre_ln_stack(path: Path) -> Path:
    """A 1-layer fp32 pre-LN transformer (3 LayerNorms, external weights) by tools/synthetic_stack.py (NumPy, onnx)."""
    subprocess.run(
        [sys.executable, str(TOOLS / "synthetic_stack.py"), str(path), "--params", "5e3", "--dtype", "float32"]
        + ["--hidden", "16", "--heads", "2", "--vocab", "48"],
        check=True,
        capture_output=True,
    )
    return path


def without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH + code, *args], capture_output=True, text=True)


def test_slice_without_torch_calibrates_in_one_process(tmp_path):
    """`combine` looks for a torch.distributed process group without importing torch: slicing needs no torch."""
    model = pre_ln_stack(tmp_path / "stack.onnx")
    out = tmp_path / "sliced.onnx"
    argv = ["slice", str(model), "-o", str(out), "--calib", "synthetic", "--samples", "8", "--ratio", "0.5"]
    run = without_torch(CLI, *argv, "--round-to", "4", "--input-shape", "input_ids:1x8")
    assert run.returncode == 0, run.stderr
    assert "1 of 1 residual streams sliced at ratio 0.5 (16 → 8, " in run.stdout and out.exists()  # then bases


def test_the_torch_api_without_torch_is_one_line_naming_the_extra():
    for code in ("import normpass; normpass.fold", "from normpass import inspect", "import normpass.torch.api"):
        run = without_torch(code)
        assert run.returncode == 1
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("normpass.errors.MissingExtraError: ") and last.endswith(TORCH_EXTRA), run.stderr
    run = without_torch("import normpass\ntry:\n    normpass.fold\nexcept ImportError as e:\n    print(e)")
    assert run.returncode == 0 and run.stdout.strip().endswith(TORCH_EXTRA)


def test_the_cli_without_torch_folds_onnx_and_refuses_torch_input_in_one_line(tmp_path):
    model = pre_ln_stack(tmp_path / "stack.onnx")
    run = without_torch(CLI, "fold", str(model), "-o", str(tmp_path / "out.onnx"))
    assert run.returncode == 0, run.stderr
    assert "2 of 3 norms folded into RMSNorm" in run.stdout
    for flags, extra in ((["--torch", "package.module:factory"], TORCH_EXTRA), (["--builtin", "gpt2"], "[models]")):
        run = without_torch(CLI, "fold", *flags, "-o", str(tmp_path / "torch.onnx"))
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert run.stderr.startswith("normpass fold: error: ") and extra in run.stderr
    assert not (tmp_path / "torch.onnx").exists()


ONNX_VERBS = """
import sys
from pathlib import Path
from normpass.cli.main import main
model, out = sys.argv[1], Path(sys.argv[2])
for verb, *flags in (
    ["inspect"], ["fold"], ["rotate"], ["slice", "--calib", "synthetic", "--ratio", "0.25"],
    ["replace", "--calib", "synthetic"], ["viz"],
):
    written = [] if verb == "inspect" else ["-o", str(out / (verb + (".html" if verb == "viz" else ".onnx")))]
    assert main([verb, model, *flags, *written]) == 0, verb
print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
"""


def contrib_model(path: Path) -> Path:
    """x → MatMul → FastGelu (an ONNX Runtime contrib op: shapes from ORT's symbolic inference) → LayerNorm."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = [
        numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("FastGelu", ["h"], ["a"], domain="com.microsoft"),
        helper.make_node("LayerNormalization", ["a", "gamma", "beta"], ["y"], axis=-1),
    ]
    ends = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 4, 8]) for name in ("x", "y")]
    graph = helper.make_graph(nodes, "contrib", ends[:1], ends[1:], weights)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed: nothing imports it")
def test_the_onnx_verbs_do_not_import_torch_where_it_is_installed(tmp_path):
    """Every ONNX verb in one process, on a model whose shapes need ONNX Runtime's symbolic inference (whose
    package, `onnxruntime.tools`, imports torch): torch is never imported, so no call pays for it."""
    model = contrib_model(tmp_path / "contrib.onnx")
    run = subprocess.run([sys.executable, "-c", ONNX_VERBS, str(model), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


WHEEL = os.environ.get("NORMPASS_WHEEL")


@pytest.mark.skipif(not WHEEL, reason="set NORMPASS_WHEEL to a built wheel to test it in a fresh venv (.ci/run does)")
def test_the_wheel_alone_installs_without_torch_and_folds_an_onnx_file(tmp_path):
    wheel = Path(str(WHEEL))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/")[0] for name in names} == {
        "normpass",
        f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info",
    }
    assert "normpass/py.typed" in names and "normpass/models/data/sentences.txt" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, normpass = venv / "bin" / "python", venv / "bin" / "normpass"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True)
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True)
    packages = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert {"normpass", "onnx", "onnxruntime", "onnx-ir", "numpy", "networkx"} <= packages
    assert not {p for p in packages if p == "torch" or p.startswith(("nvidia", "triton"))}

    model = pre_ln_stack(tmp_path / "stack.onnx")
    report = tmp_path / "report.json"
    run = subprocess.run(
        [str(normpass), "fold", str(model), "-o", str(tmp_path / "out.onnx"), "--report", str(report)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    folded = json.loads(report.read_text())
    assert (folded["folded"], folded["total"], folded["verified"]) == (2, 3, True)

    run = subprocess.run(
        [str(normpass), "fold", "--torch", "m:f", "-o", str(tmp_path / "t.onnx")], capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stderr.strip().endswith(TORCH_EXTRA), run.stderr
    run = subprocess.run([str(python), "-c", "import normpass; normpass.fold"], capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].endswith(TORCH_EXTRA), run.stderr


def test_every_package_of_the_source_tree_is_in_the_wheel_list():
    """pyproject.toml names the packages the wheel takes; a package folder missing there installs without it
    (the wheel's CLI then fails to import it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts) for init in (root / "normpass").rglob("__init__.py")} | {
        "normpass.models"
    }
    assert found == listed
