"""Is `normpass slice` SliceGPT? The anchor check against SliceGPT's own code (issue 35, item 5).

SliceGPT (Ashkboos et al., ICLR 2024; `microsoft/TransformerCompression`, `src/slicegpt/`) makes every
LayerNorm of a pre-LN model an RMSNorm (`layernorm_fusion.fuse_modules`: γ and β into the readers, the mean
baked into the embeddings and every writer), then `rotate.rotate_and_slice`: layer by layer, the covariance
`H = Σ xᵀx` of the stream where each norm reads it, in float64 on the calibration tokens (`pca_calc`), its
eigenvectors `Q` by decreasing eigenvalue; writers `W_out → Qᵀ W_out`, readers `W_in → W_in Q`, both cut to
the first k columns, and on each residual path the k×k shortcut `Q_lᵀ Q_{l+1}` (`attn_shortcut_Q`,
`mlp_shortcut_Q`). Its RMSNorm (`modules.RMSN`) divides by the dense width d, so a mean over k columns
keeps the dense scale. The signals of layer l+1 are computed by the already sliced layers 0..l. With
`ConstSlicingScheduler(k)` (what its `run_slicegpt.py` uses; k = (1 − R)·d rounded down to a multiple of 8)
the LM head's input is not sliced: the last layer writes the stream in its full PCA basis.

This script runs that code, unmodified, on a seeded tiny OPT (`normpass.models.registry.opt_entry`) and
`normpass slice` on the same model's ONNX export, at the same k and the same calibration batches, and
compares their logits on held-out token batches: each against the original (the slicing error) and against
each other (the disagreement between the two implementations), for `basis="layer"` (SliceGPT's scheme) and
`basis="stream"` (one basis for the whole stream, no shortcut matrices).

SliceGPT pins `transformers==4.41.0` (its `CompressedOPTDecoderLayer.forward` follows that version's
decoder layer), so its half runs in another interpreter, `--slicegpt-python`, where that version is
installed beside torch, numpy and `ml_collections`. Only the modules the rotation needs are imported (its
package `__init__` also imports the experiment scripts' `datasets` and `accelerate`); nothing is downloaded.
The two halves exchange the model's state dict, the token batches and the logits through `--workdir`.

    python tools/check_slicegpt.py --repo /path/to/TransformerCompression \\
        --slicegpt-python /path/to/venv-with-transformers-4.41/bin/python \\
        --json docs/results/cpu-2026-11-27/slicegpt-anchor.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import onnx
import torch

SEED = 35
# A tiny OPT: 4 pre-LN decoder layers of width d = 128 (4 heads, FFN 512), vocabulary 512.
OPT_SHAPE = {"n_layer": 4, "hidden": 128, "ffn": 512, "heads": 4, "vocab": 512, "positions": 128}
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "ffn_dim",
    "num_attention_heads",
    "max_position_embeddings",
    "word_embed_proj_dim",
    "do_layer_norm_before",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "enable_bias",
    "layer_norm_elementwise_affine",
    "activation_function",
)
ROUND_INTERVAL = 8  # run_slicegpt.py's default --round-interval


def sliced_width(hidden: int, ratio: float) -> int:
    """k as `run_slicegpt.py` computes it: (1 − R)·d, rounded down to a multiple of `ROUND_INTERVAL`."""
    width = int((1 - ratio) * hidden)
    return width - width % ROUND_INTERVAL


def token_batches(vocab: int, batches: int, batch: int, seq: int, seed: int) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.integers(0, vocab, (batch, seq), dtype=np.int64) for _ in range(batches)]


# --- SliceGPT's half (run under --slicegpt-python) ------------------------------------------------


def import_slicegpt(repo: pathlib.Path):
    """SliceGPT's rotation modules from the checkout at `repo`, without its package `__init__`."""
    import types

    package = types.ModuleType("slicegpt")
    package.__path__ = [str(repo / "src" / "slicegpt")]
    sys.modules["slicegpt"] = package
    from slicegpt import layernorm_fusion, rotate  # type: ignore[import-not-found]  # after the package is registered
    from slicegpt.adapters.opt_adapter import OPTModelAdapter  # type: ignore[import-not-found]
    from slicegpt.slicing_scheduler import ConstSlicingScheduler  # type: ignore[import-not-found]

    return layernorm_fusion, rotate, OPTModelAdapter, ConstSlicingScheduler


def slicegpt_half(repo: pathlib.Path, workdir: pathlib.Path) -> None:
    """Run SliceGPT at every width in the exchange file (`SLICEGPT_VARIANTS`); write the logits each variant
    gives on the held-out batches."""
    import transformers

    layernorm_fusion, rotate, OPTModelAdapter, ConstSlicingScheduler = import_slicegpt(repo)
    exchange = torch.load(workdir / "exchange.pt")
    config = transformers.OPTConfig(**exchange["config"])
    config.torch_dtype = torch.float32  # type: ignore[misc]  # settable in transformers 4.41
    hidden = config.hidden_size
    loader = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in exchange["calibration"]]

    def fused():
        """The model after SliceGPT's `replace_layers` and `fuse_modules` (LayerNorms now its RMSN)."""
        hf = transformers.OPTForCausalLM(config)
        hf.load_state_dict(exchange["state"])
        adapter = OPTModelAdapter(hf)
        layernorm_fusion.replace_layers(adapter, verbose=False)
        layernorm_fusion.fuse_modules(adapter)
        adapter.model.eval()  # replace_layers adds its layers in training mode (rotate_and_slice calls eval)
        return adapter

    def logits(adapter) -> np.ndarray:
        with torch.no_grad():
            return np.stack([adapter.model(input_ids=ids).logits.numpy() for ids in exchange["judge"]])

    def norm_inputs(adapter) -> list[torch.Tensor]:
        """Every token where an RMSN reads the stream, over the calibration batches (float64)."""
        found: list[torch.Tensor] = []
        hooks = [
            module.register_forward_hook(lambda _, args, __: found.append(args[0].reshape(-1, hidden).double()))
            for module in adapter.model.modules()
            if type(module).__name__ == "RMSN"
        ]
        with torch.no_grad():
            for batch in loader:
                adapter.model(**batch)
        for hook in hooks:
            hook.remove()
        return found

    def one_basis(adapter, unit: bool) -> torch.Tensor:
        """One basis for the whole stream: `pca_calc` of the tokens at every norm, raw or unit-length."""
        tokens = [t / t.norm(dim=1, keepdim=True) if unit else t for t in norm_inputs(adapter)]
        return rotate.pca_calc([t[None] for t in tokens])[1]

    hf = transformers.OPTForCausalLM(config)
    hf.load_state_dict(exchange["state"])
    results: dict[str, Any] = {"original": logits(OPTModelAdapter(hf.eval())), "fused": logits(fused())}
    pca_calc = rotate.pca_calc

    def unit_pca_calc(batches, ignore_masks=None):
        return pca_calc([x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30) for x in batches], ignore_masks)

    for width in exchange["widths"]:
        for variant, head, pca in (
            ("layer", False, pca_calc),
            ("layer-head", True, pca_calc),
            ("layer-unit", False, unit_pca_calc),
            ("layer-unit-head", True, unit_pca_calc),
        ):
            rotate.pca_calc = pca
            adapter = fused()
            rotate.rotate_and_slice(adapter, loader, ConstSlicingScheduler(width, do_slice_head=head))
            results[f"{variant}-k{width}"] = logits(adapter)
        rotate.pca_calc = pca_calc
        for unit in (False, True):
            adapter = fused()
            cut_one_basis(rotate, adapter, one_basis(adapter, unit), width)
            results[f"stream-{'unit' if unit else 'raw'}-k{width}"] = logits(adapter)
    results["transformers"] = np.array(transformers.__version__)
    np.savez(workdir / "slicegpt.npz", **results)


def cut_one_basis(rotate, adapter, basis: torch.Tensor, width: int) -> None:
    """SliceGPT's own `rotate_*` and `slice_*` steps with one basis Q for the whole stream, the LM head's
    input cut too (what `basis="stream"` computes): its shortcut matrices Q_kᵀ·Q_k are then the identity."""
    from collections import defaultdict

    rotate.rotate_embeddings(adapter, basis)
    rotate.slice_embeddings(adapter, defaultdict(lambda: width))
    for layer_adapter in adapter.get_layers():
        layer = layer_adapter.layer
        layer.attn_shortcut_Q = torch.nn.Parameter(torch.eye(basis.shape[0]))  # slice_attention_inputs cuts it
        rotate.rotate_attention_inputs(layer_adapter, basis)
        rotate.slice_attention_inputs(layer_adapter, width)
        rotate.rotate_attention_output(layer_adapter, basis)
        rotate.slice_attention_output(layer_adapter, width)
        rotate.rotate_mlp_input(layer_adapter, basis)
        rotate.slice_mlp_input(layer_adapter, width)
        rotate.rotate_mlp_output(layer_adapter, basis)
        rotate.slice_mlp_output(layer_adapter, width)
        layer.attn_shortcut_Q = layer.mlp_shortcut_Q = None
    rotate.rotate_head(adapter, basis)
    rotate.slice_head(adapter, width)


# --- normpass's half ------------------------------------------------------------------------------


def onnx_logits(model, judge: list[np.ndarray]) -> np.ndarray:
    """Logits of an ONNX model (ModelProto or path) on every held-out batch, graph optimizations off."""
    from normpass.models.reference import run_unoptimized

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    return np.stack([next(iter(run_unoptimized(proto, {"input_ids": ids}).values())) for ids in judge])


def normpass_slice(path: pathlib.Path, calibration: list[np.ndarray], judge: list[np.ndarray], width: int, basis: str):
    """`slice_onnx` of the export at `path` to `width` columns, every calibration batch fitting the bases
    (the judged batches as its held-out part); the sliced model, or None where `basis` is not built."""
    from normpass.errors import InputError
    from normpass.onnx.slice import SliceOptions, slice_onnx

    hidden = OPT_SHAPE["hidden"]
    options = SliceOptions(
        ratio=1 - width / hidden,
        round_to=ROUND_INTERVAL,
        basis=basis,
        holdout=[{"input_ids": ids} for ids in judge],
        provider="cpu",
    )
    try:
        return slice_onnx(str(path), [{"input_ids": ids} for ids in calibration], options).model
    except InputError as error:
        print(f"normpass basis {basis!r}: {error}", file=sys.stderr)
        return None


def agreement(reference: np.ndarray, got: np.ndarray) -> dict:
    """How close `got` is to `reference` (logits, last axis the vocabulary): the relative error
    ‖got − ref‖/‖ref‖ over all logits, the largest |got − ref| relative to max |ref|, and the cosine
    of each position's logit vector (min, mean)."""
    a = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    b = got.reshape(-1, got.shape[-1]).astype(np.float64)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {
        "relative_error": float(np.linalg.norm(b - a) / np.linalg.norm(a)),
        "max_abs_over_max_ref": float(np.abs(b - a).max() / np.abs(a).max()),
        "cosine_min": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "top1_agree": float((a.argmax(1) == b.argmax(1)).mean()),
    }


# SliceGPT's half's variants at each width k: what each one is
SLICEGPT_VARIANTS = {
    "layer": "SliceGPT as published: rotate_and_slice, ConstSlicingScheduler(k): a basis per norm site from the "
    "raw stream of the already sliced layers, shortcut matrices, the LM head's input not sliced",
    "layer-head": "the same with do_slice_head=True: the LM head's input sliced too",
    "layer-unit": "SliceGPT as published, its pca_calc given unit-length tokens (normpass's choice), not raw ones",
    "layer-unit-head": "SliceGPT's sequential slicing with normpass's two choices: unit-length tokens and the LM "
    "head's input sliced (do_slice_head=True): what basis='layer' computes",
    "stream-raw": "SliceGPT's rotate_*/slice_* steps with one basis for the whole stream: pca_calc of the raw "
    "tokens at every norm of the unsliced model; the LM head's input sliced",
    "stream-unit": "the same from unit-length tokens: normpass's basis='stream', computed in PyTorch on the HF "
    "module with SliceGPT's own steps (an independent oracle of normpass's cut)",
}


def check(
    repo: pathlib.Path,
    python: str,
    ratios: list[float],
    workdir: pathlib.Path,
    bases: list[str],
    commit: str | None = None,
) -> dict:
    from normpass.models.registry import opt_entry

    entry = opt_entry("opt-slicegpt-anchor", seed=SEED, **OPT_SHAPE)
    module, _ = entry.build_torch()
    hf = module.model
    hidden = hf.config.hidden_size
    calibration = token_batches(OPT_SHAPE["vocab"], batches=4, batch=4, seq=64, seed=SEED)
    judge = token_batches(OPT_SHAPE["vocab"], batches=2, batch=4, seq=64, seed=SEED + 1)
    widths = {ratio: sliced_width(hidden, ratio) for ratio in ratios}
    torch.save(
        {
            "config": {key: getattr(hf.config, key) for key in CONFIG_KEYS},
            "state": hf.state_dict(),
            "calibration": [torch.from_numpy(ids) for ids in calibration],
            "judge": [torch.from_numpy(ids) for ids in judge],
            "widths": sorted({hidden, *widths.values()}, reverse=True),
        },
        workdir / "exchange.pt",
    )
    subprocess.run([python, __file__, "--slicegpt-half", str(workdir), "--repo", str(repo)], check=True)
    theirs = dict(np.load(workdir / "slicegpt.npz"))

    path = workdir / "opt.onnx"
    with torch.no_grad():
        torch.onnx.export(
            module,
            (torch.from_numpy(calibration[0]),),
            str(path),
            dynamo=True,
            input_names=list(entry.input_names),
            output_names=list(entry.output_names),
            dynamic_shapes=entry.dynamic_shapes,
        )
    original = onnx_logits(path, judge)
    report = {
        "model": f"OPT from transformers.OPTConfig, seeded ({SEED}): {entry.summary}",
        "shape": OPT_SHAPE,
        "calibration": "4 batches of 4×64 seeded random token ids, the same for both (normpass: all fit the bases)",
        "judge": "2 batches of 4×64 other seeded random token ids",
        "slicegpt": {
            "commit": commit or git_commit(repo),
            "transformers": str(theirs["transformers"]),
            "variants": SLICEGPT_VARIANTS,
            "original_vs_onnx_export": agreement(original, theirs["original"]),
            "fused_vs_original": agreement(original, theirs["fused"]),
            "rotated_k_eq_d_vs_original": agreement(original, theirs[f"layer-k{hidden}"]),
        },
        "versions": versions(),
    }
    points = []
    for ratio, width in [(0.0, hidden), *widths.items()]:
        point: dict = {"ratio": ratio, "k": width, "vs_original": {}, "normpass_vs_slicegpt": {}}
        for variant in SLICEGPT_VARIANTS:
            point["vs_original"][f"slicegpt-{variant}"] = agreement(original, theirs[f"{variant}-k{width}"])
        for basis in bases:
            sliced = normpass_slice(path, calibration, judge, width, basis)
            if sliced is None:
                continue
            ours = onnx_logits(sliced, judge)
            point["vs_original"][f"normpass-{basis}"] = agreement(original, ours)
            for variant in SLICEGPT_VARIANTS:
                point["normpass_vs_slicegpt"][f"{basis} vs {variant}"] = agreement(theirs[f"{variant}-k{width}"], ours)
        points.append(point)
    return report | {"points": points}


def git_commit(repo: pathlib.Path) -> str | None:
    """The checkout's commit, where it is a git work tree (`--repo-commit` names it otherwise)."""
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or None


def versions() -> dict:
    import onnxruntime
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxruntime": onnxruntime.__version__,
        "machine": platform.machine(),
    }


def table(report: dict) -> str:
    rows = [f"{'R':>5} {'k':>4}  {'compared':<34} {'rel err':>9} {'cos min':>8} {'cos mean':>8} {'top-1':>6}"]
    for point in report["points"]:
        for group in ("vs_original", "normpass_vs_slicegpt"):
            for name, found in point[group].items():
                label = f"{name} vs original" if group == "vs_original" else name
                rows.append(
                    f"{point['ratio']:>5} {point['k']:>4}  {label:<34} {found['relative_error']:>9.2e} "
                    f"{found['cosine_min']:>8.4f} {found['cosine_mean']:>8.4f} {found['top1_agree']:>6.3f}"
                )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=pathlib.Path, required=True, help="a TransformerCompression checkout")
    parser.add_argument("--repo-commit", help="the commit --repo was made from, when it is not a git work tree")
    parser.add_argument("--slicegpt-python", default=sys.executable, help="an interpreter with transformers 4.41")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--basis", nargs="+", default=["layer", "stream"], choices=["layer", "stream"])
    parser.add_argument("--workdir", type=pathlib.Path, help="where the halves exchange files (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path, help="write the report here")
    parser.add_argument("--slicegpt-half", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not (args.repo / "src" / "slicegpt" / "rotate.py").is_file():
        parser.exit(2, f"{args.repo}: not a TransformerCompression checkout (no src/slicegpt/rotate.py)\n")
    if args.slicegpt_half is not None:
        slicegpt_half(args.repo, args.slicegpt_half)
        return
    with tempfile.TemporaryDirectory() as temporary:
        workdir = args.workdir or pathlib.Path(temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        report = check(
            args.repo,
            args.slicegpt_python,
            args.ratios,
            workdir,
            args.basis,
            args.repo_commit,
        )
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
