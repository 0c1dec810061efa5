"""What keeps one copy of the weights in memory where a model's weights are inside its .onnx file
(tools/bench_pass.py measures it, docs/BENCHMARKS.md records it):

* verification runs a rewritten model with more than `IN_MEMORY_WEIGHT_BYTES` of weights from a temporary
  file whose weights are external data, which ONNX Runtime maps, not from serialized bytes (a proto, its
  bytes and the session's copy side by side);
* `io.load_ir` maps the weights of a model stored inline from its file (`modelfiles.mapped_model`), as it
  maps external data: nothing is parsed or copied, and the model is written inline again;
* `io.save_ir` writes such a model one weight at a time (protobuf merges concatenated messages), never
  the whole model serialized at once (`ir.save`): the file reads back as the same model.
"""

from __future__ import annotations

import io as io_module
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from conftest import build, randn, rng
from onnx import numpy_helper
from test_patterns import pre_ln_block

from normpass.core.algebra import centre, rotate
from normpass.io import keeps_external_data, load_ir, maps_weights, save_onnx_atomic, unmapped
from normpass.onnx.fold import derived
from normpass.onnx.fold.driver import fold_onnx
from normpass.onnx.rotate.driver import rotate_onnx
from normpass.onnx.runtime import verify
from normpass.onnx.slice.driver import SliceOptions, slice_onnx


def test_a_large_rewritten_model_is_verified_from_a_file_with_external_data(tmp_path, monkeypatch):
    path = tmp_path / "inline.onnx"
    onnx.save(pre_ln_block(rng(1)), str(path))  # weights inside the file
    opened = []
    real_session = verify.ort_session

    def recording(source, options, providers):
        opened.append((source, isinstance(source, str) and Path(source).with_name("model.onnx.data").exists()))
        return real_session(source, options, providers)

    monkeypatch.setattr(verify, "ort_session", recording)
    monkeypatch.setattr(verify, "IN_MEMORY_WEIGHT_BYTES", 1)
    result = fold_onnx(str(path))
    assert result.comparison is not None and result.folded == 1
    (original, _), (rewritten, external) = opened
    assert original == str(path), "the original runs from its own file"
    assert isinstance(rewritten, str) and external, "the rewritten one from a file with external data"
    opened.clear()
    monkeypatch.setattr(verify, "IN_MEMORY_WEIGHT_BYTES", 1 << 30)
    fold_onnx(str(path))
    assert isinstance(opened[1][0], bytes), "a small one from bytes"


def wide_model() -> onnx.ModelProto:
    """Two weights of more than `io.LIGHT_INITIALIZER_LIMIT` elements, a norm's small γ and β, a bias."""
    gen = rng(2)
    return build(
        """<ir_version: 10, opset_import: ["" : 18]>
agraph (float[B, 64] x) => (float[B, 64] y) {
  h = MatMul(x, W1)
  n = LayerNormalization<axis=-1>(h, g, b)
  z = MatMul(n, W2)
  y = Add(z, c)
}""",
        W1=randn(gen, 64, 64),
        W2=randn(gen, 64, 64),
        g=1 + randn(gen, 64, scale=0.1),
        b=randn(gen, 64, scale=0.1),
        c=randn(gen, 64, scale=0.1),
    )


def test_inline_weights_are_mapped_from_the_model_file_and_written_inline_again(tmp_path):
    path = tmp_path / "inline.onnx"
    source = wide_model()
    onnx.save(source, str(path))
    before = path.read_bytes()
    model = load_ir(path)
    expected = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    mapped = set()
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            assert Path(tensor.path) == path, name
            mapped.add(name)
        assert np.array_equal(tensor.numpy(), expected[name])
    assert mapped == {"W1", "W2"}, "the weights of at least io.EXTERNAL_MIN_BYTES (γ and β are parsed)"
    assert not keeps_external_data(model), "an inline model is written inline"
    result = fold_onnx(str(path))
    assert result.folded == 1 and result.comparison is not None
    out = tmp_path / "out.onnx"
    result.save(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == ["out.onnx"]
    in_memory = fold_onnx(source)
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    reference = {t.name: numpy_helper.to_array(t) for t in in_memory.model.graph.initializer}
    assert written.keys() == reference.keys() and all(np.array_equal(written[k], reference[k]) for k in written)
    assert path.read_bytes() == before


def test_an_inline_model_is_written_one_weight_at_a_time(tmp_path, monkeypatch):
    path = tmp_path / "inline.onnx"
    source = wide_model()
    onnx.save(source, str(path))
    model = load_ir(path)
    serialized = []
    real_serialize = ir.serde.serialize_tensor

    def recording(tensor, *args, **kwargs):
        serialized.append(tensor.name)
        return real_serialize(tensor, *args, **kwargs)

    def whole(*args, **kwargs):
        raise AssertionError("the whole model was serialized at once")

    monkeypatch.setattr(ir.serde, "serialize_tensor", recording)
    monkeypatch.setattr(ir, "save", whole)
    out = tmp_path / "out.onnx"
    save_onnx_atomic(model, out)
    assert not list(tmp_path.glob("out.onnx*.data")), "the weights stay inside the file"
    assert set(serialized) == {"W1", "W2"}, "each large weight serialized alone, the small ones with the graph"
    written = onnx.load(str(out))
    expected = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in source.graph.node]
    onnx.checker.check_model(written, full_check=True)


def written_elsewhere(tmp_path: Path, write) -> None:
    """`write(model, out)` on `wide_model` loaded with `load_ir`, `out` in another folder, the input then deleted:
    the output holds every weight's bytes (no reference to the input, which would now dangle), unchanged."""
    path = tmp_path / "inline.onnx"
    source = wide_model()
    onnx.save(source, str(path))
    out = tmp_path / "elsewhere" / "out.onnx"
    out.parent.mkdir()
    write(load_ir(path), out)
    path.unlink()
    written = onnx.load(str(out), load_external_data=False)
    assert not [t.name for t in written.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    expected = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    assert all(np.array_equal(numpy_helper.to_array(t), expected[t.name]) for t in written.graph.initializer)


def test_weights_mapped_from_the_input_file_are_written_inside_the_output(tmp_path):
    written_elsewhere(tmp_path, save_onnx_atomic)


def test_unmapped_weights_survive_onnx_irs_own_writer(tmp_path):
    """`io.unmapped` reads the mapped weights into memory, so that `ir.save` (what Olive writes a pass's model
    with) writes their bytes."""
    written_elsewhere(tmp_path, lambda model, out: ir.save(unmapped(model), out))


def test_a_model_that_came_with_external_data_keeps_it_when_every_weight_changes(tmp_path):
    """`rotate_onnx` and `slice_onnx` change every weight of `wide_model` (none stays mapped from the input): their
    results, written through the library, are still OUT plus its data file, as the input was."""
    source = tmp_path / "external.onnx"
    onnx.save(wide_model(), str(source), save_as_external_data=True, location="external.onnx.data", size_threshold=0)
    results = {
        "rotated": rotate_onnx(str(source)),
        "sliced": slice_onnx(str(source), "synthetic", SliceOptions(ratio=0.25, samples=16)),
    }
    for label, result in results.items():
        assert not maps_weights(result.ir_model), f"{label}: every weight changed"
        out = tmp_path / label / "out.onnx"
        out.parent.mkdir()
        result.save(out)
        assert len(list(out.parent.glob("out.onnx.*.data"))) == 1, label


def centred_model(rows: int, hidden: int) -> onnx.ModelProto:
    """x → MatMul W0 + b0 → LayerNorm → MatMul W1 + b1: the fold centres W0, rotation rotates it, slicing cuts it,
    each along its output features (its rows are independent)."""
    gen = rng(3)
    return build(
        f"""<ir_version: 10, opset_import: ["" : 18]>
agraph (float[B, {rows}] x) => (float[B, 8] y) {{
  h0 = MatMul(x, W0)
  h = Add(h0, b0)
  n = LayerNormalization<axis=-1>(h, g, b)
  z = MatMul(n, W1)
  y = Add(z, c)
}}""",
        W0=randn(gen, rows, hidden, scale=0.1),
        b0=randn(gen, hidden, scale=0.1),
        g=1 + randn(gen, hidden, scale=0.1),
        b=randn(gen, hidden, scale=0.1),
        W1=randn(gen, hidden, 8, scale=0.1),
        c=randn(gen, 8, scale=0.1),
    )


def test_a_changed_weight_is_computed_and_written_slab_by_slab_never_whole(tmp_path, monkeypatch):
    """W0 (4 MiB) is centred by the fold, then rotated, or cut to 48 of 64 columns: its changed copy is a
    `DerivedTensor` computed from its source's slabs, each of at most `SLAB_BYTES`, when the model is written (for
    verification, for slicing's calibration and judging runs, and to OUT), never whole, and the output equals the
    model computed in memory."""
    monkeypatch.setattr(derived, "SLAB_BYTES", 2**18)
    monkeypatch.setattr(verify, "IN_MEMORY_WEIGHT_BYTES", 1)  # every model run from a file, as large ones are
    source = tmp_path / "centred.onnx"
    onnx.save(
        centred_model(16384, 64),
        str(source),
        save_as_external_data=True,
        location="centred.onnx.data",
        size_threshold=1024,
    )
    runs = {
        "folded": lambda model: fold_onnx(model),
        "rotated": lambda model: rotate_onnx(model),
        "sliced": lambda model: slice_onnx(model, "synthetic", SliceOptions(ratio=0.25, samples=16, basis="stream")),
    }
    expected = {label: run(centred_model(16384, 64)).model for label, run in runs.items()}  # computed in memory
    largest = []
    real_slab = derived.DerivedTensor.slab

    def recording(self, start, stop):
        values = real_slab(self, start, stop)
        largest.append(values.nbytes)
        return values

    def whole(self):
        raise AssertionError("a derived weight was computed whole")

    monkeypatch.setattr(derived.DerivedTensor, "slab", recording)
    monkeypatch.setattr(derived.DerivedTensor, "_whole", whole)
    for label, run in runs.items():
        largest.clear()
        result = run(str(source))
        (weight,) = [v.const_value for v in result.ir_model.graph.initializers.values() if v.name.startswith("W0")]
        assert isinstance(weight, derived.DerivedTensor), label
        out = tmp_path / label / "out.onnx"
        out.parent.mkdir()
        result.save(out)
        assert largest and max(largest) <= 2**18, f"{label}: a slab of at most SLAB_BYTES at a time"
        written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
        for tensor in expected[label].graph.initializer:
            assert np.allclose(written[tensor.name], numpy_helper.to_array(tensor), atol=1e-6), (label, tensor.name)


def test_a_derived_weight_is_the_whole_computation_along_either_axis_and_through_a_chain(monkeypatch):
    """A `DerivedTensor` gives what `make` on the whole array gives, slabbed along rows (a map along the columns),
    along columns (a map along the rows: written in runs at their places), through a chain of two (a cut of a
    centred weight) and where the map changes the size along its axis; `tofile` writes its C-order bytes at the
    file's position."""
    monkeypatch.setattr(derived, "SLAB_BYTES", 1000)
    gen = rng(4)
    weight = randn(gen, 37, 29)
    columns = np.linalg.qr(gen.standard_normal((29, 29)))[0][:, :20]
    rows = np.linalg.qr(gen.standard_normal((37, 37)))[0][:, :11]
    centred = derived.DerivedTensor(ir.Tensor(weight), lambda v: centre(v, 1), 1, "centred")
    cases = {
        "a cut of the centred weight": (
            derived.DerivedTensor(centred, lambda v: rotate(v, 1, columns, None), -1, "cut"),
            rotate(centre(weight, 1), 1, columns, None),
        ),
        "rows rotated back": (
            derived.DerivedTensor(ir.Tensor(weight), lambda v: rotate(v, 0, rows, None), 0, "rows"),
            rotate(weight, 0, rows, None),
        ),
    }
    for label, (tensor, expected) in cases.items():
        assert len(tensor.slabs()) > 1, label
        assert tuple(tensor.shape.numpy()) == expected.shape and np.allclose(tensor.numpy(), expected, atol=1e-6)
        file = io_module.BytesIO(b"head")
        file.seek(4)
        tensor.tofile(file)
        written = np.frombuffer(file.getvalue()[4:], np.float32).reshape(expected.shape)
        assert np.array_equal(written, tensor.numpy()), label
