"""Seeded ONNX Runtime GenAI folders: a tiny Hugging Face checkpoint per family, run through GenAI's builder.

``checkpoint(family, directory)`` writes a seeded checkpoint (``config.json``, ``model.safetensors``, a
word-level ``tokenizer.json`` made with ``tokenizers`` from ``models/data/sentences.txt``);
``build_folder(family, directory)`` runs ``python -m onnxruntime_genai.models.builder -p fp32 -e cpu`` on it and
returns the folder it wrote (``model.onnx``, its weights, ``genai_config.json``, the tokenizer). Nothing is
downloaded: the builder reads the local checkpoint. The weights are random but non-trivial (norm γ and β
drawn too), so a fold or rotation that drops a term shows in the logits and in the tokens generated.

``FAMILIES`` maps a family to its transformers config: Phi (LayerNorm, parallel block) and Llama (RMSNorm)
are the two the tests use; the others are there for the families table.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["FAMILIES", "build_folder", "checkpoint", "prompts", "tokenizer_json"]

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
    from transformers import PhiConfig

    return PhiConfig(**_common(64, 2, 4, 4, vocab))


def _llama(vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(64, 2, 4, 2, vocab))


def _phi3(vocab: int) -> Any:
    from transformers import Phi3Config

    return Phi3Config(**_common(64, 2, 4, 4, vocab))


def _qwen2(vocab: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_common(64, 2, 4, 2, vocab))


def _mistral(vocab: int) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(64, 2, 4, 2, vocab))


FAMILIES: dict[str, Callable[[int], Any]] = {
    "phi": _phi,
    "llama": _llama,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "mistral": _mistral,
}


def prompts() -> list[str]:
    """The test prompts: the first sentences of ``models/data/sentences.txt``, a few words each."""
    text = (_DATA / "sentences.txt").read_text().splitlines()
    lines = [line.strip() for line in text if line.strip() and not line.startswith("#")]
    return [" ".join(line.split()[:6]) for line in lines[:4]]


def tokenizer_json(path: pathlib.Path, vocab: int = 256) -> int:
    """Write a word-level ``tokenizer.json`` of at most ``vocab`` words to ``path``; return its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=_SPECIALS)
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
