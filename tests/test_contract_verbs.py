"""The error contract of the verbs added after fold and inspect (issue 37, items 8–15): `fold --ort-optimizer`,
`bench`, `distill`, `viz` and stopping signals. Each case is a test that fails without its fix.
"""

from __future__ import annotations

import pathlib
import sys

from conftest import load_module

from normpass.viz import build_view

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


# --- 14. viz: near-linear in the graph's size ----------------------------------------------------


def _calls(function, *args, **kwargs) -> int:
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


def test_viz_work_grows_with_the_graph_and_plan_not_with_their_product():
    """On a pre-LN chain every norm's proof region reaches back along the residual stream: a walk per norm
    (and per centred layer) made the view cubic in the depth. Its work per unit of input (nodes, edges and
    the plan's centrings) stays flat from 10 to 40 blocks."""
    bench_viz = load_module(TOOLS / "bench_viz.py")
    per_unit = []
    for blocks in (10, 40):
        zmg, fold_plan = bench_viz.analyse(bench_viz.pre_ln_chain(blocks))
        size = (
            len(zmg.nodes)
            + sum(len(n.inputs) for n in zmg.nodes.values())
            + sum(len(d.centrings) for d in fold_plan.decisions)
        )
        for full in (False, True):
            per_unit.append(_calls(build_view, zmg, fold_plan, full=full) / size)
    small_default, small_full, large_default, large_full = per_unit
    assert large_default < 1.5 * small_default and large_full < 1.5 * small_full, per_unit
