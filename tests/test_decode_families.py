"""Decoders exported with their KV cache (`normpass.models.past`): the refusals say what the model does, whichever
exporter wrote it, and an exact rewrite decodes the same tokens as the original in plain ONNX Runtime; the
families table (`tools/decode_families.py`, docs/decode.md)."""

from __future__ import annotations

import pathlib
import re

import onnx
import pytest
from conftest import load_module

from normpass import RotateOptions, rotate_onnx
from normpass.models import genai, past
from normpass.onnx.rotate.driver import inspect_rotation

PROMPTS = ([5, 6, 7], [100, 3])
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`exported(family, exporter, optimize=True)`: the with-past export, made once per module."""
    folder, made = tmp_path_factory.mktemp("past"), {}

    def get(family: str, exporter: str, optimize: bool = True):
        key = (family, exporter, optimize)
        if key not in made:
            made[key] = past.export(family, folder / f"{family}-{exporter}-{int(optimize)}.onnx", exporter, optimize)
        return made[key]

    return get


def streams(path):
    return inspect_rotation(path, RotateOptions())[1].streams


def test_gemma2_sandwich_norms_are_refused_for_the_gamma_they_write_into_the_stream(exported):
    (stream,) = streams(exported("gemma2", "torchscript"))
    assert not stream.rotatable
    assert "post_feedforward_layernorm" in stream.blocker.node or "post_attention_layernorm" in stream.blocker.node
    assert re.search(r"writes the stream \(.+\) with its own γ: a norm after a block", stream.reason)
    assert (
        "no rotation commutes with a per-feature γ there, so this stream cannot be rotated or sliced" in stream.reason
    )


def test_qwen3_per_head_norms_are_refused_for_the_same_reason_by_both_exporters(exported):
    reasons = {}
    for exporter in past.EXPORTERS:
        found = streams(exported("qwen3", exporter))
        residual = [s for s in found if s.rotatable]
        assert len(residual) == 1 and len(residual[0].norms) == 2 * past.LAYERS + 1  # the residual stream rotates
        heads = [s for s in found if not s.rotatable]
        assert len(heads) == 2 * past.LAYERS  # a query and a key norm per layer
        reasons[exporter] = {
            re.sub(r"\S*(q|k)_?norm\S*|\S*(view|Reshape)\S*|node_pow_\d+", "NAME", s.reason) for s in heads
        }
    assert reasons["dynamo"] == reasons["torchscript"], reasons
    assert all("normalizes each head on its own" in r and "nothing to do" in r for r in reasons["dynamo"])
    assert {re.search(r"splits (\d+) features into (\d+) groups of (\d+)", r).groups() for r in reasons["dynamo"]} == {
        ("64", "4", "16"),  # queries: 4 heads
        ("32", "2", "16"),  # keys: 2 key/value heads
    }


def test_a_stream_the_fold_had_to_centre_is_refused_for_the_mean(exported):
    """BLOOM's embedding norm writes γ ⊙ x̂ + β into the stream, so the fold centres the stream before every norm."""
    found = streams(exported("bloom", "torchscript"))
    assert found and not any(s.rotatable for s in found)
    assert all("the mean of the stream over its hidden axis (as the centring" in s.reason for s in found), [
        s.reason for s in found
    ]
    assert all("nothing to do" in s.reason for s in found)


def test_unoptimized_dynamo_gpt_neox_rotates_on_the_ort_target_and_decodes_the_same_tokens(exported, tmp_path):
    """The β Add the fold leaves after the final norm keeps its shape (it was "Add …beta has an unknown shape")."""
    source = exported("gpt-neox", "dynamo", optimize=False)
    result = rotate_onnx(source, RotateOptions())  # a prefill and a decode step, as the decode signature gives them
    (stream,) = result.rotation.streams
    assert stream.rotatable, stream.reason
    assert result.comparison is not None and result.comparison.passed
    onnx.save(result.model, tmp_path / "rotated.onnx")
    for prompt in PROMPTS:
        assert genai.greedy_ort(tmp_path / "rotated.onnx", prompt, 8) == genai.greedy_ort(source, prompt, 8)


# --- the families table (tools/decode_families.py) -------------------------------------------------------------

decode_families = load_module(ROOT / "tools" / "decode_families.py")


def test_a_row_runs_every_verb_and_checks_the_tokens(tmp_path):
    row = decode_families.run_row("gpt2", "torchscript", tmp_path)
    assert row.built is None and list(row.outcomes) == list(decode_families.VERBS)
    inspect = row.outcomes["inspect"]
    assert inspect.figures == {"norms": 5, "foldable": 5, "layer_norms": 5, "streams": 1, "rotatable": 1}
    for verb in decode_families.EXACT:
        outcome = row.outcomes[verb]
        assert outcome.exit == 0 and outcome.tokens_identical is True and outcome.max_abs_error < 1e-4, outcome
    assert row.outcomes["fold"].figures == {"folded": 4, "total": 5}  # the final norm's β has no bias to go to
    assert "kept as a LayerNorm" in row.outcomes["fold"].reason
    assert row.outcomes["rotate"].figures == {"streams": 1, "changed": 1}
    cut = row.outcomes["slice 0.25"]
    assert cut.exit == 0 and cut.figures["widths"] == "64→48" and 0 < cut.figures["held_out"]["cos_min"] < 1
    assert row.failed == []
    text = decode_families.table([row])
    line = next(line for line in text.splitlines() if line.startswith("| gpt2 | torchscript |"))
    assert "4/5 norms folded, error" in line and "tokens identical [1]" in line
    assert "\n1. proven foldable, kept as a LayerNorm" in text


def test_a_verb_with_nothing_to_do_says_so_and_why(genai_folder, tmp_path):
    """Gemma-2's folder calibrates (its sliding-window cache sized), and its cell says plainly that nothing was
    sliced, the reason in its note, instead of held-out figures of an uncut model."""
    outcome = decode_families._verb("slice 0.25", genai_folder("gemma2"), tmp_path, [], [])
    assert outcome.exit == 0 and outcome.text == "nothing to slice: 0/1 streams can be sliced"
    assert outcome.reason is not None and "with its own γ" in outcome.reason
    assert outcome.figures == {"streams": 1, "changed": 0}


def test_a_row_that_breaks_the_contract_is_reported():
    row = decode_families.Row("llama", "dynamo")
    row.outcomes["rotate"] = decode_families.Outcome("1/1 streams rotated", exit=0, tokens_identical=False)
    row.outcomes["slice 0.25"] = decode_families.Outcome("exit 3", "a bug", exit=3)
    assert row.failed == ["rotate", "slice 0.25"]


def test_the_page_holds_a_row_for_every_family_and_source():
    page = (ROOT / "docs" / "decode.md").read_text()
    section = page[page.index(decode_families.BEGIN) : page.index(decode_families.END)]
    rows = {tuple(line.split(" | ")[:2]) for line in section.splitlines() if line.startswith("| ")}
    wanted = {(f"| {f}", s) for f, s in decode_families.rows_wanted(None, list(decode_families.SOURCES))}
    assert wanted <= rows, "run python tools/decode_families.py --write docs/decode.md"
    with pytest.raises(ValueError, match="lacks the markers"):
        decode_families.replaced("no table here", [])
