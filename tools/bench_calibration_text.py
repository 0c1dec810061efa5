"""How long calibration text with one very long line takes to read, and where the time goes.

A `.txt` of one line of SIZE MB (the words "the word", repeated) is read as `replace --calib FILE --tokenizer
T --max-length N` reads it (`calibration.load_batches`, which refuses it for holding one sentence), next to
what the reader did before it tokenized a sentence from its head only: the tokenizer encoding the whole line
and truncating afterwards. The tokenizer is a word-level `tokenizer.json` built here (whitespace split).
Prints the median of `--repeat` runs of each (the whole-line encoding runs once: it takes minutes).

Usage::

    python tools/bench_calibration_text.py --size 50 --max-length 32
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from normpass import __version__
from normpass.calibration import InputSpec, load_batches
from normpass.errors import InputError


def seconds(job) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


def read(text: Path, tokenizer: Path, max_length: int) -> None:
    spec = InputSpec({"input_ids": (np.dtype(np.int64), 2)})
    with contextlib.suppress(InputError):  # one sentence: refused, as it should be
        load_batches(text, spec, tokenizer=tokenizer, max_length=max_length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=50, help="MB of the single line (default 50)")
    parser.add_argument("--max-length", type=int, default=32, help="tokens kept per sentence (default 32)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of the reader (default 5)")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-line encoding")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "the": 1, "word": 2}, "[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(directory / "tokenizer.json"))
        line = "the word " * int(args.size * 1e6 / 9)
        (directory / "calib.txt").write_text(line + "\n")
        print(
            f"normpass {__version__}, tokenizers {tokenizers.__version__}, numpy {np.__version__}, "
            f"Python {platform.python_version()}, {platform.machine()}; one line of {len(line) / 1e6:.1f} MB, "
            f"--max-length {args.max_length}"
        )
        runs = [
            seconds(lambda: read(directory / "calib.txt", directory / "tokenizer.json", args.max_length))
            for _ in range(args.repeat)
        ]
        print(f"load_batches (reads, tokenizes the head, refuses): median {statistics.median(runs):.2f} s")
        if not args.no_whole:
            tokenizer.enable_truncation(args.max_length)
            whole = seconds(lambda: tokenizer.encode_batch([line]))
            print(f"the tokenizer on the whole line, then truncating (the reader before): {whole:.1f} s")


if __name__ == "__main__":
    main()
