"""What the analysis decided: per-norm decisions and the centrings that make them exact.

A `FoldPlan` is pure data. Every declined norm carries the reason and the node that blocked it,
so `inspect` can explain and `viz` can draw the path from the norm to the blocker.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Centring:
    """Make the output of `node` zero-mean along `axis` by centring its weights.

    For a constant feeding `node` at input `input_index`, the constant itself is centred along
    `axis` of the constant (`axis=None`: the constant is constant along the required axis, so its
    centred value is zero).

    `weight` names a constant w, one positive or negative factor per feature, that multiplies the
    output before it is read (a LayerScale the proof walked through, `rules.per_channel_factor`): then
    w ⊙ y is made zero-mean, W' = W − w⁻¹ ⊗ mean_k(w ⊙ W) (`algebra.centre`), and the shift left in y
    is c·w⁻¹, which the multiply turns into c·1.
    """

    node: str
    axis: int | None
    input_index: int | None = None  # set for constants: which input of `node` is the constant
    tensor: str | None = None  # the constant's name, for constants
    stream_axis: int | None = None  # for constants: the normalized axis in `node`'s output
    weight: str | None = None  # the constant per-feature factor the centring is weighted by

    @property
    def label(self) -> str:
        return self.node if self.tensor is None else self.tensor


@dataclass(frozen=True)
class Blocker:
    """The node where a proof failed, why, and the path of nodes from the norm back to it."""

    node: str
    reason: str
    path: tuple[str, ...] = ()
    tensor: str | None = None  # the tensor that is not zero-mean (used for inserted centring)
    axis: int | None = None


@dataclass(frozen=True)
class Insertion:
    """An explicit `x − mean(x)` inserted on `tensor` along `axis`."""

    tensor: str
    axis: int


@dataclass
class NormDecision:
    name: str
    op: str
    foldable: bool
    reason: str | None
    centrings: list[Centring] = field(default_factory=list)
    insertions: list[Insertion] = field(default_factory=list)
    blocker: Blocker | None = None
    kept: bool = False  # provably foldable, but left as it is (the reason says why)

    @property
    def centred_layers(self) -> list[str]:
        return sorted({c.label for c in self.centrings})

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "op": self.op,
            "foldable": self.foldable,
            "kept": self.kept,
            "reason": self.reason,
            "centred_layers": self.centred_layers if self.foldable else [],
            "inserted_centering": [i.tensor for i in self.insertions],
            "blocked_by": None if self.blocker is None else self.blocker.node,
            "blocking_path": [] if self.blocker is None else list(self.blocker.path),
        }


@dataclass
class FoldPlan:
    decisions: list[NormDecision]

    @property
    def total(self) -> int:
        return len(self.decisions)

    @property
    def folded(self) -> list[NormDecision]:
        return [d for d in self.decisions if d.foldable]

    @property
    def centrings(self) -> list[Centring]:
        """Every centring the folded norms need, each once, in a stable order."""
        seen: dict[Centring, None] = {}
        for decision in self.folded:
            for centring in decision.centrings:
                seen.setdefault(centring)
        return list(seen)

    @property
    def insertions(self) -> list[Insertion]:
        seen: dict[Insertion, None] = {}
        for decision in self.folded:
            for insertion in decision.insertions:
                seen.setdefault(insertion)
        return list(seen)

    def to_json(self) -> dict:
        return {
            "norms": [d.to_json() for d in self.decisions],
            "total": self.total,
            "foldable": len(self.folded),
        }
