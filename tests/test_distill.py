"""`normpass.distill` and `normpass distill` (normpass/torch/distill.py, normpass/cli/distill.py).

The registry's post-LN BERT (seeded weights, 5 LayerNorms: the embedding one folds exactly, 4
candidates) with seeded token batches, distilled for a few dozen steps: the same seed gives the
same weights, a loose budget stops training early, smooth removal ends at α = 0 with no blend
left, the student exports to ONNX with no norm op for the replaced norms and matches in plain
onnxruntime; the CLI refuses bad input with exit 2 and writes its report on exit 1.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import normpass
from normpass import DistillOptions, models
from normpass.cli.main import main
from normpass.torch.surrogates import SmoothRemoval, SurrogateNorm

FAST = {"steps": 24, "eval_every": 6, "batch_size": 8, "calibration_samples": 32}
VOCAB, LENGTH = 128, 16


def calibration(count: int = 12, seed: int = 0) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (8, LENGTH), generator=gen),) for _ in range(count)]


@pytest.fixture(scope="module")
def bert():
    module, inputs = models.get("bert").build_torch()
    return module, inputs


@pytest.fixture(scope="module")
def distilled(bert):
    module, _ = bert
    options = DistillOptions(budget="cos=0.99", keep=1, **FAST)
    return normpass.distill(module, calibration(), options)


def _norm_ops(model: onnx.ModelProto) -> collections.Counter:
    ops = ("LayerNormalization", "RMSNormalization", "ReduceMean")
    return collections.Counter(n.op_type for n in model.graph.node if n.op_type in ops)


def test_same_seed_gives_the_same_weights(bert, distilled):
    module, _ = bert
    student, _ = distilled
    again, _ = normpass.distill(module, calibration(), DistillOptions(budget="cos=0.99", keep=1, **FAST))
    first, second = student.state_dict(), again.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_smooth_removal_ends_at_alpha_zero_with_plain_surrogates_left(bert, distilled):
    module, inputs = bert
    student, report = distilled
    data = report.to_json()
    assert (data["total"], data["exact"], data["replaced"], len(data["kept"])) == (5, 1, 3, 1)
    assert not any(isinstance(m, SmoothRemoval) for m in student.modules())
    surrogates = {path for path, m in student.named_modules() if isinstance(m, SurrogateNorm)}
    assert surrogates == {n for n, d in report.decisions().items() if d == "replaced"}
    kept = student.get_submodule(data["kept"][0])
    assert type(kept) is nn.LayerNorm  # the most damaging norm alone stays a norm
    alone = {r["name"]: r["alone_calibrated"]["budget_used"] for r in data["norms"] if "alone_calibrated" in r}
    assert alone[data["kept"][0]] == max(alone.values())
    history = data["rounds"][0]["history"]
    ramp_end = int(0.3 * FAST["steps"])
    assert history and history[0]["step"] >= ramp_end  # judged only once α reached 0
    assert all(r["emission"]["beta"].startswith("migrated") for r in data["norms"] if r["decision"] == "replaced")
    assert report.passed and data["test"]["cos_min"] >= 0.99 and data["test"]["cos_min"] > data["calibrated"]["cos_min"]
    with torch.no_grad():  # the user's module is untouched and the student differs from it only a little
        cos = torch.nn.functional.cosine_similarity(module(*inputs).flatten(1), student(*inputs).flatten(1))
    assert float(cos.min()) >= 0.98


def test_by_default_the_linear_layers_train_and_the_embeddings_do_not(bert, distilled):
    module, _ = bert
    student, report = distilled
    frozen, _ = normpass.distill(
        module, calibration(), DistillOptions(budget="cos=0.99", keep=1, train="surrogates", **FAST)
    )
    assert report.to_json()["train"] == "linears"
    trained, untrained = student.state_dict(), frozen.state_dict()
    tables = [k for k, v in trained.items() if "embeddings" in k and "LayerNorm" not in k and v.dim() == 2]
    assert tables and all(torch.equal(trained[k], untrained[k]) for k in tables)
    linears = [path for path, m in student.named_modules() if isinstance(m, nn.Linear)]
    changed = [p for p in linears if not torch.equal(trained[f"{p}.weight"], untrained[f"{p}.weight"])]
    assert len(changed) == len(linears)


def test_training_stops_when_the_budget_holds_on_the_decide_split(bert):
    module, _ = bert
    options = DistillOptions(budget="cos=0.9", steps=100, ramp=0.05, eval_every=2, batch_size=8, calibration_samples=32)
    _, report = normpass.distill(module, calibration(), options)
    (only,) = report.to_json()["rounds"]
    assert only["stopped"] == "the budget holds on the decide split"
    assert 5 <= only["steps"] < 100 and only["history"][-1]["decide"]["cos_min"] >= 0.9
    assert all(h["decide"]["cos_min"] < 0.9 for h in only["history"][:-1])  # it stopped at the first that held
    assert report.replaced == 4 and not report.to_json()["kept"]


def test_student_exports_to_onnx_without_norm_ops_for_replaced_norms(bert, distilled, tmp_path):
    _, inputs = bert
    student, _ = distilled
    path = tmp_path / "student.onnx"
    torch.onnx.export(student, inputs, str(path), dynamo=True, input_names=["input_ids"], verbose=False)
    exported = onnx.load(str(path))
    onnx.checker.check_model(exported)
    after = _norm_ops(exported)  # the original exports 4 LayerNormalization ops and the exact fold's RMSNorm
    assert after["LayerNormalization"] == 1  # the kept norm
    assert after["ReduceMean"] + after["RMSNormalization"] <= 1  # the exact fold's RMSNorm
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input_ids": inputs[0].numpy()})
    with torch.no_grad():
        want = student(*inputs).numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_all_norms_distils_a_student_without_a_norm_op_and_with_one_affine_op(bert, tmp_path):
    """`all_norms`: the exact fold's RMSNorm is trained away too; the affine surrogates' γ is carried along
    the residual stream, so the student's ONNX export has no norm op and one Mul (the last surrogate's)."""
    module, inputs = bert
    options = DistillOptions(budget="cos=0.5", all_norms=True, rounds=1, **FAST)
    student, report = normpass.distill(module, calibration(), options)
    data = report.to_json()
    assert (data["total"], data["exact"], data["replaced"]) == (5, 0, 5)
    modules = [m for _, m in student.named_modules() if isinstance(m, SurrogateNorm)]
    assert len(modules) == 5 and sum(m.gamma is not None for m in modules) == 1
    path = tmp_path / "norm-free.onnx"
    torch.onnx.export(student, inputs, str(path), dynamo=True, input_names=["input_ids"], verbose=False)
    exported = onnx.load(str(path))
    assert not _norm_ops(exported)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input_ids": inputs[0].numpy()})
    with torch.no_grad():
        want = student(*inputs).numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# --- the command line ----------------------------------------------------------------------------

FACTORY = """
from normpass import models


def make():
    return models.get("bert").build_torch()
"""


@pytest.fixture
def cli_files(tmp_path, monkeypatch):
    (tmp_path / "distill_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    gen = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=gen.integers(0, VOCAB, (96, LENGTH)).astype(np.int64))
    return tmp_path


def _cli(*args) -> int:
    fast = ["--steps", "12", "--eval-every", "4", "--batch-size", "8", "--no-progress"]
    return main(["distill", "--torch", "distill_factory:make", *fast, *args])


def test_cli_distills_exports_and_checks_the_onnx_file(cli_files, capsys):
    out, report = cli_files / "student.onnx", cli_files / "report.json"
    code = _cli(
        "--calib",
        str(cli_files / "calib.npz"),
        "--budget",
        "cos=0.99",
        "--keep",
        "1",
        "-o",
        str(out),
        "--report",
        str(report),
    )
    assert code == 0, capsys.readouterr().err
    data = json.loads(report.read_text())
    assert data["output"] == str(out) and data["passed"] and data["replaced"] == 3
    assert data["onnx"]["norm_ops"].get("LayerNormalization") == 1  # the kept norm only
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert "wrote" in capsys.readouterr().out
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])  # not only the example's shape
    (name,) = [i.name for i in session.get_inputs()]
    (result,) = session.run(None, {name: np.random.default_rng(1).integers(0, VOCAB, (3, LENGTH - 5))})
    assert result.shape[0] == 3 and np.isfinite(result).all()


def test_cli_keeps_one_more_norm_per_round_then_writes_only_the_report_on_exit_1(cli_files, capsys):
    out, report = cli_files / "student.onnx", cli_files / "report.json"
    args = ["--budget", "cos=0.999999", "--rounds", "2", "-o", str(out), "--report", str(report)]
    assert _cli("--calib", str(cli_files / "calib.npz"), *args) == 1 and not out.exists()
    data = json.loads(report.read_text())
    assert data["output"] is None and data["passed"] is False
    assert [len(r["kept"]) for r in data["rounds"]] == [0, 1] and len(data["kept"]) == 1  # no third round
    assert data["replaced"] == 3 and data["rounds"][1]["stopped"] == "steps done"
    assert "misses the budget" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--calib", "{dir}/empty.txt"], "no sentences"),
        (["--calib", "{dir}/few.npz"], "few"),
        (["--calib", "{dir}/calib.npz", "--keep", "model.nothing"], "no candidate norm"),
        (["--calib", "{dir}/calib.npz", "--steps", "0"], "--steps"),
        (["--calib", "{dir}/calib.npz", "--budget", "cos=2"], "--budget"),
        (["--calib", "{dir}/calib.npz", "--device", "tpu"], "--device 'tpu': give cpu, cuda or cuda:N"),
        pytest.param(
            ["--calib", "{dir}/calib.npz", "--device", "cuda"],
            "sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device"),
        ),
    ],
)
def test_cli_refuses_bad_calibration_and_options_with_one_line(cli_files, capsys, args, message):
    (cli_files / "empty.txt").write_text("")
    np.savez(cli_files / "few.npz", x=np.zeros((2, LENGTH), dtype=np.int64))
    args = [a.replace("{dir}", str(cli_files)) for a in args]
    assert _cli(*args, "-o", str(cli_files / "o.onnx")) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (cli_files / "o.onnx").exists()


def test_cli_refuses_an_onnx_model_and_says_to_give_the_module(cli_files, capsys):
    model = cli_files / "model.onnx"
    model.write_bytes(b"")
    assert main(["distill", str(model), "--calib", str(cli_files / "calib.npz"), "-o", str(cli_files / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert "--torch package.module:factory" in err and len(err.strip().splitlines()) == 1


def test_the_output_gap_leaves_ids_out_and_the_budget_judges_them():
    """Ids have no gradient and no cosine: the training gap is over the float outputs alone (0 without
    one), and the judge compares the ids by agreement."""
    from normpass.core.budget import compare
    from normpass.torch.distill import output_gap

    logits = torch.randn(2, 3, 5)
    ids, other = logits.argmax(-1), (-logits).argmax(-1)
    assert float(output_gap((logits, ids), (logits, other), None)) == pytest.approx(0.0, abs=1e-6)
    assert float(output_gap((ids,), (other,), None)) == 0.0
    assert float(output_gap((-logits, ids), (logits, ids), None)) == pytest.approx(2.0)
    metrics = compare([{"ids": ids.numpy()}], [{"ids": other.numpy()}])
    assert metrics.top1 == 0.0 and metrics.cos_min is None
