"""The fold's `Reshape → Gemm → Reshape` → `MatMul → Add` conversion next to a folded norm (`onnx/fold/matmul.py`).

A small pre-LN graph in HF Conv1D's spelling: an embedding, a LayerNorm, the norm's output flattened to
[-1, K], a Gemm, and the result reshaped to the norm's leading dims and N. The conversion happens only where
the second Reshape provably restores those dims; the result computes the same outputs either way.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_equivalent, build, check_structure, op_counts, randn

from normpass import FoldOptions, fold_onnx

UNFLATTEN = {
    # the second Reshape's target: Shape(n)[0:2] ++ [N], as the dynamo exporter spells it
    "shape-slice": ["s = Shape<start=0, end=2>(n)", "target = Concat<axis=0>(s, n_out)"],
    # Gather + Unsqueeze of each dim, as the TorchScript exporter spells it
    "gathered": [
        "full = Shape(n)",
        "d0 = Gather<axis=0>(full, i0)",
        "d1 = Gather<axis=0>(full, i1)",
        "u0 = Unsqueeze(d0, zero)",
        "u1 = Unsqueeze(d1, zero)",
        "target = Concat<axis=0>(u0, u1, n_out)",
    ],
    # not proven: the leading dims swapped (equal only when batch == seq)
    "swapped": [
        "a = Shape<start=1, end=2>(n)",
        "c = Shape<start=0, end=1>(n)",
        "target = Concat<axis=0>(a, c, n_out)",
    ],
    # not proven: a target read from a run-time tensor
    "run-time": ["target = Identity(shape_in)"],
}


def _model(unflatten: str, gemm: str = "Gemm(flat, W, b)", extra: str = ""):
    gen = np.random.default_rng(3)
    weight = randn(gen, 4, 6)
    lines = [
        "h = Gather(E, ids)",
        "n = LayerNormalization<axis=-1>(h, gamma, beta)",
        "flat = Reshape(n, flat_shape)",
        f"g = {gemm}",
        *UNFLATTEN[unflatten],
        "y = Reshape(g, target)",
        *([extra] if extra else []),
    ]
    inputs = "int64[B, S] ids" + (", int64[3] shape_in" if unflatten == "run-time" else "")
    outputs = "float[C, D, 6] y" + (", float[M, 6] z" if extra else "")
    body = "\n  ".join(lines)
    return build(
        f'<ir_version: 10, opset_import: ["" : 17]>\nconv1d ({inputs}) => ({outputs}) {{\n  {body}\n}}',
        E=randn(gen, 10, 4),
        gamma=1 + randn(gen, 4, scale=0.2),
        beta=randn(gen, 4, scale=0.2),
        flat_shape=np.array([-1, 4], np.int64),
        W=weight if "transB" not in gemm else weight.T.copy(),
        b=randn(gen, 6),
        n_out=np.array([6], np.int64),
        i0=np.array(0, np.int64),
        i1=np.array(1, np.int64),
        zero=np.array([0], np.int64),
    )


@pytest.mark.parametrize("unflatten", ["shape-slice", "gathered"])
def test_a_proven_flattening_becomes_matmul_and_add(unflatten):
    model = _model(unflatten)
    result = fold_onnx(model)
    counts = op_counts(result.model)
    assert result.folded == 1 and result.emitted["gemms_to_matmul"] == 1
    assert (counts["MatMul"], counts["Gemm"], counts["Reshape"], counts["Shape"], counts["Concat"]) == (1, 0, 0, 0, 0)
    assert counts["SimplifiedLayerNormalization"] == 1
    check_structure(result.model)
    assert_equivalent(model, result.model, shapes={"ids": (2, 3)})


@pytest.mark.parametrize(
    ("unflatten", "gemm", "extra"),
    [
        ("swapped", "Gemm(flat, W, b)", ""),
        ("run-time", "Gemm(flat, W, b)", ""),
        ("shape-slice", "Gemm<transB=1>(flat, W, b)", ""),
        ("shape-slice", "Gemm<alpha=2.0>(flat, W, b)", ""),
        ("shape-slice", "Gemm(flat, W, b)", "z = Gemm(flat, W, b)"),  # the flattened tensor has another reader
    ],
)
def test_an_unproven_flattening_keeps_its_gemm(unflatten, gemm, extra):
    model = _model(unflatten, gemm, extra)
    result = fold_onnx(model, FoldOptions(verify=False))
    counts = op_counts(result.model)
    assert result.folded == 1 and result.emitted["gemms_to_matmul"] == 0
    assert (counts["MatMul"], counts["Gemm"], counts["Reshape"]) == (0, 2 if extra else 1, 2)


def test_target_onnx_keeps_the_gemm():
    result = fold_onnx(_model("shape-slice"), FoldOptions(target="onnx"))
    assert result.emitted["gemms_to_matmul"] == 0 and op_counts(result.model)["Gemm"] == 1
