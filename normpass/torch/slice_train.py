"""Recovery by distillation for a sliced module (`SliceOptions.recover_train`): SliceGPT's recovery
fine-tuning, label-free.

The cut drops what the discarded directions carried, and every layer downstream computes on what is
left; a per-layer least-squares refit (`onnx/slice/recover.py`) cannot restore what the residual path
lost. Here the whole sliced graph is trained toward the original module instead, on the fitting batches
only (the held-out ones stay untouched, for the judge):

    L = mean over outputs ‖s − t‖² / ‖t‖²  +  mean over samples (1 − cos(s, t))      (train_loss "mse")
    L = mean over positions KL(softmax(t) ‖ softmax(s)), over the last axis           (train_loss "kl")

s, t: the sliced graph's and the module's outputs (positions the attention mask drops excluded, as
`distill` excludes them: `output_gap`). "kl" is for logits: it weighs each position's tokens by the
original's probabilities, which is what perplexity sees; "mse" weighs every output value alike.

**Hidden states** (`train_hidden` = w > 0): the cut graph's stream, where each piece's RMS ops read it,
is x̃ ≈ x·Q_k, x the folded graph's stream there and Q_k the piece's kept basis (exactly so at k = d:
slicing at R = 0 is a rotation). So the target of every such state is known, and the loss gains

    w · mean over states ‖x̃ − x·Q_k‖² / ‖x·Q_k‖²

(masked positions excluded): each block is pulled toward the best k-column image of the original's
stream, not only the end.

**Parameters** (`train_params`): "full" trains every parameter of the sliced graph (its weights, the RMS
ops' γ, `basis="layer"`'s shortcuts); "lora" freezes each matrix W and trains W + A·B instead, A: m×r
(Kaiming-uniform), B: r×n (zeros, so training starts at the cut), r = `train_rank`, the vectors (biases,
γ) trained whole; after training A·B is added into W, so the result is the same graph with the same
shapes.

AdamW at `train_lr`, warmed up over the first 5 % of the time and decayed on a cosine to 0 at
`recover_train` seconds (`distill.learning_rate_scale`, on the share of the time spent). Shapes do not
change: the trained graph runs exactly as fast as the untrained one.

Seeded (the batch order and the low-rank factors follow `seed`). Inside a `torch.distributed` process
group (gloo on CPU) the graph trains under `DistributedDataParallel`, each process on its own batches;
every process stops at the same step and follows the same learning-rate schedule (both by the slowest
process's clock).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from ..calibration import Batch
from ..core.budget import Metrics
from ..core.progress import stage
from ..onnx.slice.driver import SliceOptions
from .distill import _leaves, learning_rate_scale, output_gap
from .replace import _tensors

SCHEDULE_STEPS = 1000  # the learning-rate schedule's resolution over the time limit


@dataclass(frozen=True)
class StreamState:
    """A state of the stream in the cut graph: its fx node (named as in the folded graph), the stream's axis
    there, and the kept basis Q_k (d×k) that maps the folded graph's state onto it."""

    node: str
    axis: int
    basis: np.ndarray


@dataclass
class Training:
    """What training did: steps, seconds, the loss at the start and end, the held-out figures around it."""

    seconds: float
    steps: int
    processes: int
    loss_first: float
    loss_last: float
    params: str = "full"
    rank: int | None = None  # with params "lora"
    trained: int = 0  # trainable numbers
    hidden: float = 0.0  # the hidden-state loss's weight
    history: list[dict] = field(default_factory=list)
    held_out_before: Metrics | None = None
    held_out_after: Metrics | None = None

    def describe(self) -> str:
        what = "every parameter" if self.params == "full" else f"rank-{self.rank} updates"
        return (
            f"trained {what} ({self.trained} numbers) {self.steps} steps in {self.seconds:.0f} s, loss "
            f"{self.loss_first:.4g} → {self.loss_last:.4g}"
        )

    def to_json(self) -> dict:
        method = "every parameter" if self.params == "full" else f"rank-{self.rank} updates of each matrix (LoRA)"
        return {
            "method": f"distillation toward the original on the fitting data ({method}, AdamW)",
            "params": self.params,
            "rank": self.rank,
            "trained": self.trained,
            "hidden_weight": self.hidden,
            "seconds": self.seconds,
            "steps": self.steps,
            "processes": self.processes,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "history": self.history,
            "held_out_before": None if self.held_out_before is None else self.held_out_before.to_json(),
            "held_out_after": None if self.held_out_after is None else self.held_out_after.to_json(),
        }


def _kept(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`t` with the positions the mask drops zeroed (where its first two axes are the mask's)."""
    if mask is None or t.dim() < 2 or t.shape[:2] != mask.shape:
        return t
    return t * (mask != 0).reshape(*mask.shape, *([1] * (t.dim() - 2))).to(t.dtype)


def _relative(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """‖s − t‖² / ‖t‖² over the positions the mask keeps."""
    s, t = _kept(s, mask), _kept(t, mask)
    return (s - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-12)


def _relative_error(student_out, teacher_out, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over outputs of ‖s − t‖² / ‖t‖² (masked positions zeroed in both)."""
    pairs = zip(_leaves(student_out), _leaves(teacher_out), strict=True)
    return torch.stack([_relative(s, t, mask) for s, t in pairs]).mean()


def _divergence(student_out, teacher_out, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over outputs and positions of KL(softmax(t) ‖ softmax(s)) along the last axis."""
    terms = []
    for s, t in zip(_leaves(student_out), _leaves(teacher_out), strict=True):
        kl = torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        if mask is not None and kl.shape == mask.shape:
            keep = (mask != 0).to(kl.dtype)
            terms.append((kl * keep).sum() / keep.sum().clamp_min(1))
        else:
            terms.append(kl.mean())
    return torch.stack(terms).mean()


def _loss(kind: str, student_out, teacher_out, mask: torch.Tensor | None) -> torch.Tensor:
    if kind == "kl":
        return _divergence(student_out, teacher_out, mask)
    return _relative_error(student_out, teacher_out, mask) + output_gap(student_out, teacher_out, mask)


def hidden_error(got: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], states: list[StreamState], mask):
    """Mean over `states` of ‖x̃ − x·Q_k‖² / ‖x·Q_k‖²: `got` the cut graph's states x̃, `wanted` the projected
    targets x·Q_k (`project`), both with the stream's axis last."""
    terms = [_relative(got[s.node].movedim(s.axis, -1), wanted[s.node], mask) for s in states]
    return torch.stack(terms).mean()


def project(found: dict[str, torch.Tensor], states: list[StreamState]) -> dict[str, torch.Tensor]:
    """x·Q_k of each folded-graph state x (the stream's axis moved last)."""
    return {s.node: found[s.node].movedim(s.axis, -1) @ torch.as_tensor(s.basis, dtype=torch.float32) for s in states}


class _Tap(nn.Module):
    """Stores what it is given (with its gradient) under `key`; passes nothing on."""

    def __init__(self, store: dict, key: str):
        super().__init__()
        self.store, self.key = store, key

    def forward(self, x: torch.Tensor) -> None:
        self.store[self.key] = x


@contextlib.contextmanager
def tapped(graph: fx.GraphModule, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """`graph` (in place) storing the values of its nodes `names` on each call, in the yielded dict; the taps
    leave the graph on exit."""
    store: dict[str, torch.Tensor] = {}
    nodes = {n.name: n for n in graph.graph.nodes}
    taps = []
    for i, name in enumerate(names):
        label = f"normpass_train_tap_{i}"
        graph.add_submodule(label, _Tap(store, name))
        with graph.graph.inserting_after(nodes[name]):
            taps.append(graph.graph.call_module(label, (nodes[name],)))
    graph.recompile()
    try:
        yield store
    finally:
        for i, tap in enumerate(taps):
            graph.graph.erase_node(tap)
            graph.delete_submodule(f"normpass_train_tap_{i}")
        graph.recompile()


class _LowRank(nn.Module):
    """W ↦ W + A·B (a parametrization: `owner.W` reads the sum; A, B train, W does not)."""

    def __init__(self, shape: torch.Size, rank: int):
        super().__init__()
        self.a = nn.Parameter(torch.empty(shape[0], rank))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.b = nn.Parameter(torch.zeros(rank, shape[1]))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.a @ self.b


@contextlib.contextmanager
def trainable(graph: fx.GraphModule, params: str, rank: int) -> Iterator[list[nn.Parameter]]:
    """The parameters to train: every float one ("full"), or a `_LowRank` update of each matrix and every
    vector whole ("lora"). On exit the updates are added into their matrices (same names, same shapes) and
    nothing requires a gradient."""
    floating = [(n, p) for n, p in graph.named_parameters() if p.is_floating_point()]
    wrapped: list[tuple[nn.Module, str]] = []
    chosen = [p for _, p in floating]
    if params == "lora":
        chosen = [p for _, p in floating if p.dim() != 2]
        for name, p in floating:
            if p.dim() == 2:
                owner, _, attr = name.rpartition(".")
                module, update = graph.get_submodule(owner), _LowRank(p.shape, rank)
                parametrize.register_parametrization(module, attr, update)
                wrapped.append((module, attr))
                chosen += [update.a, update.b]
    for p in chosen:
        p.requires_grad_(True)
    try:
        yield chosen
    finally:
        for module, attr in wrapped:
            parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
        for p in graph.parameters():
            p.requires_grad_(False)


def _distributed():
    distributed = torch.distributed
    return distributed if distributed.is_available() and distributed.is_initialized() else None


def train_back(
    teacher: nn.Module,
    student: fx.GraphModule,
    batches: list[Batch],
    mask_input: str | None,
    options: SliceOptions,
    states: list[StreamState] | None = None,
    reference: fx.GraphModule | None = None,
) -> Training:
    """Train `student` (in place) toward `teacher` on `batches` for `options.recover_train` seconds; with
    `options.train_hidden`, also its `states` toward those of `reference` (the folded graph the cut started
    from, its nodes named as the student's) projected on each state's basis."""
    torch.manual_seed(options.seed)
    rng = np.random.default_rng(options.seed)
    data = [_tensors(b) for b in batches]
    states = states if options.train_hidden and states else []
    names = list(dict.fromkeys(s.node for s in states))
    targets: dict[int, tuple] = {}
    limit = float(options.recover_train)
    started = time.perf_counter()
    queue: list[int] = []
    steps, first, last = 0, float("nan"), float("nan")
    history: list[dict] = []
    reading: contextlib.AbstractContextManager[dict[str, torch.Tensor]] = contextlib.nullcontext({})
    if states:
        assert reference is not None, "hidden states need the folded graph they are read from"
        reference = copy.deepcopy(reference)  # a copy: the captured graph's own checks its inputs' form
        reading = tapped(reference, names)
    with (  # taps first: a graph recompiled while parametrized calls itself (`trainable` changes its class)
        tapped(student, names) as found,
        trainable(student, options.train_params, options.train_rank) as parameters,
        reading as theirs,
    ):
        distributed = _distributed()
        model: nn.Module = student
        if distributed is not None:
            model = nn.parallel.DistributedDataParallel(student)
        optimizer = torch.optim.AdamW(parameters, lr=options.train_lr, weight_decay=0.0)
        while True:
            clock = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            if distributed is not None:  # one clock for all: the same schedule and the same last step
                distributed.all_reduce(clock, op=distributed.ReduceOp.MAX)
            elapsed = float(clock.item())
            if elapsed >= limit:
                break
            scale = learning_rate_scale(int(SCHEDULE_STEPS * elapsed / limit), SCHEDULE_STEPS)
            for group in optimizer.param_groups:
                group["lr"] = options.train_lr * scale
            if not queue:
                queue = list(rng.permutation(len(data)))
            index = int(queue.pop())
            batch = data[index]
            if index not in targets:
                with torch.no_grad():
                    outputs = teacher(**batch)
                    if states:
                        assert reference is not None
                        reference(**batch)
                    targets[index] = outputs, project(theirs, states)
            mask = batch.get(mask_input) if mask_input else None
            out = model(**batch)
            wanted, projected = targets[index]
            loss = _loss(options.train_loss, out, wanted, mask)
            if states:
                loss = loss + options.train_hidden * hidden_error(found, projected, states, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            last = float(loss.detach())
            first = last if steps == 1 else first
            if steps == 1 or steps % 20 == 0:
                history.append({"step": steps, "seconds": round(time.perf_counter() - started, 2), "loss": last})
            stage(f"slice: training step {steps}, {time.perf_counter() - started:.0f}/{limit:g} s, loss={last:.5f}")
        trained = sum(p.numel() for p in parameters)
    processes = 1 if distributed is None else distributed.get_world_size()
    rank = options.train_rank if options.train_params == "lora" else None
    return Training(
        time.perf_counter() - started,
        steps,
        processes,
        first,
        last,
        options.train_params,
        rank,
        trained,
        options.train_hidden if states else 0.0,
        history,
    )
