"""`tools/profile_decode.py`: the kernel models it times and the per-op profile of decode steps it sums, on a
seeded GenAI folder and its 4-bit copy."""

from __future__ import annotations

import pathlib

import onnx
from conftest import load_module

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
profile_decode = load_module(TOOLS / "profile_decode.py")
bench_decode = load_module(TOOLS / "bench_decode.py")


def test_each_format_times_copies_with_weights_of_their_own():
    k, n = 256, 32
    base = profile_decode.copies_model(k, n)
    assert [n.op_type for n in base.graph.node] == ["MatMul"] * profile_decode.COPIES
    assert len({t.raw_data for t in base.graph.initializer}) == profile_decode.COPIES  # distinct weights
    for form in profile_decode.FORMATS.values():
        model = profile_decode.in_format(base, form)
        ops = [n.op_type for n in model.graph.node]
        assert ops == ["MatMul" if form is None else "MatMulNBits"] * profile_decode.COPIES
        per_copy = profile_decode.weight_bytes(model) / profile_decode.COPIES
        if form is None:
            assert per_copy == 4 * k * n
        else:  # 4 bits a weight, plus a scale (and a zero point) a block: under 8 bits a weight
            assert k * n / 2 < per_copy < k * n


def test_the_profile_of_decode_steps_sums_the_ops_each_step_runs(genai_folder, tmp_path):
    folder = genai_folder("phi")
    original = onnx.load(str(folder / "model.onnx"))
    quantized = bench_decode.save_folder(folder, bench_decode.eval_decode.four_bit(original), tmp_path / "4bit")
    prompt = bench_decode.prompts(folder, 1, 8)[0]
    fp32 = profile_decode.profile(folder, 1, prompt, 3)
    four = profile_decode.profile(quantized, 1, prompt, 3)
    assert "MatMul" in fp32["by_op_ms_per_step"] and "MatMulNBits" not in fp32["by_op_ms_per_step"]
    assert "MatMulNBits" in four["by_op_ms_per_step"] and "MatMul" not in four["by_op_ms_per_step"]
    for found in (fp32, four):
        assert "GroupQueryAttention" in found["by_op_ms_per_step"]
        assert 0 < found["ops_ms_per_step"] <= found["model_run_ms_per_step"] <= found["wall_ms_per_step"]
        assert abs(sum(found["by_op_ms_per_step"].values()) - found["ops_ms_per_step"]) < 0.01
    assert four["nodes"]["MatMulNBits"] == fp32["nodes"]["MatMul"]
