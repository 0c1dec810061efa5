"""Registry of seeded transformer models for testing and demonstrating normpass.

Modelled on Polygraphy's ``tests/models/meta.py``: every :class:`ModelEntry`
names a small architecture built from ``transformers`` code, knows how to
build it in PyTorch and export it to ONNX, and records how many normalization
layers it has and how many LayerNorms an exact LayerNorm -> RMSNorm fold can
provably fold.

The fold is exact when a LayerNorm's input is zero-mean along the hidden axis
for every input: LayerNorm(x) = RMSNorm(x - mean(x)), and a residual stream
written only by Gathers from embedding tables, constants and Linear/Conv
layers can be centred by centring those weights and biases. A stream that
also receives a LayerNorm's affine output gamma*x_hat + beta cannot.

Weights are seeded per model and made non-trivial: every norm weight, norm
bias and Linear/Conv bias is re-randomised after construction, so the
exporter can neither merge identical LayerNorm parameters into one shared
initializer nor drop zero biases.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pathlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    SwinConfig,
    SwinModel,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

Inputs = tuple[torch.Tensor, ...]

# The exporter forms of every entry (forms.py); the entry's expectations hold for each of them.
FORMS = ("dynamo", "torchscript", "ort-optimized", "fp16")

TEXT_DYNAMIC = ({0: "batch", 1: "seq"},)
IMAGE_DYNAMIC = ({0: "batch"},)


@dataclass(frozen=True)
class ModelEntry:
    """One registered model: how to build it, export it and what to expect.

    ``make_inputs(batch, seq, seed)`` returns seeded example inputs (vision
    models ignore ``seq``); ``dynamic_shapes`` holds one ``{axis: dim name}``
    dict per input, as accepted by ``torch.onnx.export``. ``large`` entries
    are too big for unit tests and are meant for benchmarks.

    The expected counts (norms, proven, kept) and reasons are the target for every form in
    ``forms``: an exporter changes how a model is spelled, not which norms provably fold.
    """

    name: str
    summary: str
    build_torch: Callable[[], tuple[torch.nn.Module, Inputs]]
    make_inputs: Callable[[int, int, int], Inputs]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_shapes: tuple[dict[int, str], ...]
    expected_norms: int
    expected_folded: int  # provably foldable (``normpass inspect``)
    why: str
    large: bool = False
    expected_kept: int = 0  # of those, kept as LayerNorms by default: their β can move nowhere
    # ``onnxruntime.transformers.optimizer`` settings for the "ort-optimized" form (forms.py):
    # model type, attention heads and hidden size (0: let the optimizer detect them).
    ort_model_type: str = "bert"
    num_heads: int = 0
    hidden_size: int = 0
    forms: tuple[str, ...] = FORMS

    @property
    def expected_rewritten(self) -> int:
        """Norms ``normpass fold`` rewrites with its default options."""
        return self.expected_folded - self.expected_kept

    def export_onnx(self, path: str | pathlib.Path) -> pathlib.Path:
        """Export the seeded model to ONNX at ``path``, quietly; return the path.

        Large entries store their weights next to the model as external data.
        """
        path = pathlib.Path(path)
        module, inputs = self.build_torch()
        with _quiet():
            torch.onnx.export(
                module,
                inputs,
                str(path),
                dynamo=True,
                input_names=list(self.input_names),
                output_names=list(self.output_names),
                dynamic_shapes=self.dynamic_shapes,
                external_data=self.large,
                verbose=False,
            )
        return path


@contextlib.contextmanager
def _quiet():
    """Silence the exporter's prints, warnings and log records."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm)) or (
        type(module).__name__.endswith("RMSNorm")
    )


@torch.no_grad()
def _randomise(model: torch.nn.Module) -> None:
    """Give every norm weight/bias and every other bias non-trivial values."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        if _is_norm(module):
            if isinstance(weight, torch.nn.Parameter):
                weight.copy_(1 + 0.2 * torch.randn_like(weight))
            if isinstance(bias, torch.nn.Parameter):
                bias.copy_(0.2 * torch.randn_like(bias))
        elif isinstance(bias, torch.nn.Parameter):
            bias.copy_(0.1 * torch.randn_like(bias))


def _token_inputs(vocab: int, batch: int, seq: int, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=gen),)


def _image_inputs(channels: int, size: int, batch: int, seq: int, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, channels, size, size, generator=gen),)


def _build(
    make_model: Callable[[], torch.nn.Module],
    make_inputs: Callable[[int, int, int], Inputs],
    seed: int,
) -> tuple[torch.nn.Module, Inputs]:
    """Build, randomise and wrap a model under ``seed`` without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model()
        _randomise(model)
    return model.eval(), make_inputs(2, 8, seed)


class _Logits(torch.nn.Module):
    """Causal LM returning plain logits, without a KV cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits


class _ImageLogits(torch.nn.Module):
    """Image classifier returning plain logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values, return_dict=True).logits


class _LastHidden(torch.nn.Module):
    """Encoder returning plain ``last_hidden_state``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, return_dict=True).last_hidden_state


def gpt2_config(
    n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab: int = 128, n_positions: int = 64
) -> GPT2Config:
    """GPT-2 config of the given size with a tied LM head and no KV cache."""
    return GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=n_positions,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        use_cache=False,
    )


def gpt2_entry(
    name: str,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    vocab: int = 128,
    n_positions: int = 64,
    seed: int = 1,
    large: bool = False,
) -> ModelEntry:
    """Entry for a GPT-2 LM of any size (benchmarks use it for deep variants)."""
    config = gpt2_config(n_layer, n_embd, n_head, vocab, n_positions)
    make_inputs = partial(_token_inputs, vocab)
    norms = 2 * n_layer + 1
    return ModelEntry(
        name=name,
        summary=f"GPT-2 LM, pre-LN decoder, {n_layer} layers, n_embd {n_embd}, vocab {vocab}, tied LM head",
        build_torch=partial(_build, lambda: _Logits(GPT2LMHeadModel(config)), make_inputs, seed),
        make_inputs=make_inputs,
        input_names=("input_ids",),
        output_names=("logits",),
        dynamic_shapes=TEXT_DYNAMIC,
        expected_norms=norms,
        expected_folded=norms,
        expected_kept=1,
        why=(
            "Pre-LN: every LayerNorm reads the residual stream, written only by the token and position "
            "embedding Gathers and the attn/mlp c_proj Gemms and read only by LayerNorms and residual Adds, "
            "so centring those tables and weights folds all of them. The tied LM head must keep the "
            "uncentred table; the ONNX export already feeds its MatMul a separate transposed copy. The "
            "final LayerNorm's β has nowhere to go (the LM head has no bias), so `fold` keeps that one."
        ),
        large=large,
        ort_model_type="gpt2",
        num_heads=n_head,
        hidden_size=n_embd,
    )


def _bert_entry() -> ModelEntry:
    layers = 2
    config = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    make_inputs = partial(_token_inputs, config.vocab_size)
    return ModelEntry(
        name="bert",
        summary=f"BERT encoder, post-LN, {layers} layers, hidden 64, vocab 128, returns last_hidden_state",
        build_torch=partial(_build, lambda: _LastHidden(BertModel(config, add_pooling_layer=False)), make_inputs, 2),
        make_inputs=make_inputs,
        input_names=("input_ids",),
        output_names=("last_hidden_state",),
        dynamic_shapes=TEXT_DYNAMIC,
        expected_norms=1 + 2 * layers,
        expected_folded=1,
        why=(
            "Post-LN: only the embedding LayerNorm folds, its input being the sum of word, position and "
            "token-type Gathers (token_type_ids default to a zeros buffer, exported as a Gather from a "
            "constant table); every later LayerNorm reads a residual containing the previous LayerNorm's "
            "affine output gamma*x_hat + beta, which is not zero-mean."
        ),
        num_heads=4,
        hidden_size=64,
    )


VIT_LABELS = 1000  # the classification head's classes (ImageNet-1k's, as ViT-B/16's)


def _vit_module(config: ViTConfig, head: bool) -> torch.nn.Module:
    """`ViTModel` returning `last_hidden_state`, or with `head` `ViTForImageClassification` returning logits."""
    if head:
        return _ImageLogits(ViTForImageClassification(config))
    return _LastHidden(ViTModel(config, add_pooling_layer=False))


def vit_entry(
    name: str = "vit",
    head: bool = False,
    image_size: int = 32,
    patch_size: int = 8,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    mlp: int = 128,
    seed: int = 3,
    large: bool = False,
) -> ModelEntry:
    """Entry for a ViT encoder of any size; with `head`, the image classifier (`VIT_LABELS` logits).

    Without a head the final LayerNorm writes the graph output (`last_hidden_state`), so `slice` and
    `rotate` leave the stream whole (a graph output reads it). With a head, as published ViTs have (final
    norm → class token → Linear), the stream is read by norms and linear layers only: it slices.
    """
    config = ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=mlp,
    )
    config.num_labels = VIT_LABELS  # (transformers 5 types the constructor without the keyword)
    make_inputs = partial(_image_inputs, 3, image_size)
    norms = 2 * layers + 1
    final = (
        "The final one feeds the classification head (the class token, a Gather, then a Linear): its β would "
        "reach the Linear's bias only through the Gather, which the fold does not follow, so `fold` keeps it."
        if head
        else "The final one writes the graph output, so its β has nowhere to go and `fold` keeps it."
    )
    return ModelEntry(
        name=name,
        summary=f"ViT encoder, pre-LN, {layers} layers, hidden {hidden}, {image_size}x{image_size} images in "
        f"{patch_size}x{patch_size} patches"
        + (f", class token → Linear to {VIT_LABELS} logits" if head else ", returns last_hidden_state"),
        build_torch=partial(_build, partial(_vit_module, config, head), make_inputs, seed),
        make_inputs=make_inputs,
        input_names=("pixel_values",),
        output_names=("logits",) if head else ("last_hidden_state",),
        dynamic_shapes=IMAGE_DYNAMIC,
        expected_norms=norms,
        expected_folded=norms,
        expected_kept=1,
        why=(
            "Pre-LN: the residual stream is written only by the patch Conv, the concatenated CLS token, the "
            "position-embedding Add and the attention/MLP output Gemms, all affine maps that can be centred, "
            "so every LayerNorm folds. " + final
        ),
        large=large,
        ort_model_type="vit",
        num_heads=heads,
        hidden_size=hidden,
    )


def _llama_entry() -> ModelEntry:
    layers = 2
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )
    # The TorchScript exporter cannot export SDPA with grouped KV heads (enable_gqa). (What the
    # config's `attn_implementation` keyword sets; transformers 5 types the constructor without it.)
    config._attn_implementation = "eager"
    make_inputs = partial(_token_inputs, config.vocab_size)
    return ModelEntry(
        name="llama",
        summary=f"Llama LM, RMSNorm decoder, {layers} layers, hidden 64, 4 heads / 2 KV heads, vocab 128",
        build_torch=partial(_build, lambda: _Logits(LlamaForCausalLM(config)), make_inputs, 4),
        make_inputs=make_inputs,
        input_names=("input_ids",),
        output_names=("logits",),
        dynamic_shapes=TEXT_DYNAMIC,
        expected_norms=2 * layers + 1,
        expected_folded=0,
        why=(
            "All norms are already RMSNorms, so there is no LayerNorm to fold; they export decomposed as "
            "Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul -> Mul(weight)."
        ),
        ort_model_type="gpt2",
        num_heads=4,
        hidden_size=64,
    )


def _swin_entry() -> ModelEntry:
    config = SwinConfig(
        image_size=32,
        patch_size=2,
        num_channels=3,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        mlp_ratio=2.0,
    )
    # The ONNX exporter (torch 2.13) cannot decompose the reshape after Swin's SDPA attention.
    config._attn_implementation = "eager"
    make_inputs = partial(_image_inputs, 3, 32)
    return ModelEntry(
        name="swin",
        summary="Swin encoder, hierarchical: 2 stages of 2 blocks (window 4, shifted), patch merging, 32x32 images",
        build_torch=partial(_build, lambda: _LastHidden(SwinModel(config, add_pooling_layer=False)), make_inputs, 5),
        make_inputs=make_inputs,
        input_names=("pixel_values",),
        output_names=("last_hidden_state",),
        dynamic_shapes=IMAGE_DYNAMIC,
        expected_norms=11,
        expected_folded=6,
        expected_kept=4,
        why=(
            "The patch-embedding LayerNorm folds (its input is the patch Conv). Stage 1's stream starts at "
            "that LayerNorm's affine output, so its blocks' LayerNorms cannot fold, and centring a stage-1 "
            "projection is unsafe anyway: patch merging concatenates four spatially strided slices along "
            "channels, so the shift would reach the merge LayerNorm unequal across its channels. Stage 2's "
            "stream is written only by the merge's reduction Linear and the blocks' projections: its 4 "
            "LayerNorms and the final one fold. `fold` rewrites 2 of the 6: the β of the others cannot move "
            "(the patch-embedding LayerNorm also starts stage 1's stream, which LayerNorms read; two reach "
            "their attention through window padding; the last writes the graph output)."
        ),
        ort_model_type="swin",
    )


def opt_entry(
    name: str,
    n_layer: int = 2,
    hidden: int = 64,
    ffn: int = 128,
    heads: int = 4,
    vocab: int = 128,
    positions: int = 64,
    seed: int = 8,
    large: bool = False,
) -> ModelEntry:
    """Entry for an OPT LM of any size, pre-LN (``do_layer_norm_before``), tied LM head."""
    config = OPTConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n_layer,
        ffn_dim=ffn,
        num_attention_heads=heads,
        max_position_embeddings=positions,
        word_embed_proj_dim=hidden,
        do_layer_norm_before=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        use_cache=False,
    )
    make_inputs = partial(_token_inputs, config.vocab_size)
    norms = 2 * n_layer + 1
    return ModelEntry(
        name=name,
        summary=f"OPT LM, pre-LN decoder (do_layer_norm_before), {n_layer} layers, hidden {hidden}, vocab {vocab}, "
        "tied LM head",
        build_torch=partial(_build, lambda: _Logits(OPTForCausalLM(config)), make_inputs, seed),
        make_inputs=make_inputs,
        input_names=("input_ids",),
        output_names=("logits",),
        dynamic_shapes=TEXT_DYNAMIC,
        expected_norms=norms,
        expected_folded=norms,
        expected_kept=1,
        why=(
            "Pre-LN like GPT-2: the residual stream is written by the token and learned position embedding "
            "Gathers and the out_proj/fc2 Linears and read by LayerNorms and residual Adds, so every "
            "LayerNorm folds; the final one's β has nowhere to go (the tied LM head has no bias)."
        ),
        large=large,
        ort_model_type="gpt2",
        num_heads=heads,
        hidden_size=hidden,
    )


def gpt2_small_shape(name: str = "gpt2-small-shape", n_layer: int = 12, n_positions: int = 1024) -> ModelEntry:
    """GPT-2-small-shaped LM (n_embd 768, 12 heads, vocab 50257; 124M at 12 layers), seeded.

    The registry holds the 12-layer, 1024-position one; benchmarks build deeper or longer ones.
    """
    return gpt2_entry(name, n_layer=n_layer, n_embd=768, n_head=12, vocab=50257, n_positions=n_positions, large=True)


def bert_base_shape(seed: int = 6) -> ModelEntry:
    """BERT-base-shaped encoder (12 layers, hidden 768, 512 positions, 110M), seeded: benchmarks only.

    Not in ``REGISTRY``, like the deeper ``gpt2_entry`` variants: build it by calling this function.
    """
    config = BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
    )
    make_inputs = partial(_token_inputs, config.vocab_size)
    return ModelEntry(
        name="bert-base-shape",
        summary="BERT-base-shaped encoder, post-LN, 12 layers, hidden 768, vocab 30522, returns last_hidden_state",
        build_torch=partial(_build, lambda: _LastHidden(BertModel(config, add_pooling_layer=False)), make_inputs, seed),
        make_inputs=make_inputs,
        input_names=("input_ids",),
        output_names=("last_hidden_state",),
        dynamic_shapes=TEXT_DYNAMIC,
        expected_norms=1 + 2 * 12,
        expected_folded=1,
        why="Post-LN, as the small `bert` entry: only the embedding LayerNorm folds.",
        large=True,
    )


def vit_b16_shape(seed: int = 7, head: bool = False) -> ModelEntry:
    """ViT-B/16-shaped encoder (224x224 images, 16x16 patches, 12 layers, hidden 768, 86M), seeded.

    With `head`, `vit-b16-shape-head`: the image classifier (final norm → class token → Linear to 1000
    logits), whose stream slices; without, the encoder returning `last_hidden_state` (the records of
    docs/results/ measured this one). For benchmarks only; not in ``REGISTRY`` (call this function).
    """
    name = "vit-b16-shape-head" if head else "vit-b16-shape"
    return vit_entry(name, head, 224, 16, 12, 768, 12, 3072, seed=seed, large=True)


def opt_125m_shape(n_layer: int = 12) -> ModelEntry:
    """OPT-125m-shaped LM (hidden 768, 12 heads, FFN 3072, vocab 50272, 2048 positions), seeded.

    For benchmarks only; not in ``REGISTRY`` (call this function).
    """
    return opt_entry("opt-125m-shape", n_layer, 768, 3072, 12, 50272, 2048, seed=9, large=True)


REGISTRY: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        gpt2_entry("gpt2"),
        _bert_entry(),
        vit_entry(),
        _llama_entry(),
        _swin_entry(),
        opt_entry("opt"),
        gpt2_small_shape(),
    )
}

default_name = "gpt2"


def get(name: str) -> ModelEntry:
    """Return the entry called ``name``; raise ``KeyError`` listing known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(names())}") from None


def names(include_large: bool = True) -> list[str]:
    """Registered model names in registration order."""
    return [name for name, entry in REGISTRY.items() if include_large or not entry.large]
