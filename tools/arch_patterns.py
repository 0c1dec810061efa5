"""Proven norms on third-party architectures whose patterns hide norms from the proof (issue 36, items 3-7).

Each architecture is built from a tiny ``transformers`` config with seeded, re-randomised weights
(``models.registry._build``), exported with both exporters (``dynamo``: ``torch.onnx.export(dynamo=True)``;
``torchscript``: ``dynamo=False``, opset 17, dynamic batch axis and, for text, sequence axis) and also
analysed by the PyTorch front end (``torch``, ``normpass.torch.inspect``). For each ONNX file it
reports norms, proven, rewritten, the largest relative output error of the fold in an ONNX Runtime
session that uses no normpass code (``models.reference``, inputs of a size the export did not see)
and the reason of each norm left. The pattern each model carries:

* ``beit``: BEiT image classifier with a mean-pooled head (``ReduceMean`` over tokens, item 3);
* ``wav2vec2``: wav2vec2 (stable layer norm): a feature projection plus a grouped positional conv (item 4);
* ``bart``: BART encoder-decoder, post-LN: its TorchScript encoder reads ``inputs_embeds[..., -1]`` for its
  shape only (item 5); only the embedding norms can fold;
* ``deberta-v2``: DeBERTa-v2, post-LN: only the embedding norm can fold;
* ``convnext``, ``swin``: ConvNeXt and Swin classifiers (mean-pooled heads), whose norms after a depthwise conv
  (ConvNeXt) and past a patch merging (Swin) must stay refused;

and, where ``timm`` imports (it needs ``torchvision``'s Python modules):

* ``xcit``: XCiT, whose class-attention blocks normalize the class token again before reading it (item 6);
* ``twins``: Twins-SVT, positional convs between blocks and reshapes to run-time sizes (items 4, 7);
* ``eva``: EVA-02-style ViT with a mean-pooled head (item 3).

Usage::

    python tools/arch_patterns.py                 # Markdown table on stdout, reasons on stderr
    python tools/arch_patterns.py --models beit --forms dynamo --json out.json
    python tools/arch_patterns.py --before old.json   # old.json: --json of a run on an older commit
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import pathlib
import re
import sys
import tempfile
from collections import Counter
from functools import partial
from typing import Any

import onnx
import torch

from normpass import inspect_onnx
from normpass.models.forms import export_form
from normpass.models.reference import entry_feeds
from normpass.models.registry import IMAGE_DYNAMIC, TEXT_DYNAMIC, ModelEntry, _build, _image_inputs, _token_inputs

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from corpus import measure

FORMS = ("dynamo", "torchscript", "torch")
MODELS = ("beit", "wav2vec2", "bart", "deberta-v2", "convnext", "swin", "xcit", "twins", "eva")


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, return_dict=True).logits


class _Hidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, return_dict=True).last_hidden_state


def _audio_inputs(samples: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, samples, generator=gen),)


def _entry(name, summary, make_model, make_inputs, input_name, dynamic, norms, seed) -> ModelEntry:
    return ModelEntry(
        name=name,
        summary=summary,
        build_torch=partial(_build, make_model, make_inputs, seed),
        make_inputs=make_inputs,
        input_names=(input_name,),
        output_names=("output",),
        dynamic_shapes=dynamic,
        expected_norms=norms,
        expected_folded=0,
        why="",
    )


def entries() -> dict[str, ModelEntry]:
    from transformers import (
        BartConfig,
        BartModel,
        BeitConfig,
        BeitForImageClassification,
        ConvNextConfig,
        ConvNextForImageClassification,
        DebertaV2Config,
        DebertaV2Model,
        SwinConfig,
        SwinForImageClassification,
        Wav2Vec2Config,
        Wav2Vec2Model,
    )

    small: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    beit = BeitConfig(image_size=32, patch_size=8, use_mean_pooling=True, **small)
    wav2vec2 = Wav2Vec2Config(
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        **small,
    )
    bart = BartConfig(
        vocab_size=99,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    deberta = DebertaV2Config(vocab_size=99, max_position_embeddings=64, **small)
    convnext = ConvNextConfig(image_size=32, patch_size=4, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1])
    swin = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    beit.num_labels = convnext.num_labels = swin.num_labels = 5
    return {
        "beit": _entry(
            "beit",
            "BEiT classifier, mean-pooled head",
            lambda: _Logits(BeitForImageClassification(beit)),
            partial(_image_inputs, 3, 32),
            "pixel_values",
            IMAGE_DYNAMIC,
            5,
            11,
        ),
        "wav2vec2": _entry(
            "wav2vec2",
            "wav2vec2 (stable layer norm), grouped positional conv",
            lambda: _Hidden(Wav2Vec2Model(wav2vec2)),
            partial(_audio_inputs, 400),
            "input_values",
            IMAGE_DYNAMIC,
            7,
            12,
        ),
        "bart": _entry(
            "bart",
            "BART encoder-decoder, post-LN",
            lambda: _Hidden(BartModel(bart)),
            partial(_token_inputs, 99),
            "input_ids",
            TEXT_DYNAMIC,
            12,
            13,
        ),
        "deberta-v2": _entry(
            "deberta-v2",
            "DeBERTa-v2 encoder, post-LN",
            lambda: _Hidden(DebertaV2Model(deberta)),
            partial(_token_inputs, 99),
            "input_ids",
            TEXT_DYNAMIC,
            5,
            14,
        ),
        "convnext": _entry(
            "convnext",
            "ConvNeXt classifier",
            lambda: _Logits(ConvNextForImageClassification(convnext)),
            partial(_image_inputs, 3, 32),
            "pixel_values",
            IMAGE_DYNAMIC,
            5,
            18,
        ),
        "swin": _entry(
            "swin",
            "Swin classifier",
            lambda: _Logits(SwinForImageClassification(swin)),
            partial(_image_inputs, 3, 32),
            "pixel_values",
            IMAGE_DYNAMIC,
            7,
            19,
        ),
    }


def timm_entries() -> dict[str, ModelEntry]:
    """The ``timm`` architectures, or none where ``timm`` does not import."""
    try:
        timm = importlib.import_module("timm")
    except Exception as e:  # timm absent, or its torchvision broken
        print(f"  timm models skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return {}
    timm.layers.set_fused_attn(False)  # the dynamo exporter cannot export Twins' 5-D scaled_dot_product_attention
    Eva, Twins, Xcit = timm.models.eva.Eva, timm.models.twins.Twins, timm.models.xcit.Xcit
    images = partial(_image_inputs, 3, 32)
    xcit = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, cls_attn_layers=2, num_classes=5)
    twins = dict(
        img_size=32,
        patch_size=4,
        embed_dims=(16, 32, 48, 64),
        num_heads=(1, 2, 2, 4),
        mlp_ratios=(2, 2, 2, 2),
        depths=(1, 1, 1, 2),
        sr_ratios=(4, 2, 1, 1),
        wss=(2, 2, 2, 2),
        num_classes=5,
    )
    eva = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, global_pool="avg", num_classes=5)
    return {
        "xcit": _entry("xcit", "XCiT, class attention", lambda: Xcit(**xcit), images, "x", IMAGE_DYNAMIC, 9, 15),
        "twins": _entry("twins", "Twins-SVT", lambda: Twins(**twins), images, "x", IMAGE_DYNAMIC, 16, 16),
        "eva": _entry("eva", "EVA, mean-pooled head", lambda: Eva(**eva), images, "x", IMAGE_DYNAMIC, 5, 17),
    }


def left(plan) -> dict[str, int]:
    """Each reason a norm was not proven, with how many norms it holds back."""
    return dict(Counter(d.reason for d in plan.decisions if not d.foldable))


def torch_row(entry: ModelEntry) -> dict:
    from normpass.torch import api

    module, inputs = entry.build_torch()
    try:
        plan = api.inspect(module, inputs)
    except Exception as e:  # reported in the table, as `measure` does
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"norms": plan.total, "proven": len(plan.folded), "left": left(plan)}


def rows(names: list[str], forms: list[str], root: pathlib.Path) -> list[dict]:
    found, out = {**entries(), **timm_entries()}, []
    for name in names:
        if name not in found:
            continue
        entry = found[name]
        for form in forms:
            row: dict[str, Any] = {"model": name, "form": form}
            if form == "torch":
                row.update(torch_row(entry))
            else:
                try:
                    model = onnx.load(str(export_form(entry, root / f"{name}.{form}.onnx", form)))
                except Exception as e:  # an exporter's failure is a row, not the end of the table
                    first = re.sub(r"\x1b\[[0-9;]*m", "", str(e).splitlines()[0])  # no terminal colours
                    row["error"] = f"export failed: {type(e).__name__}: {first}"[:300]
                    out.append(row)
                    continue
                row.update(measure(model, functools.partial(entry_feeds, entry, model)))
                if "error" not in row:
                    row["left"] = left(inspect_onnx(model))
            out.append(row)
            print(f"  {name} {form}: {row}", file=sys.stderr)
    return out


def markdown(table: list[dict], before: list[dict] | None = None) -> str:
    """The table; with `before` (the rows of an earlier run, e.g. on an older commit), its proven counts too."""
    earlier = {(row["model"], row["form"]): row for row in before or []}
    lines = [
        "| model | form | proven / norms | before | max rel. error | reasons left |",
        "|---|---|---|---|---|---|",
    ]
    for row in table:
        old = earlier.get((row["model"], row["form"]), {})
        counts, old_counts = (
            f"{r.get('proven', '')} / {r.get('norms', '')}" if "error" not in r else r["error"] if r else ""
            for r in (row, old)
        )
        error = f"{row['max_rel_error']:.1e}" if "max_rel_error" in row else ""
        reasons = "; ".join(f"{n}× {r}" for r, n in row.get("left", {}).items())
        lines.append(f"| {row['model']} | {row['form']} | {counts} | {old_counts} | {error} | {reasons} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all)")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated: dynamo, torchscript, torch")
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    parser.add_argument("--before", metavar="PATH", help="an earlier run's --json: its proven counts as a column")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(args.models.split(","), args.forms.split(","), pathlib.Path(tmp))
    before = json.loads(pathlib.Path(args.before).read_text()) if args.before else None
    print(markdown(table, before))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
