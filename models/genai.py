"""Seeded ONNX Runtime GenAI folders: a tiny Hugging Face checkpoint per family, run through GenAI's builder.

``checkpoint(family, directory)`` writes a seeded checkpoint (``config.json``, ``model.safetensors``, a
byte-level BPE ``tokenizer.json`` made with ``tokenizers`` from ``models/data/sentences.txt``);
``build_folder(family, directory)`` runs ``python -m onnxruntime_genai.models.builder -p fp32 -e cpu`` on it and
returns the folder it wrote (``model.onnx``, its weights, ``genai_config.json``, the tokenizer). Nothing is
downloaded: the builder reads the local checkpoint. The weights are random but non-trivial (norm γ and β
drawn too), so a fold or rotation that drops a term shows in the logits and in the tokens generated.

``FAMILIES`` maps a family to its transformers config: Phi (LayerNorm, parallel block) and Llama (RMSNorm)
are the two the tests use; the others are there for the families table.

``export_with_past(family, path, exporter)`` writes the same kind of model as ``torch.onnx`` does for a
Hugging Face causal LM with ``use_cache=True`` (``dynamo`` or ``torchscript``): inputs ``input_ids``,
``attention_mask`` (past + new), ``past_key_values.N.key`` / ``.value``; outputs ``logits``, ``present.N.*``.
``WITH_PAST`` lists the families it knows (GPT-2: LayerNorm; Llama: RMSNorm).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .registry import _quiet

__all__ = [
    "FAMILIES",
    "WITH_PAST",
    "build_folder",
    "checkpoint",
    "export_with_past",
    "greedy_genai",
    "greedy_ort",
    "prompt_ids",
    "prompts",
    "tokenizer_json",
]

_DATA = pathlib.Path(__file__).parent / "data"
_SPECIALS = ["<unk>", "<s>", "</s>"]


def _common(d: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict[str, Any]:
    return {
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": 2 * d,
        "vocab_size": vocab,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def _phi(vocab: int) -> Any:
    """Head size 32: GroupQueryAttention needs the rotary half-width (a quarter of a Phi head) a multiple of 8."""
    from transformers import PhiConfig

    return PhiConfig(**_common(128, 2, 4, 4, vocab))


def _llama(vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(64, 2, 4, 2, vocab))


def _phi3(vocab: int) -> Any:
    from transformers import Phi3Config

    # the builder takes a Phi-3 whose context is its original one (no LongRoPE) for Phi-3 mini
    return Phi3Config(**_common(64, 2, 4, 4, vocab), original_max_position_embeddings=128)


def _qwen2(vocab: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_common(64, 2, 4, 2, vocab))


def _mistral(vocab: int) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(64, 2, 4, 2, vocab))


def _qwen3(vocab: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(64, 2, 4, 2, vocab), head_dim=16)


def _gemma(vocab: int) -> Any:
    from transformers import GemmaConfig

    return GemmaConfig(**_common(64, 2, 4, 2, vocab), head_dim=16)


def _gemma2(vocab: int) -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(**_common(64, 2, 4, 2, vocab), head_dim=16, sliding_window=8)  # GenAI's cache must hold it


def _olmo(vocab: int) -> Any:
    from transformers import OlmoConfig

    return OlmoConfig(**_common(64, 2, 4, 2, vocab))


def _nemotron(vocab: int) -> Any:
    """Head size 32: half of it rotary (Nemotron's partial rotary factor), whose half-width GroupQueryAttention
    needs a multiple of 8."""
    from transformers import NemotronConfig

    return NemotronConfig(**_common(64, 2, 2, 2, vocab), head_dim=32)


FAMILIES: dict[str, Callable[[int], Any]] = {
    "phi": _phi,
    "llama": _llama,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "olmo": _olmo,
    "nemotron": _nemotron,
}


def prompts() -> list[str]:
    """The test prompts: the first sentences of ``models/data/sentences.txt``, a few words each."""
    text = (_DATA / "sentences.txt").read_text().splitlines()
    lines = [line.strip() for line in text if line.strip() and not line.startswith("#")]
    return [" ".join(line.split()[:6]) for line in lines[:4]]


def tokenizer_json(path: pathlib.Path, vocab: int = 384) -> int:
    """Write a byte-level BPE ``tokenizer.json`` (GPT-2's kind, which ONNX Runtime GenAI's tokenizer reads) of
    ``vocab`` tokens, trained on ``models/data/sentences.txt``, to ``path``; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=_SPECIALS, initial_alphabet=alphabet)
    tok.train([str(_DATA / "sentences.txt")], trainer)
    tok.save(str(path))
    return tok.get_vocab_size()


def _randomise(model: Any, seed: int) -> None:
    """Draw every parameter (norm γ and β included) from a seeded normal of a scale that keeps logits finite."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))


def checkpoint(family: str, directory: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the seeded checkpoint of ``family`` (config, safetensors, tokenizer) to ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_json(out / "tokenizer.json")
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(out))
    config = FAMILIES[family](vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _randomise(model, seed)
    model.save_pretrained(str(out))
    return out


def build_folder(family: str, directory: str | pathlib.Path, seed: int = 0, precision: str = "fp32") -> pathlib.Path:
    """Build the GenAI folder of ``family`` under ``directory`` (``ckpt/``, ``cache/``, ``model/``); return ``model/``.

    Raises ``RuntimeError`` with the builder's last lines if it fails.
    """
    root = pathlib.Path(directory)
    ckpt = checkpoint(family, root / "ckpt", seed)
    out = root / "model"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(root / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"onnxruntime_genai's builder failed on {family}: {tail}")
    json.loads((out / "genai_config.json").read_text())
    return out


def _gpt2() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=384, n_positions=64, bos_token_id=1, eos_token_id=2)


def _llama_small() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**_common(64, 2, 4, 2, 384), "max_position_embeddings": 64})


WITH_PAST: dict[str, Callable[[], Any]] = {"gpt2": _gpt2, "llama": _llama_small}


def export_with_past(
    family: str, path: str | pathlib.Path, exporter: str = "dynamo", seed: int = 0
) -> tuple[pathlib.Path, Any]:
    """Export the seeded ``family`` (``WITH_PAST``) with its KV cache as inputs and outputs to ``path``; return
    the path and the PyTorch model (for reference generation)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    config = WITH_PAST[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    _randomise(model, seed)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head = config.hidden_size // heads

    class WithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(config=config)
            for layer in range(layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            grown = out.past_key_values.layers
            return (out.logits, *[t for layer in grown[:layers] for t in (layer.keys, layer.values)])

    batch, new, past_length = 2, 3, 4
    ids = torch.randint(0, config.vocab_size, (batch, new))
    mask = torch.ones(batch, past_length + new, dtype=torch.int64)
    past = [torch.randn(batch, kv_heads, past_length, head) for _ in range(2 * layers)]
    cache_names = [f"{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    inputs = ["input_ids", "attention_mask"] + [f"past_key_values.{n}" for n in cache_names]
    outputs = ["logits"] + [f"present.{n}" for n in cache_names]
    out = pathlib.Path(path)
    with torch.no_grad(), _quiet():
        if exporter == "dynamo":
            b, s, p, t = (torch.export.Dim(n) for n in ("batch", "sequence", "past", "total"))
            dynamic = {
                "input_ids": {0: b, 1: s},
                "attention_mask": {0: b, 1: t},
                "past": tuple([{0: b, 2: p}] * 2 * layers),
            }
            torch.onnx.export(
                WithPast(),
                (ids, mask, *past),
                str(out),
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=inputs,
                output_names=outputs,
                verbose=False,
            )
        else:
            axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"}}
            axes.update({name: {0: "batch", 2: "past"} for name in inputs[2:]})
            axes.update({name: {0: "batch", 2: "total"} for name in outputs[1:]})
            axes["logits"] = {0: "batch", 1: "sequence"}
            torch.onnx.export(
                WithPast(),
                (ids, mask, *past),
                str(out),
                dynamo=False,
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=axes,
                opset_version=17,
            )
    return out, model


def prompt_ids(tokenizer: str | pathlib.Path) -> list[list[int]]:
    """The test prompts (``prompts()``) as token ids of ``tokenizer`` (a ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return [tok.encode(text).ids for text in prompts()]


def greedy_genai(folder: str | pathlib.Path, prompt: list[int], steps: int) -> list[int]:
    """The tokens ONNX Runtime GenAI generates greedily from ``prompt`` in ``folder`` (prompt included)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


def greedy_ort(path: str | pathlib.Path, prompt: list[int], steps: int) -> list[int]:
    """The tokens a plain ONNX Runtime decode loop generates greedily from ``prompt`` with the with-past model at
    ``path``: a prefill on an empty cache, then one token at a time, ``present.*`` fed back as
    ``past_key_values.*``."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    caches = {i.name: i for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    outputs = [o.name for o in session.get_outputs()]
    past = {name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for name, i in caches.items()}
    tokens, new = list(prompt), list(prompt)
    for _ in range(steps):
        feeds = {
            "input_ids": np.asarray([new], np.int64),
            "attention_mask": np.ones((1, len(tokens)), np.int64),
            **past,
        }
        got = dict(zip(outputs, session.run(outputs, feeds), strict=True))
        new = [int(np.argmax(got["logits"][0, -1]))]
        tokens += new
        past = {name: got[name.replace("past_key_values.", "present.")] for name in caches}
    return tokens
