"""Build a synthetic pre-LN transformer stack as ONNX, writing its weights straight to external data.

The model (hidden size h, n heads, vocabulary V, L layers) reads `input_ids` [batch, seq] and
returns `logits` [batch, seq, V]:

    x ← Gather(E, input_ids)                                          E: V×h token table
    per layer:
        q, k, v ← split(LN₁(x)·Wqkv + bqkv)                           Wqkv: h×3h
        x ← x + merge(softmax(q·kᵀ/√(h/n))·v)·Wo + bo                 Wo: h×h (n heads)
        x ← x + Gelu(LN₂(x)·Wup + bup)·Wdown + bdown                  Wup: h×4h, Wdown: 4h×h
    logits ← LN_f(x)·H                                                H: h×V

Every term added to the residual stream comes from a constant linear map (E, Wo, bo, Wdown,
bdown), so normpass's exact pass can centre them and prove the input of every LayerNorm
zero-mean. Parameters: 2·V·h + 2h + L·(12h² + 13h); L is the layer count that brings this
nearest to `--params` (at least 1).

Weights are drawn in a fixed order from `numpy.random.default_rng(seed)`: matrices and biases
0.02·N(0, 1), LayerNorm γ 1 + 0.02·N(0, 1), β 0.02·N(0, 1). They are generated and written in
chunks of at most `CHUNK` elements into `OUT.data` (each tensor at a 4096-byte-aligned offset),
so building a 13 GB model needs a few hundred MB of memory. Usage::

    python tools/synthetic_stack.py --params 7e9 --dtype float16 /tmp/s7b/model.onnx
"""

from __future__ import annotations

import argparse
import math
import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper

CHUNK = 1 << 24
ALIGN = 4096
OPSET = 20  # Gelu
IR_VERSION = 10  # accepted by ONNX Runtime 1.31
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def layer_params(hidden: int) -> int:
    return 12 * hidden * hidden + 13 * hidden


def fixed_params(hidden: int, vocab: int) -> int:
    return 2 * vocab * hidden + 2 * hidden


def layers_for(params: float, hidden: int, vocab: int) -> int:
    return max(1, round((params - fixed_params(hidden, vocab)) / layer_params(hidden)))


class WeightWriter:
    """Appends seeded random tensors to an external-data file and returns their TensorProtos."""

    def __init__(self, file, location: str, dtype: str, seed: int):
        self.file, self.location = file, location
        self.dtype, self.onnx_type = np.dtype(dtype), DTYPES[dtype]
        self.rng = np.random.default_rng(seed)
        self.offset = 0  # where the next tensor starts (after alignment)
        self.bytes = 0  # weight bytes written, padding excluded

    def tensor(self, name: str, shape: tuple[int, ...], mean: float = 0.0) -> TensorProto:
        """A tensor of `mean` + 0.02·N(0, 1) values, written in chunks at the next aligned offset."""
        padding = -self.offset % ALIGN
        self.file.write(b"\0" * padding)
        self.offset += padding
        remaining = math.prod(shape)
        length = remaining * self.dtype.itemsize
        while remaining:
            count = min(remaining, CHUNK)
            values = self.rng.standard_normal(count, dtype=np.float32)
            values *= 0.02
            values += mean
            self.file.write(values.astype(self.dtype).tobytes())
            remaining -= count
        tensor = TensorProto(name=name, data_type=self.onnx_type, dims=shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", self.offset), ("length", length)):
            tensor.external_data.add(key=key, value=str(value))
        self.offset += length
        self.bytes += length
        return tensor


def _layer(i: int, x: str, weights: WeightWriter, hidden: int, heads: int) -> tuple[str, list, list]:
    """Nodes and initializers of layer `i` reading residual stream `x`; returns (new stream, nodes, inits)."""
    p = f"layer{i}."
    inits = [
        weights.tensor(p + "ln1.gamma", (hidden,), mean=1.0),
        weights.tensor(p + "ln1.beta", (hidden,)),
        weights.tensor(p + "qkv.weight", (hidden, 3 * hidden)),
        weights.tensor(p + "qkv.bias", (3 * hidden,)),
        weights.tensor(p + "out.weight", (hidden, hidden)),
        weights.tensor(p + "out.bias", (hidden,)),
        weights.tensor(p + "ln2.gamma", (hidden,), mean=1.0),
        weights.tensor(p + "ln2.beta", (hidden,)),
        weights.tensor(p + "up.weight", (hidden, 4 * hidden)),
        weights.tensor(p + "up.bias", (4 * hidden,)),
        weights.tensor(p + "down.weight", (4 * hidden, hidden)),
        weights.tensor(p + "down.bias", (hidden,)),
    ]

    def node(op: str, inputs: list[str], name: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [p + name], name=p + name, **attrs)

    nodes = [
        node("LayerNormalization", [x, p + "ln1.gamma", p + "ln1.beta"], "ln1", axis=-1),
        node("MatMul", [p + "ln1", p + "qkv.weight"], "qkv_mm"),
        node("Add", [p + "qkv_mm", p + "qkv.bias"], "qkv"),
        helper.make_node("Split", [p + "qkv", "qkv_split"], [p + "q", p + "k", p + "v"], name=p + "split", axis=-1),
        node("Reshape", [p + "q", "heads_shape"], "q_heads"),
        node("Reshape", [p + "k", "heads_shape"], "k_heads"),
        node("Reshape", [p + "v", "heads_shape"], "v_heads"),
        node("Transpose", [p + "q_heads"], "q_t", perm=[0, 2, 1, 3]),
        node("Transpose", [p + "k_heads"], "k_t", perm=[0, 2, 3, 1]),
        node("Transpose", [p + "v_heads"], "v_t", perm=[0, 2, 1, 3]),
        node("MatMul", [p + "q_t", p + "k_t"], "scores_raw"),
        node("Mul", [p + "scores_raw", "attn_scale"], "scores"),
        node("Softmax", [p + "scores"], "probs", axis=-1),
        node("MatMul", [p + "probs", p + "v_t"], "ctx_heads"),
        node("Transpose", [p + "ctx_heads"], "ctx_t", perm=[0, 2, 1, 3]),
        node("Reshape", [p + "ctx_t", "merge_shape"], "ctx"),
        node("MatMul", [p + "ctx", p + "out.weight"], "out_mm"),
        node("Add", [p + "out_mm", p + "out.bias"], "attn_out"),
        node("Add", [x, p + "attn_out"], "resid1"),
        node("LayerNormalization", [p + "resid1", p + "ln2.gamma", p + "ln2.beta"], "ln2", axis=-1),
        node("MatMul", [p + "ln2", p + "up.weight"], "up_mm"),
        node("Add", [p + "up_mm", p + "up.bias"], "up"),
        node("Gelu", [p + "up"], "act"),
        node("MatMul", [p + "act", p + "down.weight"], "down_mm"),
        node("Add", [p + "down_mm", p + "down.bias"], "mlp_out"),
        node("Add", [p + "resid1", p + "mlp_out"], "resid2"),
    ]
    return p + "resid2", nodes, inits


def build(
    path: str | pathlib.Path,
    params: float,
    dtype: str = "float16",
    hidden: int = 4096,
    heads: int = 32,
    vocab: int = 32000,
    seed: int = 0,
) -> dict:
    """Write the stack to `path` (+ `path.data`); return its layers, parameter count and weight bytes."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
    path = pathlib.Path(path)
    layers = layers_for(params, hidden, vocab)
    location = path.name + ".data"
    path.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(dtype)
    consts = [
        helper.make_tensor("qkv_split", TensorProto.INT64, (3,), [hidden] * 3),
        helper.make_tensor("heads_shape", TensorProto.INT64, (4,), [0, 0, heads, hidden // heads]),
        helper.make_tensor("merge_shape", TensorProto.INT64, (3,), [0, 0, hidden]),
        onnx.numpy_helper.from_array(np.array(1 / math.sqrt(hidden // heads), np_dtype), "attn_scale"),
    ]
    with open(path.parent / location, "wb") as file:
        weights = WeightWriter(file, location, dtype, seed)
        inits = [weights.tensor("embed.weight", (vocab, hidden))]
        nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["embed"], name="embed")]
        x = "embed"
        for i in range(layers):
            x, layer_nodes, layer_inits = _layer(i, x, weights, hidden, heads)
            nodes += layer_nodes
            inits += layer_inits
        inits += [
            weights.tensor("ln_f.gamma", (hidden,), mean=1.0),
            weights.tensor("ln_f.beta", (hidden,)),
            weights.tensor("head.weight", (hidden, vocab)),
        ]
        nodes += [
            helper.make_node("LayerNormalization", [x, "ln_f.gamma", "ln_f.beta"], ["ln_f"], name="ln_f", axis=-1),
            helper.make_node("MatMul", ["ln_f", "head.weight"], ["logits"], name="head"),
        ]
        weight_bytes = weights.bytes
    graph = helper.make_graph(
        nodes,
        "synthetic_stack",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", DTYPES[dtype], ["batch", "seq", vocab])],
        initializer=consts + inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="synthetic_stack")
    model.ir_version = IR_VERSION
    onnx.save_model(model, str(path))
    total = fixed_params(hidden, vocab) + layers * layer_params(hidden)
    return {"path": str(path), "layers": layers, "params": total, "weight_bytes": weight_bytes}


def build_centred(
    path: str | pathlib.Path, weight_bytes: float, hidden: int = 4096, outputs: int = 64, seed: int = 0
) -> dict:
    """Write `x → MatMul W0 + b0 → LayerNorm → MatMul W1 + b1` (fp32) to `path` (+ `path.data`), W0 of
    `rows`×`hidden` with `rows` the count that brings W0 nearest to `weight_bytes`: one large weight, which
    the fold centres (it writes the norm's input), rotation rotates and slicing cuts (along its output
    features), and a small reader W1 (`hidden`×`outputs`). Returns its path, rows and weight bytes."""
    path = pathlib.Path(path)
    rows = max(1, round(weight_bytes / (4 * hidden)))
    location = path.name + ".data"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / location, "wb") as file:
        weights = WeightWriter(file, location, "float32", seed)
        inits = [
            weights.tensor("W0", (rows, hidden)),
            weights.tensor("b0", (hidden,)),
            weights.tensor("gamma", (hidden,), mean=1.0),
            weights.tensor("beta", (hidden,)),
            weights.tensor("W1", (hidden, outputs)),
            weights.tensor("b1", (outputs,)),
        ]
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h0"], name="mm0"),
        helper.make_node("Add", ["h0", "b0"], ["h"], name="add0"),
        helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "W1"], ["z"], name="mm1"),
        helper.make_node("Add", ["z", "b1"], ["y"], name="add1"),
    ]
    graph = helper.make_graph(
        nodes,
        "centred",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", outputs])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="synthetic_stack")
    model.ir_version = IR_VERSION
    onnx.save_model(model, str(path))
    return {"path": str(path), "rows": rows, "weight_bytes": weights.bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="path of the .onnx file to write (its weights go to OUT.data)")
    parser.add_argument("--params", type=float, required=True, help="target parameter count, e.g. 7e9")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    parser.add_argument("--heads", type=int, default=32, help="attention heads (default 32)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = build(args.out, args.params, args.dtype, args.hidden, args.heads, args.vocab, args.seed)
    print(
        f"{info['path']}: {info['layers']} layers, {info['params']:,} parameters, "
        f"{info['weight_bytes']:,} bytes of weights"
    )


if __name__ == "__main__":
    main()
