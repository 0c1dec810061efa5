"""`tools/bench_decode.py`'s records: one per loop and model, the baseline named for what it is (a seeded
shape's builder folder, IgLM's with-past export), the 4-bit format carried."""

from __future__ import annotations

import pathlib

from conftest import load_module

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
bench_decode = load_module(TOOLS / "bench_decode.py")


def entry(ms: float, ratio: float) -> dict:
    return {
        "ms_per_token": ms,
        "ratio": ratio,
        "ratio_p25": ratio,
        "ratio_p75": ratio,
        "read_bytes_ratio": ratio,
        "prefill_ms": 10 * ms,
        "prefill_ratio": ratio,
    }


def test_records_name_each_baseline_and_carry_the_format():
    variants = {"original": entry(100.0, 1.0), "4bit": entry(25.0, 0.25)}
    report = {
        "machine": {"cpu": "a CPU", "load_after": "load average: 1.0"},
        "command": "python tools/bench_decode.py",
        "prompt_tokens": 32,
        "decoded_tokens": 32,
        "four_bit": {"block_size": 32, "symmetric": True, "accuracy_level": 4},
        "results": {"genai-phi-1024x8": variants, "ort-phi-1024x8": variants, "ort-iglm": variants},
    }
    found = bench_decode.records(report)
    assert found["four_bit"] == report["four_bit"]
    summary = [(r["provider"], r["model"], r["baseline"]) for r in found["records"]]
    assert summary == [
        ("cpu-genai", "phi-1024x8-shape", "builder"),
        ("cpu", "phi-1024x8-shape", "builder"),
        ("cpu", "iglm", "export"),
    ]
    for record in found["records"]:
        assert record["baseline_ms"] == 100.0 and list(record["variants"]) == ["4bit"]
        assert record["variants"]["4bit"]["median_ms"] == 25.0


def test_every_phi_shape_has_a_head_size_genai_accepts():
    """GroupQueryAttention wants the rotary half-width (a quarter of a Phi head) a multiple of 8."""
    for shape in bench_decode.PHI.values():
        head, rest = divmod(shape["hidden_size"], shape["num_attention_heads"])
        assert rest == 0 and head % 32 == 0
