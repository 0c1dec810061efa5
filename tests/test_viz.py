"""`normpass viz`: what the picture of the zero-mean graph shows, its three formats, the HTML page in a
real headless browser, and the story a folded model carries for Netron (doc_string, metadata_props).

The browser test drives Debian's chromium (`apt-get install chromium`) with Playwright's Python
package (no browser download). It skips, saying why, where either is missing, unless
NORMPASS_REQUIRE_BROWSER is set (CI sets it after installing them), then it fails. Its screenshot
goes to $NORMPASS_ARTIFACTS when set, else to the test's tmp_path.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import IR_VERSION, randn, rng
from onnx import TensorProto, helper, numpy_helper

from normpass.cli.main import main
from normpass.core.analysis import plan as make_plan
from normpass.errors import InputError
from normpass.onnx.graph.frontend import build_zero_mean_graph, load_graph
from normpass.viz import build_view, render, to_dot, to_html, to_svg

D, V = 8, 16
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def story_model() -> onnx.ModelProto:
    """Three norms, three stories.

    ln_1 folds (its input is a MatMul of x, centred); ln_2 is refused, post-LN: its input is the
    residual n1 + n1·W2 and n1 is ln_1's affine output; ln_e is refused because centring the
    embedding would shift the graph output `e`.
    """
    gen = rng(5)
    inits = {"wte": randn(gen, V, D), "w1": randn(gen, D, D), "w2": randn(gen, D, D)}
    for name in ("ln_e", "ln_1", "ln_2"):
        inits[f"{name}.g"] = 1 + 0.1 * randn(gen, D)
        inits[f"{name}.b"] = 0.1 * randn(gen, D)

    def layer_norm(name, x, y):
        return helper.make_node("LayerNormalization", [x, f"{name}.g", f"{name}.b"], [y], name=name, axis=-1)

    nodes = [
        helper.make_node("Gather", ["wte", "ids"], ["e"], name="embed"),
        layer_norm("ln_e", "e", "ne"),
        helper.make_node("MatMul", ["x", "w1"], ["a"], name="proj_1"),
        layer_norm("ln_1", "a", "n1"),
        helper.make_node("MatMul", ["n1", "w2"], ["m"], name="proj_2"),
        helper.make_node("Add", ["n1", "m"], ["h"], name="residual"),
        layer_norm("ln_2", "h", "out"),
    ]
    graph = helper.make_graph(
        nodes,
        "story",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, D]),
        ],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4, D]) for name in ("e", "ne", "out")],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def analyse(model: onnx.ModelProto, name: str = "model"):
    zmg = build_zero_mean_graph(load_graph(model, name))
    return zmg, make_plan(zmg)


@pytest.fixture(scope="module")
def story():
    return analyse(story_model(), "story")


@pytest.fixture(scope="module")
def registry(registry_model):
    """Registry models (exported once per session) analysed once per module: name → (zmg, plan)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = analyse(registry_model(name), name)
        return cache[name]

    return get


def block_edges(view):
    return {(e.source, e.target) for e in view.edges if e.style == "block"}


# --- what is drawn -----------------------------------------------------------------------------


def test_view_marks_folded_refused_centred_and_blockers(story):
    zmg, fold_plan = story
    view = build_view(zmg, fold_plan)
    roles = {name: node.roles for name, node in view.nodes.items()}
    assert {d.name: d.foldable for d in fold_plan.decisions} == {"ln_e": False, "ln_1": True, "ln_2": False}
    assert "folded" in roles["ln_1"] and "refused" in roles["ln_2"] and "refused" in roles["ln_e"]
    assert "centred" in roles["proj_1"], "the layer centred for ln_1"
    assert "centred" not in roles["embed"], "ln_e is refused, so nothing is centred for it"
    assert "blocker" in roles["ln_1"], "ln_1's affine output blocks ln_2"
    assert "blocker" in roles["e"], "the graph output e blocks centring the embedding"
    assert view.nodes["e"].kind == "output" and view.nodes["x"].kind == "input"
    # the blocking paths: ln_2 ← residual ← ln_1, and embed → output e
    assert block_edges(view) == {("ln_1", "residual"), ("residual", "ln_2"), ("embed", "e")}
    assert view.nodes["ln_2"].info["decision"]["blocking_path"] == ["ln_2", "residual", "ln_1"]
    assert view.nodes["proj_1"].info["notes"] == {"centred for": ["ln_1"]}
    assert view.nodes["ln_1"].info["notes"]["blocks"] == ["ln_2"]
    assert {e.style for e in view.edges if (e.source, e.target) == ("proj_1", "ln_1")} == {"proof"}


def test_nodes_are_laid_out_in_layers_without_overlap(story):
    view = build_view(*story, full=True)
    for edge in view.edges:
        assert view.nodes[edge.source].y < view.nodes[edge.target].y, edge
    by_row = {}
    for node in view.nodes.values():
        by_row.setdefault(node.y, []).append(node)
    for row in by_row.values():
        row.sort(key=lambda n: n.x)
        for left, right in itertools.pairwise(row):
            assert left.x + left.w / 2 <= right.x - right.w / 2, (left.id, right.id)


def test_default_view_collapses_what_no_decision_needs(registry):
    zmg, fold_plan = registry("gpt2")
    full, default = build_view(zmg, fold_plan, full=True), build_view(zmg, fold_plan)
    assert set(zmg.nodes) <= set(full.nodes)
    assert len(default.nodes) < len(zmg.nodes) / 2, "most of GPT-2's graph is irrelevant to its norms"
    norms = {d.name for d in fold_plan.decisions}
    assert norms <= set(default.nodes)
    for centring in fold_plan.centrings:
        assert "centred" in default.nodes[centring.label].roles
    collapsed = [e for e in default.edges if e.style == "collapsed"]
    assert collapsed and all(e.hidden > 0 for e in collapsed)
    assert not any(e.style == "collapsed" for e in full.edges)


def test_focus_on_one_norm(registry):
    zmg, fold_plan = registry("gpt2")
    first = fold_plan.decisions[0]
    view = build_view(zmg, fold_plan, norm=first.name)
    assert first.name in view.nodes and set(first.centred_layers) <= set(view.nodes)
    assert fold_plan.decisions[-1].name not in view.nodes
    assert "around norm " + first.name in view.subtitle
    with pytest.raises(InputError, match="no such norm"):
        build_view(zmg, fold_plan, norm="no_such_norm")


# --- formats -----------------------------------------------------------------------------------


def test_svg_is_well_formed_and_draws_every_norm(story):
    zmg, fold_plan = story
    text = render(zmg, fold_plan, "svg")
    root = ET.fromstring(text.split("\n", 1)[1])
    nodes = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if "node" in g.get("class", "").split()]
    assert {g.get("data-id") for g in nodes if "kind-norm" in g.get("class")} == {"ln_e", "ln_1", "ln_2"}
    assert "story: 1 of 3 norms fold exactly into RMSNorm" in text


def test_dot_names_every_node_and_colours_the_blocking_path(story):
    view = build_view(*story)
    dot = to_dot(view)
    assert dot.startswith("digraph normpass {") and dot.rstrip().endswith("}")
    for name in view.nodes:
        assert f'"{name}" [label=' in dot
    assert re.search(r'"residual" -> "ln_2" \[color="#dc2626"', dot)


def test_html_is_one_self_contained_file(story):
    view = build_view(*story)
    page = to_html(view)
    assert not re.search(r"(src|href)=\"(?!data:|#)", page), "nothing may be fetched at view time"
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    payload = re.search(r'<script type="application/json" id="normpass-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(payload)
    assert set(data["nodes"]) == set(view.nodes)
    assert [n["name"] for n in data["norms"]] == ["ln_e", "ln_1", "ln_2"]
    assert to_svg(view, standalone=False) in page


def test_html_escapes_names_that_look_like_markup():
    model = story_model()
    for node in model.graph.node:
        if node.name == "ln_2":
            node.name = "</script><b>ln_2</b>"
    page = render(*analyse(model), "html")
    assert "</script><b>" not in page


def test_cli_writes_each_format(tmp_path, capsys):
    model = tmp_path / "story.onnx"
    onnx.save(story_model(), str(model))
    for suffix in ("html", "svg", "dot"):
        out = tmp_path / f"story.{suffix}"
        assert main(["viz", str(model), "-o", str(out)]) == 0
        assert out.stat().st_size > 1000
        assert f"wrote {suffix} to {out}" in capsys.readouterr().out
    assert main(["viz", str(model), "-o", str(tmp_path / "g.txt"), "--format", "dot", "--norm", "ln_2"]) == 0
    assert '"ln_2"' in (tmp_path / "g.txt").read_text()
    assert main(["viz", str(model), "-o", str(tmp_path / "g.png")]) == 2
    assert "use .html, .svg or .dot" in capsys.readouterr().err
    assert main(["viz", str(model), "-o", str(tmp_path / "g.svg"), "--norm", "nope"]) == 2
    assert "no such norm" in capsys.readouterr().err


def test_output_does_not_depend_on_hash_seeds(tmp_path):
    model = tmp_path / "story.onnx"
    onnx.save(story_model(), str(model))
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"story-{seed}.svg"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "normpass", "viz", str(model), "-o", str(out)],
            env=env,
            check=True,
            capture_output=True,
        )
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]


# --- the folded model's own story (Netron shows doc_string and metadata_props) --------------------


def test_folded_model_carries_its_story(registry, registry_fold, tmp_path):
    _, fold_plan = registry("gpt2")
    result = registry_fold("gpt2")
    out = tmp_path / "folded.onnx"
    onnx.save(result.model, str(out))
    folded = onnx.load(str(out))
    props = {p.key: p.value for p in folded.metadata_props}
    assert props["normpass.version"]
    assert props["normpass.folded"] == f"{result.folded} of {fold_plan.total} norms folded into RMSNorm"
    assert props["normpass.folded_norms"].split(", ") == [d.name for d in result.plan.folded]
    docs = {node.name: node.doc_string for node in folded.graph.node if node.doc_string}
    assert all(doc.startswith("normpass: ") for doc in docs.values())
    for centring in result.plan.centrings:
        if centring.tensor is None:
            assert "weights centred for" in docs[centring.node], centring.node
    for decision in result.plan.folded:
        assert any(f"LayerNorm {decision.name} folded into an RMSNorm" in doc for doc in docs.values()), decision.name


# --- the page in a real browser ----------------------------------------------------------------


def _browser_or_skip():
    """Playwright's sync API and the chromium binary, or skip (fail when NORMPASS_REQUIRE_BROWSER is set)."""
    chromium = os.environ.get("NORMPASS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = [
        what
        for what, ok in (
            ("the playwright Python package (pip install playwright)", sync_playwright),
            ("Debian's chromium (apt-get install chromium)", chromium),
        )
        if not ok
    ]
    if missing:
        message = "headless browser test needs " + " and ".join(missing)
        if os.environ.get("NORMPASS_REQUIRE_BROWSER"):
            pytest.fail(message + " (NORMPASS_REQUIRE_BROWSER is set)")
        pytest.skip(message)
    return sync_playwright, chromium


def test_html_page_in_headless_chromium(registry, tmp_path):
    sync_playwright, chromium = _browser_or_skip()
    zmg, fold_plan = registry("bert")
    page_path = tmp_path / "bert.html"
    page_path.write_text(render(zmg, fold_plan, "html"))
    artifacts = Path(os.environ.get("NORMPASS_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    refused = next(d for d in fold_plan.decisions if not d.foldable)
    folded = next(d for d in fold_plan.decisions if d.foldable)
    errors = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            page.wait_for_load_state("load")

            # every norm is drawn, with a real box on the page
            norms = page.locator("svg .node.kind-norm")
            assert sorted(norms.evaluate_all("els => els.map(e => e.dataset.id)")) == sorted(
                d.name for d in fold_plan.decisions
            )
            sizes = norms.evaluate_all("els => els.map(e => [e.getBBox().width, e.getBBox().height])")
            assert all(w > 0 and h > 0 for w, h in sizes)

            # search highlights matches; Enter selects the next one
            details = page.locator("#details")
            page.fill("#search", "matmul")
            assert page.locator("svg .node.match").count() >= 1
            assert "match" in page.inner_text("#matches")
            page.press("#search", "Enter")
            assert "MatMul" in details.inner_text()
            page.fill("#search", "")

            # the wheel zooms
            before = page.get_attribute("#viewport", "transform")
            page.mouse.move(900, 450)
            page.mouse.wheel(0, -300)
            assert page.get_attribute("#viewport", "transform") != before

            # a folded norm lists its centred layers; following one shows its op, shapes, what it was centred for
            page.locator(f'#norms button[data-norm="{folded.name}"]').click()
            page.locator(f'svg .node[data-id="{folded.name}"]').click()
            assert "folded into RMSNorm" in details.inner_text()
            layer = next(name for name in folded.centred_layers if name in zmg.nodes)
            page.locator("#details .link", has_text=re.compile(f"^{re.escape(layer)}$")).click()
            text = details.inner_text()
            assert zmg.nodes[layer].op in text and "centred for" in text
            assert re.search(r"\[batch, seq, 64\]", text), "tensors are shown with their shapes"

            # the norms list centres a norm; clicking its node shows the decision and its reason
            page.locator(f'#norms button[data-norm="{refused.name}"]').click()
            page.locator(f'svg .node[data-id="{refused.name}"]').click()
            text = details.inner_text()
            assert "refused" in text and "post-LN stream" in text and "blocked by" in text
            assert page.locator(f'svg .node.selected[data-id="{refused.name}"]').count() == 1

            page.screenshot(path=str(artifacts / "viz-bert.png"))
        finally:
            browser.close()
    assert not errors, f"console errors: {errors}"
    assert (artifacts / "viz-bert.png").stat().st_size > 10_000


def test_the_command_offers_every_format_the_renderer_draws():
    from normpass.cli import viz as command
    from normpass.viz import FORMATS

    assert set(command.FORMATS) == set(FORMATS)
