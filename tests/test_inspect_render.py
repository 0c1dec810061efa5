"""`normpass inspect` output: rows grouped by block, plain text when piped, rich colour on a terminal, stable JSON."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import onnx
import pytest
from conftest import IR_VERSION, randn, rng
from onnx import TensorProto, helper, numpy_helper

from normpass.cli import inspect as inspect_cli
from normpass.cli.main import main

D, V = 8, 16
NORM_KEYS = {"name", "op", "foldable", "reason", "centred_layers"}


def _layer_norm(name: str, x: str, y: str, prefix: str) -> onnx.NodeProto:
    return helper.make_node("LayerNormalization", [x, f"{prefix}.weight", f"{prefix}.bias"], [y], name=name, axis=-1)


def blocks_model() -> onnx.ModelProto:
    """Embedding → ln_1 → MatMul, residual → final ln_f; a second norm on a raw input is refused."""
    gen = rng(3)
    inits = {"model.wte.weight": randn(gen, V, D), "model.h.0.attn.weight": randn(gen, D, D)}
    for prefix in ("model.h.0.ln_1", "model.ln_f", "model.h.1.ln_2"):
        inits[f"{prefix}.weight"] = 1 + 0.1 * randn(gen, D)
        inits[f"{prefix}.bias"] = 0.1 * randn(gen, D)
    nodes = [
        helper.make_node("Gather", ["model.wte.weight", "ids"], ["h0"], name="embed"),
        _layer_norm("ln_1", "h0", "n0", "model.h.0.ln_1"),
        helper.make_node("MatMul", ["n0", "model.h.0.attn.weight"], ["a0"], name="attn"),
        helper.make_node("Add", ["h0", "a0"], ["h1"], name="residual"),
        _layer_norm("ln_f", "h1", "out", "model.ln_f"),
        _layer_norm("ln_raw", "x", "raw", "model.h.1.ln_2"),
    ]
    graph = helper.make_graph(
        nodes,
        "blocks",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, D]),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4, D]),
            helper.make_tensor_value_info("raw", TensorProto.FLOAT, [2, 4, D]),
        ],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "blocks.onnx"
    onnx.save(blocks_model(), str(path))
    return str(path)


@pytest.mark.parametrize(
    "name, block",
    [
        ("model.transformer.h.0.ln_1.weight", "transformer.h.0"),
        ("model.encoder.layer.11.attention.output.LayerNorm.bias", "encoder.layer.11"),
        ("model.transformer.ln_f.weight", "transformer"),
        ("model.embeddings.LayerNorm.weight", "embeddings"),
        ("transformer.h.3.ln_2.weight", "transformer.h.3"),
        ("/transformer/h.2/ln_1/LayerNormalization", "transformer.h.2"),
        ("ln_f.weight", "(top level)"),
        ("node_layer_norm_3", "(top level)"),
    ],
)
def test_block_of(name, block):
    assert inspect_cli.block_of(name) == block


def test_plain_table_groups_rows_by_block(model_path, capsys):
    assert main(["inspect", model_path, "--fold-with-beta-add"]) == 0  # ln_f's β could move nowhere
    out = capsys.readouterr().out
    assert "\x1b[" not in out, "piped output must be plain text"
    lines = out.splitlines()
    assert lines[0] == f"{model_path}: 2 of 3 norms fold exactly into RMSNorm"
    assert lines[2].split() == ["block", "norm", "op", "decision", "why"]
    rows = [line for line in lines[3:] if line.strip()]
    assert [row.split()[:2] for row in rows] == [["h.0", "ln_1"], ["(top", "level)"], ["h.1", "ln_raw"]]
    assert "ln_f" in rows[1] and " fold " in rows[1]
    assert " keep " in rows[2] and "graph input x carries arbitrary data" in rows[2]
    assert lines[3:].count("") == 2, "a blank line separates the groups"


def test_json_is_stable_and_keeps_the_schema(model_path, capsys):
    assert main(["inspect", model_path, "--json", "--fold-with-beta-add"]) == 0
    first = capsys.readouterr().out
    assert main(["inspect", model_path, "--json", "--fold-with-beta-add"]) == 0
    assert capsys.readouterr().out == first
    data = json.loads(first)
    assert list(data) == ["model", "norms", "total", "foldable"]
    assert (data["model"], data["total"], data["foldable"]) == (model_path, 3, 2)
    for norm in data["norms"]:
        assert set(norm) >= NORM_KEYS
    by_name = {n["name"]: n for n in data["norms"]}
    assert by_name["ln_1"]["block"] == "h.0" and by_name["ln_raw"]["block"] == "h.1"
    assert by_name["ln_1"]["foldable"] and by_name["ln_1"]["centred_layers"] == ["embed"]
    assert by_name["ln_f"]["centred_layers"] == ["attn", "embed"]
    assert not by_name["ln_raw"]["foldable"] and by_name["ln_raw"]["blocked_by"] == "x"


def test_rich_table_is_coloured_and_grouped():
    pytest.importorskip("rich", reason="the coloured table needs rich (pip install 'normpass[pretty]')")
    from rich.console import Console

    from normpass.core.analysis import plan
    from normpass.onnx.graph.frontend import build_zero_mean_graph, load_graph

    zmg = build_zero_mean_graph(load_graph(blocks_model(), "blocks"))
    sink = io.StringIO()
    console = Console(file=sink, force_terminal=True, color_system="standard", width=160)
    inspect_cli.print_rich(plan(zmg), "blocks", inspect_cli.blocks(zmg), console)
    out = sink.getvalue()
    assert "\x1b[32mfold" in out and "\x1b[31mkeep" in out, "fold is green, keep is red"
    text = re.sub(r"\x1b\[[0-9;]*m", "", out)
    for expected in ("blocks: 2 of 3 norms fold exactly into RMSNorm", "h.0", "(top level)", "h.1", "ln_raw"):
        assert expected in text
    assert text.index("h.0") < text.index("ln_1") < text.index("(top level)") < text.index("ln_f") < text.index("h.1")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("columns", [80, 120])
def test_terminal_output_shows_every_reason_in_full_at_the_terminals_width(model_path, monkeypatch, capsys, columns):
    """On a terminal the reason goes on its own lines, wrapped at the width (COLUMNS): nothing cut, no line
    wider than the terminal, the reasons' lines use the width (not a narrow column)."""
    pytest.importorskip("rich", reason="the terminal layout needs rich (pip install 'normpass[pretty]')")
    assert main(["inspect", model_path, "--json"]) == 0
    reasons = {norm["name"]: norm["reason"] for norm in json.loads(capsys.readouterr().out)["norms"] if norm["reason"]}
    assert set(reasons) == {"ln_1", "ln_f", "ln_raw"}  # ln_1, ln_f: a long one, kept for their β
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("NO_COLOR", "1")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert main(["inspect", model_path]) == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", terminal.getvalue())
    lines = text.splitlines()
    assert "…" not in text and max(len(line) for line in lines) <= columns
    flowing = " ".join(line.strip() for line in lines)
    for reason in reasons.values():
        assert " ".join(reason.split()) in flowing
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["ln_raw"])
    assert lines[row].split()[1:] == ["LayerNormalization", "keep"], "the row holds name, op and decision"
    assert lines[row + 1] == " " * inspect_cli.REASON_INDENT + reasons["ln_raw"], "a reason that fits is one line"
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["ln_f"])
    assert len(lines[row + 1]) > columns - 25, "a longer reason fills the terminal's width"


def test_terminal_console_only_on_a_tty(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert inspect_cli._terminal_console() is None


def test_registry_model_rows_are_grouped_by_transformer_block(registry_export, capsys):
    assert main(["inspect", str(registry_export("bert")), "--json"]) == 0
    blocks = [n["block"] for n in json.loads(capsys.readouterr().out)["norms"]]
    assert blocks == ["embeddings"] + ["encoder.layer.0"] * 2 + ["encoder.layer.1"] * 2
