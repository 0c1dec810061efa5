"""Decoders exported with their KV cache (`normpass.models.past`): the refusals say what the model does, whichever
exporter wrote it, and an exact rewrite decodes the same tokens as the original in plain ONNX Runtime."""

from __future__ import annotations

import re

import onnx
import pytest

from normpass import RotateOptions, rotate_onnx
from normpass.models import past
from normpass.onnx.rotate.driver import inspect_rotation

PROMPTS = ([5, 6, 7], [100, 3])


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


def test_unoptimized_dynamo_gpt_neox_rotates_on_the_ort_target_and_decodes_the_same_tokens(exported, tmp_path):
    """The β Add the fold leaves after the final norm keeps its shape (it was "Add …beta has an unknown shape")."""
    source = exported("gpt-neox", "dynamo", optimize=False)
    shapes = past.decode_shapes(onnx.load(source, load_external_data=False))
    result = rotate_onnx(source, RotateOptions(input_shapes=shapes))
    (stream,) = result.rotation.streams
    assert stream.rotatable, stream.reason
    assert result.comparison is not None and result.comparison.passed
    onnx.save(result.model, tmp_path / "rotated.onnx")
    for prompt in PROMPTS:
        assert past.greedy(tmp_path / "rotated.onnx", prompt, 8) == past.greedy(source, prompt, 8)
