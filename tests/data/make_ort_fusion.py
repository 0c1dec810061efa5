"""Write the small graphs in `ort_fusion/`: ONNX Runtime's LayerNorm and SkipLayerNormalization fusion-test
graphs, recreated (run from this folder: `python make_ort_fusion.py`).

ONNX Runtime (MIT licence, Copyright (c) Microsoft Corporation) tests its `LayerNormFusion`,
`SkipLayerNormFusion` and `SimplifiedLayerNormFusion` graph transformers on graphs that its scripts
in `onnxruntime/test/testdata/transform/fusion/` generate (`skip_layer_norm_gen.py`,
`layer_norm_with_cast_2.py`, `layer_norm_with_cast_3.py`, `layer_norm_fusion_scale_bias.py`,
`layer_norm_shared_input.py`, `layer_norm_without_scale_bias.py`, `layer_norm_fp16.py`,
`layer_norm_t5_gen.py`) or that `onnxruntime/test/optimizer/graph_transform_test_layernorm.cc`
builds (`BuildLayerNorm`, the `LayerNormWithCastFusionTest_5` to `_9` cases). Each graph here
has the same nodes, operands, types, shapes, attributes and opsets as the one named after it
(there, nodes are sometimes listed out of topological order; here they are sorted), written
with `onnx.parser`. `build_layer_norm_axes_*` are `BuildLayerNorm`'s graphs at opset 18, named
after the axes of the two ReduceMeans.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent / "ort_fusion"
F16 = np.float16


def model(name: str, opset: int, signature: str, body: list[str], **initializers) -> None:
    """Write `ort_fusion/{name}.onnx` from its signature, body lines and initializers."""
    lines = "\n  ".join(body)
    text = f'<ir_version: 8, opset_import: ["" : {opset}, "com.microsoft" : 1]>\n{name} {signature} {{\n  {lines}\n}}'
    proto = onnx.parser.parse_model(text)
    for index, node in enumerate(proto.graph.node):
        node.name = f"{node.op_type}_{index}"
    proto.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items())
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, HERE / f"{name}.onnx")


def layer_norm(x: str, p: str = "", dup_sub: bool = False, beta_first: bool = False) -> list[str]:
    """x → ReduceMean → Sub → Pow → ReduceMean → Add ε → Sqrt → Div → Mul γ → Add β, tensors prefixed
    by `p`; `dup_sub`: x − mean computed twice, one Sub for the Pow and one for the Div; `beta_first`:
    `Add(β, ·)`."""
    subs = [f"{p}sb1_out = Sub({x}, {p}rd1_out)", f"{p}sb2_out = Sub({x}, {p}rd1_out)"]
    return [
        f"{p}rd1_out = ReduceMean<axes=[-1], keepdims=1>({x})",
        *(subs if dup_sub else subs[:1]),
        f"{p}pow_out = Pow({p}sb2_out, {p}pow_in_2)" if dup_sub else f"{p}pow_out = Pow({p}sb1_out, {p}pow_in_2)",
        f"{p}rd2_out = ReduceMean<axes=[-1], keepdims=1>({p}pow_out)",
        f"{p}add1_out = Add({p}rd2_out, {p}const_e12)",
        f"{p}sqrt_out = Sqrt({p}add1_out)",
        f"{p}div_out = Div({p}sb1_out, {p}sqrt_out)",
        f"{p}mul_out = Mul({p}gamma, {p}div_out)",
        f"{p}C = Add({p}beta, {p}mul_out)" if beta_first else f"{p}C = Add({p}mul_out, {p}beta)",
    ]


def skip_layer_norm(fmt: int, variant: str = "", with_cast: bool = False) -> None:
    """skip_layer_norm_gen.py: the residual Add (with a bias: format 1 `(A + bias) + B`, format 2
    `A + (B + bias)`; format 3 `A + B`) before a LayerNorm whose x − mean is computed twice (one Sub
    for the Pow, one for the Div); "partial" also reads the biased sum elsewhere (Neg), "graph_output"
    makes it a graph output. `with_cast`: fp16 inputs and bias, the sum cast to fp32 first."""
    dtype = "float16" if with_cast else "float"
    residual = {
        1: ["add3_out = Add(A, bias)", "ln_in = Add(add3_out, B)"],
        2: ["add3_out = Add(B, bias)", "ln_in = Add(A, add3_out)"],
        3: ["ln_in = Add(A, B)"],
    }[fmt]
    cast = ["c_out = Cast<to=1>(ln_in)"] if with_cast else []
    norm = layer_norm("c_out" if with_cast else "ln_in", dup_sub=True)
    extra = "ln_in" if fmt == 3 else "add3_out"
    tail = [f"neg_out = Neg({extra})"] if variant == "partial" else []
    outputs = "float[16, 32, 4] C" + (f", {dtype}[16, 32, 4] {extra}" if variant == "graph_output" else "")
    suffix = {"": "", "partial": "_no_fusion" if fmt == 3 else "_partial", "graph_output": "_graph_output"}[variant]
    biases = {} if fmt == 3 else {"bias": np.array([0.1, 0.2, 0.3, 0.4], F16 if with_cast else np.float32)}
    model(
        f"skip_layer_norm_format{fmt}{suffix}{'_with_cast' if with_cast else ''}",
        12,
        f"({dtype}[16, 32, 4] A, {dtype}[16, 32, 4] B) => ({outputs})",
        residual + cast + norm + tail,
        pow_in_2=np.array(2.0, np.float32),
        const_e12=np.array(1e-12, np.float32),
        gamma=np.array([1.0, 2.0, 3.0, 4.0], np.float32),
        beta=np.array([0.1, 0.2, 0.3, 0.4], np.float32),
        **biases,
    )


def layer_norms() -> None:
    """The LayerNorm fusion tests' graphs (see the module docstring)."""
    plain = layer_norm("A")
    affine = {"gamma": np.array([1.0, 2.0, 3.0, 4.0], np.float32), "beta": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    model(
        "layer_norm",
        12,
        "(float[16, 32, 4] A) => (float[16, 32, 4] C)",
        plain,
        pow_in_2=np.array(2.0, np.float32),
        const_e12=np.array(1e-5, np.float32),
        **affine,
    )
    model(  # layer_norm_fp16.py: fp16, γ and β given as graph inputs, opset 10
        "layer_norm_fp16",
        10,
        "(float16[M, N] A, float16[N] gamma, float16[N] beta) => (float16[M, N] C)",
        plain,
        pow_in_2=np.array([2.0], F16),
        const_e12=np.array([1e-4], F16),
    )
    model(  # layer_norm_without_scale_bias.py: ε = 0, no γ, no β
        "layer_norm_without_scale_bias",
        12,
        "(float[16, 32, 4] A) => (float[16, 32, 4] div_out)",
        plain[:7],
        pow_in_2=np.array(2.0, np.float32),
        const_e12=np.array(0.0, np.float32),
    )
    model(  # layer_norm_shared_input.py: two LayerNorms of one input (GPT-J's parallel residual)
        "layer_norm_shared_input",
        12,
        "(float[16, 32, 4] A) => (float[16, 32, 4] LN1_C, float[16, 32, 4] LN2_C)",
        layer_norm("A", "LN1_", beta_first=True) + layer_norm("A", "LN2_", beta_first=True),
        **{f"LN{i}_{k}": v for i in (1, 2) for k, v in affine.items()},
        **{f"LN{i}_pow_in_2": np.array(2.0, np.float32) for i in (1, 2)},
        **{f"LN{i}_const_e12": np.array(0.0, np.float32) for i in (1, 2)},
    )
    fp16 = {"gamma": np.array([1, 2, 3, 4], F16), "beta": np.array([1, 2, 3, 4], F16)}
    model(  # layer_norm_with_cast_2.py: fp16, the exponent cast to fp16
        "layer_norm_with_cast_2",
        12,
        "(float16[16, 32, 4] A) => (float16[16, 32, 4] C)",
        ["cast_out = Cast<to=10>(pow_in_2)"]
        + [line.replace("pow_in_2", "cast_out") for line in layer_norm("A", beta_first=True)],
        pow_in_2=np.array(2.0, np.float32),
        const_e12=np.array(0.0, F16),
        **fp16,
    )
    model(  # layer_norm_with_cast_3.py: fp32, x̂ cast to fp16 before γ
        "layer_norm_with_cast_3",
        12,
        "(float[16, 32, 4] A) => (float16[16, 32, 4] C)",
        plain[:7] + ["cast_out = Cast<to=10>(div_out)", "mul_out = Mul(gamma, cast_out)", "C = Add(beta, mul_out)"],
        pow_in_2=np.array(2.0, np.float32),
        const_e12=np.array(0.0, np.float32),
        **fp16,
    )
    model(  # layer_norm_fusion_scale_bias.py (casts, identities): fp16 x − mean, cast to fp32 inside
        "layer_norm_fusion_scale_bias",
        12,
        "(float16[16, 32, 4] A) => (float16[16, 32, 4] C)",
        plain[:2]
        + ["cast_sub_out = Cast<to=1>(sb1_out)", "pow_out = Pow(cast_sub_out, pow_in_2)"]
        + plain[3:6]
        + [
            "div_out = Div(cast_sub_out, sqrt_out)",
            "cast_div_out = Cast<to=10>(div_out)",
            "gamma_id_out = Identity(gamma)",
            "mul_out = Mul(gamma_id_out, cast_div_out)",
            "const_e6_f16_out = Identity(const_e6_f16)",
            "C = Add(mul_out, const_e6_f16_out)",
        ],
        pow_in_2=np.array(2.0, np.float32),
        const_e12=np.array(1e-12, np.float32),
        const_e6_f16=np.full(4, 1e-6, F16),
        gamma=np.array([1, 2, 3, 4], F16),
    )
    for reduce1, reduce2 in (
        ((-1,), (-1,)),
        ((-2,), (-1,)),
        ((-2, -1), (-1, -2)),
        ((-3, -2, -1), (-1, -2)),
        ((2, -1), (-1, -2)),
    ):
        build_layer_norm(reduce1, reduce2)


def build_layer_norm(reduce1: tuple[int, ...], reduce2: tuple[int, ...]) -> None:
    """graph_transform_test_layernorm.cc `BuildLayerNorm`: fp16 x of shape [2, 3, 3, 3], x − mean in fp16,
    cast to fp32 for the variance and the division, x̂ cast back to fp16 before γ (ones) and β (zeros)."""
    shape = [2, 3, 3, 3]
    normalized = [shape[a] for a in sorted(a % 4 for a in reduce1)]
    name = (
        "_".join(str(a).replace("-", "m") for a in reduce1) + "__" + "_".join(str(a).replace("-", "m") for a in reduce2)
    )
    model(
        f"build_layer_norm_axes_{name}",
        18,
        "(float16[2, 3, 3, 3] X) => (float16[2, 3, 3, 3] Y)",
        [
            "mean = ReduceMean(X, axes1)",
            "sub = Sub(X, mean)",
            "cast1 = Cast<to=1>(sub)",
            "pow = Pow(cast1, two)",
            "variance = ReduceMean(pow, axes2)",
            "add1 = Add(variance, eps)",
            "root = Sqrt(add1)",
            "div = Div(cast1, root)",
            "cast2 = Cast<to=10>(div)",
            "mul = Mul(cast2, weight)",
            "Y = Add(mul, bias)",
        ],
        axes1=np.array(reduce1, np.int64),
        axes2=np.array(reduce2, np.int64),
        two=np.array(2.0, np.float32),
        eps=np.array(1e-5, np.float32),
        weight=np.ones(normalized, F16),
        bias=np.zeros(normalized, F16),
    )


def rms_norms() -> None:
    """layer_norm_t5_gen.py: T5's RMSNorm, in fp32 and (simplified_layer_norm_with_casts) in fp16 cast to fp32."""
    body = [
        "pow_out = Pow(A_, pow_in_2)",
        "rd2_out = ReduceMean<axes=[-1], keepdims=1>(pow_out)",
        "add1_out = Add(rd2_out, const_e12)",
        "sqrt_out = Sqrt(add1_out)",
        "div_out = Div(A_, sqrt_out)",
    ]
    constants = {"pow_in_2": np.array(2.0, np.float32), "const_e12": np.array(1e-12, np.float32)}
    model(
        "layer_norm_t5",
        12,
        "(float[16, 32, 4] A) => (float[16, 32, 4] C)",
        ["A_ = Identity(A)", *body, "C = Mul(gamma, div_out)"],
        gamma=np.array([1.0, 2.0, 3.0, 4.0], np.float32),
        **constants,
    )
    model(
        "simplified_layer_norm_with_casts",
        12,
        "(float16[16, 32, 4] A) => (float16[16, 32, 4] C)",
        ["A_ = Cast<to=1>(A)", *body, "cast_div_out = Cast<to=10>(div_out)", "C = Mul(gamma, cast_div_out)"],
        gamma=np.array([1, 2, 3, 4], F16),
        **constants,
    )


if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    for fmt in (1, 2, 3):
        for variant in ("", "partial", "graph_output"):
            for with_cast in (False, True):
                skip_layer_norm(fmt, variant, with_cast)
    layer_norms()
    rms_norms()
