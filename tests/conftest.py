"""Shared helpers for the normpass tests: building small ONNX models, checking and running them.

* `build(text, **initializers)` parses an `onnx.parser` model (IR version pinned to one ONNX
  Runtime 1.31 accepts) and attaches NumPy initializers.
* `check_structure(model)` runs the full `onnx.checker` on a copy in which ORT's contrib op
  `SimplifiedLayerNormalization` is moved to a custom domain, so everything else is still checked.
* `run_ort`, `assert_equivalent`: run in ONNX Runtime (optimizations off) and compare outputs.
* Session fixtures `registry_export`, `registry_model`, `registry_fold`: each registry model is
  exported once per form, loaded once and folded once per `FoldOptions` for the whole run; no test
  exports a registry model itself.
"""

from __future__ import annotations

import collections
import importlib.util
import pathlib
import sys

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import numpy_helper

from normpass import FoldOptions, FoldResult, fold_onnx
from normpass.onnx.runtime.verify import make_inputs, run

IR_VERSION = 10  # ONNX Runtime 1.31 accepts IR ≤ 13; onnx 1.23 defaults to a newer one
CONTRIB_TEST_DOMAIN = "normpass.test.contrib"
REL_TOL = 1e-5


def calls_made(function, *args, **kwargs) -> int:
    """How many Python and C functions `function(*args, **kwargs)` calls: a measure of work that does not
    depend on the machine's load."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        function(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return count


def load_module(path: pathlib.Path, name: str | None = None):
    """The script at `path` (a tool, an example) imported as the module `name` (its file's stem by default),
    registered in `sys.modules` so that its dataclasses can look their module up."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(gen: np.random.Generator, *shape, scale: float = 1.0) -> np.ndarray:
    return (scale * gen.standard_normal(shape)).astype(np.float32)


def build(text: str, ir_version: int = IR_VERSION, **initializers: np.ndarray) -> onnx.ModelProto:
    """A model from `onnx.parser` text, with `initializers` (name → array) added to its graph.

    Unnamed nodes are named after their first output tensor.
    """
    model = onnx.parser.parse_model(text)
    model.ir_version = ir_version
    for node in model.graph.node:  # name each node after its first output, so tests can refer to it
        if not node.name:
            node.name = node.output[0]
    for name, value in initializers.items():
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    onnx.checker.check_model(model, full_check=True)
    return model


# What rms_op "simplified" produces: the ORT contrib RMS op, fused with a preceding residual Add
# into SkipSimplifiedLayerNormalization (com.microsoft) unless FoldOptions(fuse_skip=False).
SIMPLIFIED_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def rms_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type in SIMPLIFIED_OPS]


def rms_scale(node: onnx.NodeProto) -> str:
    """The name of an RMS node's γ input (Skip* ops take (x, skip, γ[, bias]))."""
    return node.input[2] if node.op_type.startswith("Skip") else node.input[1]


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


def nodes_of(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type == op_type]


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def producer(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto | None:
    return next((node for node in model.graph.node if tensor in node.output), None)


def consumers(model: onnx.ModelProto, tensor: str) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if tensor in node.input]


def check_structure(model: onnx.ModelProto) -> None:
    """`onnx.checker.check_model(full_check=True)` on a copy with the ORT contrib RMS op re-domained.

    `SimplifiedLayerNormalization` is an ONNX Runtime contrib op in the default domain, which the
    checker rejects ("No Op registered"); moving just those nodes to a custom domain keeps every
    other node, initializer and type checked. (`com.microsoft` ops such as the fused
    SkipSimplifiedLayerNormalization are already in a custom domain, which the checker skips.)
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    moved = False
    for node in copy.graph.node:
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
            node.domain = CONTRIB_TEST_DOMAIN
            moved = True
    if moved and not any(o.domain == CONTRIB_TEST_DOMAIN for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid(CONTRIB_TEST_DOMAIN, 1))
    onnx.checker.check_model(copy, full_check=True)


def check_plain(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run(model, feeds)


def max_rel_error(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> float:
    worst = 0.0
    assert set(reference) == set(candidate), (set(reference), set(candidate))
    for name, ref in reference.items():
        got = candidate[name]
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        assert got.dtype == ref.dtype, (name, got.dtype, ref.dtype)
        ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
        scale = max(float(np.abs(ref64).max()), 1e-30) if ref.size else 1.0
        worst = max(worst, float(np.abs(ref64 - got64).max()) / scale if ref.size else 0.0)
    return worst


def assert_equivalent(
    original: onnx.ModelProto, folded: onnx.ModelProto, seeds=(11, 12), shapes=None, rel_tol: float = REL_TOL
) -> None:
    """Both models give the same outputs (within `rel_tol` of each output's scale) on new inputs."""
    for seed in seeds:
        feeds = make_inputs(original, shapes, seed=seed)
        # scale float inputs up so a forgotten shift would be visible above the tolerance
        feeds = {k: (v * 3 + 1).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        expected, got = run_ort(original, feeds), run_ort(folded, feeds)
        error = max_rel_error(expected, got)
        assert error <= rel_tol, f"seed {seed}: relative error {error:.3g} > {rel_tol}"


@pytest.fixture
def gen() -> np.random.Generator:
    return rng(0)


@pytest.fixture(scope="session")
def registry_export(tmp_path_factory):
    """`registry_export(name, form="dynamo")` → path of registry model `name` exported in `form`, once per session.

    Every test that needs a registry model's ONNX file takes it from here, so each (model, form) is
    exported once per run; a derived form (`builtin_models.BASE_FORM`) is converted from the cached
    export of its base form.
    """
    from normpass import models as builtin_models

    root = tmp_path_factory.mktemp("registry")
    cache: dict[tuple[str, str], pathlib.Path] = {}

    def export(name: str, form: str = "dynamo") -> pathlib.Path:
        key = (name, form)
        if key not in cache:
            path = root / f"{name}.{form}.onnx"
            base = builtin_models.BASE_FORM.get(form)
            if base is None:
                cache[key] = builtin_models.export_onnx(name, path, form)
            else:
                cache[key] = builtin_models.convert(builtin_models.get(name), export(name, base), path, form)
        return cache[key]

    return export


@pytest.fixture(scope="session")
def registry_model(registry_export):
    """`registry_model(name, form="dynamo")` → the loaded ModelProto of that export, shared: never modify it."""
    cache: dict[tuple[str, str], onnx.ModelProto] = {}

    def load(name: str, form: str = "dynamo") -> onnx.ModelProto:
        if (name, form) not in cache:
            cache[name, form] = onnx.load(str(registry_export(name, form)))
        return cache[name, form]

    return load


@pytest.fixture(scope="session")
def registry_fold(registry_model):
    """`registry_fold(name, form="dynamo", **options)` →
    `fold_onnx(registry_model(name, form), FoldOptions(**options))`.

    Each fold (verified by `fold_onnx` unless `verify=False`) runs once per session; tests read the
    result and never modify it.
    """
    cache: dict[tuple[str, str, str], FoldResult] = {}

    def fold(name: str, form: str = "dynamo", **options) -> FoldResult:
        fold_options = FoldOptions(**options)
        key = (name, form, repr(fold_options))  # equal FoldOptions share one fold
        if key not in cache:
            cache[key] = fold_onnx(registry_model(name, form), fold_options, name=f"{name} ({form})")
        return cache[key]

    return fold


@pytest.fixture(scope="session")
def genai_folder(tmp_path_factory):
    """`genai_folder(family)` → the seeded ONNX Runtime GenAI folder of `family` (`normpass.models.genai`), built by
    the GenAI builder once per session; skips where onnxruntime-genai is not installed."""
    pytest.importorskip("onnxruntime_genai", reason="the GenAI builder needs onnxruntime-genai (the genai extra)")
    from normpass.models import genai

    root = tmp_path_factory.mktemp("genai")
    cache: dict[str, pathlib.Path] = {}

    def folder(family: str) -> pathlib.Path:
        if family not in cache:
            cache[family] = genai.build_folder(family, root / family)
        return cache[family]

    return folder


@pytest.fixture(scope="session")
def with_past_export(tmp_path_factory):
    """`with_past_export(family, exporter)` → (path, PyTorch model) of `family` exported with its KV cache as inputs
    and outputs (`normpass.models.genai.export_with_past`), once per session."""
    from normpass.models import genai

    root = tmp_path_factory.mktemp("with_past")
    cache: dict[tuple[str, str], tuple] = {}

    def export(family: str, exporter: str = "dynamo"):
        if (family, exporter) not in cache:
            cache[family, exporter] = genai.export_with_past(family, root / f"{family}.{exporter}.onnx", exporter)
        return cache[family, exporter]

    return export
