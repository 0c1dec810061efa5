"""Label-free distillation into a norm-free student: `normpass.distill`.

    student, report = normpass.distill(model, calibration, DistillOptions(budget="cos=0.99"))

The original module is the teacher, the calibration inputs are the data; there are no labels.

1. **Start** (`torch/replace.prepare`, the surrogate pass's own front end): the module folded exactly,
   its remaining norms the candidates. The calibration samples are split (seeded) into *train*
   (gradient steps; the first `calibration_samples` of them also calibrate), *decide* (the budget
   stop and which norms to keep) and *test* (the report's figures and the gate; nothing decides on
   it), or test is `holdout`.
2. **Which norms to keep.** Each candidate's damage alone on decide (its calibrated surrogate,
   nothing trained; `core/replace.candidate_pool`) orders them; `keep` (names, or a count of the
   most damaging) stay norms from the start, and every round that ends missing the budget on
   decide keeps the most damaging norm still replaced, then trains on (at most `rounds` rounds).
3. **The student**: the replaced norms' surrogates (reduction-free: affine, scalebias, dyt, derf)
   calibrated sequentially (DaMN; `core/replace.Search`), every term in its module
   (`migrate_affine=False`), each blended with its norm, `SmoothRemoval`: α·N(x) + (1 − α)·S(x).
4. **Training** (AdamW; learning rate warmed up over the first 5 % of a round's steps, then a cosine
   decay to 0): in the first round α goes linearly from 1 to 0 over the first `ramp` of the steps
   (DaMN's smooth removal: no norm is cut out cold), then stays 0. Loss per batch, over the tokens
   the attention mask keeps (all tokens without one)::

       L = (1/K) Σ_k mean‖s_k − t_k‖² / v_k  +  w · mean over samples (1 − cos(f_s, f_t))

   s_k, t_k: the student's and teacher's outputs at candidate norm k (K of them), v_k the
   teacher's mean per-feature variance there (on the first training batches); f the module's
   outputs, flattened per sample; w = `output_weight`. The teacher is the exactly folded module
   (the original's function, verified by `fold`). Parameters trained (`train`): "surrogates"
   only; "linears" (the default): also every `nn.Linear` and the kept norms; "all": every
   parameter but the replaced norms' own γ/β, which no longer reach the output.
5. **Stop.** Once α is 0, every `eval_every` steps (and at a round's end) the student is judged on
   decide; the round stops when it keeps the budget there within `margin`. `time_limit` seconds
   end training early (the report says so).
6. **Emission**: every blend leaves for its surrogate, whose trained terms become the core's
   `Surrogate` and are emitted into the trained module by `torch/replace.emit`, as `replace`
   writes them (c, γ, β migrated into adjacent layers where exact); the result is verified
   against the unmigrated student (fp32 rounding only).
7. **Gate** on test: the emitted student against the original. A miss raises `BudgetMissed`,
   which carries the report (and the student, for inspection).

Seeded: the splits, the batch order and the initial state follow `seed`; the same seed on the
same machine and thread count gives the same weights.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import __version__
from ..calibration import Batch, sample_count
from ..core.budget import Budget, Metrics
from ..core.progress import stage
from ..core.replace import BudgetMissed, Candidate, ReplaceOptions, ReplaceReport, Search, candidate_pool
from ..errors import InputError, VerificationError
from ..onnx.runtime.verify import compare_outputs
from .replace import Prepared, _run, _set_module, _tensors, emit, prepare
from .surrogates import SmoothRemoval, smooth_removal, surrogate_modules, surrogate_norm

REDUCTION_FREE = ("affine", "scalebias", "dyt", "derf")
TRAINED = ("surrogates", "linears", "all")
WARMUP = 0.05  # share of a round's steps over which the learning rate rises to its value


@dataclass
class DistillOptions:
    """Options of `distill` (the CLI flag in brackets)."""

    kind: str = "affine"  # affine | scalebias | dyt | derf  [--with]
    budget: Budget | str = "cos=0.99"
    split: tuple[float, float, float] = (0.7, 0.15, 0.15)  # train, decide, test  [--split]
    holdout: object = None  # test data from elsewhere  [--holdout]
    keep: tuple[str, ...] | int = 0  # norms kept from the start: names, or the count of the most damaging  [--keep]
    all_norms: bool = False  # the norms the exact pass folds are candidates too  [--all-norms]
    rounds: int = 3  # training rounds; each after the first keeps one more norm  [--rounds]
    steps: int = 300  # optimizer steps per round  [--steps]
    ramp: float = 0.3  # share of the first round's steps over which α goes 1 → 0  [--ramp]
    train: str = "linears"  # surrogates | linears | all  [--train]
    lr: float = 5e-5  # the module's own parameters  [--lr]
    lr_surrogates: float = 1e-3  # the surrogates' parameters  [--lr-surrogates]
    output_weight: float = 10.0  # w of the output term of the loss
    eval_every: int = 25  # steps between checks on decide, once α is 0  [--eval-every]
    margin: float = 1.0  # share of the budget's allowance the decide split may use  [--margin]
    calibration_samples: int = 256  # training samples the sequential calibration uses
    time_limit: float | None = None  # seconds of training at most  [--time-limit]
    batch_size: int = 16  # [--batch-size]
    tokenizer: str | None = None  # for .txt / .jsonl calibration files  [--tokenizer]
    max_length: int = 128  # [--max-length]
    mask_input: str | None = None  # [--mask-input]
    seed: int = 0  # [--seed]
    progress: bool = False  # one updating line on stderr  [--progress]
    device: str = "cpu"  # where the student trains and is judged: cpu, cuda, cuda:N  [--device]

    def torch_device(self) -> torch.device:
        """The training device, checked: a CUDA device must exist."""
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise InputError(f"device {self.device!r}: give cpu, cuda or cuda:N") from e
        if device.type not in ("cpu", "cuda"):
            raise InputError(f"device {self.device!r}: give cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device {self.device!r}: this PyTorch sees no CUDA device (torch.cuda.is_available())")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise InputError(f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return device

    def replace_options(self) -> ReplaceOptions:
        """The surrogate pass's options for the start (step 1): roles fit/select/test, no check split."""
        if self.kind not in REDUCTION_FREE:
            raise InputError(
                f"kind {self.kind!r}: distill trains reduction-free surrogates; "
                f"choose one of {', '.join(REDUCTION_FREE)}"
            )
        if self.train not in TRAINED:
            raise InputError(f"train {self.train!r}: choose one of {', '.join(TRAINED)}")
        for name in ("steps", "rounds", "eval_every", "calibration_samples", "batch_size"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} {getattr(self, name)}: must be at least 1")
        if not 0 <= self.ramp < 1:
            raise InputError(f"ramp {self.ramp}: the share of the steps must be in [0, 1)")
        if not self.lr >= 0:
            raise InputError(f"lr {self.lr}: must be ≥ 0")
        for name in ("lr_surrogates", "margin"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name} {getattr(self, name)}: must be > 0")
        if isinstance(self.keep, int) and self.keep < 0:
            raise InputError(f"keep {self.keep}: give a count ≥ 0 or norm names")
        if self.time_limit is not None and not self.time_limit > 0:
            raise InputError(f"time_limit {self.time_limit:g}: give seconds > 0")
        return ReplaceOptions(
            kind=self.kind,
            budget=self.budget,
            split=self.split,
            check=0.0,
            holdout=self.holdout,
            migrate_affine=False,
            all_norms=self.all_norms,
            batch_size=self.batch_size,
            tokenizer=self.tokenizer,
            max_length=self.max_length,
            mask_input=self.mask_input,
            seed=self.seed,
            progress=self.progress,
        )


@dataclass
class DistillReport(ReplaceReport):
    """What `distill` did: `to_json()` is the `--report` file (rounds, the decide and test figures,
    every norm's decision); `surrogates` the trained surrogates before migration."""


# --- the student ---------------------------------------------------------------------------------


def damage_order(search: Search, kind: str) -> list[Candidate]:
    """Every candidate norm's calibrated surrogate alone, judged on decide, most damaging first."""
    pool = candidate_pool(search, (kind,), cost_rule="no dearer")
    found = [c for candidates in pool.values() for c in candidates if c.alone is not None]
    return sorted(found, key=lambda c: (-c.usage, search.index[c.norm]))


def initial_keep(keep: tuple[str, ...] | int, ranked: list[str]) -> list[str]:
    """The norms kept from the start: the names given (each a candidate), or the `keep` most damaging."""
    if isinstance(keep, int):
        return ranked[:keep]
    unknown = sorted(set(keep) - set(ranked))
    if unknown:
        raise InputError(f"keep: no candidate norm {', '.join(unknown)} (candidates: {', '.join(ranked)})")
    return [n for n in ranked if n in keep]


def build_student(p: Prepared, kind: str, replaced: list[str]) -> tuple[nn.Module, dict[str, SmoothRemoval]]:
    """The base with every norm of `replaced` blended into its sequentially calibrated surrogate (α = 1)."""
    bench, search = p.bench, p.search
    surrogates = search.materialize(tuple((n, kind) for n in replaced))
    student, _ = emit(bench.base, bench.tg, surrogates, migrate=False)
    blends = smooth_removal(student, bench.base)
    paths = {bench.by_name[n].ref.module: n for n in replaced}
    by_norm = {paths[path]: blend for path, blend in _blends(student)}
    assert set(by_norm) == set(replaced) and len(blends) == len(replaced)
    return student, by_norm


def _blends(module: nn.Module):
    return [(path, m) for path, m in module.named_modules() if isinstance(m, SmoothRemoval)]


def trainable(student: nn.Module, train: str) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the module's parameters that train, the surrogates' parameters), per `DistillOptions.train`."""
    surrogate = [q for _, m in surrogate_modules(student) for q in m.parameters()]
    gone = {id(q) for _, blend in _blends(student) for q in blend.norm.parameters()}
    taken = gone | {id(q) for q in surrogate}
    if train == "surrogates":
        body: list[nn.Parameter] = []
    elif train == "linears":
        linears = [m for m in student.modules() if isinstance(m, nn.Linear)]
        norms = [m for m in student.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]
        body = [q for m in linears + norms for q in m.parameters() if id(q) not in taken]
    else:
        body = [q for q in student.parameters() if id(q) not in taken]
    unique = list({id(q): q for q in body}.values())  # tied parameters once
    return unique, surrogate


# --- the loss ------------------------------------------------------------------------------------


class Positions:
    """Forward hooks collecting a module's outputs at the candidate norms' paths, by norm name."""

    def __init__(self, module: nn.Module, paths: dict[str, str]):
        self.out: dict[str, torch.Tensor] = {}
        self.handles = [
            module.get_submodule(path).register_forward_hook(self._hook(name)) for name, path in paths.items()
        ]

    def _hook(self, name: str):
        def hook(_module, _args, output):
            self.out[name] = output

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The feature rows of `x` ([..., d]) that the mask keeps (every row without a fitting mask)."""
    if mask is not None and x.dim() == mask.dim() + 1 and x.shape[:-1] == mask.shape:
        return x[mask != 0]
    return x.reshape(-1, x.shape[-1])


def _leaves(output) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def output_gap(student_out, teacher_out, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over samples and float outputs of 1 − cos(f_s, f_t), each output flattened per sample
    (positions the mask drops zeroed). Integer outputs (ids) have no gradient: they are left out here and
    judged by the budget's agreement (`core/budget.compare`); with none left the gap is 0."""
    gaps = []
    for s, t in zip(_leaves(student_out), _leaves(teacher_out), strict=True):
        if not s.is_floating_point():
            continue
        if mask is not None and s.dim() >= 2 and s.shape[:2] == mask.shape:
            keep = (mask != 0).reshape(*mask.shape, *([1] * (s.dim() - 2))).to(s.dtype)
            s, t = s * keep, t * keep
        s, t = (
            s.reshape(s.shape[0], -1) if s.dim() else s.reshape(1, 1),
            t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1),
        )
        gaps.append(1 - torch.nn.functional.cosine_similarity(s, t, dim=1, eps=1e-12))
    return torch.cat(gaps).mean() if gaps else torch.zeros(())


# --- training ------------------------------------------------------------------------------------


@dataclass
class Round:
    kept: list[str]
    steps: int = 0
    stopped: str = ""
    history: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"kept": list(self.kept), "steps": self.steps, "stopped": self.stopped, "history": self.history}


def learning_rate_scale(step: int, steps: int) -> float:
    """Linear warm-up over `WARMUP` of the steps, then a cosine decay to 0."""
    warm = max(1, int(WARMUP * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


class Trainer:
    """Rounds of AdamW on the student against the teacher (steps 4 and 5 of the module docstring)."""

    def __init__(self, p: Prepared, options: DistillOptions, train: list[Batch], budget: Budget, device: torch.device):
        self.p, self.options, self.budget = p, options, budget
        self.teacher = p.bench.base
        self.train = [_tensors(b, device) for b in train]
        self.mask_input = p.bench.mask_input
        self.paths = {n.name: n.ref.module for n in p.bench.norms}
        self.rng = np.random.default_rng(options.seed)
        self.queue: list[int] = []
        self.started = time.perf_counter()
        self.variance = self._variance()

    def _mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        return batch.get(self.mask_input) if self.mask_input else None

    def _variance(self) -> dict[str, float]:
        """v_k: the teacher's mean per-feature variance at each candidate norm (first training batches)."""
        positions = Positions(self.teacher, self.paths)
        rows: dict[str, list[torch.Tensor]] = {n: [] for n in self.paths}
        try:
            with torch.no_grad():
                for batch in self.train[: max(1, 256 // self.options.batch_size)]:
                    self.teacher(**batch)
                    for name, out in positions.out.items():
                        rows[name].append(_rows(out, self._mask(batch)).double())
        finally:
            positions.remove()
        return {n: max(float(torch.cat(r).var(0).mean()), 1e-12) for n, r in rows.items()}

    def _next_batch(self) -> dict[str, torch.Tensor]:
        if not self.queue:
            self.queue = list(self.rng.permutation(len(self.train)))
        return self.train[self.queue.pop()]

    def judge(self, student: nn.Module, split: str = "select") -> Metrics:
        """The student (α as it is) against the original on a split."""
        search = self.p.search
        return search.judge(split, [_run(student, b) for b in search.splits.batches[split]])

    def out_of_time(self) -> bool:
        limit = self.options.time_limit
        return limit is not None and time.perf_counter() - self.started > limit

    def run_round(self, student: nn.Module, blends: dict[str, SmoothRemoval], ramp: float, record: Round) -> bool:
        """One round of at most `steps` steps; True when the budget holds on decide at its end."""
        o = self.options
        body, surrogate = trainable(student, o.train)
        student.requires_grad_(False)
        for q in body + surrogate:
            q.requires_grad_(True)
        groups = [{"params": surrogate, "lr": o.lr_surrogates}]
        if body and o.lr > 0:
            groups.append({"params": body, "lr": o.lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
        rates = [g["lr"] for g in optimizer.param_groups]
        ramp_steps = int(ramp * o.steps)
        teacher_at = Positions(self.teacher, self.paths)
        student_at = Positions(student, self.paths)
        holds, figure = False, ""
        try:
            for step in range(o.steps):
                alpha = max(0.0, 1.0 - step / ramp_steps) if ramp_steps else 0.0
                for blend in blends.values():
                    blend.alpha.fill_(alpha)
                for group, rate in zip(optimizer.param_groups, rates, strict=True):
                    group["lr"] = rate * learning_rate_scale(step, o.steps)
                batch = self._next_batch()
                mask = self._mask(batch)
                with torch.no_grad():
                    teacher_out = self.teacher(**batch)
                student_out = student(**batch)
                hidden = sum(
                    (_rows(student_at.out[n], mask) - _rows(teacher_at.out[n], mask)).pow(2).mean() / self.variance[n]
                    for n in self.paths
                )
                loss = hidden / len(self.paths) + o.output_weight * output_gap(student_out, teacher_out, mask)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                record.steps = step + 1
                last = step + 1 == o.steps or self.out_of_time()
                if alpha == 0 and ((step + 1) % o.eval_every == 0 or last):
                    metrics = self.judge(student)
                    usage = self.budget.usage(metrics)
                    holds = usage <= o.margin
                    figure = f"decide {metrics.describe()}"
                    record.history.append(
                        {"step": step + 1, "loss": round(float(loss.detach()), 6), "decide": metrics.to_json()}
                    )
                self._show(len(record.kept), step + 1, alpha, float(loss.detach()), figure)
                if alpha == 0 and holds:
                    record.stopped = "the budget holds on the decide split"
                    break
                if self.out_of_time():
                    record.stopped = f"time limit ({o.time_limit:g} s)"
                    break
            else:
                record.stopped = "steps done"
        finally:
            teacher_at.remove()
            student_at.remove()
            student.requires_grad_(False)
        return holds

    def _show(self, kept: int, step: int, alpha: float, loss: float, figure: str) -> None:
        line = f"distill: {kept} kept, step {step}/{self.options.steps} α={alpha:.2f} loss={loss:.4f} {figure}"
        stage(line)
        if self.options.progress:
            print(f"\r{line:<100}", end="", file=sys.stderr, flush=True)


def keep_norm(student: nn.Module, blends: dict[str, SmoothRemoval], name: str, path: str) -> None:
    """Put `name`'s norm back in the student (it stays a norm from now on)."""
    blend = blends.pop(name)
    _set_module(student, path, blend.norm)


# --- emission ------------------------------------------------------------------------------------


def trained_base(base: nn.Module, student: nn.Module) -> nn.Module:
    """A copy of `base` carrying every trained parameter and buffer of `student` at the same key
    (the replaced norms' keys differ: they keep `base`'s, which emission removes)."""
    trained = copy.deepcopy(base)
    learned = student.state_dict()
    state = trained.state_dict()
    trained.load_state_dict({k: learned.get(k, v) for k, v in state.items()})
    return trained


def unwrap(student: nn.Module) -> nn.Module:
    """The student with every blend replaced by its surrogate (what the blends compute at α = 0)."""
    plain = copy.deepcopy(student)
    for path, blend in _blends(plain):
        _set_module(plain, path, blend.surrogate)
    return plain


def emit_student(p: Prepared, student: nn.Module, blends: dict[str, SmoothRemoval], batch: Batch):
    """Step 6: the trained surrogates emitted into the trained module as `replace` writes them,
    checked against the unmigrated student on `batch`."""
    bench = p.bench
    by_path = {bench.by_name[n].ref.module: n for n in blends}
    surrogates = {by_path[path]: surrogate_norm(blend.surrogate).to_surrogate() for path, blend in _blends(student)}
    ordered = [(n.name, surrogates[n.name]) for n in bench.norms if n.name in surrogates]
    final, emissions = emit(trained_base(bench.base, student), bench.tg, ordered, migrate=True)
    comparison = compare_outputs(_run(unwrap(student), batch), _run(final, batch))
    if not comparison.passed:
        raise VerificationError(
            f"the emitted student differs from the trained one beyond rounding ({comparison.failures()})"
        )
    return final, dict(ordered), emissions


# --- the pass ------------------------------------------------------------------------------------


def distill(
    module: nn.Module, calibration, options: DistillOptions | None = None, *, name: str | None = None
) -> tuple[nn.Module, DistillReport]:
    """A copy of `module` whose norms are trained reduction-free surrogates (the module docstring).

    `calibration`: as for `replace` (an iterable of input dicts or tuples, or a file). Raises
    `BudgetMissed` when the student misses the budget on the test split.
    """
    options = options or DistillOptions()
    started = time.perf_counter()
    replace_options = options.replace_options()
    budget, _, _ = replace_options.checked()
    device = options.torch_device()
    torch.manual_seed(options.seed)
    p = prepare(module, calibration, replace_options, name)
    search = p.search
    if not p.bench.norms:
        raise InputError(f"{p.frame.name}: no norm is left to distill (every norm folds exactly or is unsupported)")
    train = search.splits.batches["fit"]
    samples = {role: search.splits.count(split) for role, split in ROLES.items()}
    limited, count = [], 0
    for batch in train:  # the first `calibration_samples` training samples calibrate
        if count >= options.calibration_samples:
            break
        limited.append(batch)
        count += sample_count([batch])
    search.splits.batches["fit"] = limited

    ranked = damage_order(search, options.kind)
    order = [c.norm for c in ranked]
    kept = initial_keep(options.keep, order)
    replaced = [n for n in search.order if n not in kept]
    student, blends = build_student(p, options.kind, replaced)
    for blend in blends.values():
        blend.alpha.fill_(0.0)
    calibrated = search.judge("select", [_run(student, b) for b in search.splits.batches["select"]])
    prepared_at = time.perf_counter()

    # The teacher (the pass's own folded copy, not `module`) and the student train on `device`, and come
    # back to the CPU for emission and the final judgement.
    p.bench.base.to(device)
    student.to(device)
    trainer = Trainer(p, options, train, budget, device)
    rounds: list[Round] = []
    holds = False
    while blends:
        record = Round(list(kept))
        rounds.append(record)
        holds = trainer.run_round(student, blends, options.ramp if len(rounds) == 1 else 0.0, record)
        if holds or len(rounds) == options.rounds or trainer.out_of_time():
            break
        victim = next(n for n in order if n in blends)
        keep_norm(student, blends, victim, p.bench.by_name[victim].ref.module)
        kept.append(victim)
    if options.progress:
        print(file=sys.stderr)
    for blend in blends.values():
        blend.alpha.fill_(0.0)
    p.bench.base.to("cpu")
    student.to("cpu")
    trained_at = time.perf_counter()

    if blends:
        final, surrogates, emissions = emit_student(p, student, blends, train[0])
    else:
        final, surrogates, emissions = unwrap(student), {}, {}
    decide = trainer.judge(final)
    test = trainer.judge(final, "test")
    passed = budget.holds(test)
    seconds = {
        "prepare": prepared_at - p.started,
        "train": trained_at - prepared_at,
        "emit": time.perf_counter() - trained_at,
        "total": time.perf_counter() - started,
    }
    data = _report(p, options, budget, ranked, kept, surrogates, emissions, rounds, calibrated, decide, test, seconds)
    data["samples"] = samples
    data["passed"] = passed
    report = DistillReport(data, surrogates, emissions)
    if not passed:
        raise BudgetMissed(
            report,
            f"{p.frame.name}: the distilled student misses the budget {budget} on the test split "
            f"({test.describe(mean=False)}; {len(surrogates)} norms replaced; decide split: "
            f"{decide.describe(mean=False)}); nothing written. Give more calibration data, more steps or rounds, "
            "or keep more norms",
            final,
        )
    return final, report


def _report(p, options, budget, ranked, kept, surrogates, emissions, rounds, calibrated, decide, test, seconds) -> dict:
    frame, search = p.frame, p.search
    alone = {c.norm: c for c in ranked}
    exact = frame.exact_left(surrogates)
    rows = []
    for name, op in frame.norms:
        row: dict = {"name": name, "op": op}
        if name in exact:
            row.update(decision="exact", reason="folded exactly into an RMSNorm by the exact pass")
        elif name in frame.declined:
            row.update(decision="unsupported", reason=frame.declined[name])
        elif name in surrogates:
            row.update(
                decision="replaced",
                surrogate=options.kind,
                parameters=surrogates[name].describe(),
                emission=emissions[name].to_json(),
                reason=f"trained {options.kind} surrogate",
            )
        else:
            when = "from the start" if name in rounds[0].kept else "after a round missed the budget on decide"
            row.update(decision="kept", reason=f"kept {when} (the most damaging alone on the decide split)")
        if name in alone:
            row["alone_calibrated"] = {**alone[name].alone.to_json(), "budget_used": alone[name].usage}
        rows.append(row)
    return {
        "normpass_version": __version__,
        "model": frame.name,
        "front_end": frame.front_end,
        "kind": options.kind,
        "train": options.train,
        "budget": {"cos": budget.cos, "rel": budget.rel, "top1": budget.top1, "margin": options.margin},
        "seed": options.seed,
        "calibration_samples": search.splits.count("fit"),
        "total": len(frame.norms),
        "exact": len(exact),
        "replaced": len(surrogates),
        "kept": sorted(kept, key=search.index.__getitem__),
        "rounds": [r.to_json() for r in rounds],
        "steps": sum(r.steps for r in rounds),
        "calibrated": calibrated.to_json(),
        "decide": decide.to_json(),
        "test": test.to_json(),
        "norms": rows,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


ROLES = {"train": "fit", "decide": "select", "test": "test"}
