"""`normpass.replace` on nn.Modules (normpass/torch/replace.py), and the two front ends agreeing.

* The registry's post-LN BERT (seeded weights, 5 LayerNorms) with seeded token batches: the
  embedding LayerNorm folds exactly (its β across the residual add, as the ONNX fold puts it), the
  others become surrogate modules whose shift and β sit in the adjacent linear layers; the
  result matches the un-migrated surrogates, runs eagerly, under `torch.compile` and through
  `torch.onnx.export` (checked in ONNX Runtime); the user's module is untouched.
* The same model through ONNX (its dynamo export) and through PyTorch: the same norms are
  candidates with the same reasons and the same decisions and costs, the fits agree, and a
  surrogate fitted on either front end, emitted on the other, computes the same function.
* Each surrogate module computes the core's formula, exports to ONNX as what `ops()` says, and
  blends with its norm in `SmoothRemoval`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import numpy as np
import onnx
import pytest
import torch
from conftest import run_ort
from torch import nn

import normpass
from normpass import InputError, ReplaceOptions, models
from normpass.core.surrogates import Surrogate
from normpass.models import zoo
from normpass.onnx.replace.driver import prepare as prepare_onnx
from normpass.torch.replace import apply_surrogates
from normpass.torch.rewrite import Permuted
from normpass.torch.surrogates import (
    Affine,
    Derf,
    DyT,
    ScaleBias,
    ShiftedRMSNorm,
    SmoothRemoval,
    SurrogateNorm,
    smooth_removal,
    surrogate_module,
    surrogate_modules,
    surrogate_norm,
)

OPTIONS = ReplaceOptions(kind="auto", budget="cos=0.99", orders=("input",))
REL_TOL = 1e-4  # float32: migrating constants only changes rounding


def _rel(reference, candidate) -> float:
    reference, candidate = np.asarray(reference, np.float64), np.asarray(candidate, np.float64)
    return float(np.abs(reference - candidate).max() / np.abs(reference).max())


@pytest.fixture(scope="module")
def bert():
    module, inputs = models.get("bert").build_torch()
    gen = torch.Generator().manual_seed(0)
    calibration = [(torch.randint(0, 128, (8, 16), generator=gen),) for _ in range(6)]
    before = copy.deepcopy(module.state_dict())
    replaced, report = normpass.replace(module, calibration, OPTIONS)
    return module, inputs, calibration, replaced, report, before


def test_replace_module_folds_exactly_first_then_swaps_norms_for_surrogates(bert):
    module, _, _, replaced, report, before = bert
    data = report.to_json()
    assert (data["total"], data["exact"], data["front_end"]) == (5, 1, "pytorch")
    assert report.passed and report.replaced >= 2 and report.test["cos_min"] >= 0.99
    folded = replaced.model.embeddings.LayerNorm  # the exact fold: β moved across the residual add, as in ONNX
    assert type(folded) is nn.RMSNorm and folded.weight is not None
    swapped = dict(surrogate_modules(replaced))
    assert {f"{name}" for name, d in report.decisions().items() if d == "replaced"} == set(swapped)
    for path, surrogate in swapped.items():
        assert path in report.surrogates and surrogate.kind == report.surrogates[path].kind
        assert repr(surrogate).startswith(f"{type(surrogate).__name__}(64")
        assert all(isinstance(p, nn.Parameter) for p in surrogate.parameters())
        row = next(r for r in data["norms"] if r["name"] == path)
        assert row["emission"]["cost"] < row["original_cost"] and row["emission"]["beta"].startswith("migrated")
        if surrogate.kind == "rms":  # c into the dense bias before it, β into the layers after it
            assert surrogate.shift is None and surrogate.beta is None and surrogate.gamma is not None
    for key, value in module.state_dict().items():  # the user's module is untouched
        assert torch.equal(value, before[key])


def test_replaced_module_matches_its_unmigrated_surrogates_and_the_report(bert):
    module, inputs, _, replaced, report, _ = bert
    plain, emissions = apply_surrogates(
        module, inputs, report.surrogates, ReplaceOptions(kind="auto", migrate_affine=False)
    )
    assert all(e.beta == "Add" for e in emissions.values())  # every term stays in its module
    other = models.get("bert").make_inputs(3, 11, 5)
    with torch.no_grad():
        assert _rel(plain(*other), replaced(*other)) <= REL_TOL
        cos = torch.nn.functional.cosine_similarity(module(*other).flatten(1), replaced(*other).flatten(1))
        assert float(cos.min()) >= 0.99
        # smooth removal (DaMN): at α = 1 the student computes the original, at α = 0 its surrogates
        surrogate_outputs = plain(*other)
        blends = smooth_removal(plain, module)
        assert len(blends) == report.replaced and _rel(module(*other), plain(*other)) <= REL_TOL
        for blend in blends:
            blend.alpha.fill_(0.0)
        assert _rel(surrogate_outputs, plain(*other)) <= 1e-6
    with pytest.raises(ValueError, match="migrate_affine=False"):
        smooth_removal(copy.deepcopy(replaced), module)  # its shift and β live in the linear layers


def test_replaced_module_compiles_and_exports_to_onnx(bert, tmp_path):
    _, inputs, _, replaced, _, _ = bert
    torch._dynamo.reset()
    compiled = torch.compile(replaced, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        eager = replaced(*inputs)
        assert _rel(eager, compiled(*inputs)) <= 1e-6
    path = tmp_path / "replaced.onnx"
    torch.onnx.export(replaced, inputs, str(path), dynamo=True, input_names=["input_ids"], verbose=False)
    model = onnx.load(str(path))
    assert not [n for n in model.graph.node if n.op_type == "LayerNormalization"][1:]  # the last norm was kept
    (got,) = run_ort(model, {"input_ids": inputs[0].numpy()}).values()
    assert _rel(eager, got) <= REL_TOL


@pytest.fixture(scope="module")
def through_onnx(bert, registry_export):
    _, _, calibration, _, _, _ = bert
    model = onnx.load(str(registry_export("bert")))
    batches = [{"input_ids": ids.numpy()} for (ids,) in calibration]
    return model, batches, normpass.replace_onnx(model, batches, OPTIONS)


def test_front_ends_agree_on_candidates_reasons_decisions_and_fits(bert, through_onnx):
    torch_rows = bert[4].to_json()["norms"]
    onnx_rows = through_onnx[2].report.to_json()["norms"]
    assert len(torch_rows) == len(onnx_rows) == 5
    for ours, theirs in zip(torch_rows, onnx_rows, strict=True):
        assert (ours["decision"], ours["reason"]) == (theirs["decision"], theirs["reason"])
        assert [c["kind"] for c in ours.get("candidates", [])] == [c["kind"] for c in theirs.get("candidates", [])]
        for a, b in zip(ours.get("candidates", []), theirs.get("candidates", []), strict=True):
            assert a["cost"] == b["cost"] and (a["skipped"] is None) == (b["skipped"] is None)
        if ours["decision"] == "replaced":
            assert ours["surrogate"] == theirs["surrogate"] and ours["emission"]["cost"] == theirs["emission"]["cost"]
            assert ours["input_centring"] and theirs["input_centring"]  # a MatMul and its bias Add: one nn.Linear
            for term in ("gamma", "beta"):
                assert ours["parameters"][term]["mean"] == pytest.approx(theirs["parameters"][term]["mean"], abs=1e-5)


def _pairs(torch_report, onnx_report) -> list[tuple[str, str]]:
    """(torch name, ONNX name) of each replaced norm: both reports list the norms in topological order."""
    names = zip(torch_report.to_json()["norms"], onnx_report.to_json()["norms"], strict=True)
    return [(a["name"], b["name"]) for a, b in names if a["decision"] == "replaced"]


def test_a_surrogate_fitted_in_torch_emits_the_same_function_into_onnx(bert, through_onnx):
    _, _, calibration, replaced, report, _ = bert
    model, batches, result = through_onnx
    pairs = _pairs(report, result.report)
    bench = prepare_onnx(model, batches, OPTIONS).bench
    onnx_outputs = bench.outputs([(ours, report.surrogates[theirs]) for theirs, ours in pairs], batches)
    with torch.no_grad():
        for (ids,), got in zip(calibration, onnx_outputs, strict=True):
            assert _rel(replaced(ids), got["last_hidden_state"]) <= REL_TOL


def test_a_surrogate_fitted_on_onnx_emits_the_same_function_into_torch(bert, through_onnx):
    module, inputs, _, _, report, _ = bert
    _, batches, result = through_onnx
    fitted = {ours: result.report.surrogates[theirs] for ours, theirs in _pairs(report, result.report)}
    emitted, _ = apply_surrogates(module, inputs, fitted, OPTIONS)
    with torch.no_grad():
        for batch in batches:
            (expected,) = run_ort(result.model, batch).values()
            assert _rel(expected, emitted(torch.from_numpy(batch["input_ids"]))) <= REL_TOL


# --- the surrogate modules ---------------------------------------------------------------------

D = 6


def _fitted(kind: str, gen) -> Surrogate:
    gamma, beta = 1 + 0.3 * gen.standard_normal(D), 0.2 * gen.standard_normal(D)
    if kind == "scalebias":
        return Surrogate(kind, np.full(D, 0.7), beta, alpha=0.7)
    shift = {"rms": 0.3, "derf": -0.4, "dyt": 0.1 * gen.standard_normal(D)}.get(kind, 0.0)
    return Surrogate(kind, gamma, beta, shift=shift, alpha=0.8, epsilon=1e-5)


KINDS = {
    "affine": (Affine, {"Mul": 1, "Add": 1}),
    "scalebias": (ScaleBias, {"Mul": 1, "Add": 1}),
    "dyt": (DyT, {"Sub": 1, "Mul": 2, "Tanh": 1, "Add": 1}),
    "derf": (Derf, {"Sub": 1, "Mul": 2, "Erf": 1, "Add": 1}),
    "rms": (ShiftedRMSNorm, {"Sub": 1, "RMSNormalization": 1, "Add": 1}),
}


class _Every(nn.Module):
    """Every surrogate module on the same input, for one export."""

    def __init__(self, modules):
        super().__init__()
        self.each = nn.ModuleList(modules)

    def forward(self, x):
        return tuple(m(x) for m in self.each)


def test_surrogate_modules_compute_the_core_formula_and_export(gen, tmp_path):
    x = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(1))
    wide = x.double().numpy()
    fitted = {kind: _fitted(kind, gen) for kind in KINDS}
    modules = {kind: surrogate_module(s, D) for kind, s in fitted.items()}
    for kind, (cls, ops) in KINDS.items():
        module = modules[kind]
        assert type(module) is cls and dict(module.ops()) == ops and repr(module).startswith(f"{cls.__name__}({D}")
        with torch.no_grad():
            np.testing.assert_allclose(module(x).double().numpy(), fitted[kind](wide), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(module.to_surrogate()(wide), fitted[kind](wide), rtol=1e-5, atol=1e-6)
    every = _Every(list(modules.values())).eval()
    path = tmp_path / "every.onnx"
    torch.onnx.export(every, (x,), str(path), dynamo=True, input_names=["x"], verbose=False)
    exported = run_ort(onnx.load(str(path)), {"x": x.numpy()})
    with torch.no_grad():
        for got, expected in zip(exported.values(), every(x), strict=True):
            np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_migrated_terms_are_left_out_and_said_so(gen):
    fitted = _fitted("derf", gen)
    module = surrogate_module(fitted, D, keep_shift=False, keep_gamma=False, keep_beta=False)
    assert module.shift is None and module.gamma is None and module.beta is None
    assert dict(module.ops()) == {"Mul": 1, "Erf": 1} and "gamma=migrated" in repr(module)
    assert module.migrated == ("shift", "gamma", "beta")
    assert [name for name, _ in module.named_parameters()] == ["alpha"]


def test_smooth_removal_blends_a_norm_into_its_surrogate(gen):
    norm = nn.LayerNorm(D)
    surrogate = surrogate_module(_fitted("affine", gen), D)
    model = nn.Sequential(nn.Linear(D, D), SmoothRemoval(norm, surrogate))
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = model[0](x)
        blend = model[1]
        assert torch.allclose(model(x), norm(h))
        blend.alpha.fill_(0.0)
        assert torch.allclose(model(x), surrogate(h))
        blend.alpha.fill_(0.25)
        assert torch.allclose(model(x), 0.25 * norm(h) + 0.75 * surrogate(h))
    assert [path for path, _ in surrogate_modules(model)] == ["1.surrogate"]
    assert isinstance(dict(surrogate_modules(model))["1.surrogate"], SurrogateNorm)


def test_bad_torch_calibration_is_refused_with_a_reason(bert):
    module = bert[0]
    nan = torch.full((8, 16), float("nan"))
    with pytest.raises(InputError, match="non-finite"):
        normpass.replace(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval(), [(nan,)] * 2, OPTIONS)
    with pytest.raises(InputError, match="do not fit"):
        normpass.replace(module, [(torch.zeros(8, 4, dtype=torch.long), torch.zeros(1))], OPTIONS)
    with pytest.raises(InputError, match="provider prices ONNX Runtime's fusions"):
        normpass.replace(module, [(torch.zeros(8, 4, dtype=torch.long),)], dataclasses.replace(OPTIONS, provider="cpu"))
    counts = collections.Counter(type(m).__name__ for m in module.modules())
    assert counts["LayerNorm"] == 5  # still the user's module


def test_replace_swaps_timm_layer_norm_modules_between_their_permutes():
    """timm's LayerNorm2d (a permute, F.layer_norm over its own weight and bias, a permute back) is a
    candidate as `fold` reads it: its surrogate sits between the same permutes, fitted on the
    channels-last rows its norm sees."""
    pytest.importorskip("timm", reason=f"timm is not installed ({zoo.TIMM_INSTALL})")
    module, inputs = zoo.get("timm-convnext").build()
    before = copy.deepcopy(module.state_dict())
    gen = torch.Generator().manual_seed(0)
    calibration = [(torch.randn(2, 3, 32, 32, generator=gen),) for _ in range(4)]
    options = ReplaceOptions(
        kind="rms", budget="cos=0.99", orders=("input",), norms=("stages.1.downsample.0",), migrate_affine=False
    )
    replaced, report = normpass.replace(module, calibration, options)
    assert type(module.stages[1].downsample[0]).__name__ == "LayerNorm2d"
    assert report.decisions()["stages.1.downsample.0"] == "replaced" and report.passed
    swapped = replaced.stages[1].downsample[0]
    assert type(swapped).__name__ == "Permuted" and (swapped.before, swapped.after) == ((0, 2, 3, 1), (0, 3, 1, 2))
    assert [path for path, _ in surrogate_modules(replaced)] == ["stages.1.downsample.0.norm"]
    with torch.no_grad():
        cos = nn.functional.cosine_similarity(module(*inputs).flatten(), replaced(*inputs).flatten(), 0)
    assert cos >= 0.99
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    blend = smooth_removal(replaced, module)[0]  # the LayerNorm2d and the permuted surrogate, at one path
    assert replaced.stages[1].downsample[0] is blend and blend.surrogate is swapped
    x = torch.randn(2, 16, 4, 4, generator=gen)
    with torch.no_grad():
        assert torch.allclose(blend(x), module.stages[1].downsample[0](x))
        blend.alpha.fill_(0.0)
        assert torch.allclose(blend(x), swapped(x))


def test_smooth_removal_blends_at_the_path_of_the_norm_it_replaces(gen):
    """A surrogate between permutes replaced a channels-first norm module (blended at that module's path);
    a surrogate for a folded RMSNorm inside `Permuted` replaced that RMSNorm (blended at its own path)."""
    channels_first = nn.Sequential(Permuted(surrogate_module(_fitted("affine", gen), D), (0, 2, 1), (0, 2, 1)))
    folded = nn.Sequential(Permuted(nn.RMSNorm(D), (0, 2, 1), (0, 2, 1)))
    for norms, path, held in [(nn.Sequential(nn.LayerNorm(D)), "0", Permuted), (folded, "0.norm", SurrogateNorm)]:
        student = copy.deepcopy(channels_first)
        blend = smooth_removal(student, norms)[0]
        assert student.get_submodule(path) is blend and isinstance(blend.surrogate, held)
        assert surrogate_norm(blend.surrogate) is next(m for _, m in surrogate_modules(student))
