"""`normpass.fold_graph`: the plan applied to torch.export's graph, where `fold` declines a centring
inside a module's forward (`torch/graph_rewrite.py`)."""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normpass import fold, fold_graph
from normpass.errors import UnsupportedModelError

REL_TOL = 1e-5


class GeluStem(nn.Module):
    """Whisper's encoder stem: a functional GELU, then a position table, then pre-LN blocks.

    The stream starts at the GELU's output, which only an inserted x − mean(x) makes zero-mean,
    and no module makes that tensor, so the module rewrite cannot put it there.
    """

    def __init__(self):
        super().__init__()
        self.stem, self.pos = nn.Linear(4, 8), nn.Parameter(torch.randn(5, 8))
        self.ln1, self.fc1, self.ln2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = F.gelu(self.stem(x)) + self.pos
        h = h + self.fc1(self.ln1(h))
        return self.ln2(h)


class SharedLayerScale(nn.Module):
    """CaiT's LayerScale γ after a linear layer, with γ read again elsewhere: the module rewrite cannot
    absorb it (a module edit changes every read), the graph rewrite absorbs it into the one read."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln1, self.fc = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.gamma, self.ln2 = nn.Parameter(torch.rand(8) + 0.5), nn.LayerNorm(8)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.gamma * self.fc(self.ln1(h))
        return self.ln2(h) + self.gamma


class TransposedWeight(nn.Module):
    """Falcon's `x @ W.T`: the graph reads W through `aten.numpy_T`; W is centred along its outputs."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln1, self.ln2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.LayerNorm(8)
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = self.emb(x)
        h = h + self.ln1(h) @ self.weight.T
        return self.ln2(h)


class InlineLayerNorm(nn.Module):
    """`F.layer_norm` in the model's own forward, on parameters of its own: not a LayerNorm module, so
    `fold` cannot swap it; in the graph it is one `aten.layer_norm` node like any other."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Linear(4, 8), nn.Linear(8, 8)
        self.gamma, self.beta = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.emb(x)
        return self.fc(F.layer_norm(h, (8,), self.gamma, self.beta)) * 2


class ClassRow(nn.Module):
    """XCiT's class-attention tail: the class row normalized again before its MLP reads it alone. The proof
    needs the sizes of the concatenations' parts along the tokens, which a dynamic token axis hides."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm1, self.attn = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.norm2, self.mlp, self.norm3, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        s = self.embed(x)
        s = s + self.attn(self.norm1(s))
        x2 = torch.cat([self.norm2(s[:, :1]), s[:, 1:]], dim=1)
        x3 = torch.cat([self.mlp(x2[:, :1]), x2[:, 1:]], dim=1)
        return self.head(self.norm3(x2 + x3))


def _seeded(cls) -> nn.Module:
    torch.manual_seed(0)
    module = cls().eval()
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm):
                sub.weight.uniform_(0.5, 1.5)
                sub.bias.normal_()
    return module


X = (torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1)),)


def _ops(graph_module: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"]


def test_centring_inside_a_forward_folds_in_the_graph():
    module = _seeded(GeluStem)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    _, module_report = fold(module, X)
    assert module_report.folded == 0  # the module rewrite declines both: the centring is after F.gelu
    assert "not at the output of a one-op module called once" in module_report.plan.decisions[0].reason
    graph, report = fold_graph(module, X)
    assert isinstance(graph, torch.fx.GraphModule) and report.capture == "torch.export"
    assert [d.name for d in report.plan.folded] == ["ln1", "ln2"] and report.max_rel_error <= REL_TOL
    ops = _ops(graph)
    assert ops.count("aten.rms_norm.default") == 2 and "aten.layer_norm.default" not in ops
    assert ops.count("aten.mean.dim") == 1 and ops.count("aten.sub.Tensor") == 1  # the inserted centring
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # the input is not modified


def test_layer_scale_is_absorbed_per_read():
    module = _seeded(SharedLayerScale)
    _, module_report = fold(module, X)
    assert [d.name for d in module_report.plan.folded] == ["ln1"]
    assert "cannot be absorbed: gamma is also read by" in module_report.plan.decisions[1].reason
    graph, report = fold_graph(module, X)
    assert [d.name for d in report.plan.folded] == ["ln1", "ln2"] and report.max_rel_error <= REL_TOL
    gamma_reads = {
        str(node.target): getattr(graph, read.target)
        for node in graph.graph.nodes
        for read in node.all_input_nodes
        if read.op == "get_attr" and "gamma" in read.target
    }
    assert torch.equal(gamma_reads["aten.mul.Tensor"], torch.ones(8))  # γ moved into fc for this read
    assert torch.equal(gamma_reads["aten.add.Tensor"], module.gamma)  # the other read keeps it
    linear = next(n for n in graph.graph.nodes if n.name == "linear_1")
    assert getattr(graph, linear.args[1].target).sum(0).abs().max() < 1e-5  # fc centred along its outputs


def test_the_graph_is_specialised_to_the_captured_shapes_unless_told():
    module = _seeded(GeluStem)
    graph, _ = fold_graph(module, X)
    other = torch.randn(3, 5, 4)
    with pytest.raises(Exception, match="Guard failed"):
        graph(other)
    graph, _ = fold_graph(module, X, dynamic_shapes=({0: torch.export.Dim("batch")},))
    with torch.no_grad():
        expected = module(other)
        assert float((graph(other) - expected).abs().max() / expected.abs().max()) <= REL_TOL


def test_a_model_torch_export_cannot_capture_is_refused(monkeypatch):
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(UnsupportedModelError, match=r"fold_graph rewrites torch\.export's graph"):
        fold_graph(_seeded(GeluStem), X)


def test_the_folded_graph_exports_again():
    module = _seeded(GeluStem)
    graph, _ = fold_graph(module, X)
    program = torch.export.export(graph, X)
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "aten.rms_norm.default" in ops and "aten.layer_norm.default" not in ops
    with torch.no_grad():
        expected = module(*X)
        assert float((program.module()(*X) - expected).abs().max() / expected.abs().max()) <= REL_TOL


def test_a_weight_read_through_its_transpose_is_centred():
    module = _seeded(TransposedWeight)
    graph, report = fold_graph(module, X)
    assert [d.name for d in report.plan.folded] == ["ln1", "ln2"] and report.max_rel_error <= REL_TOL
    transpose = next(n for n in graph.graph.nodes if n.target == torch.ops.aten.numpy_T.default)
    assert getattr(graph, transpose.args[0].target).sum(0).abs().max() < 1e-5  # W [out, in], centred along out


def test_a_layer_norm_call_inside_a_forward_folds_in_the_graph():
    module = _seeded(InlineLayerNorm)
    _, module_report = fold(module, X)
    assert module_report.folded == 0 and "the PyTorch rewrite swaps LayerNorm modules only" in (
        module_report.plan.decisions[0].reason
    )
    graph, report = fold_graph(module, X)
    assert report.folded == 1 and report.max_rel_error <= REL_TOL
    assert "aten.rms_norm.default" in _ops(graph) and "aten.layer_norm.default" not in _ops(graph)


def gelu_stem_factory():
    """A `--torch` factory (`normpass fold --torch test_torch_graph:gelu_stem_factory`)."""
    return _seeded(GeluStem), X


def test_cli_fold_torch_graph(tmp_path, capsys):
    """`fold --torch F --graph` folds what `fold_graph` folds and writes ONNX that runs at another batch size."""
    import onnxruntime as ort

    from normpass.cli.main import main

    module_out, graph_out = tmp_path / "module.onnx", tmp_path / "graph.onnx"
    assert main(["fold", "--torch", "test_torch_graph:gelu_stem_factory", "-o", str(module_out)]) == 0
    assert "0 of 2 norms folded" in capsys.readouterr().out  # the module swap cannot centre after F.gelu
    assert main(["fold", "--torch", "test_torch_graph:gelu_stem_factory", "--graph", "-o", str(graph_out)]) == 0
    printed = capsys.readouterr().out
    assert "2 of 2 norms folded" in printed and "captured with torch.export" in printed
    session = ort.InferenceSession(str(graph_out), providers=["CPUExecutionProvider"])
    ops = {node.op_type for node in onnx.load(str(graph_out)).graph.node}
    assert "LayerNormalization" not in ops
    other = torch.randn(3, 5, 4)  # another batch size than the example's: the capture kept it dynamic
    (got,) = session.run(None, {session.get_inputs()[0].name: other.numpy()})
    with torch.no_grad():
        expected = _seeded(GeluStem)(other).numpy()
    assert abs(got - expected).max() <= 1e-5 * abs(expected).max()


def class_row_factory():
    return _seeded(ClassRow), X


def test_cli_fold_torch_graph_keeps_the_sizes_a_proof_needs(tmp_path, capsys):
    """Captured with every dimension dynamic, the class row's proof fails (the parts' sizes along the tokens are
    symbolic); `--graph` then captures with the batch axis alone dynamic, which folds more, and says so."""
    import onnxruntime as ort

    from normpass.cli.main import main
    from normpass.torch.api import auto_dynamic_shapes

    module = _seeded(ClassRow)
    _, every = fold_graph(module, X, dynamic_shapes=auto_dynamic_shapes(X))
    assert not every.plan.folded
    out = tmp_path / "class_row.onnx"
    assert main(["fold", "--torch", "test_torch_graph:class_row_factory", "--graph", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 of 3 norms folded" in printed and "axis 0 alone dynamic (2 more norm(s) fold" in printed
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    other = torch.randn(3, 5, 4)
    (got,) = session.run(None, {session.get_inputs()[0].name: other.numpy()})
    with torch.no_grad():
        expected = module(other).numpy()
    assert abs(got - expected).max() <= 1e-5 * abs(expected).max()


def test_cli_graph_without_torch_refuses(tmp_path, capsys):
    from normpass.cli.main import main

    assert main(["fold", "--builtin", "gpt2", "--graph", "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--graph applies to --torch only" in err[0]
    assert not (tmp_path / "o.onnx").exists()
