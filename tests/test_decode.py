"""KV-cache graphs (`normpass/onnx/runtime/decode.py`): GenAI builder folders and torch.onnx with-past exports
verify a prefill and a decode step, calibrate on prefill sequences and benchmark a decode step, all without a
single `--input-shape`."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from normpass.cli.main import main
from normpass.onnx.runtime import decode
from normpass.onnx.runtime.bench import make_feeds


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def structure(path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def test_the_relations_of_a_builder_graph_are_read_from_it(genai_folder):
    model = structure(genai_folder("llama") / "model.onnx")
    sig = decode.signature(model)
    assert sig is not None and sig.gqa
    assert (sig.tokens, sig.mask, sig.batch, sig.new) == (
        "input_ids",
        "attention_mask",
        "batch_size",
        "sequence_length",
    )
    assert (sig.past, sig.total) == ("past_sequence_length", "total_sequence_length")
    assert sig.fixed == {"kv_cache_dim": 16}  # GroupQueryAttention's packed projection: 128 / (4 + 2·2)
    assert len(sig.caches) == 4
    shapes = decode.input_shapes(model, sig, 2, 1, 7)
    assert shapes["attention_mask"] == (2, 8) and shapes["past_key_values.1.value"] == (2, 2, 7, 16)
    assert [step[0] for step in sig.steps(16) if step[1] > 1 and step[2] > 0] == [1]  # GQA: batch 1 then


def test_a_model_without_a_cache_has_no_decode_signature(registry_export):
    assert decode.signature(structure(registry_export("gpt2"))) is None


@pytest.mark.parametrize("family", ["phi", "llama"])
def test_rotate_verifies_a_prefill_and_a_decode_step_of_a_genai_folder(genai_folder, capsys, tmp_path, family):
    model = genai_folder(family) / "model.onnx"
    code, out, err = cli(capsys, "rotate", model, "-o", tmp_path / "r.onnx")
    assert code == 0, err
    kv = "2x4x{}x32" if family == "phi" else "2x2x{}x16"
    assert f"past_key_values.0.key {kv.format(0)}" in out  # the prefill: an empty past
    assert f"input_ids 2x1, attention_mask 2x17, past_key_values.0.key {kv.format(16)}" in out  # a decode step
    assert "1 of 1 residual streams rotated" in out


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_with_past_exports_verify_without_input_shapes(with_past_export, capsys, tmp_path, exporter):
    path, _ = with_past_export("gpt2", exporter)
    code, out, err = cli(capsys, "rotate", path, "-o", tmp_path / "r.onnx")
    assert code == 0, err
    assert "past_key_values.0.key 2x4x0x16" in out and "attention_mask 2x17" in out


def test_slice_calibrates_a_genai_folder_on_text_prefills(genai_folder, capsys, tmp_path):
    folder = genai_folder("llama")
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"the model reads sentence number {i} of the calibration text" for i in range(24)))
    args = ("slice", folder / "model.onnx", "--ratio", "0.25", "--round-to", "8", "--basis", "stream")
    code, out, err = cli(capsys, *args, "--calib", text, "--tokenizer", folder / "tokenizer.json", "-o", tmp_path / "s")
    assert code == 0 and "64 → 48" in out, err
    code, out, err = cli(capsys, *args, "--calib", "synthetic", "-o", tmp_path / "t.onnx")
    assert code == 0 and "64 → 48" in out, err


def _npz(path, model: onnx.ModelProto, samples: int, new: int, past: int):
    sig = decode.signature(model)
    assert sig is not None
    shapes = decode.input_shapes(model, sig, samples, new, past)
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    arrays["input_ids"] = rng.integers(3, 200, shapes["input_ids"]).astype(np.int64)
    arrays["attention_mask"] = np.ones(shapes["attention_mask"], np.int64)
    np.savez(path, **arrays)
    return path


def test_an_empty_past_is_valid_calibration(genai_folder, capsys, tmp_path):
    model = genai_folder("llama") / "model.onnx"
    data = _npz(tmp_path / "prefill.npz", structure(model), 8, 6, 0)
    code, out, err = cli(capsys, "slice", model, "--ratio", "0", "--calib", data, "-o", tmp_path / "s.onnx")
    assert code == 0 and "64 → 64" in out, err


def test_a_past_with_several_new_tokens_at_batch_above_one_is_bad_input(genai_folder, capsys, tmp_path):
    """GroupQueryAttention refuses it (ONNX Runtime raised in the middle of the pass: exit 3 before)."""
    model = genai_folder("llama") / "model.onnx"
    data = _npz(tmp_path / "past.npz", structure(model), 8, 3, 2)
    code, _, err = cli(capsys, "slice", model, "--ratio", "0.25", "--calib", data, "-o", tmp_path / "s.onnx")
    assert code == 2 and "GroupQueryAttention" in err and "batch 1" in err, err
    assert len(err.strip().splitlines()) == 1
    code, _, err = cli(
        capsys, "slice", model, "--ratio", "0", "--calib", data, "--batch-size", "1", "-o", tmp_path / "s.onnx"
    )
    assert code == 0, err


def test_bench_times_a_decode_step(genai_folder, capsys, tmp_path):
    model = genai_folder("llama") / "model.onnx"
    rotated = tmp_path / "r.onnx"
    assert cli(capsys, "rotate", model, "-o", rotated)[0] == 0
    code, _, err = cli(capsys, "bench", model, rotated, "--seq", "12", "--repeats", "2", "--warmup", "0")
    assert code == 0, err
    feeds = make_feeds(structure(model), 1, 12)
    assert feeds["input_ids"].shape == (1, 1) and feeds["attention_mask"].shape == (1, 13)
    assert feeds["past_key_values.0.key"].shape == (1, 2, 12, 16)
