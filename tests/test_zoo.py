"""The zoo (models/zoo.py): third-party architectures through both exporters and the PyTorch front end.

For every architecture and front end: every LayerNorm the module runs is listed, every norm proven
is rewritten (the ONNX fold with `fold_with_beta_add`, so none is kept), and the folded model
matches the original outside normpass's verifier (ONNX Runtime without normpass code; the module's
own outputs). Parity: the module proves the same number of norms as its exports, except where the
entry says why not (`ZooModel.differs`, printed in the table). docs/zoo.md is what this run gives,
with the forced fold of every norm left (models/counterexample.py), tested here on small graphs.

Each architecture runs once per session (about 8 minutes for all of them on 2 shared CPU cores);
timm's skip, naming the install command, where timm is missing.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from conftest import build, randn, rng
from test_patterns import D, S, header, post_ln

from normpass import inspect_onnx
from normpass.models import zoo
from normpass.models.counterexample import ROUNDING, ForcedFold, forced_folds

TABLE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "zoo.md"


@pytest.fixture(scope="session")
def zoo_runs(tmp_path_factory):
    """`zoo_runs(model)` → its run through each front end, once per session."""
    cache: dict[str, dict[str, zoo.ZooRun]] = {}
    workdir = tmp_path_factory.mktemp("zoo")

    def runs(model: zoo.ZooModel) -> dict[str, zoo.ZooRun]:
        if model.name not in cache:
            cache[model.name] = {front_end: zoo.run(model, front_end, workdir) for front_end in zoo.FRONT_ENDS}
        return cache[model.name]

    return runs


def _available(model: zoo.ZooModel) -> None:
    if not model.available:
        pytest.skip(f"{model.name}: timm is not installed ({zoo.TIMM_INSTALL})")


@pytest.mark.parametrize("model", zoo.ZOO, ids=lambda m: m.name)
def test_listed_proven_folded_and_matching(model, zoo_runs):
    _available(model)
    for front_end, run in zoo_runs(model).items():
        if front_end in model.differs and (run.failure or run.norms != run.executed):
            continue  # a known exporter failure or listing difference, with its reason in the table
        assert zoo.problem(run) is None, f"{model.name} ({front_end}): {zoo.problem(run)}"
        assert run.folded == run.proven, f"{model.name} ({front_end}): proven {run.proven}, folded {run.folded}"


@pytest.mark.parametrize("model", zoo.ZOO, ids=lambda m: m.name)
def test_module_proves_what_its_exports_prove(model, zoo_runs):
    _available(model)
    proven = {front_end: run.proven for front_end, run in zoo_runs(model).items() if front_end not in model.differs}
    assert len(set(proven.values())) <= 1, f"{model.name}: proven by front end {proven}"


def test_zoo_covers_the_families():
    assert len(zoo.ZOO) >= 30
    families = {model.family for model in zoo.ZOO}
    assert {"decoder", "encoder", "encoder-decoder", "speech"} <= families
    assert {"vision: ViT", "vision: hierarchical", "vision: conv stem"} <= families
    assert {model.source for model in zoo.ZOO} == {"transformers", "timm"}


def test_table_is_what_the_run_gives(zoo_runs):
    if not zoo.timm_available():
        pytest.skip(f"the table covers timm's models: install timm ({zoo.TIMM_INSTALL})")
    runs = [run for model in zoo.ZOO for run in zoo_runs(model).values()]
    assert TABLE.read_text() == zoo.table(runs), "docs/zoo.md is stale: python tools/zoo.py --write docs/zoo.md"


def _feeds(gen: np.random.Generator, width: int = 6) -> dict[str, np.ndarray]:
    return {"x": randn(gen, 2, S, width)}


def test_a_post_ln_norm_forced_changes_its_input_and_the_outputs_and_an_insertion_is_exact():
    """y reads n1's γ⊙x̂+β: centring the layer the proof reaches (W1) leaves a mean; x − mean(x) at r is exact."""
    model = post_ln(rng(13))
    (fold,) = forced_folds(model, inspect_onnx(model), _feeds(rng(1)))
    assert fold.norm == "y"
    assert fold.input_mean > 0.01 and fold.output_change > 0.01
    assert fold.insertion_change is not None and fold.insertion_change < ROUNDING


def test_an_unsafe_centring_forced_leaves_the_input_zero_mean_and_changes_another_output():
    """Centring W makes y's input zero-mean exactly, but its shift reaches Relu: the outputs change, and no
    insertion is exact (the shift of h reaches the Relu too)."""
    model = build(
        f"""{header()}
agraph (float[B, {S}, 6] x) => (float[B, {S}, {D}] y, float[B, {S}, {D}] z) {{
  h = MatMul(x, W)
  y = LayerNormalization<axis=-1>(h, g, b)
  z = Relu(h)
}}""",
        W=randn(rng(2), 6, D),
        g=randn(rng(3), D),
        b=randn(rng(4), D),
    )
    plan = inspect_onnx(model)
    assert not plan.folded
    (fold,) = forced_folds(model, plan, _feeds(rng(5)))
    assert fold.input_mean < ROUNDING and fold.output_change > 0.01
    assert fold.insertion_change is None


def test_nothing_is_forced_where_every_norm_folds():
    model = post_ln(rng(13))
    plan = inspect_onnx(model)
    plan.decisions = plan.folded
    assert forced_folds(model, plan, _feeds(rng(1))) == []


def test_the_table_gives_each_reason_its_counter_example():
    folds = [ForcedFold("a", 0.123, 0.0214, 1e-7), ForcedFold("b", 0.04, 3e-6, None)]
    text = zoo.evidence(folds, 2)
    assert "input |mean|/rms 0.04–0.12" in text and "(2 of 3)" in zoo.evidence(folds, 3)
    assert f"output change <{ROUNDING:g}–0.021" in text
    assert "inserted x − mean(x) (1 of 2)" in text
    assert zoo.evidence([], 1) == ""


def test_layer_scales_are_drawn_per_channel():
    """ConvNeXt initialises its LayerScales to 1e-6, where its blocks hardly reach the outputs; the zoo draws them."""
    module, _ = zoo.get("convnext").build()
    scales = [p for name, p in module.named_parameters() if name.endswith("layer_scale_parameter")]
    assert scales and all(float(p.min()) > 0.1 and float(p.std()) > 0.05 for p in scales)


def test_an_exported_norm_is_named_after_the_module_that_ran_it():
    """The dynamo exporter's name scopes give the module path, the name the PyTorch front end gives the norm."""
    model = post_ln(rng(13))
    node = next(n for n in model.graph.node if n.name == "y")
    entry = node.metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.name_scopes", "['', 'model', 'model.encoder.norm', 'layer_norm_1']"
    assert zoo.norm_keys(model) == {"y": "model.encoder.norm"}
