"""KV-cache (decode) graphs: which inputs are the cache, and the inputs of a prefill and of a decode step.

A decode graph takes the keys and values of the tokens already seen as inputs (`past_key_values.N.key`,
`past.N`: floating-point inputs whose name says *past*, shaped like (batch, heads, past, head size)) and returns
them grown by the new tokens (`present.*`); its attention mask spans past + new tokens. One size for every
dynamic dimension cannot feed it (past ≠ total − new), so the relations are read from the graph:

* **batch** and **new**: axes 0 and 1 of the token input (`input_ids`, else the first integer input that is
  neither a mask nor positions);
* **past**: the dynamic axis of the cache inputs that is not the batch;
* **total** = past + new: axis 1 of the attention mask, where its name is neither of those (a mask over the new
  tokens only shares new's name);
* the cache's other dynamic dimensions (GenAI's builder names the head size `kv_cache_dim`): from ONNX Runtime
  GenAI's `genai_config.json` (`head_size`) where it is given, else from `GroupQueryAttention`'s packed
  projection, whose width is (num_heads + 2·kv_num_heads)·head size.

Values: the mask is all ones over past + new; `position_ids` count from past (`past … past + new − 1`);
`seqlens_k` (total − 1 per row) and `total_sequence_length`, where a graph takes them as inputs. A prefill has an
empty past (length 0, a valid ONNX Runtime input), the natural calibration input; a decode step has past > 0.
`GroupQueryAttention` refuses a batch above 1 when there is a past and more than one new token, so such a step
runs at batch 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ...errors import InputError

PAST_WORDS = ("past",)
POSITION_INPUTS = ("position_ids",)
SEQLENS_INPUTS = ("seqlens_k",)
TOTAL_INPUTS = ("total_sequence_length",)
GQA = "GroupQueryAttention"


@dataclass(frozen=True)
class DecodeSignature:
    """What a KV-cache graph takes: the names of its inputs by role and of its dimensions by meaning."""

    tokens: str
    caches: tuple[str, ...]
    batch: str | None
    new: str | None
    past: str
    total: str | None = None
    mask: str | None = None
    positions: str | None = None
    seqlens: str | None = None
    total_length: str | None = None
    fixed: dict[str, int] = field(default_factory=dict)  # other dynamic dims of the cache, resolved
    gqa: bool = False

    def sizes(self, batch: int, new: int, past: int) -> dict[str, int]:
        """Every dimension name this signature knows, for a step of `new` tokens after `past` at `batch`."""
        named = dict(self.fixed)
        named[self.past] = past
        for name, size in ((self.batch, batch), (self.new, new), (self.total, past + new)):
            if name:
                named[name] = size
        return named

    def steps(self, new: int) -> list[tuple[int, int, int]]:
        """(batch, new, past) of the runs that check a rewrite: a prefill (empty past), a decode step (one new
        token after `new`) and several new tokens after a past (batch 1 where GroupQueryAttention needs it)."""
        return [(2, new, 0), (2, 1, new), (1 if self.gqa else 3, 5, 3)]


def describe(batch: int, new: int, past: int) -> str:
    """A step in words: "prefill: batch 2, 16 new tokens, empty past", "decode step: batch 2, 1 new token after
    16", "batch 1, 5 new tokens after 3"."""
    tokens = f"{new} new token{'s' if new != 1 else ''}"
    if past == 0:
        return f"prefill: batch {batch}, {tokens}, empty past"
    return f"{'decode step: ' if new == 1 else ''}batch {batch}, {tokens} after {past}"


def _dims(value: onnx.ValueInfoProto) -> list[str | int | None]:
    return [
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
        for d in value.type.tensor_type.shape.dim
    ]


def _is_float(value: onnx.ValueInfoProto) -> bool:
    return onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).kind == "f"


def run_time_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {i.name for i in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def signature(model: onnx.ModelProto, config: dict | None = None, sized: bool = True) -> DecodeSignature | None:
    """The decode signature of `model` (see the module docstring), or None where it takes no cache or its
    dimensions cannot all be told apart (the caller falls back to the general inputs). With `sized` False,
    a cache's head size left unknown (a part of the graph without its attention) does not matter."""
    inputs = run_time_inputs(model)
    caches = [v for v in inputs if _is_float(v) and any(w in v.name.lower() for w in PAST_WORDS)]
    ints = [v for v in inputs if not _is_float(v) and v.type.tensor_type.elem_type != onnx.TensorProto.BOOL]
    by_name = {v.name: v for v in ints}
    mask = next((v for v in ints if "mask" in v.name.lower()), None)
    positions = next((v for v in ints if v.name in POSITION_INPUTS), None)
    special = {v.name for v in ints if v.name in SEQLENS_INPUTS + TOTAL_INPUTS}
    tokens = by_name.get("input_ids") or next(
        (v for v in ints if v is not mask and v is not positions and v.name not in special), None
    )
    if not caches or tokens is None or len(_dims(tokens)) != 2:
        return None
    batch, new = (d if isinstance(d, str) else None for d in _dims(tokens))
    past_names = {d for v in caches for d in _dims(v)[1:] if isinstance(d, str) and d != batch}
    spans = _dims(mask)[1] if mask is not None and len(_dims(mask)) == 2 else None
    total = spans if isinstance(spans, str) and spans not in (new, batch) else None
    gqa = any(node.op_type == GQA for node in model.graph.node)
    fixed = _head_sizes(model, past_names, config)
    past = past_names - set(fixed) - (set() if sized else _last_axis_only(model, past_names))
    if len(past) != 1 or new is None or new in past_names:
        return None
    return DecodeSignature(
        tokens=tokens.name,
        caches=tuple(v.name for v in caches),
        batch=batch,
        new=new,
        past=past.pop(),
        total=total,
        mask=mask.name if mask is not None else None,
        positions=positions.name if positions is not None else None,
        seqlens=next((n for n in special if n in SEQLENS_INPUTS), None),
        total_length=next((n for n in special if n in TOTAL_INPUTS), None),
        fixed=fixed,
        gqa=gqa,
    )


def _head_sizes(model: onnx.ModelProto, names: set[str], config: dict | None) -> dict[str, int]:
    """The cache's dynamic dimensions that hold the head size (GenAI's `kv_cache_dim`): from the config's
    `head_size`, else from GroupQueryAttention's packed projection. Only names other than the past are meant:
    one dynamic name per cache axis other than batch and past is the head size."""
    last = _last_axis_only(model, names)
    if not last:
        return {}
    head = (config or {}).get("model", {}).get("decoder", {}).get("head_size") or _gqa_head_size(model)
    return {name: int(head) for name in last} if head else {}


def _last_axis_only(model: onnx.ModelProto, names: set[str]) -> set[str]:
    """The dimension names of `names` that the inputs use on axis 3 (a cache's last, the head size) only."""
    axes: dict[str, set[int]] = {}
    for v in run_time_inputs(model):
        for axis, d in enumerate(_dims(v)):
            if isinstance(d, str) and d in names:
                axes.setdefault(d, set()).add(axis)
    return {name for name, at in axes.items() if at == {3}}


def _gqa_head_size(model: onnx.ModelProto) -> int | None:
    """Head size from the first GroupQueryAttention with a packed query-key-value input: its width, read from
    the projection's weight (through an `Add` of a bias), over num_heads + 2·kv_num_heads."""
    producers = {out: node for node in model.graph.node for out in node.output}
    weights = {v.name: _dims(v) for v in model.graph.input if all(isinstance(d, int) for d in _dims(v))}
    weights.update({i.name: list(i.dims) for i in model.graph.initializer})  # a weight may be an input of a copy
    for node in model.graph.node:
        if node.op_type != GQA or (len(node.input) > 1 and node.input[1]):
            continue
        heads = {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")}
        width = _projection_width(node.input[0], producers, weights)
        if width and len(heads) == 2 and width % (heads["num_heads"] + 2 * heads["kv_num_heads"]) == 0:
            return width // (heads["num_heads"] + 2 * heads["kv_num_heads"])
    return None


def _projection_width(tensor: str, producers: dict, weights: dict) -> int | None:
    node = producers.get(tensor)
    for _ in range(4):
        if node is None:
            return None
        if node.op_type in ("MatMul", "Gemm", "MatMulNBits") and node.input[1] in weights:
            dims = weights[node.input[1]]
            if node.op_type == "MatMulNBits":
                return next((a.i for a in node.attribute if a.name == "N"), None)
            transposed = any(a.name == "transB" and a.i for a in node.attribute)
            return dims[0] if transposed else dims[-1]
        if node.op_type == "Add":
            bias = next((i for i in node.input if i in weights), None)
            if bias is not None:
                return weights[bias][-1]
            node = producers.get(node.input[0])
            continue
        node = producers.get(node.input[0]) if node.op_type in ("Cast", "Identity") else None
    return None


def input_shapes(model: onnx.ModelProto, sig: DecodeSignature, batch: int, new: int, past: int) -> dict:
    """The shape of every run-time input of `model` for a step of `new` tokens after `past` at `batch`."""
    named = sig.sizes(batch, new, past)
    shapes = {}
    for v in run_time_inputs(model):
        if v.name == sig.total_length:
            shapes[v.name] = tuple(int(d) for d in _dims(v) if isinstance(d, int))
            continue
        dims = _dims(v)
        shapes[v.name] = tuple(d if isinstance(d, int) else named.get(d or "", 1) for d in dims)
    return shapes


def set_values(sig: DecodeSignature, feeds: dict[str, np.ndarray], past: int) -> dict[str, np.ndarray]:
    """`feeds` with the mask all ones, positions counted from `past`, `seqlens_k` and `total_sequence_length`."""
    new = feeds[sig.tokens].shape[1]
    if sig.mask is not None:
        feeds[sig.mask] = np.ones_like(feeds[sig.mask])
    if sig.positions is not None:
        counted = np.arange(past, past + new, dtype=feeds[sig.positions].dtype)
        feeds[sig.positions] = np.broadcast_to(counted, feeds[sig.positions].shape).copy()
    if sig.seqlens is not None:
        feeds[sig.seqlens] = np.full(feeds[sig.seqlens].shape, past + new - 1, feeds[sig.seqlens].dtype)
    if sig.total_length is not None:
        feeds[sig.total_length] = np.full(feeds[sig.total_length].shape, past + new, feeds[sig.total_length].dtype)
    return feeds


def prefill(model: onnx.ModelProto, sig: DecodeSignature, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`batch` (tokens, maybe a mask) completed into a prefill: an empty cache, positions, the other inputs.

    The mask the data gives is kept (padding stays masked); one is made all ones where the data has none.
    """
    rows, new = batch[sig.tokens].shape
    dtypes = {
        v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) for v in run_time_inputs(model)
    }
    shapes = input_shapes(model, sig, rows, new, 0)
    given = dict(batch)
    made = {name: np.zeros(shape, dtypes[name]) for name, shape in shapes.items() if name not in given}
    feeds = set_values(sig, {**made, **given}, 0)
    feeds.update({name: given[name] for name in (sig.mask, sig.positions) if name in given})
    return feeds


def leaves_out(sig: DecodeSignature | None) -> frozenset[str]:
    """The inputs calibration data may leave out, filled in by `prefill`."""
    if sig is None:
        return frozenset()
    made = (sig.mask, sig.positions, sig.seqlens, sig.total_length) + sig.caches
    return frozenset(name for name in made if name)


def read_config(model_path: str | Path | None) -> dict | None:
    """The `genai_config.json` beside `model_path` whose decoder reads that file, or None."""
    if model_path is None:
        return None
    path = Path(model_path)
    config = path.parent / "genai_config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    decoder = data.get("model", {}).get("decoder", {}) if isinstance(data, dict) else {}
    return data if isinstance(decoder, dict) and decoder.get("filename") == path.name else None


def calibration_batches(
    model: onnx.ModelProto, batches: list[dict[str, np.ndarray]], where: str
) -> list[dict[str, np.ndarray]]:
    """Calibration `batches` for `model`: as they are for a graph without a cache; for a KV-cache graph each
    completed into a prefill (`prefill`), after refusing a batch GroupQueryAttention cannot take (a past with
    more than one new token at a batch above 1) as bad input naming the constraint."""
    sig = signature(model)
    if sig is None:
        return batches
    for index, batch in enumerate(batches):
        rows, new = batch[sig.tokens].shape
        past = next((batch[c].shape for c in sig.caches if c in batch), None)
        past_length = _past_length(model, sig, past)
        if sig.gqa and past_length and new > 1 and rows > 1:
            raise InputError(
                f"{where}: calibration batch {index} has a past of {past_length} tokens and {new} new tokens at batch "
                f"{rows}; GroupQueryAttention takes a past with more than one new token only at batch 1: calibrate on "
                "prefill sequences (leave the past_key_values out, or give them empty) or use --batch-size 1"
            )
    return [prefill(model, sig, batch) if not any(c in batch for c in sig.caches) else batch for batch in batches]


def _past_length(model: onnx.ModelProto, sig: DecodeSignature, shape: tuple | None) -> int:
    if shape is None:
        return 0
    cache = next(v for v in run_time_inputs(model) if v.name == sig.caches[0])
    axis = _dims(cache).index(sig.past)
    return int(shape[axis])


def zero_allowed(model: onnx.ModelProto) -> dict[str, int]:
    """Per cache input of a KV-cache graph, the axis of its past: a length of 0 there is an empty cache."""
    sig = signature(model, sized=False)
    if sig is None:
        return {}
    return {v.name: _dims(v).index(sig.past) for v in run_time_inputs(model) if v.name in sig.caches}
