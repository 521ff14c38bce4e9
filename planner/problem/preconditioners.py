"""The preconditioner families the planner costs, and the words each uses for its tasks: one table.

A cost table says which family it is for in `CostTable.family` (K-FAC's for the analytic model, profiles and
measured tables). Views, traces and explanations take
their labels from `WORDS` so a Shampoo plan speaks of statistics and root inverses, not curvature and inversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fxkfac.planner.problem.costs import CostTable, PreconditionerKind

__all__ = ["PreconditionerKind", "InverseMethod", "TaskWords", "WORDS", "tagged_source", "kind_of", "words_of"]


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
    PreconditionerKind.MUON: TaskWords("Muon", "statistics", "decomposition", "Newton-Schulz", "grad"),
}
"""The words of every family (the one place they are written)."""


def tagged_source(kind: PreconditionerKind, source: str) -> str:
    """`source` with the family's name in front, for the views (K-FAC's stay unmarked, as they always were)."""
    return source if kind is PreconditionerKind.KFAC else f"{kind.value}:{source}"


def kind_of(costs: CostTable) -> PreconditionerKind:
    """The family a cost table is for."""
    return costs.family


def words_of(costs: CostTable) -> TaskWords:
    """The words of the family a cost table is for."""
    return WORDS[kind_of(costs)]
