"""Random transformer-like ONNX graphs for fuzzing the fold, each made from one integer seed.

`generate(seed)` returns a `Case`: a checked ONNX model and the feeds an independent oracle runs it
on (`tests/fuzzcheck.py`). The same seed always gives the same model and feeds.

A model is a residual stream h of shape [batch, seq, D] (batch symbolic, seq symbolic or fixed):

* entry: a float input through a linear layer, or token ids through an embedding `Gather`;
* blocks: pre-norm (h + f(N(h))) or post-norm (N(h + f(h))), f times a per-feature LayerScale
  sometimes, f an attention-like branch
  (q·kᵀ of two run-time tensors, Softmax, ·v, heads split by Reshape/Transpose sometimes) or an
  MLP (linear → nonlinearity → linear); plus Split/Concat over D, shape arithmetic on hidden
  states (Shape → Gather → Concat → Reshape), a scalar Mul, a bias Add, a blocker (Relu);
* linear layers: MatMul + Add, Gemm (transB 0 or 1) on a [-1, D] view made by shape arithmetic,
  or a 1×1 Conv on an NCHW view; weights sometimes shared with an earlier layer;
* norms: `LayerNormalization` (opset ≥ 17) or the decomposed chain (ReduceMean, Sub, Pow/Mul,
  Sqrt, Div), γ/β random, centred, absent or unit; the chain spelled as exporters and ONNX
  Runtime's fusion tests write it sometimes (x − mean computed twice, x and γ read through
  `Identity`, the moments variance E[x²] − E[x]², x − mean cast to a wider float for the variance
  and the division and cast back before γ), or as ONNX's own function body of
  `LayerNormalization` (opset ≥ 17: Flatten, moments variance, Reshape back); a norm sometimes
  inside a model-local function (its constants `Constant` nodes), called from the graph;
* an `If` on a bool input whose branches read stream tensors through outer scope (nested
  sometimes, with a norm inside sometimes), or a `Loop` whose body does, its output added to the
  stream or returned;
* XCiT's class-attention block, where the sequence length is fixed: h + w ⊙ cat(proj(n1[:, :1]), n1[:, 1:])
  along the tokens (w a per-feature LayerScale sometimes, with a zero entry sometimes), then
  cat(norm2(h[:, :r]), h[:, r:]), r = 1 mostly (the class row alone), 2 sometimes;
* exits: the final stream, a norm, an LM head (tied to the embedding table sometimes) or the ids of its
  arg-max (an `ArgMax` head, int64: what classifiers and greedy decoders export), and extra graph outputs at
  random points;
* one float dtype per model (fp32 mostly, fp16, fp64), an opset in 13–23 with ops valid for it,
  an IR version from the opset's minimum to 10 (opset 23 needs IR 11);
* overridable initializers: some or all initializers also listed in `graph.input`.

Spellings and functions are drawn from a random stream of their own, LayerScales from another, class-attention
blocks from a third, `ArgMax` heads from a fourth (all seeded by the seed too), so every other draw, and with it
the model of a seed without them, is what it was before they existed.

Feeds: several shapes when a dim is dynamic, both values of the bool input, and a feed set that
overrides every overridable float initializer. Float inputs have a non-zero mean per feature, so
that a dropped centring shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

D, HEADS, VOCAB = 8, 2, 11
OPSETS = tuple(range(13, 24))
DTYPES = (np.float32, np.float16, np.float64)
DTYPE_WEIGHTS = (0.7, 0.15, 0.15)
SHAPES = ((2, 5), (1, 3))  # (batch, seq) of the first and second feed shape
FEATURES = (
    "subgraph",
    "loop",
    "overridable",
    "shared",
    "shape_arith",
    "conv",
    "gemm",
    "attention",
    "embedding",
    "spellings",
    "functions",
    "layer_scale",
    "class_token",
    "ids",
)
# The features the pinned campaign seeds were found with: `generate(seed, PINNED_FEATURES)` replays
# the very model a regression test was written for (later features draw from a stream of their own).
PINNED_FEATURES = FEATURES[:9]
# The features the surrogate and rotation tests' seeds were chosen with (before LayerScales existed).
FEATURES_BEFORE_LAYER_SCALE = FEATURES[: FEATURES.index("layer_scale")]
# The features the slicing and LayerScale tests' seeds were chosen with (before `ArgMax` heads existed).
FEATURES_BEFORE_IDS = FEATURES[: FEATURES.index("ids")]
SPELLINGS = ("twice", "identity", "moments", "wide", "onnx")  # of a decomposed LayerNorm (see the module docstring)
WIDER = {np.dtype(np.float16): np.float32, np.dtype(np.float32): np.float64}  # the "wide" spelling's inner type
FUNCTION_DOMAIN = "fuzz.functions"
NONLINEAR = ("Relu", "Tanh", "Sigmoid", "Gelu")


@dataclass
class Case:
    seed: int
    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    used: set[str] = field(default_factory=set)  # the features this model exercises
    norms: list[str] = field(default_factory=list)  # outputs of every LayerNorm built, subgraphs included


class Builder:
    """Accumulates the nodes and initializers of one graph; a subgraph's builder shares its parent's records."""

    def __init__(self, rng: np.random.Generator, dtype, opset: int, features: set[str], seq, spell=None):
        self.rng, self.dtype, self.opset, self.features, self.seq = rng, np.dtype(dtype), opset, features, seq
        self.spell = spell or np.random.default_rng(0)  # spellings and functions: a stream of their own
        self.scales = np.random.default_rng(0)  # LayerScales (top-level blocks only): another one
        self.classes = np.random.default_rng(0)  # class-attention blocks: a third
        self.prefix = ""
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.weights: dict[tuple, list[str]] = {}  # shape → weight initializers, for sharing
        self.used: set[str] = set()
        self.norms: list[str] = []
        self.functions: list[onnx.FunctionProto] = []
        self.constant_nodes = False  # a function body: constants are Constant nodes, not initializers
        self.counter = 0

    def subgraph(self, kind: str) -> Builder:
        sub = Builder(self.rng, self.dtype, self.opset, self.features, self.seq, self.spell)
        sub.prefix, sub.used, sub.norms, sub.functions = f"{self.name(kind)}_", self.used, self.norms, self.functions
        return sub

    def stream_info(self, name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(self.dtype), ["batch", self.seq, D])

    # --- primitives ---------------------------------------------------------------------------

    def name(self, prefix: str) -> str:
        self.counter += 1
        return f"{self.prefix}{prefix}{self.counter}"

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def const(self, prefix: str, values) -> str:
        tensor = self.name(prefix)
        if self.constant_nodes:
            self.nodes.append(
                helper.make_node(
                    "Constant", [], [tensor], name=tensor, value=numpy_helper.from_array(np.asarray(values))
                )
            )
        else:
            self.inits.append(numpy_helper.from_array(np.asarray(values), tensor))
        return tensor

    def floats(self, prefix: str, *shape, scale=1.0, offset=0.0) -> str:
        return self.const(prefix, (offset + scale * self.rng.standard_normal(shape)).astype(self.dtype))

    def ints(self, *values) -> str:
        return self.const("i", np.array(values, np.int64))

    def node(self, op: str, inputs: list[str], outputs: int = 1, **attrs):
        names = [self.name(op.lower() + "_") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=names[0], **attrs))
        return names[0] if outputs == 1 else names

    def weight(self, *shape) -> str:
        """A weight initializer, sometimes one an earlier layer already reads (shared weights)."""
        earlier = self.weights.setdefault(shape, [])
        if earlier and "shared" in self.features and self.chance(0.25):
            self.used.add("shared")
            return earlier[self.rng.integers(len(earlier))]
        weight = self.floats("W", *shape, scale=0.5)
        earlier.append(weight)
        return weight

    # --- layers -------------------------------------------------------------------------------

    def linear(self, x: str, d_out: int = D) -> str:
        """x·W + b on the last axis of a [batch, seq, D] tensor, as MatMul+Add, Gemm or Conv 1×1."""
        conv = "conv" in self.features and d_out == D and self.dtype == np.float32  # ORT's CPU Conv: fp32 only
        kinds = ["matmul"] + ["gemm"] * ("gemm" in self.features) + ["conv"] * conv
        kind = kinds[self.rng.integers(len(kinds))]
        if kind == "gemm":
            self.used.add("gemm")
            trans_b = int(self.chance(0.5))
            w = self.weight(d_out, D) if trans_b else self.weight(D, d_out)
            flat = self.node("Reshape", [x, self.ints(-1, D)])
            y = self.node("Gemm", [flat, w] + ([self.floats("c", d_out)] if self.chance(0.7) else []), transB=trans_b)
            return self.node("Reshape", [y, self.leading_shape(x, d_out)])
        if kind == "conv":
            self.used.add("conv")
            nchw = self.node("Unsqueeze", [self.node("Transpose", [x], perm=[0, 2, 1]), self.ints(3)])
            inputs = [nchw, self.weight(D, D, 1, 1)] + ([self.floats("c", D)] if self.chance(0.7) else [])
            y = self.node("Conv", inputs, kernel_shape=[1, 1])  # [b, D, s, 1]
            if self.chance(0.5):
                return self.node("Transpose", [self.node("Squeeze", [y, self.ints(3)])], perm=[0, 2, 1])
            return self.node("Reshape", [self.node("Transpose", [y], perm=[0, 2, 3, 1]), self.ints(0, 0, D)])
        y = self.node("MatMul", [x, self.weight(D, d_out)])
        return self.node("Add", [y, self.floats("c", d_out)]) if self.chance(0.7) else y

    def leading_shape(self, x: str, last: int) -> str:
        """[batch, seq, last] computed from x's run-time shape (Shape → Gather → Concat)."""
        self.used.add("shape_arith")
        dims = self.node("Gather", [self.node("Shape", [x]), self.ints(0, 1)], axis=0)
        return self.node("Concat", [dims, self.ints(last)], axis=0)

    def reduce_mean(self, x: str) -> str:
        if self.opset >= 18:
            return self.node("ReduceMean", [x, self.ints(-1)], keepdims=1)
        return self.node("ReduceMean", [x], axes=[-1], keepdims=1)

    def norm(self, x: str) -> str:
        """A LayerNorm over the last axis, in one op (opset ≥ 17) or decomposed; inside a function sometimes."""
        if "functions" in self.features and not self.prefix and self.spell.random() < 0.2:
            return self.function_norm(x)
        affine = ("random", "random", "centred", "unit", "none")[self.rng.integers(5)]
        gamma = beta = None
        if affine == "random":
            gamma, beta = self.floats("g", D, scale=0.3, offset=1.0), self.floats("b", D, scale=0.3)
        elif affine == "centred":
            b = 0.3 * self.rng.standard_normal(D)
            gamma, beta = (
                self.const("g", np.full(D, 1.25, self.dtype)),
                self.const("b", (b - b.mean()).astype(self.dtype)),
            )
        elif affine == "unit":
            gamma = self.const("g", np.ones(D, self.dtype))
        eps = float(self.rng.choice([1e-5, 1e-6]))
        if self.opset >= 17 and self.chance(0.7):
            gamma = gamma or self.const("g", np.ones(D, self.dtype))
            y = self.node("LayerNormalization", [x, gamma] + ([beta] if beta else []), axis=-1, epsilon=eps)
        else:
            y = self.decomposed_norm(x, gamma, beta, eps, square_by_pow=self.chance(0.5))
        self.norms.append(y)
        return y

    def spelling(self) -> str:
        """How a decomposed LayerNorm is spelled: "plain", or one of `SPELLINGS` with the spellings feature."""
        if "spellings" not in self.features or self.spell.random() < 0.4:
            return "plain"
        self.used.add("spellings")
        return SPELLINGS[self.spell.integers(len(SPELLINGS))]

    def decomposed_norm(self, x: str, gamma, beta, eps: float, square_by_pow: bool) -> str:
        """d = x − ReduceMean(x); d / Sqrt(ReduceMean(d²) + ε) [⊙ γ] [+ β], spelled as `spelling` says."""
        spelling = self.spelling()
        if spelling == "onnx" and self.opset >= 17 and self.dtype != np.float64:  # ONNX's body computes in fp32
            return self.onnx_layer_norm(x, gamma, beta, eps)
        wide = WIDER.get(self.dtype) if spelling == "wide" else None
        mean = self.reduce_mean(self.node("Identity", [x]) if spelling == "identity" else x)
        centred = self.node("Sub", [x, mean])
        other = self.node("Sub", [x, mean]) if spelling == "twice" else centred
        if wide is not None:
            centred = other = self.node("Cast", [centred], to=helper.np_dtype_to_tensor_dtype(np.dtype(wide)))
        inner = np.dtype(wide or self.dtype)
        if spelling == "moments":
            variance = self.node("Sub", [self.reduce_mean(self.node("Mul", [x, x])), self.node("Mul", [mean, mean])])
        else:
            square = (
                self.node("Pow", [other, self.const("two", np.array(2, inner))])
                if square_by_pow
                else self.node("Mul", [other, other])
            )
            variance = self.reduce_mean(square)
        root = self.node("Sqrt", [self.node("Add", [variance, self.const("eps", np.array(eps, inner))])])
        y = self.node("Div", [centred, root])
        if wide is not None:
            y = self.node("Cast", [y], to=helper.np_dtype_to_tensor_dtype(self.dtype))
        if gamma and spelling == "identity":
            gamma = self.node("Identity", [gamma])
        y = self.node("Mul", [y, gamma]) if gamma else y
        return self.node("Add", [y, beta]) if beta else y

    def onnx_layer_norm(self, x: str, gamma, beta, eps: float) -> str:
        """ONNX's function body of LayerNormalization over the last axis, computing in fp32, inlined (the
        opset-17 body at opset 17, the opset-18 one above)."""
        from onnx.backend.test.case.node import function_testcase_helper

        gamma = gamma or self.const("g", np.ones(D, self.dtype))
        y = self.name("layer_norm_")
        node = helper.make_node("LayerNormalization", [x, gamma] + ([beta] if beta else []), [y], axis=-1, epsilon=eps)
        tensor_type = helper.np_dtype_to_tensor_dtype(self.dtype)
        types = [helper.make_tensor_type_proto(tensor_type, shape) for shape in (["batch", self.seq, D], [D], [D])]
        bodies, _ = function_testcase_helper(node, types[: len(node.input)], y, [helper.make_opsetid("", 17)])
        for inner in bodies[0 if self.opset == 17 else 1][0]:
            inner.name = self.name("onnx_")
            self.nodes.append(inner)
        return y

    def function_norm(self, x: str) -> str:
        """A norm (any spelling) as the body of a model-local function, called on x."""
        self.used.add("functions")
        body = Builder(self.rng, self.dtype, self.opset, self.features, self.seq, self.spell)
        body.prefix, body.used, body.norms, body.constant_nodes = f"fn{len(self.functions)}_", self.used, [], True
        out = body.norm("t")
        name = f"Norm{len(self.functions)}"
        self.functions.append(
            helper.make_function(FUNCTION_DOMAIN, name, ["t"], [out], body.nodes, [helper.make_opsetid("", self.opset)])
        )
        y = self.name("call_")
        self.nodes.append(helper.make_node(name, [x], [y], name=y, domain=FUNCTION_DOMAIN))
        self.norms.append(y)
        return y

    def nonlinearity(self, x: str) -> str:
        gelu = self.opset >= 20 and self.dtype != np.float64  # ORT's CPU Erf (inside Gelu) has no fp64 kernel
        ops = NONLINEAR if gelu else NONLINEAR[:-1]
        return self.node(ops[self.rng.integers(len(ops))], [x])

    def mlp(self, x: str) -> str:
        return self.linear(self.nonlinearity(self.linear(x)))

    def attention(self, x: str) -> str:
        """softmax(q·kᵀ)·v with q, k, v linear in x, by heads sometimes, then an output projection."""
        self.used.add("attention")
        q, k, v = self.linear(x), self.linear(x), self.linear(x)
        if self.chance(0.5):  # [b, s, D] → [b, H, s, D/H]
            q, k, v = (
                self.node(
                    "Transpose", [self.node("Reshape", [t, self.ints(0, 0, HEADS, D // HEADS)])], perm=[0, 2, 1, 3]
                )
                for t in (q, k, v)
            )
            scores = self.node("MatMul", [q, self.node("Transpose", [k], perm=[0, 1, 3, 2])])
            mixed = self.node("MatMul", [self.node("Softmax", [scores], axis=-1), v])
            merged = self.node("Reshape", [self.node("Transpose", [mixed], perm=[0, 2, 1, 3]), self.ints(0, 0, D)])
        else:
            scores = self.node("MatMul", [q, self.node("Transpose", [k], perm=[0, 2, 1])])
            merged = self.node("MatMul", [self.node("Softmax", [scores], axis=-1), v])
        return self.linear(merged)

    def branch(self, x: str) -> str:
        return self.attention(x) if "attention" in self.features and self.chance(0.5) else self.mlp(x)

    def block(self, h: str) -> str:
        if self.chance(0.7):  # pre-norm
            return self.node("Add", [h, self.layer_scale(self.branch(self.norm(h)))])
        return self.norm(self.node("Add", [h, self.layer_scale(self.branch(h))]))

    def layer_scale(self, x: str) -> str:
        """The branch's output times a per-feature constant sometimes (LayerScale: DINOv2, CaiT), either
        operand first, the factor of shape [D] or [1, 1, D]."""
        if "layer_scale" not in self.features or self.scales.random() >= 0.3:
            return x
        self.used.add("layer_scale")
        shape = (D,) if self.scales.random() < 0.5 else (1, 1, D)
        factor = self.const("ls", self.scales.uniform(0.05, 1.5, shape).astype(self.dtype))
        return self.node("Mul", [x, factor] if self.scales.random() < 0.5 else [factor, x])

    def class_attention(self, h: str) -> str:
        """XCiT's class-attention block (`tokens_norm` False), its attention left out: the stream plus a LayerScale
        w (sometimes) over cat(proj(n1[:, :1]), n1[:, 1:]) along the tokens, then the first r rows normalized
        again. norm2 folds with proj centred weighted by w where r = 1 and no wₖ is 0."""
        self.used.add("class_token")
        draw, big = self.classes, 2**62
        n1 = self.norm(h)
        first = self.node("Slice", [n1, self.ints(0), self.ints(1), self.ints(1)])
        rest = self.node("Slice", [n1, self.ints(1), self.ints(big), self.ints(1)])
        parts = self.node("Concat", [self.linear(first), rest], axis=1)
        if draw.random() < 0.8:
            w = draw.uniform(0.05, 1.5, D)
            if draw.random() < 0.2:
                w[draw.integers(D)] = 0
            factor = self.const("ls", w.astype(self.dtype))
            parts = self.node("Mul", [parts, factor] if draw.random() < 0.5 else [factor, parts])
        h = self.node("Add", [h, parts])
        rows = 1 if draw.random() < 0.7 else 2
        head = self.node("Slice", [h, self.ints(0), self.ints(rows), self.ints(1)])
        tail = self.node("Slice", [h, self.ints(rows), self.ints(big), self.ints(1)])
        return self.node("Concat", [self.norm(head), tail], axis=1)

    def split_concat(self, h: str) -> str:
        """Split D in two, transform one half linearly or not at all, concatenate back."""
        left, right = self.node("Split", [h, self.ints(D // 2, D // 2)], outputs=2, axis=-1)
        if self.chance(0.5):
            left = self.node("Mul", [left, self.const("s", np.array(self.rng.uniform(0.5, 2), self.dtype))])
        return self.node("Concat", [right, left] if self.chance(0.5) else [left, right], axis=-1)

    def reshape_by_shape(self, h: str) -> str:
        """An identity Reshape whose target shape is computed from the hidden state's Shape."""
        return self.node("Reshape", [h, self.leading_shape(h, D)])


def _subgraph_node(parent: Builder, readers: list[str], depth: int = 0) -> str:
    """An `If` on the bool input or a two-step `Loop`, whose bodies read `readers` through outer scope."""
    if "loop" in parent.features and ("subgraph" not in parent.features or parent.chance(0.3)):
        return _loop(parent, readers)
    return _if(parent, readers, depth)


def _if(parent: Builder, readers: list[str], depth: int) -> str:
    """Each branch: Identity, a scalar Mul, a norm, or a nested If/Loop of one outer-scope reader."""
    parent.used.add("subgraph")
    branches = []
    for side in ("then", "else"):
        sub = parent.subgraph(side)
        outer = readers[sub.rng.integers(len(readers))]
        kind = sub.rng.integers(4)
        if kind == 0:
            y = sub.node("Identity", [outer])
        elif kind == 1:
            y = sub.node("Mul", [outer, sub.const("s", np.array(sub.rng.uniform(0.5, 2), sub.dtype))])
        elif kind == 2:
            y = sub.norm(outer)
        else:
            y = _subgraph_node(sub, readers, depth + 1) if depth < 1 else sub.node("Neg", [outer])
        branches.append(
            helper.make_graph(sub.nodes, sub.prefix + "graph", [], [sub.stream_info(y)], initializer=sub.inits)
        )
    return parent.node("If", ["cond"], then_branch=branches[0], else_branch=branches[1])


def _loop(parent: Builder, readers: list[str]) -> str:
    """carried ← carried + s·f(outer) twice, f the identity or a norm, from a stream value or from zeros."""
    parent.used.add("loop")
    body = parent.subgraph("loop")
    step, cond, carried = body.name("iter"), body.name("cond"), body.name("carried")
    outer = readers[body.rng.integers(len(readers))]
    read = body.norm(outer) if body.chance(0.5) else outer
    scaled = body.node("Mul", [read, body.const("s", np.array(body.rng.uniform(0.5, 2), body.dtype))])
    outputs = [body.node("Identity", [cond]), body.node("Add", [carried, scaled])]
    graph = helper.make_graph(
        body.nodes,
        body.prefix + "graph",
        [
            helper.make_tensor_value_info(step, onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info(cond, onnx.TensorProto.BOOL, []),
            body.stream_info(carried),
        ],
        [helper.make_tensor_value_info(outputs[0], onnx.TensorProto.BOOL, []), body.stream_info(outputs[1])],
        initializer=body.inits,
    )
    start = readers[parent.rng.integers(len(readers))]
    if parent.chance(0.5):  # zeros of the stream's shape: the body's outer-scope read is the only value reader
        zero = numpy_helper.from_array(np.zeros(1, parent.dtype))
        start = parent.node("ConstantOfShape", [parent.node("Shape", [start])], value=zero)
    return parent.node("Loop", [parent.const("trips", np.array(2, np.int64)), "", start], body=graph)


def _ir_version(rng: np.random.Generator, opset: int) -> int:
    lowest = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return int(rng.integers(lowest, max(lowest, 10) + 1))


def generate(seed: int, features=FEATURES) -> Case:
    """The model and feeds for `seed`; `features` limits what the generator may use."""
    rng = np.random.default_rng(seed)
    features = set(features)
    dtype = DTYPES[rng.choice(len(DTYPES), p=DTYPE_WEIGHTS)]
    opset = int(rng.choice(OPSETS))
    seq = "seq" if rng.random() < 0.5 else SHAPES[0][1]
    b = Builder(rng, dtype, opset, features, seq, np.random.default_rng((seed, 1)))
    b.scales = np.random.default_rng((seed, 2))
    b.classes = np.random.default_rng((seed, 3))
    heads = np.random.default_rng((seed, 4))
    tensor_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs, outputs = [], []

    embedding = None
    if "embedding" in features and b.chance(0.4):
        b.used.add("embedding")
        inputs.append(helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", seq]))
        embedding = b.floats("E", VOCAB, D, offset=0.5)
        h = b.node("Gather", [embedding, "ids"], axis=0)
    else:
        inputs.append(helper.make_tensor_value_info("x", tensor_type, ["batch", seq, D]))
        h = b.linear("x")
    stream = [h]  # stream values, readable by subgraphs and extra outputs

    for _ in range(rng.integers(1, 5)):
        step = rng.choice(
            ["block", "block", "block", "split", "reshape", "scale", "bias", "relu", "subgraph", "output"]
        )
        if step == "block":
            h = b.block(h)
        elif step == "split":
            h = b.split_concat(h)
        elif step == "reshape" and "shape_arith" in features:
            h = b.reshape_by_shape(h)
        elif step == "scale":
            h = b.node("Mul", [h, b.const("s", np.array(rng.uniform(0.5, 2), dtype))])
        elif step == "bias":
            h = b.node("Add", [h, b.floats("k", D)])
        elif step == "relu":
            h = b.node("Relu", [h])
        elif step == "subgraph" and {"subgraph", "loop"} & features:
            result = _subgraph_node(b, stream + [h])
            if b.chance(0.5):
                h = b.node("Add", [h, result])
            else:
                outputs.append(result)
        elif step == "output":
            outputs.append(h)
        stream.append(h)
    if "class_token" in features and seq != "seq" and b.classes.random() < 0.4:
        h = b.class_attention(h)
        stream.append(h)

    exit_kind, width = rng.integers(3), D
    if exit_kind == 0:
        h = b.norm(h)
    elif exit_kind == 1:  # final norm and LM head, tied to the embedding table sometimes
        h = b.norm(h)
        if embedding is not None and b.chance(0.6):
            b.used.add("shared")
            h = b.node("MatMul", [h, b.node("Transpose", [embedding], perm=[1, 0])])
        else:
            h = b.linear(h, VOCAB)
        width = VOCAB
        if "ids" in features and heads.random() < 0.3:  # the ids are the output, the logits are not
            b.used.add("ids")
            h = b.node("ArgMax", [h], axis=-1, keepdims=0)
    outputs.append(h)
    if "subgraph" in b.used:  # an If reads the bool input
        inputs.append(helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []))

    overridable = _overridable(b, rng)
    inputs += [
        helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in b.inits if i.name in overridable
    ]
    out_infos = [
        helper.make_tensor_value_info(o, onnx.TensorProto.INT64, ["batch", seq])
        if o == h and "ids" in b.used
        else helper.make_tensor_value_info(o, tensor_type, ["batch", seq, width if o == h else D])
        for o in dict.fromkeys(outputs)
    ]
    graph = helper.make_graph(b.nodes, f"fuzz{seed}", inputs, out_infos, initializer=b.inits)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(FUNCTION_DOMAIN, 1)] * bool(b.functions)
    ir_version = _ir_version(rng, opset)
    model = helper.make_model(
        graph, opset_imports=opsets, functions=b.functions, ir_version=max(ir_version, 8) if b.functions else ir_version
    )
    onnx.checker.check_model(model, full_check=True)  # full_check: strict shape inference passes too
    return Case(seed, model, _feeds(rng, model, overridable, b.inits), b.used, b.norms)


def _overridable(b: Builder, rng: np.random.Generator) -> set[str]:
    """Initializers also listed as graph inputs: none, some float ones, or all (keep_initializers_as_inputs)."""
    if "overridable" not in b.features:
        return set()
    mode = rng.choice(["none", "none", "some", "all"])
    if mode == "none":
        return set()
    b.used.add("overridable")
    if mode == "all":
        return {i.name for i in b.inits}
    floats = [i.name for i in b.inits if i.data_type != onnx.TensorProto.INT64]
    return {name for name in floats if rng.random() < 0.3} or set(floats[:1])


def _feeds(
    rng: np.random.Generator, model: onnx.ModelProto, overridable: set[str], inits
) -> list[dict[str, np.ndarray]]:
    """Feed sets: each shape, both bool values, and overrides of the overridable float initializers."""
    declared = {i.name: i for i in model.graph.input}
    dynamic_seq = any(d.dim_param == "seq" for i in model.graph.input for d in i.type.tensor_type.shape.dim)
    shapes = SHAPES if dynamic_seq else tuple((batch, SHAPES[0][1]) for batch, _ in SHAPES)
    feed_sets = []
    for index, (batch, seq) in enumerate(shapes):
        for cond in (True, False) if "cond" in declared else (None,):
            feeds = {}
            if "x" in declared:
                x_type = declared["x"].type.tensor_type.elem_type
                offset = rng.uniform(-2, 2, D)  # a non-zero mean per feature
                x = offset + 1.5 * rng.standard_normal((batch, seq, D))
                feeds["x"] = x.astype(helper.tensor_dtype_to_np_dtype(x_type))
            if "ids" in declared:
                feeds["ids"] = rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)
            if cond is not None:
                feeds["cond"] = np.array(cond)
            feed_sets.append(feeds)
        if index == 0 and overridable:
            feed_sets.append(feed_sets[-1] | _overrides(rng, overridable, inits))
    return feed_sets


def _overrides(rng: np.random.Generator, overridable: set[str], inits) -> dict[str, np.ndarray]:
    overrides = {}
    for init in inits:
        value = numpy_helper.to_array(init)
        if init.name not in overridable or value.dtype.kind != "f" or value.ndim == 0:
            continue  # scalars (ε, exponents, scales) stay: overriding them only makes NaNs
        overrides[init.name] = (value + 0.3 + 0.5 * rng.standard_normal(value.shape)).astype(value.dtype)
    return overrides
