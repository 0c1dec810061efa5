"""The PyTorch front end (`normpass.fold` / `normpass.inspect` on nn.Modules).

* Registry models built from transformers code with seeded weights (GPT-2 with a tied LM head,
  BERT, ViT, Swin, Llama): the PyTorch fold decides every norm as the ONNX front end does on the
  same model's ONNX export (norms matched by their γ parameter's name), with the same kind of
  reason; the folded module matches the original (≤ 1e-5 relative) at the example and at other
  input shapes; the user's module is left untouched.
* Every folded registry model runs under `torch.compile` (backend "aot_eager": inductor takes
  about a minute per model on 2 CPU cores); the folded GPT-2 exports to ONNX, where it stays folded
  and ONNX Runtime matches it (the other models' exports take ~10 s each and were checked by hand).
* Small modules: what a module rewrite cannot express is declined with a reason (a layer also
  called where centring is unsafe, F.layer_norm, a LayerNorm called twice); the symbolic_trace
  fallback; untraceable models; verification failure; bad input.
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normpass import models as builtin_models
from normpass.core.analysis import plan as make_plan
from normpass.errors import InputError, UnsupportedModelError, VerificationError
from normpass.onnx.fold.driver import inspect_onnx
from normpass.onnx.graph.frontend import build_zero_mean_graph, load_graph
from normpass.onnx.runtime.verify import run
from normpass.torch.api import export_onnx, fold, inspect, load_factory
from normpass.torch.capture import capture
from normpass.torch.fx import build_zero_mean_graph as torch_graph
from normpass.torch.rewrite import Centred, Permuted, RMSNormWithBias, _edits_of

SMALL = builtin_models.names(include_large=False)
REL_TOL = 1e-5


def _rel_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    reference, candidate = reference.double(), candidate.double()
    return float((reference - candidate).abs().max() / reference.abs().max())


def _last_words(reason: str) -> str:
    """The end of a reason: what blocked, without the node names that differ between front ends."""
    return " ".join(reason.split()[-4:])


@pytest.fixture(scope="module")
def fold_registry():
    """`fold_registry(name)` → (entry, module, inputs, folded module, report, the module's state before), once per
    module."""
    cache = {}

    def folded(name):
        if name not in cache:
            entry = builtin_models.get(name)
            module, inputs = entry.build_torch()
            before = {k: v.clone() for k, v in module.state_dict(keep_vars=False).items()}
            result, report = fold(module, inputs)
            cache[name] = entry, module, inputs, result, report, before
        return cache[name]

    return folded


@pytest.fixture(scope="module", params=SMALL)
def folded(request, fold_registry):
    return fold_registry(request.param)


# --- registry models ---------------------------------------------------------------------------


def test_same_verdicts_as_onnx(folded, registry_export):
    entry, _, _, _, report, _ = folded
    zmg = build_zero_mean_graph(load_graph(onnx.load(str(registry_export(entry.name)))))
    onnx_plan = make_plan(zmg)
    by_gamma = {norm.scale: decision for norm, decision in zip(zmg.norms, onnx_plan.decisions, strict=False)}
    assert report.plan.total == onnx_plan.total == entry.expected_norms
    assert report.folded == len(onnx_plan.folded) == entry.expected_folded
    for decision in report.plan.decisions:
        twin = by_gamma[f"{decision.name}.weight"]
        assert decision.foldable == twin.foldable, (decision.name, decision.reason, twin.reason)
        if not decision.foldable:
            assert _last_words(decision.reason) == _last_words(twin.reason), (decision.reason, twin.reason)


def test_folded_module_matches(folded):
    entry, module, _, result, report, _ = folded
    assert report.capture == "torch.export" and report.export_error is None
    assert report.comparison.passed and report.max_rel_error <= REL_TOL, report.to_json()
    assert report.float64["folded_rel_error"] <= REL_TOL
    other = entry.make_inputs(3, 11, 123)  # shapes differ from the captured ones
    with torch.no_grad():
        assert _rel_error(module(*other), result(*other)) <= REL_TOL


def test_norm_modules_are_swapped(folded):
    _, module, _, result, report, before = folded
    assert module.state_dict().keys() == before.keys()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items()), "the user's module changed"
    for decision in report.plan.decisions:
        original, new = module.get_submodule(decision.name), result.get_submodule(decision.name)
        if decision.foldable:
            assert isinstance(original, nn.LayerNorm) and isinstance(new, nn.RMSNorm)
            assert new.eps == original.eps
            migrated = report.affine_notes[decision.name].startswith("γ/β migrated")
            assert (new.weight is None) == migrated
            assert isinstance(new, RMSNormWithBias) == (not migrated and original.bias is not None)
        else:
            assert type(new) is type(original)


def test_inspect_gives_the_folds_plan(folded):
    _, module, inputs, _, report, _ = folded
    assert inspect(module, inputs).to_json() == report.plan.to_json()


def test_gpt2_tied_head_is_untied_copy_on_write(fold_registry):
    _, module, inputs, result, report, _ = fold_registry("gpt2")
    original, new = module.model, result.model
    assert original.lm_head.weight is original.transformer.wte.weight
    assert new.lm_head.weight is not new.transformer.wte.weight
    assert report.untied == {"model.transformer.wte.weight": ["model.lm_head.weight"]}
    table = new.transformer.wte.weight.detach().double()
    assert table.mean(dim=1).abs().max() < 1e-6  # centred rows
    assert new.lm_head.bias is not None  # β of ln_f migrated into the head, which had no bias
    assert original.config.tie_word_embeddings and not new.config.tie_word_embeddings
    with torch.no_grad():
        expected = result(*inputs)
        new.tie_weights()  # HF must not tie the centred table to the head again
        assert new.lm_head.weight is not new.transformer.wte.weight
        assert torch.equal(result(*inputs), expected)


def test_folded_module_compiles(folded):
    _, _, inputs, result, _, _ = folded
    torch._dynamo.reset()
    compiled = torch.compile(result, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        assert _rel_error(result(*inputs), compiled(*inputs)) <= REL_TOL


def test_folded_gpt2_exports_to_onnx_and_stays_folded(fold_registry, tmp_path):
    entry, module, inputs, result, _, _ = fold_registry("gpt2")
    path = tmp_path / "folded.onnx"
    export_onnx(result, inputs, path, dynamic_shapes=entry.dynamic_shapes)
    model = onnx.load(str(path))
    assert not [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    plan = inspect_onnx(model)
    assert plan.total == entry.expected_norms and {d.op for d in plan.decisions} == {"decomposed RMSNorm"}
    other = entry.make_inputs(3, 11, 7)
    (got,) = run(model, {model.graph.input[0].name: other[0].numpy()}).values()
    with torch.no_grad():
        assert _rel_error(result(*other), torch.from_numpy(got)) <= REL_TOL
        assert _rel_error(module(*other), torch.from_numpy(got)) <= REL_TOL


# --- small modules -----------------------------------------------------------------------------


class Stack(nn.Module):
    """embedding → residual blocks (pre-LN) → final LN → bias-free head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.ln1, self.up, self.down, self.ln2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + 0.5 * self.down(F.gelu(self.up(self.ln1(h))))
        return self.head(self.ln2(h))


class SharedLayer(nn.Module):
    """`fc` feeds `ln` (centring it is safe there) and, called again, the output (unsafe)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.ln(self.fc(x))) + self.fc(2 * x)


class FunctionalNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gamma, self.beta = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.layer_norm(self.fc(x), (8,), self.gamma, self.beta)


class NormTwice(nn.Module):
    """`ln` reads a centrable layer and, called again, the raw input."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(self.fc(x)) + self.ln(x)


@torch.fx.wrap
def flip_if_positive(x):
    return -x if x.sum() > 0 else x  # a data-dependent branch: torch.export cannot capture it


class WrappedBranch(Stack):
    def forward(self, ids):
        return flip_if_positive(super().forward(ids))


class Branch(Stack):
    def forward(self, ids):
        h = self.emb(ids)
        if h.sum() > 0:
            h = -h
        return self.head(self.ln2(h))


class TinyViT(nn.Module):
    """Patch conv, CLS token and position table, pre-LN attention and MLP blocks, GroupNorm, RMSNorm."""

    def __init__(self):
        super().__init__()
        self.gn, self.patch = nn.GroupNorm(1, 3), nn.Conv2d(3, 8, 4, stride=4)
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, 8)), nn.Parameter(torch.randn(1, 5, 8))
        self.ln1, self.qkv, self.proj, self.drop = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8), nn.Dropout(0.1)
        self.ln2, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.ln3, self.rms, self.head = nn.LayerNorm(8), nn.RMSNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        p = self.patch(self.gn(x)).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], dim=1) + self.pos
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1)
        h = h + self.drop(self.proj(attention @ v))
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.head(self.rms(self.ln3(h)[:, 0]))


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """timm's LayerNorm2d: a LayerNorm over the channels of an NCHW tensor, between two permutes."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class OwnLayerNorm(nn.Module):
    """A LayerNorm that is no nn.LayerNorm: F.layer_norm over its own weight and bias."""

    def __init__(self, width):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(width) + 0.5), nn.Parameter(torch.randn(width))
        self.width = width

    def forward(self, x):
        return F.layer_norm(x, (self.width,), self.weight, self.bias, 1e-6)


class ScaledLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


class ConvNet(nn.Module):
    """A conv stem, a channels-first LayerNorm, then a token LayerNorm that is no nn.LayerNorm."""

    def __init__(self):
        super().__init__()
        self.stem, self.ln2d, self.conv = nn.Conv2d(3, 8, 2, stride=2), ChannelsFirstLayerNorm(8), nn.Conv2d(8, 8, 1)
        self.ln, self.head = OwnLayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        tokens = self.conv(self.ln2d(self.stem(x))).flatten(2).transpose(1, 2)
        return self.head(self.ln(tokens))


class ScaledNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), ScaledLayerNorm(8)

    def forward(self, x):
        return self.ln(self.fc(x))


class Spellings(nn.Module):
    """Third-party spellings of linear maps: a position table indexed by a tensor (Whisper), a token-type
    table read at `zeros_like(ids)` (DeBERTa-v2), a table repeated per sample (XCiT), `x @ W.T + b` (Falcon),
    an in-place residual `add_`, and a dead read of one feature (mBART)."""

    def __init__(self):
        super().__init__()
        self.emb, self.kind, self.pos = nn.Embedding(16, 8), nn.Embedding(2, 8), nn.Parameter(torch.randn(5, 8))
        self.weight, self.bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
        self.ln1, self.ln2 = nn.LayerNorm(8), nn.LayerNorm(8)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        h = self.emb(ids) + self.pos[positions] + self.kind(torch.zeros_like(ids))
        h = h + self.pos[None].repeat(ids.shape[0], 1, 1)  # a copy per sample (XCiT)
        h[:, :, -1]  # computed, never read (mBART reads its embeddings so)
        h.add_(self.ln1(h) @ self.weight.T + self.bias)
        return self.ln2(h)


class AddThroughView(Spellings):
    def forward(self, ids):
        h = self.emb(ids)
        h[:, :1].add_(self.ln1(h)[:, :1] @ self.weight.T)  # changes h, which ln2 reads
        return self.ln2(h)


class EmbeddingNorm(nn.Module):
    """BLOOM's stream: it starts at an embedding LayerNorm's affine output, then two pre-LN blocks."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln0 = nn.Embedding(16, 8), nn.LayerNorm(8)
        self.ln1, self.fc1, self.ln2, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.ln3 = nn.LayerNorm(8)

    def embed(self, ids):
        return self.ln0(self.emb(ids))

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.fc1(self.ln1(h))
        h = h + self.fc2(self.ln2(h))
        return self.ln3(h)


class BatchNormStem(EmbeddingNorm):
    """XCiT's stream: it starts at the BatchNorm ending a convolutional stem."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 2, stride=2), nn.BatchNorm2d(8)

    def embed(self, images):
        return self.bn(self.conv(images)).flatten(2).transpose(1, 2)


class FunctionalEmbeddingNorm(EmbeddingNorm):
    def embed(self, ids):
        return F.layer_norm(self.emb(ids), (8,), self.ln0.weight, self.ln0.bias)


class PositionalConvStream(nn.Module):
    """wav2vec2's encoder input: a projection, plus a grouped positional conv of it, then a dropout module.

    The projection cannot be centred (the conv reads it too), so the plan centres the Add, which a
    module rewrite reaches through the dropout that is its one reader.
    """

    def __init__(self):
        super().__init__()
        self.proj, self.act, self.drop = nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1)
        self.pos_conv = nn.Conv1d(8, 8, 3, padding=1, groups=4)
        self.ln1, self.fc1, self.ln2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.proj(x)
        h = self.drop(h + self.act(self.pos_conv(h.transpose(1, 2))).transpose(1, 2))
        h = h + self.fc1(self.ln1(h))
        return self.ln2(h)


class LayerScaled(nn.Module):
    """CaiT's and DINOv2's residual branch: a linear layer, a dropout, then a per-channel LayerScale γ."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln1, self.fc, self.drop = nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(0.1)
        self.scale, self.ln2 = nn.Parameter(torch.rand(8) + 0.5), nn.LayerNorm(8)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.drop(self.fc(self.ln1(h))) * self.scale
        return self.ln2(h)


class ScaleReadTwice(LayerScaled):
    def forward(self, ids):
        return super().forward(ids) * self.scale


def _seeded(cls):
    torch.manual_seed(0)
    module = cls().eval()
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.LayerNorm, OwnLayerNorm)):
                sub.weight.uniform_(0.5, 1.5)
                sub.bias.normal_()
    return module


IDS = (torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1)),)
X = (torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)),)


def toy_factory():
    return _seeded(Stack), IDS


def test_small_stack_folds_and_migrates():
    result, report = fold(_seeded(Stack), IDS)
    assert report.folded == 2 and report.max_rel_error <= REL_TOL
    assert report.affine_notes == {"ln1": "γ/β migrated into up/linear", "ln2": "γ/β migrated into head/linear_2"}
    assert result.head.bias is not None and isinstance(result.ln2, nn.RMSNorm) and result.ln2.weight is None


def test_bfloat16_module_is_judged_at_bfloat16_tolerance():
    result, report = fold(_seeded(Stack).to(torch.bfloat16), IDS)
    (output,) = report.comparison.outputs
    assert report.folded == 2 and output.dtype == "bfloat16" and output.passed
    assert result.up.weight.dtype == torch.bfloat16
    # against a float64 run, the fold adds no error beyond bfloat16 rounding
    assert report.float64["folded_rel_error"] <= 2 * report.float64["original_rel_error"] + 1e-3


@pytest.mark.parametrize(
    "cls, name, reason",
    [
        (SharedLayer, "ln", "fc.weight cannot be centred: it is also read by fc/linear_2, where centring is unsafe"),
        (FunctionalNorm, "layer_norm", "not a LayerNorm module (the model itself)"),
        (ScaledNormNet, "ln/layer_norm", "not a LayerNorm module (its forward also calls aten.mul)"),
        (NormTwice, "ln", "module ln is also called as ln@1, which does not fold"),
    ],
)
def test_declines_what_a_module_rewrite_cannot_express(cls, name, reason):
    module = _seeded(cls)
    result, report = fold(module, X)
    decision = next(d for d in report.plan.decisions if d.name == name)
    assert not decision.foldable and reason in decision.reason
    assert decision.reason.startswith("provably foldable, but the PyTorch rewrite cannot apply it")
    with torch.no_grad():
        assert torch.equal(result(*X), module(*X))


def _fold_captured_by(capture: str, module, inputs, monkeypatch):
    """`fold(module, inputs)` captured by torch.export, or (torch.export made to fail) by the fallback."""
    if capture != "torch.export":
        monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: 1 / 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning
        return fold(module, inputs)


@pytest.mark.parametrize("capture", ["torch.export", "torch.fx.symbolic_trace"])
def test_layer_norm_modules_of_other_classes_fold(capture, monkeypatch):
    """A LayerNorm subclass between permutes (LayerNorm2d) and a module calling F.layer_norm on its own
    weight and bias are swapped for RMSNorms (the first between the same permutes), by either capture."""
    module, images = _seeded(ConvNet), (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3)),)
    result, report = _fold_captured_by(capture, module, images, monkeypatch)
    assert report.capture == capture
    assert [(d.name, d.foldable) for d in report.plan.decisions] == [("ln2d", True), ("ln", True)]
    assert report.max_rel_error <= REL_TOL
    assert isinstance(result.ln2d, Permuted) and isinstance(result.ln2d.norm, nn.RMSNorm)
    assert (result.ln2d.before, result.ln2d.after) == ((0, 2, 3, 1), (0, 3, 1, 2))
    assert isinstance(result.ln, nn.RMSNorm)
    other = torch.randn(1, 3, 12, 4)  # another shape: the swap is a module, not a traced graph
    with torch.no_grad():
        assert _rel_error(module(other), result(other)) <= REL_TOL


@pytest.mark.parametrize("capture", ["torch.export", "torch.fx.symbolic_trace"])
def test_third_party_spellings_of_linear_maps_fold(capture, monkeypatch):
    """By either capture: symbolic_trace lowers `table[positions]`, `zeros_like`, `repeat` and the
    residual `h.add_(…)` (its later readers read the sum) as torch.export does."""
    module = _seeded(Spellings)
    result, report = _fold_captured_by(capture, module, IDS, monkeypatch)
    assert report.capture == capture
    assert [(d.name, d.foldable) for d in report.plan.decisions] == [("ln1", True), ("ln2", True)]
    assert report.max_rel_error <= REL_TOL
    assert not torch.equal(result.pos, module.pos) and not torch.equal(result.weight, module.weight)  # centred
    longer = torch.randint(0, 16, (3, 5))
    with torch.no_grad():
        assert _rel_error(module(longer), result(longer)) <= REL_TOL


def test_in_place_add_through_a_view_blocks_the_readers_of_its_base():
    module = _seeded(AddThroughView)
    result, report = fold(module, IDS)
    decision = next(d for d in report.plan.decisions if d.name == "ln2")
    assert not decision.foldable and "aten.add_ add_ changes it in place through a view" in decision.reason
    with torch.no_grad():
        assert _rel_error(module(*IDS), result(*IDS)) <= REL_TOL


def test_centring_inserted_at_a_layer_norm_modules_output():
    module = _seeded(EmbeddingNorm)
    result, report = fold(module, IDS)
    assert report.folded == 4 and report.max_rel_error <= REL_TOL
    insertions = {i.tensor for d in report.plan.folded for i in d.insertions}
    assert insertions == {"layer_norm"}  # ln0's output, where each later norm needs it
    assert isinstance(result.ln0, Centred) and isinstance(result.ln0.module, RMSNormWithBias)
    assert report.affine_notes["ln0"].endswith("output centred along axis -1")
    with torch.no_grad():
        assert result.ln0(torch.randn(2, 3, 8)).mean(-1).abs().max() < 1e-6


def test_centring_inserted_at_a_batch_norm_modules_output():
    module = _seeded(BatchNormStem)
    with torch.no_grad():
        module.bn.running_mean.normal_()
        module.bn.bias.normal_()
    images = (torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(4)),)
    result, report = fold(module, images)
    assert [d.name for d in report.plan.folded] == ["ln1", "ln2", "ln3"] and report.max_rel_error <= REL_TOL
    assert isinstance(result.bn, Centred) and result.bn.axis == -3  # the channels of NCHW


def test_centring_inserted_through_the_pass_through_module_that_reads_it():
    module = _seeded(PositionalConvStream)
    x = (torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(2)),)
    result, report = fold(module, x)
    assert [d.name for d in report.plan.folded] == ["ln1", "ln2"] and report.max_rel_error <= REL_TOL
    assert {i.tensor for d in report.plan.folded for i in d.insertions} == {"add"}  # proj + pos, before the dropout
    assert isinstance(result.drop, Centred) and isinstance(result.drop.module, nn.Dropout)
    longer = torch.randn(3, 9, 4)
    with torch.no_grad():
        assert _rel_error(module(longer), result(longer)) <= REL_TOL


def test_centring_inside_a_forward_is_declined():
    _, report = fold(_seeded(FunctionalEmbeddingNorm), IDS)
    verdicts = {d.name: d for d in report.plan.decisions}
    assert not verdicts["ln1"].foldable
    assert "is not at the output of a one-op module called once" in verdicts["ln1"].reason


def test_layer_scale_is_absorbed_into_its_layer():
    module = _seeded(LayerScaled)
    result, report = fold(module, IDS, migrate_affine=False)  # fc's weight takes the LayerScale only
    assert [(d.name, d.foldable) for d in report.plan.decisions] == [("ln1", True), ("ln2", True)]
    assert report.max_rel_error <= REL_TOL
    assert torch.equal(result.scale, torch.ones(8))
    expected = module.fc.weight * module.scale[:, None]  # W⊙s along the outputs, then centred
    assert torch.allclose(result.fc.weight, expected - expected.mean(0), atol=1e-6)


def test_a_layer_scale_is_centred_only_with_its_factor_absorbed():
    """`replace` centres the layers before a norm it keeps, without absorbing: it must skip a LayerScale's."""
    module = _seeded(LayerScaled)
    tg = torch_graph(module, capture(module, IDS))
    centrings = [c for d in make_plan(tg.zmg).decisions for c in d.centrings if c.node == "mul"]
    assert centrings, "ln2's proof centres the LayerScale"
    assert "would have to be absorbed into fc" in _edits_of(tg, centrings[0])
    assert [(tensor, axis) for _, tensor, axis in _edits_of(tg, centrings[0], absorbing=True)] == [
        ("fc.weight", 0),
        ("fc.bias", 0),
    ]


def test_layer_scale_read_elsewhere_is_not_absorbed():
    module = _seeded(ScaleReadTwice)
    result, report = fold(module, IDS)
    decision = next(d for d in report.plan.decisions if d.name == "ln2")
    assert not decision.foldable and "cannot be absorbed: scale is also read by" in decision.reason
    assert torch.equal(result.scale, module.scale)


def test_falls_back_to_symbolic_trace_and_says_why():
    module = _seeded(WrappedBranch)
    with pytest.warns(UserWarning, match="torch.export failed .*flip_if_positive.*symbolic_trace"):
        result, report = fold(module, IDS)
    assert report.capture == "torch.fx.symbolic_trace"
    assert "x.sum() > 0" in report.export_error
    assert report.folded == 2 and report.max_rel_error <= REL_TOL
    assert isinstance(result.ln1, nn.RMSNorm)


def test_symbolic_trace_classifies_like_torch_export(monkeypatch):
    module, images = _seeded(TinyViT), (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2)),)
    _, exported = fold(module, images)

    def no_export(*args, **kwargs):
        raise RuntimeError("torch.export is switched off for this test")

    monkeypatch.setattr(torch.export, "export", no_export)
    with pytest.warns(UserWarning, match="switched off"):
        result, traced = fold(module, images)
    assert (exported.capture, traced.capture) == ("torch.export", "torch.fx.symbolic_trace")
    verdicts = [(d.name, d.foldable, d.reason) for d in exported.plan.decisions]
    assert verdicts == [(d.name, d.foldable, d.reason) for d in traced.plan.decisions]
    assert [v[:2] for v in verdicts] == [("gn", False), ("ln1", True), ("ln2", True), ("ln3", True), ("rms", False)]
    assert traced.max_rel_error <= REL_TOL and isinstance(result.rms, nn.RMSNorm)


class Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        y = self.fc(x)
        z = self.ln(y)
        y.mul_(2.0)
        return z + y


class MutatingView(Mutating):
    def forward(self, x):
        y = self.fc(x)
        head = y[:, :1]
        y.mul_(2.0)
        return self.ln(y) + head  # head is a view of y: it sees the change


def test_symbolic_trace_renames_the_readers_of_an_in_place_result(monkeypatch):
    _, report = _fold_captured_by("torch.fx.symbolic_trace", _seeded(Mutating), X, monkeypatch)
    assert report.capture == "torch.fx.symbolic_trace" and report.max_rel_error <= REL_TOL


def test_symbolic_trace_refuses_mutation_it_cannot_see(monkeypatch):
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(UnsupportedModelError, match="in-place mul_ at node mul_ changes fc"):
        fold(_seeded(MutatingView), X)


def test_untraceable_model_names_the_construct():
    with pytest.raises(
        UnsupportedModelError,
        match=r"torch.export failed.*`if h.sum\(\) > 0:`.*"
        r"symbolic_trace failed.*control flow",
    ):
        fold(_seeded(Branch), IDS)


def test_untraceable_model_in_a_directory_named_normpass_is_still_named(tmp_path, monkeypatch):
    """Only frames of the normpass package itself are skipped, not a user's project called normpass."""
    project = tmp_path / "normpass" / "src"
    project.mkdir(parents=True)
    (project / "user_branch.py").write_text(
        "import test_torch_frontend as t\n\n\n"
        "class UserBranch(t.Stack):\n"
        "    def forward(self, ids):\n"
        "        h = self.emb(ids)\n"
        "        if h.sum() > 0:\n"
        "            h = -h\n"
        "        return self.head(self.ln2(h))\n"
    )
    monkeypatch.syspath_prepend(str(project))
    import user_branch  # type: ignore[import-not-found]  # written above, into a temporary sys.path entry

    with pytest.raises(UnsupportedModelError, match=r"user_branch.py:7 in forward: `if h.sum\(\) > 0:`"):
        fold(_seeded(user_branch.UserBranch), IDS)


def test_refuses_a_rewrite_that_does_not_verify(monkeypatch):
    import normpass.torch.rewrite as rewrite

    monkeypatch.setattr(rewrite, "centre", lambda values, axis, weight=None: values + 1.0)
    with pytest.raises(VerificationError, match="does not match the original"):
        fold(_seeded(Stack), IDS)


def test_rejects_bad_input():
    with pytest.raises(InputError, match="training mode"):
        fold(Stack(), IDS)
    with pytest.raises(InputError, match=r"nn\.Module"):
        fold(lambda x: x, IDS)


def test_load_factory():
    module, inputs = load_factory("test_torch_frontend:toy_factory")
    assert isinstance(module, Stack) and inputs == IDS
    for spec, message in [
        ("no_colon", "package.module:factory"),
        ("no_such_module:f", "cannot import"),
        ("test_torch_frontend:IDS", "not callable"),
    ]:
        with pytest.raises(InputError, match=message):
            load_factory(spec)


def test_cli_fold_torch_factory(tmp_path, capsys):
    """`normpass fold --torch module:factory` folds, verifies, and exports ONNX that ORT runs."""
    import json

    import onnxruntime as ort

    from normpass.cli.main import main

    out, report_path = tmp_path / "toy.onnx", tmp_path / "toy.json"
    code = main(["fold", "--torch", "test_torch_frontend:toy_factory", "-o", str(out), "--report", str(report_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "2 of 2 norms folded" in printed.out
    report = json.loads(report_path.read_text())
    assert report["folded"] == 2 and report["max_rel_error"] <= REL_TOL
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (ort_out,) = session.run(None, {session.get_inputs()[0].name: IDS[0].numpy()})
    with torch.no_grad():
        expected = _seeded(Stack)(*IDS).numpy()
    assert abs(ort_out - expected).max() <= 1e-5 * abs(expected).max()
    assert main(["fold", "--torch", "no_colon", "-o", str(tmp_path / "x.onnx")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
