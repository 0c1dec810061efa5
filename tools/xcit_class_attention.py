"""XCiT's class-attention norm2: its fold's algebra measured with torch alone (docs/proof-patterns.md).

In timm's ``ClassAttentionBlock`` (``tokens_norm`` False) ``norm2`` reads row 0 (the class token) of

    x + γ ⊙ cat(proj(attn(x̂₁)), x̂₁[:, 1:])        (cat along the tokens, γ a per-channel LayerScale)

that is x₀ + γ ⊙ a, with a = W h + b the projection of the class token's attention. A per-channel
factor over a concatenation is absorbed into no one layer, since it also scales x̂₁[:, 1:]. Two ways
to fold norm2 into the RMS op over the same γ/β (normpass's proof finds the second, `Centring.weight`;
this script checks the algebra without normpass's proof or rewrite):

* ``centred``: centre the projection as a fold centres a layer, W' = W − mean_k(W), b' = b − mean_k(b).
  a' is zero-mean, γ ⊙ a' is not: mean_k(γ ⊙ a') = mean_k((γ − mean γ) ⊙ a') ≠ 0 unless γ is uniform.
* ``γ-weighted``: W' = W − γ⁻¹ ⊗ mean_k(γ ⊙ W), b' = b − γ⁻¹ mean_k(γ ⊙ b). Then γ ⊙ a' = γ ⊙ a − mean_k(γ ⊙ a)·1,
  a shift of row 0 alone (the concatenation puts the projection there), which norm2 reads alone and
  removes: exact wherever no γ_k is 0 (a zero γ_k cannot carry the shift).

The proof makes x₀ zero-mean by centring the layers that write the stream (as it does for the norms
that fold); here the stream entering the block is centred explicitly instead, which is exact on its
own (``stream centred``: every reader of that stream is a LayerNorm), so that what is left is the
projection's term. The zoo's XCiT (``models/zoo.py``: seeded, LayerScales drawn around 1) runs each
variant on the zoo's inputs; printed: norm2's largest |mean|/rms over its input rows, and the largest
change of the model's outputs relative to their largest magnitude.

    python tools/xcit_class_attention.py
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from normpass.models import zoo


class _RMSNorm(nn.Module):
    """`norm`'s γ/β over the RMS op: the LayerNorm with its mean subtraction removed."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps) + norm.bias


def variant(module: nn.Module, projection: str | None) -> tuple[nn.Module, list[float]]:
    """`module` with the stream entering its class-attention block centred and, unless `projection` is None,
    norm2 folded with the projection centred that way ("centred" or "γ-weighted"); and the list its norm2
    inputs' |mean|/rms fill as it runs."""
    module = copy.deepcopy(module)
    block: Any = module.get_submodule("cls_attn_blocks.0")
    block.register_forward_pre_hook(lambda _module, args: (args[0] - args[0].mean(-1, keepdim=True),))
    gamma, proj = block.gamma1.detach().double(), block.attn.proj
    weight, bias = proj.weight.detach().double(), proj.bias.detach().double()  # weight: (out k, in)
    with torch.no_grad():
        if projection == "γ-weighted":
            proj.weight.copy_(weight - torch.outer(1 / gamma, (gamma[:, None] * weight).mean(0)))
            proj.bias.copy_(bias - (gamma * bias).mean() / gamma)
        elif projection == "centred":
            proj.weight.copy_(weight - weight.mean(0))
            proj.bias.copy_(bias - bias.mean())
    means: list[float] = []

    def record(_module, args):
        x = args[0].double()
        means.append(float((x.mean(-1).abs() / x.pow(2).mean(-1).sqrt()).max()))

    if projection is not None:
        block.norm2 = _RMSNorm(block.norm2)
    block.norm2.register_forward_pre_hook(record)
    return module, means


def main() -> None:
    module, inputs = zoo.get("timm-xcit").build()
    with torch.no_grad():
        expected = module(*inputs).double()
        print("| norm2 | projection | norm2 input |mean|/rms | output change |\n|---|---|---|---|")
        for projection in (None, "centred", "γ-weighted"):
            changed, means = variant(module, projection)
            got = changed(*inputs).double()
            change = float((got - expected).abs().max() / expected.abs().max())
            norm = "LayerNorm (stream centred)" if projection is None else "RMS op"
            print(f"| {norm} | {projection or 'as it is'} | {max(means):.2g} | {change:.2g} |")


if __name__ == "__main__":
    main()
