"""The preconditioner families the planner costs, and the words each uses for its tasks: one table.

A cost table says which family it is for by the first field of its `source` ("shampoo:analytic:..."); a table
without one (K-FAC's analytic model, profiles, measured tables) is K-FAC's. Views, traces and explanations take
their labels from `WORDS` so a Shampoo plan speaks of statistics and root inverses, not curvature and inversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fxkfac.planner.costs import CostTable

__all__ = ["PreconditionerKind", "InverseMethod", "TaskWords", "WORDS", "tagged_source", "kind_of", "words_of"]


class PreconditionerKind(StrEnum):
    """A family the planner has a cost model for."""

    KFAC = "kfac"
    SHAMPOO = "shampoo"
    SOAP = "soap"


class InverseMethod(StrEnum):
    """How K-FAC inverts a damped factor (`KFACConfig.inverse`), which its cost models price: a Cholesky inverse,
    or an eigendecomposition that also serves the eigenbasis form of the preconditioner."""

    CHOLESKY = "cholesky"
    EIGEN = "eigen"


@dataclass(frozen=True, slots=True)
class TaskWords:
    """How one family names itself and its tasks: STATS (`stats`), DECOMP (`decomp`), APPLY (`apply`), and what its
    collectives carry (`synced`: the gradient, the statistics, the decompositions, in short)."""

    name: str
    stats: str
    decomp: str
    apply: str
    synced: str


WORDS: dict[PreconditionerKind, TaskWords] = {
    PreconditionerKind.KFAC: TaskWords("K-FAC", "curvature", "inversion", "precondition", "grad/curv/inverse"),
    PreconditionerKind.SHAMPOO: TaskWords("Shampoo", "statistics", "root inverse", "precondition", "grad/roots"),
    PreconditionerKind.SOAP: TaskWords("SOAP", "statistics", "eigenbasis", "rotate + Adam", "grad/bases"),
}
"""The words of every family (the one place they are written)."""


def tagged_source(kind: PreconditionerKind, source: str) -> str:
    """`source` marked as a cost table of `kind` (K-FAC's tables stay unmarked, as they always were)."""
    return source if kind is PreconditionerKind.KFAC else f"{kind.value}:{source}"


def kind_of(costs: CostTable) -> PreconditionerKind:
    """The family a cost table is for: its source's mark, K-FAC when unmarked."""
    head = costs.source.split(":", 1)[0]
    known = {kind.value for kind in PreconditionerKind}
    return PreconditionerKind(head) if head in known else PreconditionerKind.KFAC


def words_of(costs: CostTable) -> TaskWords:
    """The words of the family a cost table is for."""
    return WORDS[kind_of(costs)]
