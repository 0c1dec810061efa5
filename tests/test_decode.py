"""KV-cache graphs (`normpass/onnx/runtime/decode.py`): GenAI builder folders and torch.onnx with-past exports
verify a prefill and a decode step, calibrate on prefill sequences and benchmark a decode step, all without a
single `--input-shape`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import build

from normpass.cli.main import main
from normpass.onnx.runtime import decode
from normpass.onnx.runtime.bench import make_feeds
from normpass.onnx.runtime.verify import make_inputs


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


def test_qwen3s_head_size_is_read_through_its_per_head_norms(genai_folder):
    """Its query and key reach GroupQueryAttention through per-head norms; the value comes from the packed
    projection's Split, whose sizes say 2 KV heads of 16 (no genai_config.json read: the graph says it)."""
    sig = decode.signature(structure(genai_folder("qwen3") / "model.onnx"))
    assert sig is not None and sig.fixed == {"kv_cache_dim": 16} and sig.past == "past_sequence_length"


def test_gemma2s_sliding_window_cache_is_given_its_window(genai_folder):
    """Layer 0's cache is a buffer ONNX Runtime takes at the window's capacity or more (8: `past_sliding_length`),
    the mask telling what is filled; layer 1's is the past. Both a prefill and a decode step run."""
    path = genai_folder("gemma2") / "model.onnx"
    model = structure(path)
    sig = decode.signature(model)
    assert sig is not None and sig.past == "past_sequence_length"
    assert sig.fixed == {"kv_cache_dim": 16, "past_sliding_length": 8}
    assert decode.zero_allowed(model) == {f"past_key_values.1.{kind}": 2 for kind in ("key", "value")}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, new, past in sig.steps(16):
        shapes = decode.input_shapes(model, sig, batch, new, past)
        assert shapes["past_key_values.0.key"] == (batch, 2, 8, 16)
        assert shapes["past_key_values.1.key"] == (batch, 2, past, 16)
        logits = session.run(["logits"], decode.set_values(sig, make_inputs(model, shapes, 0), past))[0]
        assert logits.shape == (batch, new, 384) and np.isfinite(logits).all()


def _hide_the_head_size(folder, out):
    """A copy of the GenAI folder `folder` whose packed projection reaches GroupQueryAttention through a Mul by 1:
    the graph no longer shows the head size; its genai_config.json does."""
    shutil.copytree(folder, out)
    model = onnx.load(str(out / "model.onnx"))
    one = onnx.numpy_helper.from_array(np.ones((), np.float32), "one")
    model.graph.initializer.append(one)
    for node in [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]:
        hidden = node.input[0] + "/times_one"
        index = list(model.graph.node).index(node)
        model.graph.node.insert(index, onnx.helper.make_node("Mul", [node.input[0], "one"], [hidden]))
        node.input[0] = hidden
    (out / "model.onnx.data").unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out / "model.onnx"


def test_a_head_size_only_the_folders_config_gives(genai_folder, capsys, tmp_path):
    model = _hide_the_head_size(genai_folder("llama"), tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "genai_config.json").read_text())
    assert decode.signature(structure(model)) is None
    sig = decode.signature(structure(model), config)
    assert sig is not None and sig.fixed == {"kv_cache_dim": 16}
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"the model reads sentence number {i} of the calibration text" for i in range(24)))
    options = ("--ratio", "0.25", "--round-to", "8", "--calib", text, "--max-length", "16")
    code, out, err = cli(capsys, "slice", tmp_path / "llama", *options, "-o", tmp_path / "sliced")
    assert code == 0 and "64 → 48" in out, err  # the folder: its config
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(model, alone / "model.onnx")
    shutil.copy(model.with_name("model.onnx.data"), alone / "model.onnx.data")
    tokenizer = ("--tokenizer", tmp_path / "llama" / "tokenizer.json")
    code, _, err = cli(capsys, "slice", alone / "model.onnx", *options, *tokenizer, "-o", tmp_path / "s.onnx")
    assert code == 2 and "head size (kv_cache_dim)" in err and "genai_config.json" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_model_without_a_cache_has_no_decode_signature():
    without = """<ir_version: 10, opset_import: ["" : 17]>
        g (int64[B, S] input_ids, int64[B, S] attention_mask, float[B, S, 4] {name}) => (float[B, S, 4] y) {{
          y = Identity({name})
        }}"""
    assert decode.signature(build(without.format(name="hidden"))) is None  # no input says past
    assert decode.signature(build(without.format(name="past"))) is None  # its only dynamic axis is the new tokens


@pytest.mark.parametrize("family", ["phi", "llama"])
def test_rotate_verifies_a_prefill_and_a_decode_step_of_a_genai_folder(genai_folder, capsys, tmp_path, family):
    model = genai_folder(family) / "model.onnx"
    report = tmp_path / "report.json"
    code, out, err = cli(capsys, "rotate", model, "-o", tmp_path / "r.onnx", "--report", report)
    assert code == 0, err
    assert "1 of 1 residual streams rotated" in out
    assert "3 runs: prefill: batch 2, 16 new tokens, empty past; decode step: batch 2, 1 new token after 16" in out
    runs = json.loads(report.read_text())["verification_runs"]
    kv = [2, 4, 0, 32] if family == "phi" else [2, 2, 0, 16]
    assert runs[0]["shapes"]["past_key_values.0.key"] == kv and runs[0]["shapes"]["attention_mask"] == [2, 16]
    assert runs[1]["shapes"]["past_key_values.1.value"] == kv[:2] + [16] + kv[3:]
    assert runs[1]["shapes"]["input_ids"] == [2, 1] and runs[1]["shapes"]["attention_mask"] == [2, 17]
    assert runs[2]["shapes"]["input_ids"] == [1, 5] and runs[2]["skipped"] is None  # GQA: batch 1


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_with_past_exports_verify_without_input_shapes(with_past_export, capsys, tmp_path, exporter):
    path, _ = with_past_export("gpt2", exporter)
    code, out, err = cli(capsys, "rotate", path, "-o", tmp_path / "r.onnx")
    assert code == 0, err
    assert "empty past; decode step: batch 2, 1 new token after 16; batch 3, 5 new tokens after 3)" in out


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
    folder = genai_folder("llama")
    model = folder / "model.onnx"
    rotated = tmp_path / "rotated"
    assert cli(capsys, "rotate", folder, "-o", rotated)[0] == 0
    code, _, err = cli(capsys, "bench", folder, rotated, "--seq", "12", "--repeats", "2", "--warmup", "0")
    assert code == 0, err  # folders: their decoders
    feeds = make_feeds(structure(model), 1, 12)
    assert feeds["input_ids"].shape == (1, 1) and feeds["attention_mask"].shape == (1, 13)
    assert feeds["past_key_values.0.key"].shape == (1, 2, 12, 16)


def test_positions_and_the_lengths_attention_takes_as_inputs_count_from_the_past():
    """position_ids run past … past + new − 1; seqlens_k is total − 1 per row, total_sequence_length the total."""
    model = build(
        """<ir_version: 10, opset_import: ["" : 17]>
        g (int64[B, S] input_ids, int64[B, S] position_ids, int64[B, T] attention_mask, float[B, 2, P, 4] past_0,
           int32[B] seqlens_k, int32[1] total_sequence_length) => (float[B, 2, P, 4] present_0) {
          present_0 = Identity(past_0)
        }"""
    )
    sig = decode.signature(model)
    assert sig is not None and not sig.gqa
    assert (sig.positions, sig.seqlens, sig.total_length, sig.past, sig.total) == (
        "position_ids",
        "seqlens_k",
        "total_sequence_length",
        "P",
        "T",
    )
    shapes = decode.input_shapes(model, sig, 2, 3, 5)
    assert shapes == {
        "input_ids": (2, 3),
        "position_ids": (2, 3),
        "attention_mask": (2, 8),
        "past_0": (2, 2, 5, 4),
        "seqlens_k": (2,),
        "total_sequence_length": (1,),
    }
    feeds = decode.set_values(sig, make_inputs(model, shapes, 0), 5)
    assert feeds["position_ids"].tolist() == [[5, 6, 7]] * 2 and feeds["attention_mask"].all()
    assert feeds["seqlens_k"].tolist() == [7, 7] and feeds["total_sequence_length"].tolist() == [8]
    prefill = decode.prefill(model, sig, {"input_ids": np.ones((1, 4), np.int64)})
    assert prefill["past_0"].shape == (1, 2, 0, 4) and prefill["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert prefill["attention_mask"].shape == (1, 4)
