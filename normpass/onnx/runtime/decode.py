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
* the cache's head size where it is a dynamic dimension (GenAI's builder names it `kv_cache_dim`): from
  `GroupQueryAttention`'s inputs, where the graph shows their widths: a packed query-key-value projection is
  (num_heads + 2·kv_num_heads)·head size wide, a separate value kv_num_heads·head size (a key or query read
  through per-head norms, as Qwen-3's, is reshaped back to its width); else from ONNX Runtime GenAI's
  `genai_config.json` beside the model (`head_size`);
* a sliding-window cache (`GroupQueryAttention` with `sliding_window_cache` 1: Gemma-2's local layers, whose
  past is `past_sliding_length`): a buffer of fixed capacity that must hold the window (`local_window_size`);
  the mask says how much of it is filled, so it is given the window's length at every step.

Values: the mask is all ones over past + new; `position_ids` count from past (`past … past + new − 1`);
`seqlens_k` (total − 1 per row) and `total_sequence_length`, where a graph takes them as inputs. A prefill has an
empty past (length 0, a valid ONNX Runtime input), the natural calibration input; a decode step has past > 0.
`GroupQueryAttention` refuses a batch above 1 when there is a past and more than one new token, so such a step
runs at batch 1.
"""

from __future__ import annotations

import json
import os
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
    fixed = _head_sizes(model, past_names, config) | _window_capacities(model, past_names)
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
    """The cache's dynamic dimensions that hold the head size (GenAI's `kv_cache_dim`): from the graph
    (`_gqa_head_size`), else from the config's `head_size`. Only names other than the past are meant: one
    dynamic name per cache axis other than batch and past is the head size."""
    last = _last_axis_only(model, names)
    if not last:
        return {}
    head = _gqa_head_size(model) or (config or {}).get("model", {}).get("decoder", {}).get("head_size")
    return {name: int(head) for name in last} if head else {}


def _last_axis_only(model: onnx.ModelProto, names: set[str]) -> set[str]:
    """The dimension names of `names` that the inputs use on axis 3 (a cache's last, the head size) only."""
    axes: dict[str, set[int]] = {}
    for v in run_time_inputs(model):
        for axis, d in enumerate(_dims(v)):
            if isinstance(d, str) and d in names:
                axes.setdefault(d, set()).add(axis)
    return {name for name, at in axes.items() if at == {3}}


def _attributes(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _window_capacities(model: onnx.ModelProto, names: set[str]) -> dict[str, int]:
    """The past dimensions of `names` that only sliding-window caches use (axis 2 of the caches a
    GroupQueryAttention with `sliding_window_cache` 1 reads), each sized to the largest window reading it:
    ONNX Runtime takes such a cache at a capacity of the window or more, the mask telling what is filled."""
    dims = {v.name: _dims(v) for v in run_time_inputs(model)}
    windows: dict[str, int] = {}
    unbounded: set[str] = set()
    for node in model.graph.node:
        if node.op_type != GQA:
            continue
        attrs = _attributes(node)
        window = attrs.get("local_window_size", -1) if attrs.get("sliding_window_cache") == 1 else -1
        for cache in node.input[3:5]:
            shape = dims.get(cache)
            name = shape[2] if shape is not None and len(shape) == 4 else None
            if not isinstance(name, str) or name not in names:
                continue
            if window > 0:
                windows[name] = max(windows.get(name, 0), window)
            else:
                unbounded.add(name)
    return {name: size for name, size in windows.items() if name not in unbounded}


def _gqa_head_size(model: onnx.ModelProto) -> int | None:
    """Head size from the first GroupQueryAttention whose inputs' widths the graph shows (`_width`): a packed
    query-key-value input over num_heads + 2·kv_num_heads, else its value, key or query input over its
    head count."""
    producers = {out: node for node in model.graph.node for out in node.output}
    weights = {v.name: _dims(v) for v in model.graph.input if all(isinstance(d, int) for d in _dims(v))}
    weights.update({i.name: list(i.dims) for i in model.graph.initializer})  # a weight may be an input of a copy
    constants = _small_integers(model)
    for node in model.graph.node:
        if node.op_type != GQA:
            continue
        attrs = _attributes(node)
        if "num_heads" not in attrs or "kv_num_heads" not in attrs:
            continue
        heads, kv = attrs["num_heads"], attrs["kv_num_heads"]
        packed = len(node.input) < 2 or not node.input[1]
        for index, count in [(0, heads + 2 * kv)] if packed else [(2, kv), (1, kv), (0, heads)]:
            width = _width(node.input[index], producers, weights, constants)
            if width and count and width % count == 0:
                return width // count
    return None


def _small_integers(model: onnx.ModelProto) -> dict[str, list[int]]:
    """The values of the graph's small integer constants held in the model (a `Split`'s sizes, a `Reshape`'s
    shape): initializers with their data inline, and `Constant` nodes."""
    found: dict[str, list[int]] = {}
    tensors = [(i.name, i) for i in model.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL]
    tensors += [
        (node.output[0], a.t)
        for node in model.graph.node
        if node.op_type == "Constant"
        for a in node.attribute
        if a.name == "value"
    ]
    for name, tensor in tensors:
        if tensor.data_type == onnx.TensorProto.INT64 and len(tensor.dims) <= 1 and int(np.prod(tensor.dims)) <= 8:
            found[name] = [int(v) for v in onnx.numpy_helper.to_array(tensor).reshape(-1)]
    return found


def _width(tensor: str, producers: dict, weights: dict, constants: dict, depth: int = 6) -> int | None:
    """The last-axis width of `tensor` where the graph shows it: a projection's weight (through an `Add` of a
    bias, a `Cast`), a `Split` along the last axis with its sizes, a `Reshape` to a shape whose last entry is
    given; None otherwise."""
    node = producers.get(tensor)
    if node is None or depth == 0:
        return None
    if node.op_type in ("MatMul", "Gemm", "MatMulNBits") and node.input[1] in weights:
        if node.op_type == "MatMulNBits":
            return next((a.i for a in node.attribute if a.name == "N"), None)
        dims = weights[node.input[1]]
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
        return dims[0] if transposed else dims[-1]
    if node.op_type == "Add":
        bias = next((i for i in node.input if i in weights), None)
        if bias is not None:
            return weights[bias][-1]
    if node.op_type == "Split" and _attributes(node).get("axis", 0) == -1:
        sizes = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        sizes = sizes or next((list(a.ints) for a in node.attribute if a.name == "split"), None)
        return sizes[list(node.output).index(tensor)] if sizes and len(sizes) == len(node.output) else None
    if node.op_type == "Reshape":
        shape = constants.get(node.input[1])
        return shape[-1] if shape and shape[-1] > 0 else None
    if node.op_type in ("Add", "Cast", "Identity"):
        return _width(node.input[0], producers, weights, constants, depth - 1)
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


def read_config(model_path: object) -> dict | None:
    """The `genai_config.json` beside `model_path` whose decoder reads that file, or None (also where the model
    is not a path: an in-memory model has no folder)."""
    if not isinstance(model_path, (str, os.PathLike)):
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
    model: onnx.ModelProto, batches: list[dict[str, np.ndarray]], where: str, config: dict | None = None
) -> list[dict[str, np.ndarray]]:
    """Calibration `batches` for `model`: as they are for a graph without a cache; for a KV-cache graph each
    completed into a prefill (`prefill`; `config`: the GenAI config beside the model, for a size the graph does
    not show), after refusing a batch GroupQueryAttention cannot take (a past with more than one new token at a
    batch above 1) as bad input naming the constraint."""
    sig = signature(model, config)
    if sig is None:
        _refuse_unsized(model, batches, where)
        return batches
    for index, batch in enumerate(batches):
        rows, new = batch[sig.tokens].shape
        past_length = _past_length(model, sig, batch)
        if sig.gqa and past_length and new > 1 and rows > 1:
            raise InputError(
                f"{where}: calibration batch {index} has a past of {past_length} tokens and {new} new tokens at batch "
                f"{rows}; GroupQueryAttention takes a past with more than one new token only at batch 1: calibrate on "
                "prefill sequences (leave the past_key_values out, or give them empty) or use --batch-size 1"
            )
    return [prefill(model, sig, batch) if not any(c in batch for c in sig.caches) else batch for batch in batches]


def _refuse_unsized(model: onnx.ModelProto, batches: list[dict[str, np.ndarray]], where: str) -> None:
    """Refuse batches without a cache for a KV-cache graph whose cache has a head size nothing gives."""
    sig = signature(model, sized=False)
    if sig is None or all(any(c in batch for c in sig.caches) for batch in batches):
        return
    caches = [v for v in run_time_inputs(model) if v.name in sig.caches]
    unsized = sorted({d for v in caches for d in _dims(v)[3:] if isinstance(d, str)})
    raise InputError(
        f"{where}: the model's cache ({sig.caches[0]}, …) has a head size ({', '.join(unsized)}) that "
        "neither its GroupQueryAttention's inputs nor a genai_config.json beside the model give (model.decoder."
        "head_size), so an empty cache cannot be made; give the past_key_values in an .npz (a past of length 0 is "
        "fine), or keep the model in its GenAI folder"
    )


def _past_axes(model: onnx.ModelProto, sig: DecodeSignature) -> dict[str, int]:
    """Per cache input whose past is the signature's (not a sliding window's buffer), the axis of that past."""
    caches = [v for v in run_time_inputs(model) if v.name in sig.caches]
    return {v.name: _dims(v).index(sig.past) for v in caches if sig.past in _dims(v)}


def _past_length(model: onnx.ModelProto, sig: DecodeSignature, batch: dict[str, np.ndarray]) -> int:
    """The past length of `batch`'s cache, 0 where it gives none."""
    given = [(name, axis) for name, axis in _past_axes(model, sig).items() if name in batch]
    return int(batch[given[0][0]].shape[given[0][1]]) if given else 0


def zero_allowed(model: onnx.ModelProto) -> dict[str, int]:
    """Per cache input of a KV-cache graph, the axis of its past: a length of 0 there is an empty cache."""
    sig = signature(model, sized=False)
    return {} if sig is None else _past_axes(model, sig)
