"""What the examples share: a small model to run them on, ONNX Runtime runs and their comparison, the command line.

Each example runs as `python examples/NAME.py [WORKDIR]` (this folder is then on `sys.path`).
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort


def tiny_gpt2(workdir: Path) -> Path:
    """A 2-layer GPT-2 (hidden size 64, 4 heads, vocabulary 128) from `normpass.models`, seeded, exported
    with `torch.onnx.export(dynamo=False)` as HF Optimum does (needs `normpass[models]`)."""
    from normpass import models

    return models.export_onnx("gpt2", workdir / "gpt2.onnx", form="torchscript")


def token_ids(shape: tuple[int, int], vocab: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
    return {"input_ids": np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)}


def run(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Every output of the model at `model` in ONNX Runtime (CPU, default graph optimizations)."""
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)


def max_rel_error(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> float:
    """The largest max |a − b| / max |a| over the outputs."""
    return max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(reference, outputs, strict=True))


def op_counts(nodes) -> dict[str, int]:
    return dict(collections.Counter(node.op_type for node in nodes))


def cli(main: Callable[[Path], dict]) -> None:
    """`main(WORKDIR)` (a temporary folder if none is given), its result printed as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)), indent=2))
