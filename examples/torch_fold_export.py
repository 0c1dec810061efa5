"""PyTorch: a `transformers` model folded with `normpass.fold`, exported with `torch.onnx`, run in ONNX Runtime.

`normpass.fold(model, example_inputs)` returns a folded deep copy (the model itself is not
touched): folded `nn.LayerNorm`s become `nn.RMSNorm`s and the centred weights are new
parameters, verified against the original on the example inputs. The folded module is an
ordinary `nn.Module`: `torch.onnx.export(dynamo=True)` exports it, at opset 23 with its RMSNorms
as `RMSNormalization`, and ONNX Runtime runs it at other input sizes than the example's.

    pip install "normpass[torch]" transformers
    python examples/torch_fold_export.py [WORKDIR]
"""

from __future__ import annotations

import collections
from pathlib import Path

import onnx
import torch
from _shared import cli, max_rel_error, op_counts, run
from transformers import GPT2Config, GPT2LMHeadModel

import normpass

VOCAB = 128


def gpt2() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with random weights, its LayerNorms' γ and β randomised too."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False)
    config.bos_token_id = config.eos_token_id = VOCAB - 1
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    return model


def main(workdir: Path) -> dict:
    model = gpt2()
    ids = torch.randint(0, VOCAB, (2, 16))
    folded, report = normpass.fold(model, (ids,))
    path = workdir / "gpt2.rms.onnx"
    torch.onnx.export(
        folded,
        (ids,),
        str(path),
        dynamo=True,
        opset_version=23,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes=({0: "batch", 1: "sequence"},),
        verbose=False,
    )
    other = torch.randint(0, VOCAB, (3, 7))  # sizes the example inputs did not have
    with torch.no_grad():
        reference = model(other).logits.numpy()
    outputs = run(path, {"input_ids": other.numpy()})
    return {
        "folded": report.folded,
        "norms": report.plan.total,
        "capture": report.capture,
        "verified_max_rel_error": report.max_rel_error,
        "modules": dict(collections.Counter(type(m).__name__ for m in folded.modules() if "Norm" in type(m).__name__)),
        "original_modules": dict(
            collections.Counter(type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__)
        ),
        "ops": op_counts(onnx.load(str(path)).graph.node),
        "max_rel_error": max_rel_error([reference], outputs),
    }


if __name__ == "__main__":
    cli(main)
