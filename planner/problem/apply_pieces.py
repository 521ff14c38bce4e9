"""Pieces of a Muon matrix's APPLY ("APPLY s0 i/n layer"): piece i of n runs Newton-Schulz iterations
[i*S//n, (i+1)*S//n) of S = `NS_STEPS`, after piece i-1 on the same rank; a Muon problem cuts every matrix's APPLY
into `Problem.apply_pieces` of them (its `decomp_pieces`: Muon has no decomposition)."""

from __future__ import annotations

from dataclasses import replace

from fxkfac.planner.problem.ir import Op, OpKind

__all__ = ["NS_STEPS", "piece_iterations", "piece_share", "cut_apply"]

NS_STEPS = 5
"""Newton-Schulz iterations per step the planner prices pieces with (torch.optim.Muon's and MuonConfig's
`ns_steps` default)."""


def piece_iterations(piece: tuple[int, int] | None, ns_steps: int = NS_STEPS) -> range:
    """The iterations piece (i, n) of a matrix's APPLY runs: [i*S//n, (i+1)*S//n) of S = ns_steps (all: None)."""
    if piece is None:
        return range(ns_steps)
    i, n = piece
    return range(i * ns_steps // n, (i + 1) * ns_steps // n)


def piece_share(piece: tuple[int, int] | None) -> float:
    """The share of its matrix's APPLY seconds piece (i, n) takes: its iterations' share of `NS_STEPS` (the step's
    elementwise work, a few percent of it, spread with them)."""
    return len(piece_iterations(piece)) / NS_STEPS


def cut_apply(op: Op, pieces: int) -> list[Op]:
    """A layer's APPLY as `pieces` pieces in order (itself when 1)."""
    assert op.kind is OpKind.APPLY and op.layer is not None, "only one layer's APPLY is cut"
    return [op] if pieces == 1 else [replace(op, piece=(i, pieces)) for i in range(pieces)]
