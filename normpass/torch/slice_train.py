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

Every parameter of the sliced graph trains (its weights, the RMS ops' γ, `basis="layer"`'s shortcuts):
AdamW at `train_lr`, warmed up over the first 5 % of the time and decayed on a cosine to 0 at
`recover_train` seconds (`distill.learning_rate_scale`, on the share of the time spent). Shapes do not
change: the trained graph runs exactly as fast as the untrained one.

Seeded (the batch order follows `seed`). Inside a `torch.distributed` process group (gloo on CPU) the
graph trains under `DistributedDataParallel`, each process on its own batches; every process stops at
the same step and follows the same learning-rate schedule (both by the slowest process's clock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx, nn

from ..calibration import Batch
from ..core.budget import Metrics
from ..core.progress import stage
from ..onnx.slice.driver import SliceOptions
from .distill import _leaves, learning_rate_scale, output_gap
from .replace import _tensors

SCHEDULE_STEPS = 1000  # the learning-rate schedule's resolution over the time limit


@dataclass
class Training:
    """What training did: steps, seconds, the loss at the start and end, the held-out figures around it."""

    seconds: float
    steps: int
    processes: int
    loss_first: float
    loss_last: float
    history: list[dict] = field(default_factory=list)
    held_out_before: Metrics | None = None
    held_out_after: Metrics | None = None

    def describe(self) -> str:
        return f"trained {self.steps} steps in {self.seconds:.0f} s, loss {self.loss_first:.4g} → {self.loss_last:.4g}"

    def to_json(self) -> dict:
        return {
            "method": "distillation toward the original on the fitting data (every parameter, AdamW)",
            "seconds": self.seconds,
            "steps": self.steps,
            "processes": self.processes,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "history": self.history,
            "held_out_before": None if self.held_out_before is None else self.held_out_before.to_json(),
            "held_out_after": None if self.held_out_after is None else self.held_out_after.to_json(),
        }


def _relative_error(student_out, teacher_out, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over outputs of ‖s − t‖² / ‖t‖² (masked positions zeroed in both)."""
    terms = []
    for s, t in zip(_leaves(student_out), _leaves(teacher_out), strict=True):
        if mask is not None and s.dim() >= 2 and s.shape[:2] == mask.shape:
            keep = (mask != 0).reshape(*mask.shape, *([1] * (s.dim() - 2))).to(s.dtype)
            s, t = s * keep, t * keep
        terms.append((s - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-12))
    return torch.stack(terms).mean()


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


def _distributed():
    distributed = torch.distributed
    return distributed if distributed.is_available() and distributed.is_initialized() else None


def train_back(
    teacher: nn.Module, student: fx.GraphModule, batches: list[Batch], mask_input: str | None, options: SliceOptions
) -> Training:
    """Train `student` (in place) toward `teacher` on `batches` for `options.recover_train` seconds."""
    torch.manual_seed(options.seed)
    rng = np.random.default_rng(options.seed)
    data = [_tensors(b) for b in batches]
    targets: dict[int, object] = {}
    parameters = [p for p in student.parameters() if p.is_floating_point()]
    for p in parameters:
        p.requires_grad_(True)
    distributed = _distributed()
    model: nn.Module = student
    if distributed is not None:
        model = nn.parallel.DistributedDataParallel(student)
    optimizer = torch.optim.AdamW(parameters, lr=options.train_lr, weight_decay=0.0)
    limit = float(options.recover_train)
    started = time.perf_counter()
    queue: list[int] = []
    steps, first, last = 0, float("nan"), float("nan")
    history: list[dict] = []
    try:
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
                    targets[index] = teacher(**batch)
            mask = batch.get(mask_input) if mask_input else None
            out = model(**batch)
            loss = _loss(options.train_loss, out, targets[index], mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            last = float(loss.detach())
            first = last if steps == 1 else first
            if steps == 1 or steps % 20 == 0:
                history.append({"step": steps, "seconds": round(time.perf_counter() - started, 2), "loss": last})
            stage(f"slice: training step {steps}, {time.perf_counter() - started:.0f}/{limit:g} s, loss={last:.5f}")
    finally:
        for p in parameters:
            p.requires_grad_(False)
    processes = 1 if distributed is None else distributed.get_world_size()
    return Training(time.perf_counter() - started, steps, processes, first, last, history)
