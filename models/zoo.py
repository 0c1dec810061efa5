"""The zoo: third-party architectures from ``transformers`` and ``timm`` configs, tiny and seeded.

Every :class:`ZooModel` builds one architecture as its authors' code writes it (hidden width 32, 2
layers where the config allows, LayerNorm γ/β and every bias re-randomised: ``registry._randomise``;
LayerScales drawn per channel around 1: ``_randomise_layer_scales``)
with example inputs. ``run(model, front_end)`` takes it through one front end and checks the result
outside normpass's own verifier:

* ``dynamo`` / ``torchscript``: ``torch.onnx.export`` with that exporter; ``inspect_onnx`` lists and
  proves, ``fold_onnx`` (its verification off; ``fold_with_beta_add``, so that every proven norm is
  rewritten) folds, and ``reference.rewrite_error`` (ONNX Runtime, no normpass code) compares the
  folded file with the export on the example inputs;
* ``torch``: ``normpass.fold`` on the module (its verification off); the folded module's outputs
  are compared with the module's directly.

A :class:`ZooRun` counts the LayerNorms the module executes (``F.layer_norm`` calls, seen by a
``TorchFunctionMode``: no normpass code), those the front end lists, proves and folds, and why each
LayerNorm left was left, with its measured counter-example on the ONNX exports (the refused fold
forced: ``counterexample.py``; the PyTorch front end's norms take the figures of the same module's
norm in the dynamo export, ``norm_keys``). ``tools/zoo.py`` runs every model through every front end
and writes ``docs/zoo.md``; ``tests/test_zoo.py`` runs them in CI.

``timm`` needs ``torchvision``'s Python modules only, and PyPI's ``torchvision`` builds beside the
CPU ``torch`` do not import; ``TIMM_INSTALL`` is the install that works (``.ci/run`` makes it).
Where ``timm`` is missing its models are skipped with that command.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .counterexample import ROUNDING, ForcedFold, forced_folds
from .forms import torchscript_export
from .reference import rewrite_error
from .registry import _quiet, _randomise

TIMM_INSTALL = 'pip install --no-deps "timm==1.0.31" "torchvision==0.16.2"'
FRONT_ENDS = ("dynamo", "torchscript", "torch")
SEED = 36
BATCH, SEQ, IMAGE = 2, 8, 32
VOCAB, WIDTH, LAYERS, HEADS = 128, 32, 2, 2
REL_TOL = 1e-4  # fp32, as models/reference.py


@dataclass(frozen=True)
class ZooModel:
    """One architecture: how to build it (module, example inputs), its family, and known front-end differences.

    ``differs`` maps a front end to why it proves other norms than the others do (shown in the table).
    """

    name: str
    family: str
    source: str  # "transformers" or "timm"
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    differs: dict[str, str] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.source != "timm" or timm_available()


@dataclass
class ZooRun:
    """One model through one front end: the counts, the outside check, and why each norm left was left."""

    model: str
    family: str
    front_end: str
    executed: int  # LayerNorms the module runs on the example inputs
    norms: int = 0  # LayerNorms the front end lists
    proven: int = 0
    folded: int = 0
    error: float | None = None  # largest output difference relative to the output's largest magnitude
    left: dict[str, list[str]] = field(default_factory=dict)  # reason → the norms left for it (`norm_keys`)
    forced: dict[str, ForcedFold] = field(default_factory=dict)  # norm → its forced fold (ONNX exports)
    failure: str | None = None  # what failed (an export, a capture), instead of the counts
    seconds: float = 0.0


def timm_available() -> bool:
    return importlib.util.find_spec("timm") is not None


# --- building ------------------------------------------------------------------------------------


class _Output(nn.Module):
    """A Hugging Face model called with keyword inputs, returning one field of its output as a tensor."""

    def __init__(self, model: nn.Module, field: str, keyword: str = "input_ids", second: str | None = None):
        super().__init__()
        self.model, self.field, self.keyword, self.second = model, field, keyword, second

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {self.keyword: x} if self.second is None else {self.keyword: x, self.second: y}
        return getattr(self.model(**inputs, return_dict=True), self.field)


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(SEED)
        model = make()
        _randomise(model)
        _randomise_layer_scales(model)
        _randomise_quiet_heads(model)
    return model.eval()


def _randomise_quiet_heads(model: nn.Module) -> None:
    """Draw a linear layer initialised near zero like the others (std 0.02): timm's EVA-02 scales its head by
    1e-3 (`head_init_scale`), so that its outputs were its head's bias to within 2e-4, and a wrong rewrite of the
    blocks before it would not have shown."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and float(module.weight.abs().max()) < 1e-3:
            module.weight.normal_(0.0, 0.02)


def _randomise_layer_scales(model: nn.Module) -> None:
    """Draw every LayerScale per channel around 1: a 1-D parameter, neither a weight nor a bias, that its
    module initialises to one constant (ConvNeXt's 1e-6, CaiT's 1e-5, BEiT's 0.1, XCiT's 1). At 1e-6 the
    blocks it scales hardly reach the outputs, and neither would a wrong rewrite of them."""
    for name, parameter in model.named_parameters():
        last = name.rsplit(".", 1)[-1]
        scale = parameter.dim() == 1 and last != "weight" and not last.endswith("bias")
        if scale and bool((parameter == parameter[0]).all()):
            parameter.copy_(1 + 0.2 * torch.randn_like(parameter))


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(SEED))


def _floats(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED))


def _hf(class_name: str, field: str = "last_hidden_state", keyword: str = "input_ids", **config):
    """A builder of the transformers model `<class_name>Model` from `<class_name>Config(**config)`."""

    def build():
        import transformers

        config_class = getattr(transformers, f"{class_name}Config")
        model_class = getattr(transformers, f"{class_name}Model")
        model = _seeded(lambda: model_class(config_class(**config)))
        return _Output(model, field, keyword).eval(), (_inputs(keyword, config),)

    return build


def _hf_seq2seq(class_name: str, keyword: str = "input_ids", **config):
    """A builder of an encoder-decoder `<class_name>Model`, called with `keyword` and `decoder_input_ids`."""

    def build():
        import transformers

        config_class = getattr(transformers, f"{class_name}Config")
        model_class = getattr(transformers, f"{class_name}Model")
        model = _seeded(lambda: model_class(config_class(**config)))
        inputs = (_inputs(keyword, config), _tokens(BATCH, SEQ))
        return _Output(model, "last_hidden_state", keyword, "decoder_input_ids").eval(), inputs

    return build


def _inputs(keyword: str, config: dict) -> torch.Tensor:
    if keyword == "pixel_values":
        return _floats(BATCH, config.get("num_channels", 3), IMAGE, IMAGE)
    if keyword == "input_values":
        return _floats(BATCH, 1600)
    if keyword == "input_features":
        return _floats(BATCH, config["num_mel_bins"], 2 * config["max_source_positions"])
    return _tokens(BATCH, SEQ)


def _timm(name: str, **kwargs):
    """A builder of timm's `name` with `kwargs` (its registered config otherwise), 10 classes."""

    def build():
        import timm

        model = _seeded(lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs))
        return model, (_floats(BATCH, 3, IMAGE, IMAGE),)

    return build


def _timm_mvitv2():
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    config = MultiScaleVitCfg(depths=(1, 1), embed_dim=16, num_heads=1)
    model = _seeded(lambda: MultiScaleVit(config, img_size=(IMAGE, IMAGE), num_classes=10))
    return model, (_floats(BATCH, 3, IMAGE, IMAGE),)


_INSIDE_FORWARD = "the exports insert a centring {}, where a module rewrite cannot put one (normpass.fold_graph does)"
TEXT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": WIDTH,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
}
BERT_LIKE: dict[str, Any] = TEXT | {"intermediate_size": 64, "max_position_embeddings": 64}
SEQ2SEQ: dict[str, Any] = {
    "vocab_size": VOCAB,
    "d_model": WIDTH,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
    "pad_token_id": 1,
    "decoder_start_token_id": 2,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
VISION: dict[str, Any] = {
    "image_size": IMAGE,
    "patch_size": 8,
    "hidden_size": WIDTH,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": 64,
}
PIXELS: dict[str, Any] = {"keyword": "pixel_values"}
WHISPER: dict[str, Any] = {k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"}
TIMM_VIT: dict[str, Any] = {"img_size": IMAGE, "patch_size": 8, "embed_dim": WIDTH, "depth": LAYERS, "num_heads": HEADS}
TIMM_STAGES: dict[str, Any] = {"img_size": IMAGE, "embed_dims": (16, 32), "depths": (1, 1), "num_heads": (1, 2)}

ZOO = [
    # decoders
    ZooModel(
        "gpt2",
        "decoder",
        "transformers",
        _hf(
            "GPT2",
            n_embd=WIDTH,
            n_layer=LAYERS,
            n_head=HEADS,
            vocab_size=VOCAB,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        ),
    ),
    ZooModel(
        "opt",
        "decoder",
        "transformers",
        _hf("OPT", ffn_dim=64, word_embed_proj_dim=WIDTH, max_position_embeddings=64, use_cache=False, **TEXT),
    ),
    ZooModel(
        "gpt-neo",
        "decoder",
        "transformers",
        _hf(
            "GPTNeo",
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_size=WIDTH,
            vocab_size=VOCAB,
            use_cache=False,
        ),
    ),
    ZooModel(
        "gpt-neox",
        "decoder",
        "transformers",
        _hf("GPTNeoX", intermediate_size=64, max_position_embeddings=64, use_cache=False, **TEXT),
    ),
    ZooModel(
        "bloom",
        "decoder",
        "transformers",
        _hf("Bloom", vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS, n_head=HEADS, use_cache=False),
    ),
    ZooModel(
        "falcon", "decoder", "transformers", _hf("Falcon", new_decoder_architecture=False, use_cache=False, **TEXT)
    ),
    ZooModel(
        "codegen",
        "decoder",
        "transformers",
        _hf(
            "CodeGen",
            vocab_size=VOCAB,
            n_embd=WIDTH,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=64,
            rotary_dim=8,
            use_cache=False,
        ),
    ),
    ZooModel(
        "biogpt",
        "decoder",
        "transformers",
        _hf("BioGpt", intermediate_size=64, max_position_embeddings=64, use_cache=False, **TEXT),
    ),
    ZooModel(
        "xglm",
        "decoder",
        "transformers",
        _hf(
            "XGLM",
            vocab_size=VOCAB,
            d_model=WIDTH,
            num_layers=LAYERS,
            attention_heads=HEADS,
            ffn_dim=64,
            max_position_embeddings=64,
            use_cache=False,
        ),
    ),
    ZooModel(
        "phi",
        "decoder",
        "transformers",
        _hf("Phi", intermediate_size=64, max_position_embeddings=64, use_cache=False, **TEXT),
    ),
    ZooModel(
        "stablelm",
        "decoder",
        "transformers",
        _hf(
            "StableLm",
            intermediate_size=64,
            max_position_embeddings=64,
            num_key_value_heads=HEADS,
            use_cache=False,
            **TEXT,
        ),
    ),
    # encoders
    ZooModel("bert", "encoder", "transformers", _hf("Bert", **BERT_LIKE)),
    ZooModel("roberta", "encoder", "transformers", _hf("Roberta", pad_token_id=1, **BERT_LIKE)),
    ZooModel(
        "distilbert",
        "encoder",
        "transformers",
        _hf(
            "DistilBert",
            vocab_size=VOCAB,
            dim=WIDTH,
            n_layers=LAYERS,
            n_heads=HEADS,
            hidden_dim=64,
            max_position_embeddings=64,
        ),
    ),
    ZooModel("albert", "encoder", "transformers", _hf("Albert", embedding_size=16, **BERT_LIKE)),
    ZooModel("electra", "encoder", "transformers", _hf("Electra", embedding_size=16, **BERT_LIKE)),
    ZooModel("deberta-v2", "encoder", "transformers", _hf("DebertaV2", **BERT_LIKE)),
    ZooModel("mpnet", "encoder", "transformers", _hf("MPNet", **BERT_LIKE)),
    # encoder-decoders
    ZooModel("bart", "encoder-decoder", "transformers", _hf_seq2seq("Bart", **SEQ2SEQ)),
    ZooModel("mbart", "encoder-decoder", "transformers", _hf_seq2seq("MBart", **SEQ2SEQ)),
    ZooModel("marian", "encoder-decoder", "transformers", _hf_seq2seq("Marian", **SEQ2SEQ)),
    ZooModel("pegasus", "encoder-decoder", "transformers", _hf_seq2seq("Pegasus", **SEQ2SEQ)),
    ZooModel("blenderbot-small", "encoder-decoder", "transformers", _hf_seq2seq("BlenderbotSmall", **SEQ2SEQ)),
    # vision transformers
    ZooModel("vit", "vision: ViT", "transformers", _hf("ViT", **PIXELS, **VISION)),
    ZooModel("deit", "vision: ViT", "transformers", _hf("DeiT", **PIXELS, **VISION)),
    ZooModel(
        "beit",
        "vision: ViT",
        "transformers",
        _hf("Beit", use_mean_pooling=True, field="pooler_output", **PIXELS, **VISION),
    ),
    ZooModel("dinov2", "vision: ViT", "transformers", _hf("Dinov2", **PIXELS, **VISION)),
    ZooModel("timm-vit", "vision: ViT", "timm", _timm("vit_tiny_patch16_224", **TIMM_VIT)),
    ZooModel("timm-deit", "vision: ViT", "timm", _timm("deit_tiny_distilled_patch16_224", **TIMM_VIT)),
    ZooModel(
        "timm-eva02",
        "vision: ViT",
        "timm",
        _timm("eva02_tiny_patch14_224", **TIMM_VIT),
        {"torchscript": "the TorchScript exporter fails on timm's attention (is_causal traced as a tensor)"},
    ),
    ZooModel("timm-cait", "vision: ViT", "timm", _timm("cait_xxs24_224", depth_token_only=1, **TIMM_VIT)),
    ZooModel(
        "timm-xcit",
        "vision: ViT",
        "timm",
        _timm("xcit_nano_12_p8_224", cls_attn_layers=1, **TIMM_VIT),
        {"torch": _INSIDE_FORWARD.format("on the local patch interaction's LayerScale (after a depthwise conv)")},
    ),
    # hierarchical vision
    ZooModel(
        "swin",
        "vision: hierarchical",
        "transformers",
        _hf(
            "Swin",
            image_size=IMAGE,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=4,
            **PIXELS,
        ),
    ),
    ZooModel(
        "pvt-v2",
        "vision: hierarchical",
        "transformers",
        _hf(
            "PvtV2",
            image_size=IMAGE,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_attention_heads=[1, 2],
            sr_ratios=[2, 1],
            patch_sizes=[7, 3],
            strides=[4, 2],
            mlp_ratios=[2, 2],
            num_encoder_blocks=2,
            **PIXELS,
        ),
    ),
    ZooModel(
        "timm-swin",
        "vision: hierarchical",
        "timm",
        _timm(
            "swin_tiny_patch4_window7_224",
            img_size=IMAGE,
            patch_size=2,
            embed_dim=16,
            depths=(1, 1),
            num_heads=(1, 2),
            window_size=4,
        ),
    ),
    ZooModel(
        "timm-pvt-v2",
        "vision: hierarchical",
        "timm",
        _timm("pvt_v2_b0", embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2)),
    ),
    ZooModel("timm-mvitv2", "vision: hierarchical", "timm", _timm_mvitv2),
    ZooModel(
        "timm-twins",
        "vision: hierarchical",
        "timm",
        _timm("twins_pcpvt_small", **TIMM_STAGES, sr_ratios=(2, 1), mlp_ratios=(2, 2)),
    ),
    # convolutional stems
    ZooModel(
        "convnext",
        "vision: conv stem",
        "transformers",
        _hf("ConvNext", field="pooler_output", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, **PIXELS),
    ),
    ZooModel(
        "timm-convnext", "vision: conv stem", "timm", _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 16, 32, 32))
    ),
    # speech
    ZooModel(
        "wav2vec2",
        "speech",
        "transformers",
        _hf(
            "Wav2Vec2",
            keyword="input_values",
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
            **BERT_LIKE,
        ),
    ),
    ZooModel(
        "hubert",
        "speech",
        "transformers",
        _hf(
            "Hubert",
            keyword="input_values",
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            **BERT_LIKE,
        ),
    ),
    ZooModel(
        "whisper",
        "speech",
        "transformers",
        _hf_seq2seq(
            "Whisper",
            keyword="input_features",
            num_mel_bins=16,
            max_source_positions=16,
            max_target_positions=32,
            **WHISPER,
        ),
        {"torch": _INSIDE_FORWARD.format("after the convolutional stem's GELU, in WhisperEncoder.forward")},
    ),
]


def get(name: str) -> ZooModel:
    return next(model for model in ZOO if model.name == name)


# --- running -------------------------------------------------------------------------------------


class _LayerNormCounter(TorchFunctionMode):
    """Counts `F.layer_norm` calls (nn.LayerNorm and every subclass or module that calls it)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.layer_norm:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def executed_layer_norms(module: nn.Module, inputs: tuple) -> int:
    counter = _LayerNormCounter()
    with torch.no_grad(), counter:
        module(*inputs)
    return counter.calls


def _is_layer_norm(reason: str | None) -> bool:
    """Whether a decision is about a LayerNorm (RMSNorms and GroupNorms are listed too, never folded)."""
    from normpass.core.graph import ALREADY_RMS

    return reason is None or (ALREADY_RMS not in reason and "GroupNorm:" not in reason)


def short_reason(decision) -> str:
    """What blocked a norm, without the node names that differ from model to model."""
    reason = decision.blocker.reason if decision.blocker is not None else decision.reason or ""
    reason = re.sub(r"\s+", " ", reason)
    parts = [p for p in reason.split(": ") if len(p.split()) >= 4]
    text = parts[-1] if parts else reason
    words = ["…" if _is_name(word) else word for word in text.split()]
    return " ".join(w for i, w in enumerate(words) if w != "…" or i == 0 or words[i - 1] != "…")[:160]


def _is_name(word: str) -> bool:
    """A node or tensor name (`/blocks.0/Add`, `model.h.0.ln_1`, `node_layer_norm_3`), not an op (`aten.mul`)."""
    word = word.rstrip(",;")
    return not word.startswith("aten.") and bool(re.search(r"[/_]|\w\.\w", word))


def _count(run: ZooRun, plan, keys: dict[str, str]) -> None:
    decisions = [d for d in plan.decisions if _is_layer_norm(d.reason)]
    run.norms, run.proven = len(decisions), sum(d.foldable for d in decisions)
    for decision in decisions:
        if not decision.foldable:
            run.left.setdefault(short_reason(decision), []).append(keys.get(decision.name, decision.name))


def norm_keys(model: onnx.ModelProto) -> dict[str, str]:
    """Node name → the module that ran it, where the export says so (the dynamo exporter's name scopes) and
    no other node of that module is a norm's name: the name the PyTorch front end gives the same norm."""
    modules = {}
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        path = ast.literal_eval(scopes) if scopes else []
        if len(path) >= 2 and path[-2]:
            modules[node.name] = path[-2]
    return modules


def run(model: ZooModel, front_end: str, workdir: str | pathlib.Path | None = None) -> ZooRun:
    """`model` through `front_end`; a failure is recorded in `ZooRun.failure`, not raised."""
    try:
        module, inputs = model.build()
    except Exception as e:  # a config the installed transformers or timm does not take
        return ZooRun(model.name, model.family, front_end, 0, failure=f"cannot build it: {type(e).__name__}: {e}")
    result = ZooRun(model.name, model.family, front_end, executed_layer_norms(module, inputs))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            if front_end == "torch":
                _run_torch(result, module, inputs)
            else:
                _run_onnx(result, module, inputs, front_end, pathlib.Path(tmp) / f"{model.name}.onnx")
        except Exception as e:  # an exporter or front end refusal: the table says which
            result.failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    result.seconds = time.perf_counter() - start
    return result


def _run_torch(result: ZooRun, module: nn.Module, inputs: tuple) -> None:
    import normpass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback capture warns; the report says it
        folded, report = normpass.fold(module, inputs, verify=False)
    _count(result, report.plan, {})
    result.folded = report.folded
    result.error = relative_error(module, folded, inputs)


def relative_error(module: nn.Module, folded: nn.Module, inputs: tuple) -> float:
    """max |y − y₀| / max |y₀| of `folded`'s output against `module`'s, in float64: no normpass code."""
    with torch.no_grad():
        expected, got = module(*inputs).double(), folded(*inputs).double()
    return float((expected - got).abs().max() / expected.abs().max())


def _run_onnx(result: ZooRun, module: nn.Module, inputs: tuple, front_end: str, path: pathlib.Path) -> None:
    from normpass import FoldOptions, fold_onnx, inspect_onnx

    names = [f"input_{i}" for i in range(len(inputs))]
    if front_end == "dynamo":
        with _quiet(), torch.no_grad():
            torch.onnx.export(module, inputs, str(path), dynamo=True, input_names=names, output_names=["output"])
    else:
        torchscript_export(module, inputs, path, names, ["output"], {})
    exported = onnx.load(str(path))
    plan = inspect_onnx(exported)
    refused = [d.name for d in plan.decisions if not d.foldable]
    modules = norm_keys(exported)
    shared = {path for path, n in Counter(modules.get(name) for name in refused).items() if n > 1}
    keys = {name: modules[name] for name in refused if name in modules and modules[name] not in shared}
    _count(result, plan, keys)
    folded = fold_onnx(exported, FoldOptions(verify=False, fold_with_beta_add=True))
    result.folded = len(folded.plan.folded)
    feeds = {name: tensor.numpy() for name, tensor in zip(names, inputs, strict=True)}
    result.error, _ = rewrite_error(exported, folded.model, feeds)
    result.forced = {keys.get(fold.norm, fold.norm): fold for fold in forced_folds(exported, plan, feeds)}


# --- the table -----------------------------------------------------------------------------------


def table(runs: list[ZooRun]) -> str:
    """docs/zoo.md: per model and front end, LayerNorms proven / listed, and why each norm left was left."""
    by_model: dict[str, dict[str, ZooRun]] = {}
    for run_ in runs:
        by_model.setdefault(run_.model, {})[run_.front_end] = run_
    lines = [
        "# The zoo: third-party architectures through every front end",
        "",
        "Generated by `python tools/zoo.py --write docs/zoo.md` from `models/zoo.py`: do not edit by hand",
        "(`tests/test_zoo.py` checks that it matches a run). Each architecture is built from its",
        "`transformers` or `timm` config, tiny (width 32, 2 layers where the config allows) and seeded, with",
        "random LayerNorm γ/β; `dynamo` and `torchscript` are its ONNX exports through `normpass fold`,",
        "`torch` is `normpass.fold` on the module. Every folded model matched its original outside",
        f"normpass's own verifier (ONNX Runtime without normpass code; the module's own outputs) within {REL_TOL:g}.",
        "",
        "A cell reads *proven / LayerNorms listed*; *runs* is how many LayerNorms the module executes",
        "(`F.layer_norm` calls). Proven from the module means proven *and* expressible as a module swap.",
        "",
        "Each reason a norm was left carries its measured counter-example, on the ONNX exports",
        "(`models/counterexample.py`): the *forced fold* does what the refused fold would, on top of the",
        "folds that are proven: it centres the layers the proof reached, swaps the norm for the RMS op, and",
        "ONNX Runtime runs it beside the export. *input |mean|/rms* is the largest |mean| over rms of a row",
        "of the norm's input after those centrings, *output change* the largest change of the model's outputs",
        "relative to their largest magnitude, over the norms with that reason. A figure far above fp32",
        f"rounding shows that no fold of that form is exact there (below {ROUNDING:g}: rounding, the refusal",
        "over-cautious). Where an inserted x − mean(x) makes the fold exact, it is said: one insertion costs",
        "what the mean the LayerNorm computes itself costs, so the fold is planned only where one insertion",
        "enables 2 folds. The PyTorch front end's lines give the figures of the same norms (by module) in the",
        "dynamo export, where that export refuses them too.",
        "",
    ]
    totals = {front_end: [0, 0] for front_end in FRONT_ENDS}
    lines += ["| family | model | runs | " + " | ".join(FRONT_ENDS) + " |", "|---|---|---|" + "---|" * len(FRONT_ENDS)]
    for model in ZOO:
        found = by_model.get(model.name)
        if not found:
            continue
        cells = []
        for front_end in FRONT_ENDS:
            cell = found.get(front_end)
            if cell is None:
                cells.append("")
            elif cell.failure:
                cells.append("failed")
            else:
                cells.append(f"{cell.proven} / {cell.norms}")
                totals[front_end][0] += cell.proven
                totals[front_end][1] += cell.norms
        executed = next(iter(found.values())).executed
        lines.append(f"| {model.family} | {model.name} | {executed} | " + " | ".join(cells) + " |")
    lines.append("| | **all** | | " + " | ".join(f"**{p} / {n}**" for p, n in totals.values()) + " |")
    lines += ["", "## Why the norms left were left", ""]
    for model in ZOO:
        found = by_model.get(model.name, {})
        notes = []
        for front_end in FRONT_ENDS:
            left = found.get(front_end)
            if left is None:
                continue
            if left.failure:
                notes.append(f"  * {front_end}: failed: {left.failure}")
            forced = (found["dynamo"].forced if "dynamo" in found else {}) if front_end == "torch" else left.forced
            for reason, norms in sorted(left.left.items()):
                measured = evidence([forced[n] for n in norms if n in forced], len(norms))
                notes.append(f"  * {front_end}: {len(norms)}× {reason}{measured}")
            if front_end in model.differs:
                notes.append(f"  * {front_end} differs from the others: {model.differs[front_end]}")
        if notes:
            lines += [f"* **{model.name}**", *notes]
    return "\n".join(lines) + "\n"


def evidence(folds: list[ForcedFold], norms: int) -> str:
    """The counter-example of one reason left to `norms` norms: their forced folds (`counterexample.py`) as ranges."""
    if not folds:
        return ""
    measured = "" if len(folds) == norms else f" ({len(folds)} of {norms})"
    text = (
        f" — forced fold{measured}: input |mean|/rms {_range([f.input_mean for f in folds])}, "
        f"output change {_range([f.output_change for f in folds])}"
    )
    exact = sum(f.insertion_change is not None and f.insertion_change < ROUNDING for f in folds)
    if exact:
        which = "" if exact == len(folds) else f" ({exact} of {len(folds)})"
        text += f"; exact with an inserted x − mean(x){which}, which costs what the norm's own mean does"
    return text


def _range(values: list[float]) -> str:
    """`low–high` in 2 significant digits (rounding-level figures as `<1e-05`, which do not repeat exactly)."""
    low, high = (f"<{ROUNDING:g}" if v < ROUNDING else f"{v:.2g}" for v in (min(values), max(values)))
    return low if low == high else f"{low}–{high}"


def problem(run_: ZooRun) -> str | None:
    """What is wrong with a run, or None: a failure, outputs that differ, LayerNorms run but not listed."""
    if run_.failure:
        return run_.failure
    if run_.error is None or not run_.error <= REL_TOL:
        return f"the folded model differs from the original by {run_.error} (tolerance {REL_TOL:g})"
    if run_.norms != run_.executed:
        return f"{run_.norms} LayerNorms listed, {run_.executed} run"
    return None
