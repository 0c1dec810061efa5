"""Seeded decoders exported with their KV cache (`use_cache=True`), as users serve them token by token.

Each family is its ``transformers`` causal LM at a tiny seeded config (d = 64, 2 layers, a vocabulary of
128), norms and biases randomised (``registry._randomise``), every weight drawn at the scale of a trained
model's (N(0, 0.08²)). ``export(family, path, exporter)`` writes it with either torch exporter: the graph
takes ``input_ids`` [batch, sequence], ``attention_mask`` [batch, past + sequence] and
``past_key_values.<layer>.key|value`` [batch, kv heads, past, head size], and returns ``logits`` and
``present.<layer>.key|value`` (Optimum's names), which ``genai.greedy_ort`` decodes greedily in plain ONNX
Runtime. ``genai.export_with_past`` makes GPT-2 and Llama the same way for the decode tests; this module holds
the families of the decode table (``tools/decode_families.py``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from .forms import torchscript_export
from .registry import _quiet, _randomise

EXPORTERS = ("dynamo", "torchscript")
VOCAB, WIDTH, LAYERS, HEADS = 128, 64, 2, 4
SEED = 43
EXAMPLE = (1, 3, 5)  # batch, new tokens, past tokens of the example the exporters trace


@dataclass(frozen=True)
class Family:
    """A causal LM of ``transformers``: ``<name>Config(**config)`` and ``model`` (a class name)."""

    config_class: str
    model_class: str
    config: dict[str, Any]

    def build(self, seed: int = SEED) -> torch.nn.Module:
        import transformers

        config = getattr(transformers, self.config_class)(**self.config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, self.model_class)(config)
            with torch.no_grad():
                for parameter in model.parameters():
                    if parameter.dim() > 1:
                        parameter.normal_(0.0, 0.08)
            _randomise(model)
        return model.eval()


_LLAMA_LIKE = {"intermediate_size": 128, "max_position_embeddings": 128, "num_key_value_heads": 2}
_TEXT = {"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
FAMILIES = {
    "gpt2": Family(
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "vocab_size": VOCAB,
            "n_embd": WIDTH,
            "n_layer": LAYERS,
            "n_head": HEADS,
            "n_positions": 128,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "opt": Family(
        "OPTConfig",
        "OPTForCausalLM",
        _TEXT | {"ffn_dim": 128, "word_embed_proj_dim": WIDTH, "max_position_embeddings": 128},
    ),
    "gpt-neox": Family(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", _TEXT | {"intermediate_size": 128, "max_position_embeddings": 128}
    ),
    "falcon": Family("FalconConfig", "FalconForCausalLM", _TEXT | {"new_decoder_architecture": False}),
    "bloom": Family(
        "BloomConfig",
        "BloomForCausalLM",
        {"vocab_size": VOCAB, "hidden_size": WIDTH, "n_layer": LAYERS, "n_head": HEADS},
    ),
    "phi": Family("PhiConfig", "PhiForCausalLM", _TEXT | {"intermediate_size": 128, "max_position_embeddings": 128}),
    "llama": Family("LlamaConfig", "LlamaForCausalLM", _TEXT | _LLAMA_LIKE),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", _TEXT | _LLAMA_LIKE | {"head_dim": WIDTH // HEADS}),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", _TEXT | _LLAMA_LIKE | {"head_dim": WIDTH // HEADS}),
}


class _WithPast(torch.nn.Module):
    """The LM over flat cache tensors: (input_ids, attention_mask, past…) → (logits, present…)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    """The past inputs' and present outputs' names, key then value per layer."""
    kinds = [f"{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")]
    return [f"past_key_values.{k}" for k in kinds], [f"present.{k}" for k in kinds]


def _example(model: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    batch, new, past = EXAMPLE
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        prefix = model(input_ids=torch.randint(0, VOCAB, (batch, past), generator=gen), use_cache=True)
    cache = tuple(t for layer in prefix.past_key_values.layers for t in (layer.keys, layer.values))
    return torch.randint(0, VOCAB, (batch, new), generator=gen), torch.ones(batch, past + new, dtype=torch.int64), cache


def export(
    family: str, path: str | pathlib.Path, exporter: str = "dynamo", optimize: bool = True, seed: int = SEED
) -> pathlib.Path:
    """Write `family`'s seeded model with its KV cache to `path` with `exporter` (dynamo: `optimize` is the
    exporter's own graph optimization, on by default)."""
    model = FAMILIES[family].build(seed)
    example = _example(model, seed)
    past, present = cache_names(len(example[2]) // 2)
    inputs, outputs = ["input_ids", "attention_mask", *past], ["logits", *present]
    path = pathlib.Path(path)
    if exporter == "torchscript":
        axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"}}
        axes |= {name: {0: "batch", 2: "past_sequence"} for name in past}
        axes |= {name: {0: "batch", 2: "total_sequence"} for name in present} | {"logits": {0: "batch", 1: "sequence"}}
        return torchscript_export(_WithPast(model).eval(), example, path, inputs, outputs, axes)
    batch, new, cached, total = (torch.export.Dim(n) for n in ("batch", "sequence", "past_sequence", "total_sequence"))
    shapes = ({0: batch, 1: new}, {0: batch, 1: total}, tuple({0: batch, 2: cached} for _ in past))
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            _WithPast(model).eval(),
            example,
            str(path),
            dynamo=True,
            optimize=optimize,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=shapes,
        )
    return path


def decode_shapes(model, batch: int = 1, new: int = 3, past: int = 5) -> dict[str, list[int]]:
    """Input shapes of one decode step of a with-past graph (an `onnx.ModelProto`): `new` tokens after `past`."""
    shapes = {}
    for graph_input in model.graph.input:
        dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]  # heads and head size are static
        if graph_input.name.startswith("past_key_values"):
            shapes[graph_input.name] = [batch, dims[1], past, dims[3]]
        elif graph_input.name == "attention_mask":
            shapes[graph_input.name] = [batch, past + new]
        else:  # input_ids, position_ids
            shapes[graph_input.name] = [batch, new]
    return shapes
