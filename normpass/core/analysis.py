"""Which LayerNorms fold into RMSNorms exactly, and what must be centred for it (pure; never mutates).

Notation: a norm N normalizes tensor x along one axis k. LN(x) = RMSNorm(x) whenever
mean_k(x) = 0 for every input, so N folds if we can make its input zero-mean along k by
centring the weights of the linear layers that produce it.

**Proof (backward, seed 003 Algorithm 1).** From (x, k), walk producers: a `Linear` layer whose
output axis is k is centred (W' = W − mean_out(W), b' = b − mean(b)) and the walk stops, and so
is one followed by a per-channel constant Mul (LayerScale: W' = centre(W⊙s), b' = centre(b⊙s)); a
constant on a branch is centred; `Sum`, `Concat`, `Scale` (factor constant along k) and layout
ops that keep the axis intact continue the walk on their inputs; an already-centred output stops
it; anything else blocks the proof.

Two refinements travel with a walk's state (`State`). *Rows*: a slice with constant bounds along
another axis needs only the rows it keeps, so a concatenation's parts outside them need nothing
(XCiT's class attention: norm2 reads row 0 of x + γ₁ ⊙ cat(proj(…), x̂₁[:, 1:])). *Weights*: a Mul
by a per-feature constant w that is no layer's LayerScale (it scales a concatenation) needs its
input w-weighted zero-mean, mean_k(w ⊙ x) = 0, and a layer under that need is centred weighted,
W' = W − w⁻¹ ⊗ mean_k(w ⊙ W), b' likewise: exact where no wₖ is 0, since w ⊙ y' = centre(w ⊙ y).

**Safety (forward, seed 003 App. D.2).** Centring a layer changes its output y into
y − m(x)·1ₖ, a per-sample shift constant along k. The model is unchanged iff every path from y
carries that shift (through sums, scalings constant along k, axis-preserving layout ops and means
over other axes) into
an op that removes it: a LayerNorm over k (folded or not: LN(x + c·1) = LN(x)), a centring
x − mean_k(x), or a Softmax over k; a reader of shapes only (Shape, Size) never sees it. A shift
reaching a graph output, a linear layer, a nonlinearity or an RMSNorm makes the centring unsafe,
and the norms that need it are refused. A weighted centring leaves c·w⁻¹, not constant along k:
it must reach a multiply by w (which makes it c·1) before anything removes it.

**Inserted centring.** Where a proof is blocked, or needs a centring that is unsafe, inserting
t' = t − mean_k(t) at a tensor t of its walk whose shifts are all removed downstream (the safety
condition) makes t zero-mean exactly, at the cost of one ReduceMean and one Sub; the walk above t
is then not needed (`Cutter`: the blocked tensor itself where that is exact, else a tensor below it,
e.g. the sum of a layer and a grouped conv that reads it). It is planned only where it enables at
least `MIN_FOLDS_PER_INSERTION` folds, since one insertion costs about what one fold saves.

**Cost.** Each rule's transfer (`Rule.backward`, `Rule.forward` in `rules.py`) is evaluated at most
once per (tensor, axis) state and plan: proofs and shift checks are memoised per state and shared
by every norm whose walk reaches it (a pre-LN residual stream is walked once, not once per norm).
What remains per norm is copying its state's memoised centrings, in the size of its own answer (at C
speed: a residual stream's answers sum to O(norms²) entries). Whether a norm's centrings are all safe, and
which is the first unsafe one, is memoised per state too (`FirstUnsafe`), so the plan never walks a norm's
list of centrings in Python; nor does `Cutter`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .graph import NormInfo, Rows, Shift, ZeroMeanGraph, ZNode
from .plan import Blocker, Centring, FoldPlan, Insertion, NormDecision
from .rules import Concat, Linear, layer_scale, regroup_axis  # noqa: F401  (layer_scale, regroup_axis: re-exported)

MIN_FOLDS_PER_INSERTION = 2


class State(NamedTuple):
    """What the proof needs of a tensor: `weight ⊙ tensor` zero-mean along `axis`, in the slice `rows`.

    `rows` (None: all of it) is the one slice along another axis that the norm reads, where a slice
    with constant bounds tells (`Rule.rows_read`): a concatenation's parts outside it need nothing.
    `weight` (None: no weight) names a per-feature constant w that multiplies the tensor before the
    norm reads it (`Rule.weigh`): a layer there is centred weighted by w (`plan.Centring.weight`).
    """

    tensor: str
    axis: int
    rows: Rows | None = None
    weight: str | None = None


# (tensor, axis, the rows that carry the shift (None: all), the weight w of a shift c·w⁻¹ (None: c·1))
ShiftState = tuple[str, int, Rows | None, str | None]


# --- proof (backward) --------------------------------------------------------------------------


@dataclass
class Proof:
    centrings: list[Centring] = field(default_factory=list)
    blockers: list[Blocker] = field(default_factory=list)


@dataclass
class _Step:
    """One rule evaluation at a state: centrings found there, a blocker, or the states it needs."""

    centrings: tuple[Centring, ...] = ()
    blocker: Blocker | None = None
    node: str = ""  # the node whose inputs `needs` are ("" where there are none)
    needs: tuple[State, ...] = ()


@dataclass
class _Found:
    """Everything a state's proof needs, in walk order; blocker paths start at the state's node.

    `parts`: the states whose proofs were merged into it, in merge order: its centrings are its own
    step's, then each part's, first occurrences kept.
    """

    centrings: dict[Centring, None]
    blockers: dict[State, Blocker]
    parts: tuple[State, ...] = ()


class Prover:
    """Proofs that norms' inputs are zero-mean, memoised per (tensor, axis) across norms.

    The walk from a state visits the state's needs last input first (depth-first, as a stack
    would), each state once.
    """

    def __init__(self, zmg: ZeroMeanGraph):
        self.zmg = zmg
        self.memo: dict[State, _Found] = {}
        self.steps: dict[State, _Step] = {}  # each state's own rule evaluation, for `Cutter`

    def prove(self, norm: NormInfo) -> Proof:
        """The centrings that make the norm's input zero-mean, or the blockers that prevent it."""
        if self.zmg.is_constant(norm.input):  # constants on branches are centred; not the norm's own input
            reason = f"the norm's input {norm.input} is a constant"
            return Proof(blockers=[Blocker(norm.input, reason, (norm.name, norm.input))])
        if norm.axis is None:  # front ends mark such norms unsupported; a proof needs one axis
            return Proof(blockers=[Blocker(norm.name, "the norm normalizes over several axes", (norm.name,))])
        found = self._found(State(norm.input, norm.axis))
        blockers = [replace(b, path=(norm.name, *b.path)) for b in found.blockers.values()]
        return Proof(list(found.centrings), blockers)

    def _found(self, start: State) -> _Found:
        steps = self.steps
        stack = [start]
        while stack:
            state = stack[-1]
            if state in self.memo:
                stack.pop()
                continue
            if state not in steps:
                steps[state] = self._step(state)
                waiting = [s for s in steps[state].needs if s not in self.memo and s not in steps]
                if waiting:
                    stack.extend(waiting)
                    continue
            stack.pop()
            self.memo[state] = self._merge(state, steps[state])
        return self.memo[start]

    def _step(self, state: State) -> _Step:
        tensor, axis, rows, weight = state
        node = self.zmg.producer_of(tensor)
        if node is None:
            return _Step(
                blocker=Blocker(tensor, f"graph input {tensor} carries arbitrary data", (tensor,), tensor, axis)
            )

        def blocked(reason: str) -> _Step:
            return _Step(blocker=Blocker(node.name, reason, (node.name,), tensor, axis))

        result = node.rule.backward(self.zmg, node, tensor, axis)
        if isinstance(result, str) and weight is None:  # a per-feature factor: its input weighted by it
            weighed = node.rule.weigh(self.zmg, node, tensor, axis)
            if isinstance(weighed, str):
                result = weighed
            elif weighed is not None:
                result, weight = weighed
        if isinstance(result, Centring):
            if weight is None:
                return _Step(centrings=(result,))
            layer = self.zmg.nodes[result.node].rule
            if not isinstance(layer, Linear):
                return blocked(f"{node.op} {node.name} is a LayerScale after the per-feature factor {weight}")
            if not layer.bias_per_feature:
                reason = f"{node.op} {node.name}'s bias is one number for every feature: no centring weighted by"
                return blocked(f"{reason} {weight} keeps its shape")
            return _Step(centrings=(replace(result, weight=weight),))
        if isinstance(result, str):
            return blocked(result)
        if weight is not None and not result:
            return blocked(f"{node.op} {node.name}'s output is zero-mean, not once weighted by {weight}")
        if weight is not None and isinstance(node.rule, Concat) and node.rule.axis == axis:
            return blocked(f"{node.op} {node.name} concatenates along the axis that {weight} weights")
        centrings: list[Centring] = []
        needs: dict[State, None] = {}
        for index, source, in_axis in result:
            part = node.rule.rows_read(self.zmg, node, tensor, rows, index)
            if part is not None and part[2] <= part[1]:
                continue  # the norm reads none of this input
            if self.zmg.is_constant(source):
                if weight is not None and in_axis is None:
                    return blocked(
                        f"{node.op} {node.name} adds {source}, constant along the axis that {weight} weights"
                    )
                centrings.append(Centring(node.name, in_axis, index, source, stream_axis=axis, weight=weight))
            else:
                assert in_axis is not None  # rules refuse a run-time input broadcast along the axis
                needs[State(source, in_axis, self._whole(source, part), weight)] = None
        return _Step(tuple(centrings), node=node.name, needs=tuple(needs))

    def _whole(self, tensor: str, rows: Rows | None) -> Rows | None:
        """`rows`, or None where they are all of `tensor` along their axis (so states that need the same share
        one proof)."""
        if rows is None:
            return None
        axis, start, stop = rows
        shape = self.zmg.shape(tensor)
        size = shape[axis] if shape is not None and axis < len(shape) else None
        return None if start <= 0 and isinstance(size, int) and stop >= size else rows

    def _merge(self, state: State, step: _Step) -> _Found:
        found = _Found(dict.fromkeys(step.centrings), {} if step.blocker is None else {state: step.blocker})
        parts = []
        for need in reversed(step.needs):
            part = self.memo.get(need)  # absent only on a cycle back to a state being proven
            if part is None:
                continue
            parts.append(need)
            found.centrings.update(part.centrings)
            for key, blocker in part.blockers.items():
                if key not in found.blockers:
                    found.blockers[key] = replace(blocker, path=(step.node, *blocker.path))
        found.parts = tuple(parts)
        return found


def prove(zmg: ZeroMeanGraph, norm: NormInfo) -> Proof:
    """Walk back from the norm's input; collect the centrings that make it zero-mean, or blockers."""
    return Prover(zmg).prove(norm)


# --- safety (forward) --------------------------------------------------------------------------


class ShiftChecker:
    """Decides whether a per-sample shift constant along an axis is removed downstream.

    `removed(tensor, axis)` is memoised over (tensor, axis, rows) states (`rows`: the one slice of the
    tensor that carries the shift, where a concatenation tells, see `rules.py`), so checking every
    centring of a deep residual stream is linear in graph size; so is `unsafe`, over centrings.
    """

    def __init__(self, zmg: ZeroMeanGraph):
        self.zmg = zmg
        self.memo: dict[ShiftState, Blocker | None] = {}
        self.verdicts: dict[Centring, Blocker | None] = {}

    def unsafe(self, centring: Centring) -> Blocker | None:
        """None if `centring` leaves the model unchanged, else where its shift survives (memoised).

        The blocker's path is (the centred layer or constant, the node the shift reaches).
        """
        if centring not in self.verdicts:
            node = self.zmg.nodes[centring.node]
            if centring.input_index is None:
                assert centring.axis is not None  # a layer is centred along an axis
                blocker = self.removed(node.outputs[0], centring.axis, centring.weight)
            else:
                assert centring.stream_axis is not None  # set for every constant (`Prover._step`)
                blocker = self.entering(
                    node, centring.input_index, centring.axis, centring.stream_axis, centring.weight
                )
            if blocker is not None:
                blocker = Blocker(blocker.node, blocker.reason, (centring.label, blocker.node))
            self.verdicts[centring] = blocker
        return self.verdicts[centring]

    def _through(self, node: ZNode, index: int, axis: int | None, out_axis: int | None = None, rows=None, weight=None):
        """Successor states of a shift entering `node` at input `index` (see `graph.Shift`), or a Blocker.

        A successor whose rows are empty (a slice that keeps none of the shifted rows) carries no shift. A
        weighted shift c·w⁻¹ stays weighted until a multiply by w (`Rule.unweighs`), and no rule that removes
        a shift constant along its axis removes it.
        """
        shift = Shift(self.zmg, node, index, axis, out_axis, rows, weight)
        result = node.rule.forward(shift)
        if isinstance(result, str):
            return Blocker(node.name, f"{node.op} {node.name} {result}")
        if weight is not None and not result and node.rule.removes_shift:
            return Blocker(node.name, f"{node.op} {node.name} receives c/{weight}, not constant along its axis")
        if weight is not None and node.rule.unweighs(shift):
            weight = None
        states = [(out, out_axis, node.rule.rows(shift, out), weight) for out, out_axis in result]
        return [s for s in states if s[2] is None or s[2][1] < s[2][2]]

    def entering(
        self, node: ZNode, index: int, axis: int | None, out_axis: int, weight: str | None = None
    ) -> Blocker | None:
        """Is a shift entering `node` at input `index` (along `axis` of that input; c·w⁻¹ for a `weight` w)
        removed downstream?"""
        successors = self._through(node, index, axis, out_axis, weight=weight)
        if isinstance(successors, Blocker):
            return successors
        return next((b for s in successors if (b := self._removed(s)) is not None), None)

    def removed(self, tensor: str, axis: int, weight: str | None = None) -> Blocker | None:
        """None if a shift along `axis` of `tensor` (c·w⁻¹ for a `weight` w) is removed on every path, else where
        it is not."""
        return self._removed((tensor, axis, None, weight))

    def _removed(self, start: ShiftState) -> Blocker | None:
        stack = [(start, False)]
        successors_of: dict[ShiftState, list[ShiftState]] = {}
        while stack:
            state, expanded = stack.pop()
            if state in self.memo:
                continue
            if expanded:
                successors = successors_of[state]
                self.memo[state] = next((self.memo[s] for s in successors if self.memo[s] is not None), None)
                continue
            successors = self._expand(*state)
            if isinstance(successors, Blocker):
                self.memo[state] = successors
                continue
            successors_of[state] = successors
            stack.append((state, True))
            stack.extend((s, False) for s in successors if s not in self.memo)
        return self.memo[start]

    def _expand(self, tensor: str, axis: int, rows: Rows | None, weight: str | None):
        if tensor in self.zmg.graph_outputs:
            return Blocker(tensor, f"the shift reaches graph output {tensor}")
        states = []
        for node, index in self.zmg.consumers_of(tensor):
            result = self._through(node, index, axis, rows=rows, weight=weight)
            if isinstance(result, Blocker):
                return result
            states.extend(result)
        return states


class FirstUnsafe:
    """The first unsafe centring of a proven state's centrings, in walk order (`ShiftChecker.unsafe`'s blocker),
    or None where all are safe; memoised per state.

    A state's centrings are its own step's, then each merged part's (`_Found.parts`), first occurrences kept;
    so the first unsafe one is the first unsafe among its own, else the first part's that has one. Each
    state and centring is checked once, however many norms' walks share it: linear in the walk's size, where
    checking each norm's list would be O(norms²) on a residual stream.
    """

    def __init__(self, prover: Prover, checker: ShiftChecker):
        self.prover, self.checker = prover, checker
        self.memo: dict[State, Blocker | None] = {}

    def __call__(self, start: State) -> Blocker | None:
        stack = [start]
        while stack:
            state = stack[-1]
            if state in self.memo:
                stack.pop()
                continue
            parts = self.prover.memo[state].parts
            waiting = [part for part in parts if part not in self.memo]
            if waiting:  # parts were proven before the state: no cycle
                stack.extend(waiting)
                continue
            stack.pop()
            own = (self.checker.unsafe(c) for c in self.prover.steps[state].centrings)
            found = (self.memo[part] for part in parts)
            self.memo[state] = next((b for b in itertools.chain(own, found) if b is not None), None)
        return self.memo[start]


# --- plan --------------------------------------------------------------------------------------


def plan(zmg: ZeroMeanGraph, insert_centering: bool = True, keep: dict[str, str] | None = None) -> FoldPlan:
    """Decide every norm of `zmg`: fold (with the centrings it needs) or decline (with the reason).

    `keep` names norms to leave as they are even where they fold, with the reason (a rewrite
    that would not pay); their centrings and insertions are not planned for them.
    """
    keep = keep or {}
    prover, checker = Prover(zmg), ShiftChecker(zmg)
    first_unsafe = FirstUnsafe(prover, checker)
    decisions: list[NormDecision] = []
    pending: dict[str, NormInfo] = {}
    for norm in zmg.norms:
        decision = NormDecision(norm.name, norm.op, False, None)
        decisions.append(decision)
        if norm.unsupported:
            decision.reason = norm.unsupported
            continue
        proof = prover.prove(norm)
        decision.centrings = proof.centrings
        if norm.name in keep:
            decision.kept, decision.reason, decision.centrings = True, keep[norm.name], []
            continue
        unsafe = first_unsafe(State(norm.input, norm.axis)) if proof.centrings and norm.axis is not None else None
        if unsafe is not None:
            decision.blocker = unsafe
            decision.reason = f"centring {unsafe.path[0]} is unsafe: {unsafe.reason}"
        elif proof.blockers:
            decision.blocker = proof.blockers[0]
            decision.reason = f"input not provably zero-mean: {proof.blockers[0].reason}"
        else:
            decision.foldable = True
            continue
        pending[norm.name] = norm
    if insert_centering:
        _plan_insertions(zmg, Cutter(first_unsafe), decisions, pending)
    return FoldPlan(decisions)


def safe_centrings(zmg: ZeroMeanGraph, norm: NormInfo, checker: ShiftChecker | None = None) -> list[Centring]:
    """The centrings `prove` finds for `norm` whose shift is removed downstream, proven or not.

    Each centring shifts its own output by a per-sample constant along the axis; where every such
    shift is removed (the safety condition), centring any subset leaves the model unchanged. For a
    LayerNorm whose input is not provably zero-mean (a post-LN stream), these centrings still take
    the per-sample mean of the linear layers they reach out of its input.
    """
    checker = checker or ShiftChecker(zmg)
    return [c for c in prove(zmg, norm).centrings if checker.unsafe(c) is None]


# states to centre by insertion, centrings the rest needs (a dict, so that merging cuts rehashes no centring)
Cut = tuple[frozenset[State], dict[Centring, None]]


class Cutter:
    """Where inserted centrings make a norm's input zero-mean: a cut through the walk of its proof.

    A state (t, k) of the walk is *clean* when its proof found no blocker and every centring it needs
    is safe. A dirty state is cut either there, by inserting t' = t − mean_k(t), which is exact iff a
    shift of t along k is removed downstream (`ShiftChecker.removed`), or above it: when its own rule
    step neither failed nor needs an unsafe centring, by cutting each dirty state it needs. The cut
    furthest upstream is taken (it is the blocked tensor itself where inserting there is exact, and
    is shared by the most norms). Below a cut, the norm needs the clean parts' centrings and the
    steps' own; the centrings above a cut are not needed (and may be unsafe).

    This finds, e.g., wav2vec2's: the projection's output feeds the stream and a grouped positional
    conv, which cannot take the projection's centring; the Add of both is centred instead.
    """

    def __init__(self, first_unsafe: FirstUnsafe):
        self.prover, self.checker, self.first_unsafe = first_unsafe.prover, first_unsafe.checker, first_unsafe
        self.memo: dict[State, Cut | None] = {}

    def cut(self, start: State) -> Cut | None:
        """The cut of a state the prover walked, or None where no insertion makes it zero-mean."""
        stack, opened = [start], set()
        while stack:
            state = stack[-1]
            if state in self.memo:
                stack.pop()
                continue
            found, step = self.prover.memo[state], self.prover.steps[state]
            if not found.blockers and self.first_unsafe(state) is None:
                self.memo[state] = (frozenset(), found.centrings)  # shared, never changed
                stack.pop()
                continue
            above = step.blocker is None and self._safe(step.centrings)
            if above and state not in opened:
                opened.add(state)
                waiting = [n for n in step.needs if n not in self.memo and n not in opened]
                if waiting:
                    stack.extend(waiting)
                    continue
            stack.pop()
            parts = [self.memo.get(need) for need in step.needs] if above else [None]
            if all(part is not None for part in parts):
                cuts = frozenset().union(*(part[0] for part in parts if part is not None))
                centrings = dict.fromkeys(step.centrings)
                for part in parts:
                    centrings.update(part[1] if part is not None else {})
                self.memo[state] = (cuts, centrings)
            elif state.weight is None and self.checker.removed(state.tensor, state.axis) is None:
                self.memo[state] = (frozenset([State(state.tensor, state.axis)]), {})
            else:
                self.memo[state] = None
        return self.memo[start]

    def _safe(self, centrings) -> bool:
        return all(self.checker.unsafe(c) is None for c in centrings)


def _plan_insertions(zmg: ZeroMeanGraph, cutter: Cutter, decisions: list[NormDecision], pending) -> None:
    """Insert x − mean(x) where it makes pending norms provable (`Cutter`), where it pays."""
    cuts: dict[str, Cut] = {}
    candidates: dict[Insertion, set[str]] = {}
    for name, norm in pending.items():
        if norm.axis is None or zmg.is_constant(norm.input):
            continue
        cut = cutter.cut(State(norm.input, norm.axis))
        if cut is None:
            continue
        cuts[name] = cut
        for state in cut[0]:
            candidates.setdefault(Insertion(state.tensor, state.axis), set()).add(name)
    chosen = set(candidates)
    while True:
        enabled = {
            name for name, (states, _) in cuts.items() if all(Insertion(s.tensor, s.axis) in chosen for s in states)
        }
        weak = {i for i in chosen if len(candidates[i] & enabled) < MIN_FOLDS_PER_INSERTION}
        if not weak:
            break
        chosen -= weak
    by_name = {d.name: d for d in decisions}
    for name in enabled:
        states, centrings = cuts[name]
        decision = by_name[name]
        decision.insertions = sorted((Insertion(s.tensor, s.axis) for s in states), key=lambda i: (i.tensor, i.axis))
        decision.centrings = list(centrings)
        decision.foldable = True
        decision.reason = None
        decision.blocker = None
