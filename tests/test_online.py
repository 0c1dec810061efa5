"""Online rotation (`normpass/onnx/rotate/online.py`, `normpass rotate --online-rotation`): the input of every MLP down
projection is rotated at run time by a block-diagonal Hadamard matrix and its weight rotated back, exactly;
the inserted MatMuls are named in the model's metadata for the quantizer to keep in floating point.

Each rotated model is checked by `rotate_onnx`'s own verification and by an ONNX Runtime run on other
inputs (`assert_equivalent`).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import assert_equivalent, build, check_structure, initializers, op_counts, randn, rng, run_ort
from test_patterns import header

from normpass import RotateOptions, rotate_onnx
from normpass.errors import InputError
from normpass.onnx.rotate.online import METADATA_KEY, SUFFIX

D, T, F = 8, 5, 32  # width, tokens, MLP width
OUTLIER = 5  # the hidden feature that carries an outlier


def mlp_model(hidden: int = F) -> onnx.ModelProto:
    """x → MatMul(D → F) → Relu → MatMul(F → D): the second layer's input has an outlier feature."""
    gen = rng(2)
    w1 = randn(gen, D, hidden)
    w1[:, OUTLIER] *= 30.0
    return build(
        f"""{header()}
agraph (float[B, {T}, {D}] x) => (float[B, {T}, {D}] y) {{
  h = MatMul(x, w1)
  r = Relu(h)
  y = MatMul(r, w2)
}}""",
        w1=w1,
        w2=randn(gen, hidden, D),
    )


def rotated(model: onnx.ModelProto, block: int):
    before = model.SerializeToString()
    result = rotate_onnx(model, RotateOptions(online_block=block))
    assert model.SerializeToString() == before, "rotate_onnx modified its input model"
    assert result.comparison is not None and result.comparison.passed, result.comparison
    check_structure(result.model)
    assert_equivalent(model, result.model)
    return result


def peak_to_rms(values: np.ndarray) -> float:
    return float(np.abs(values).max() / np.sqrt(np.mean(values.astype(np.float64) ** 2)))


def test_the_down_projection_reads_its_input_rotated_in_blocks():
    model = mlp_model()
    result = rotated(model, 8)
    plan = result.online
    assert [s.features for s in plan.sites] == [F] and not plan.refused
    counts, before = op_counts(result.model), op_counts(model)
    assert counts["MatMul"] == before["MatMul"] + 1 and counts["Reshape"] == before.get("Reshape", 0) + 2
    (inserted,) = [n for n in result.model.graph.node if n.name.endswith(SUFFIX)]
    metadata = {p.key: p.value for p in result.model.metadata_props}
    assert metadata[METADATA_KEY] == inserted.name == plan.keep_fp32[0]
    assert result.report()["online_rotation"]["keep_fp32"] == [inserted.name]
    # H is orthogonal, and the rotated input spreads the outlier feature over its block
    h = initializers(result.model)[inserted.input[1]]
    np.testing.assert_allclose(h @ h.T, np.eye(8), atol=1e-6)
    probe = onnx.ModelProto()
    probe.CopyFrom(result.model)
    merged = next(n for n in result.model.graph.node if n.input and n.input[0] == inserted.output[0])
    for name in ("r", merged.output[0]):
        probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    x = randn(rng(9), 4, T, D).astype(np.float32)
    got = run_ort(probe, {"x": x})
    assert peak_to_rms(got[merged.output[0]]) < peak_to_rms(got["r"]) / 2


def test_a_width_that_the_block_does_not_divide_is_refused_with_the_reason():
    result = rotated(mlp_model(hidden=36), 8)
    assert not result.online.sites and not result.online.keep_fp32
    assert "36 input features are not a multiple of the block 8" in next(iter(result.online.refused.values()))


@pytest.mark.parametrize(
    "name, form, sites",
    [
        ("bert", "torchscript", 2),
        ("gpt2", "dynamo", 2),
        ("llama", "dynamo", 2),  # its grouped-query K/V projections narrow too, but read a norm: not sites
        ("opt", "dynamo", 2),  # Gemm with transB: the weight's columns rotate back
        ("vit", "dynamo", 2),
    ],
)
def test_registry_models_rotate_their_down_projections_online(registry_model, name, form, sites):
    model = registry_model(name, form)
    result = rotate_onnx(model, RotateOptions(online_block=16), name=name)
    assert result.comparison.passed and len(result.online.sites) == sites
    assert len(result.online.keep_fp32) == sites
    assert {s.node.op_type for s in result.online.sites} == ({"Gemm"} if name == "opt" else {"MatMul"})
    assert_equivalent(model, result.model)


def test_options_are_checked_before_the_model_is_read():
    with pytest.raises(InputError, match="2 or more"):
        rotate_onnx("no-such-file.onnx", RotateOptions(online_block=1))


def test_cli_rotate_online_names_the_matmuls_to_keep_in_fp32(tmp_path, capsys):
    from normpass.cli.main import main

    source, out, report = tmp_path / "model.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(mlp_model(), str(source))
    assert main(["rotate", str(source), "-o", str(out), "--online-rotation", "8", "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "1 down projections read their input rotated online (blocks of 8)" in printed
    assert "keep the 1 inserted rotations in fp32 when quantizing" in printed
    assert json.loads(report.read_text())["online_rotation"]["block"] == 8


def test_inspect_rotation_says_which_down_projections_would_rotate_online(tmp_path, capsys):
    from normpass.cli.main import main

    source = tmp_path / "model.onnx"
    onnx.save(mlp_model(hidden=36), str(source))  # 36 features: not a multiple of the default block
    assert main(["inspect", str(source), "--rotation", "--json"]) == 0
    online = json.loads(capsys.readouterr().out)["online_rotation"]
    assert online["block"] == 64 and not online["rotated"] and len(online["refused"]) == 1
    assert main(["inspect", str(source), "--rotation"]) == 0
    printed = capsys.readouterr().out
    assert "online rotation (rotate --online-rotation): 0 down projections" in printed
    assert "36 input features are not a multiple of the block 64" in printed
