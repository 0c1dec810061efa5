"""The slice tools: `tools/bench_gpu.py`'s `slice-R` variant and `tools/check_slicegpt.py`'s width and refusal
(the SliceGPT run itself needs a TransformerCompression checkout and its transformers 4.41: not here)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import load_module, run_ort

from normpass.onnx.runtime.verify import make_inputs

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
bench_gpu = load_module(TOOLS / "bench_gpu.py")
check_slicegpt = load_module(TOOLS / "check_slicegpt.py")


def test_slice_variant_is_timed_against_ort_opt_and_not_checked():
    for label in bench_gpu.SLICED:
        assert label in bench_gpu.VARIANTS and label in bench_gpu.BASELINES["ort-opt"]
        assert label in bench_gpu.UNCHECKED  # a sliced model's outputs differ from the original's


def test_slice_variant_cuts_the_stream_to_k_columns(registry_export):
    raw = onnx.load(str(registry_export("gpt2")))
    ratio = bench_gpu.SLICE_RATIOS[0]
    model = bench_gpu.sliced(raw, "gpt2", ratio)
    kept = round((1 - ratio) * 64 / 16) * 16  # the registry GPT-2's width is 64: k = 48 at R = 0.25

    def widths(m: onnx.ModelProto) -> list[tuple[int, ...]]:
        return [tuple(i.dims) for i in m.graph.initializer if len(i.dims) == 2 and kept in i.dims]

    assert not widths(raw)
    # the embedding tables and the writers' outputs, the readers' inputs (QKV, MLP, LM head): k columns
    assert len(widths(model)) >= 2 + 2 * 4
    feeds = make_inputs(raw, seed=3)
    got, want = run_ort(model, feeds), run_ort(raw, feeds)
    name = raw.graph.output[0].name
    assert got[name].shape == want[name].shape and np.isfinite(got[name]).all()


def test_the_gpu_rounds_slice_step_runs_end_to_end_on_the_cpu_with_the_small_twins(tmp_path, monkeypatch):
    """`prepare` then `run`, as the GPU session will call them, with `--cpu-dry-run`: the ViT with a head
    is sliced, timed against `ort-opt` in one run, and its linear layers do k/d of the original's work."""
    monkeypatch.setattr(bench_gpu, "MODELS", dict(bench_gpu.MODELS))  # --cpu-dry-run swaps in the twins
    cache, out, name = tmp_path / "cache", tmp_path / "out", "vit-b16-shape-head"
    for step in (
        ["prepare", "--cache", str(cache), "--variants", "slice-0.25"],
        ["run", "--cache", str(cache), "--out", str(out), "--dtypes", "fp32"],
    ):
        monkeypatch.setattr(sys, "argv", ["bench_gpu.py", *step, "--models", name, "--cpu-dry-run"])
        bench_gpu.main()
    (record,) = json.loads((out / "records.json").read_text())["records"]
    assert (record["model"], record["provider"], record["baseline"]) == (name, "cpu", "ort-opt")
    assert set(record["variants"]) == {"slice-0.25"} and record["variants"]["slice-0.25"]["median_ms"] > 0
    (macs,) = json.loads((out / f"ort-{name}.fp32.json").read_text())["macs"]  # the twin's one point: 2 images
    assert (macs["batch"], macs["seq"]) == (2, 1)
    # 2 images: the patch Conv (16 patches, 3·8·8 → 64), 2 blocks × 17 tokens × (QKV, out, MLP), the head (1 token)
    per_image = 16 * 64 * 3 * 8 * 8 + 2 * 17 * (3 * 64 * 64 + 64 * 64 + 2 * 64 * 128) + 64 * 1000
    assert macs["original"] == {"linear": 2 * per_image, "attention": 2 * 2 * 2 * 17 * 17 * 64}
    assert macs["slice-0.25"]["linear"] * 64 == macs["original"]["linear"] * 48  # every linear layer: k/d
    assert macs["slice-0.25"]["attention"] == macs["original"]["attention"]  # the heads keep their width


@pytest.mark.parametrize(("ratio", "width"), [(0.0, 128), (0.1, 112), (0.25, 96), (0.5, 64)])
def test_slicegpt_width_is_run_slicegpts(ratio, width):
    assert check_slicegpt.sliced_width(128, ratio) == width  # (1 − R)·d rounded down to a multiple of 8


def test_check_slicegpt_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    found = subprocess.run(
        [sys.executable, str(TOOLS / "check_slicegpt.py"), "--repo", str(tmp_path)], capture_output=True, text=True
    )
    assert found.returncode == 2
    assert found.stderr.strip() == f"{tmp_path}: not a TransformerCompression checkout (no src/slicegpt/rotate.py)"
