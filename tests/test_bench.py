"""`normpass.onnx.runtime.bench` and `normpass bench` on the small registry GPT-2: inputs per point, interleaved
timing, the JSON/CSV schema, the plot, and refusing models that are not equivalent."""

from __future__ import annotations

import csv
import io
import json
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from normpass.cli.main import main
from normpass.errors import InputError, VerificationError
from normpass.onnx.runtime import bench

REPEATS = 2


@pytest.fixture(scope="module")
def gpt2_pair(registry_export, registry_fold, tmp_path_factory):
    """(original path, folded path) of the registry gpt2."""
    folded = tmp_path_factory.mktemp("bench") / "gpt2.rms.onnx"
    onnx.save(registry_fold("gpt2").model, str(folded))
    return str(registry_export("gpt2")), str(folded)


def _perturbed(path: str, out) -> str:
    """A copy of the model at `path` with its largest initializer scaled by 1.5."""
    model = onnx.load(path)
    init = max(model.graph.initializer, key=lambda i: np.prod(i.dims))
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.5), init.name))
    onnx.save(model, str(out))
    return str(out)


def test_point_inputs_override_dynamic_dims_with_ids_in_range(gpt2_pair):
    model = onnx.load(gpt2_pair[0], load_external_data=False)
    assert bench.point_shapes(model, 3, 40) == {"input_ids": (3, 40)}
    feeds = bench.make_feeds(model, 3, 40)
    assert feeds["input_ids"].shape == (3, 40)
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() < 128  # the registry gpt2's vocabulary


def test_image_model_keeps_fixed_dims(registry_export):
    model = onnx.load(str(registry_export("vit")), load_external_data=False)
    assert bench.point_shapes(model, 4, 999) == {"pixel_values": (4, 3, 32, 32)}


def test_run_benchmark_report_schema(gpt2_pair):
    candidates = [bench.Candidate("original", gpt2_pair[0]), bench.Candidate("folded", gpt2_pair[1])]
    report = bench.run_benchmark(candidates, [(1, 8), (2, 16)], repeats=REPEATS, warmup=1, progress=False, sweep="seq")
    json.dumps(report)  # JSON-ready
    assert {"machine", "settings", "models", "baseline", "points"} <= set(report)
    assert report["baseline"] == "original" and report["settings"]["repeats"] == REPEATS
    assert [(p["batch"], p["seq"]) for p in report["points"]] == [(1, 8), (2, 16)]
    for point in report["points"]:
        base, folded = point["results"]["original"], point["results"]["folded"]
        assert len(base["runs_ms"]) == len(folded["runs_ms"]) == REPEATS
        assert base["p25_ms"] <= base["median_ms"] <= base["p75_ms"] and "ratio" not in base
        assert folded["ratio"] == pytest.approx(folded["median_ms"] / base["median_ms"])
        assert folded["ratio_p25"] <= folded["ratio_p75"]
        assert folded["checked"] and folded["max_rel_error"] < 1e-4
    rows = list(csv.DictReader(io.StringIO(bench.to_csv(report))))
    assert len(rows) == 4 and list(rows[0]) == list(bench.CSV_FIELDS)
    assert [r["model"] for r in rows] == ["original", "folded"] * 2
    assert rows[0]["ratio"] == "" and float(rows[1]["ratio"]) > 0


def test_refuses_models_whose_outputs_differ(gpt2_pair, tmp_path):
    wrong = _perturbed(gpt2_pair[1], tmp_path / "wrong.onnx")
    candidates = [bench.Candidate("original", gpt2_pair[0]), bench.Candidate("wrong", wrong)]
    with pytest.raises(VerificationError, match="outputs differ"):
        bench.run_benchmark(candidates, [(1, 8)], repeats=REPEATS, progress=False)


def test_unchecked_candidate_is_timed_and_its_error_reported(gpt2_pair, tmp_path):
    bound = _perturbed(gpt2_pair[1], tmp_path / "bound.onnx")
    candidates = [bench.Candidate("original", gpt2_pair[0]), bench.Candidate("bound", bound, check=False)]
    report = bench.run_benchmark(candidates, [(1, 8)], repeats=REPEATS, warmup=0, progress=False)
    result = report["points"][0]["results"]["bound"]
    assert not result["checked"] and result["max_rel_error"] > 1e-2


def test_cpu_clock_times_runs_by_process_time(gpt2_pair):
    candidates = [bench.Candidate("original", gpt2_pair[0]), bench.Candidate("folded", gpt2_pair[1])]
    report = bench.run_benchmark(candidates, [(1, 8)], repeats=REPEATS, warmup=0, progress=False, clock="cpu")
    assert report["settings"]["clock"] == "cpu"
    assert all(t > 0 for r in report["points"][0]["results"].values() for t in r["runs_ms"])
    with pytest.raises(InputError, match="clock"):
        bench.run_benchmark(candidates, [(1, 8)], provider="cuda", clock="cpu", progress=False)


def test_profile_takes_each_nodes_fastest_run(gpt2_pair):
    paths = {"original": gpt2_pair[0], "folded": gpt2_pair[1]}
    feeds = bench.make_feeds(onnx.load(gpt2_pair[0], load_external_data=False), 1, 8)
    fastest = bench.profile_ops(paths, feeds, threads=1, runs=3, statistic="min")
    assert set(fastest) == set(paths) and fastest["original"]["MatMul"] > 0
    assert "LayerNormalization" in fastest["original"] and "LayerNormalization" not in fastest["folded"]
    with pytest.raises(InputError, match="statistic"):
        bench.profile_ops(paths, feeds, statistic="median")


def test_refuses_different_signatures(gpt2_pair, registry_export):
    candidates = [bench.Candidate("original", gpt2_pair[0]), bench.Candidate("vit", str(registry_export("vit")))]
    with pytest.raises(InputError, match="differ"):
        bench.run_benchmark(candidates, [(1, 8)], repeats=REPEATS, progress=False)


class _Recorder:
    """A runner that takes `seconds` per run and logs its label in `log`."""

    def __init__(self, label, log, seconds=0.0):
        self.label, self.log, self.seconds = label, log, seconds

    def time_run(self) -> float:
        self.log.append(self.label)
        time.sleep(self.seconds)
        return self.seconds


def test_interleave_rotates_the_order_every_round():
    log = []
    times = bench.interleave({k: _Recorder(k, log) for k in "abc"}, repeats=3, warmup=1)
    assert "".join(log) == "abc" + "bca" + "cab" + "abc"  # one warm-up round, then three timed rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_budget_raises_repeats_for_short_points():
    log = []
    times = bench.interleave({k: _Recorder(k, log, 0.002) for k in "ab"}, repeats=2, warmup=1, budget_s=0.2)
    assert 10 < len(times["a"]) == len(times["b"]) < 60


@pytest.mark.parametrize("spec", ["seq", "seq=", "len=1,2", "seq=a,b", "seq=0,4"])
def test_parse_sweep_rejects(spec):
    with pytest.raises(InputError, match=r"^sweep "):
        bench.parse_sweep(spec)


def test_parse_sweep():
    assert bench.parse_sweep("batch=1,4") == ("batch", [1, 4])


def test_cuda_without_the_provider_is_bad_input(gpt2_pair):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(InputError, match="CUDAExecutionProvider"):
        bench.open_session(gpt2_pair[0], "cuda")


def test_cli_sweep_writes_json_csv_and_plot(gpt2_pair, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = {ext: tmp_path / f"r.{ext}" for ext in ("json", "csv", "png")}
    code = main(
        [
            "bench",
            *gpt2_pair,
            "--sweep",
            "seq=8,16",
            "--repeats",
            str(REPEATS),
            "--warmup",
            "1",
            "--no-progress",
            "--json",
            str(out["json"]),
            "--csv",
            str(out["csv"]),
            "--plot",
            str(out["png"]),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "ratio" in printed and len(printed.strip().splitlines()) == 4  # header, 2 points, "wrote ..."
    report = json.loads(out["json"].read_text())
    assert report["settings"]["sweep"] == "seq" and [p["seq"] for p in report["points"]] == [8, 16]
    assert len(out["csv"].read_text().splitlines()) == 5
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_mismatch_with_exit_1(gpt2_pair, tmp_path, capsys):
    wrong = _perturbed(gpt2_pair[1], tmp_path / "wrong.onnx")
    assert main(["bench", gpt2_pair[0], wrong, "--repeats", "1", "--seq", "8", "--no-progress"]) == 1
    assert "outputs differ" in capsys.readouterr().err


def test_cli_times_a_model_within_an_explicit_bound(gpt2_pair, tmp_path, capsys):
    wrong = _perturbed(gpt2_pair[1], tmp_path / "wrong.onnx")
    args = ["bench", gpt2_pair[0], wrong, "--repeats", "1", "--seq", "8", "--no-progress", "--json"]
    assert main([*args, str(tmp_path / "tight.json"), "--max-diff", "1e-6"]) == 1
    assert "--max-diff" in capsys.readouterr().err and not (tmp_path / "tight.json").exists()
    assert main([*args, str(tmp_path / "loose.json"), "--max-diff", "10"]) == 0
    result = json.loads((tmp_path / "loose.json").read_text())["points"][0]["results"]["optimized"]
    assert result["checked"] and result["bound"] == 10 and 1e-6 < result["max_rel_error"] <= 10
    assert main([*args, str(tmp_path / "bad.json"), "--max-diff", "-1"]) == 2


def test_cli_missing_model_exit_2(gpt2_pair, tmp_path, capsys):
    assert main(["bench", gpt2_pair[0], str(tmp_path / "nope.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err


class _FakeSession:
    def __init__(self, path: str, calls: list):
        calls.append(path)

    def get_outputs(self):
        return [type("Output", (), {"name": "y"})()]

    def run(self, names, feeds):
        return [np.zeros(1)]


@pytest.mark.parametrize(("provider", "fp16", "opened"), [("cuda", False, 2), ("cuda", True, 0), ("cpu", False, 0)])
def test_cuda_outputs_are_checked_with_tf32_off_where_a_model_has_fp32_matrices(
    gpt2_pair, tmp_path, monkeypatch, provider, fp16, opened
):
    """ORT's CUDA provider computes fp32 MatMuls in TF32 by default: the check runs each model once more with
    use_tf32=0 where TF32 could touch it (fp32 weight matrices), and only on CUDA."""
    paths = list(gpt2_pair)
    if fp16:
        from normpass.onnx.runtime.precision import to_fp16

        paths = [str(tmp_path / f"{i}.onnx") for i in range(2)]
        for source, path in zip(gpt2_pair, paths, strict=True):
            onnx.save(to_fp16(onnx.load(source)), path)
    calls: list = []
    seen_tf32: list = []

    def fake_open(path, provider, threads=0, optimized_model_path=None, tf32=True):
        seen_tf32.append(tf32)
        return _FakeSession(path, calls)

    monkeypatch.setattr(bench, "open_session", fake_open)
    candidates = [bench.Candidate(label, path) for label, path in zip(("a", "b"), paths, strict=True)]
    outputs = bench._checked_outputs(candidates, {}, provider, 0, (1, 8))
    assert len(calls) == opened and seen_tf32 == [False] * opened
    assert (outputs is None) == (opened == 0)
