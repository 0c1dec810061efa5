"""The long fuzzing campaign: generate random transformer-like graphs and check every fold of each.

    python tools/fuzz.py --examples 5000 [--seed S] [--jobs 2] [--out fuzz-out]
    python tools/fuzz.py --replay SEED     # one example: its failures, in full
    python tools/fuzz.py --from-files 0 --examples 2000   # fold from files, every tensor external
    python tools/fuzz.py --replace --examples 1000        # the surrogate pass's emission instead
    python tools/fuzz.py --rotate --examples 1000         # the rotation (keys centred, outputs smoothed)
    python tools/fuzz.py --slice --examples 1000          # the slicing, at ratios 0 (exact) and 0.5 (sound)

Example i uses generator seed S + i (tests/graphgen.py), checked by tests/fuzzcheck.py (with
`--from-files BYTES`: saved with its tensors of BYTES or more as external data, folded from the
file, and the files attacked: outputs aimed at the inputs, short and missing data files, a data
file shared by two models, two concurrent writers, a signal at a random moment of a run;
`fuzzcheck.check_from_file(..., hostile=True)`). Prints

the examples run, the failures by class with their seeds, and saves each failing model as
OUT/SEED.onnx with a one-line repro in OUT/SEED.txt.
"""

from __future__ import annotations

import argparse
import collections
import functools
import multiprocessing
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fuzzcheck
import graphgen
import onnx

ORACLES = {
    "replace": fuzzcheck.check_replace,
    "rotate": fuzzcheck.check_rotate,
    "slice": fuzzcheck.check_slice,
}  # besides the fold's


def check(case, from_files: int | None, oracle: str = "fold") -> list:
    if oracle in ORACLES:
        return ORACLES[oracle](case)
    if from_files is None:
        return fuzzcheck.check(case)
    with tempfile.TemporaryDirectory() as directory:
        return fuzzcheck.check_from_file(case, Path(directory), from_files, hostile=True)


def run_one(
    seed: int, from_files: int | None = None, oracle: str = "fold"
) -> tuple[int, list[str], onnx.ModelProto | None]:
    warnings.simplefilter("ignore")
    case = graphgen.generate(seed)
    try:
        failures = [str(f) for f in check(case, from_files, oracle)]
    except Exception as e:
        failures = [f"generator [original]: {fuzzcheck.describe(e)}"]
    return seed, failures, case.model if failures else None


def failure_class(failure: str) -> str:
    """'kind [mode]: detail' → a key that groups failures of one cause: names and numbers are blanked."""
    kind_mode, _, detail = failure.partition(": ")
    kind_mode = re.sub(r"[0-9][0-9.]*", "*", kind_mode)  # "file-signal [signal SIGTERM after 0.008 of 0.028 s]"
    op = re.match(r"output ([a-z]+)", detail)
    if kind_mode.startswith("mismatch") and op:  # generated tensors are named after their op: "output if_25: ..."
        return f"{kind_mode}: an output of {op.group(1)}"
    if kind_mode.startswith("signature"):
        return f"{kind_mode}: " + "; ".join(re.findall(r"(?:inputs|outputs) \[", detail)).replace("[", "changed")
    return f"{kind_mode}: {re.sub(r'[(]?[A-Za-z_]*[0-9][^ ]*', '*', ' '.join(detail.split()[:20]))}"


def campaign(
    first: int, examples: int, jobs: int, out: Path, from_files: int | None = None, oracle: str = "fold"
) -> int:
    out.mkdir(parents=True, exist_ok=True)
    classes: dict[str, list[int]] = collections.defaultdict(list)
    failing = 0
    start = time.perf_counter()
    with multiprocessing.Pool(jobs) as pool:
        for done, (seed, failures, model) in enumerate(
            pool.imap_unordered(
                functools.partial(run_one, from_files=from_files, oracle=oracle), range(first, first + examples)
            ),
            1,
        ):
            if failures and model is not None:
                failing += 1
                onnx.save(model, out / f"{seed}.onnx")
                replay_flags = f"--replay {seed}" + (f" --from-files {from_files}" if from_files is not None else "")
                replay_flags += f" --{oracle}" if oracle in ORACLES else ""
                (out / f"{seed}.txt").write_text(f"python tools/fuzz.py {replay_flags}\n" + "\n".join(failures) + "\n")
                for key in dict.fromkeys(failure_class(f) for f in failures):
                    classes[key].append(seed)
            if done % 250 == 0:
                print(f"{done} examples, {failing} failing, {time.perf_counter() - start:.0f} s", flush=True)
    print(
        f"\n{examples} examples (seeds {first}..{first + examples - 1}) in {time.perf_counter() - start:.0f} s; "
        f"{failing} failing; models and repros in {out}/"
    )
    for key, seeds in sorted(classes.items(), key=lambda item: -len(item[1])):
        seeds.sort()
        print(
            f"{len(seeds):5d}  {key}\n       seeds {', '.join(map(str, seeds[:10]))}{' ...' if len(seeds) > 10 else ''}"
        )
    return 1 if failing else 0


def replay(seed: int, from_files: int | None = None, oracle: str = "fold") -> int:
    case = graphgen.generate(seed)
    print(
        f"seed {seed}: opset {case.model.opset_import[0].version}, IR {case.model.ir_version}, "
        f"features {sorted(case.used)}, {len(case.feeds)} feed sets"
    )
    failures = check(case, from_files, oracle)
    for failure in failures:
        print(failure)
    print("no failure" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0, help="the first generator seed")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("fuzz-out"))
    parser.add_argument("--replay", type=int, metavar="SEED", help="run one example and print its failures")
    parser.add_argument(
        "--from-files",
        type=int,
        metavar="BYTES",
        help="fold each example from a file whose tensors of BYTES or more are external data",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="check the surrogate pass's emission instead of the fold (fuzzcheck.check_replace)",
    )
    parser.add_argument(
        "--rotate",
        action="store_true",
        help="check the rotation instead, with keys centred and norm outputs smoothed (fuzzcheck.check_rotate)",
    )
    parser.add_argument(
        "--slice",
        action="store_true",
        help="check the slicing instead, at ratio 0 (exact) and 0.5 (structure, finite outputs; fuzzcheck.check_slice)",
    )
    args = parser.parse_args(argv)
    chosen = [name for name in ORACLES if getattr(args, name)]
    if len(chosen) > 1:
        parser.error(f"{' and '.join('--' + name for name in chosen)} are separate oracles: choose one")
    oracle = chosen[0] if chosen else "fold"
    if args.replay is not None:
        return replay(args.replay, args.from_files, oracle)
    return campaign(args.seed, args.examples, args.jobs, args.out, args.from_files, oracle)


if __name__ == "__main__":
    sys.exit(main())
