"""The APPLY of a `SplitApplyFamily` unit in pieces (``APPLY s i/n unit``, planner/problem/ir.py): piece 0 starts the
core from its input, each piece runs its share and hands the result to the next, in order on one rank, and the last
returns the core's output. One step's pieces: nothing is in flight at a step's end (a plan that leaves a piece
out is refused at OPT_STEP), so checkpoints hold none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from fxkfac.errors import PipelineError
from fxkfac.planner.problem import Op
from fxkfac.preconditioner import SplitApplyFamily

__all__ = ["ApplyPieces"]


class ApplyPieces:
    """The cores in flight between their pieces on one rank: unit name -> (next piece, pieces, carry)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.carries: dict[str, tuple[int, int, Tensor]] = {}

    def run(self, family: SplitApplyFamily, unit: Any, op: Op, start: Callable[[], Tensor]) -> Tensor | None:
        """Run the piece `op` names (the whole core when it names none) of `unit`'s core; piece 0 takes `start()`.
        The core's output after the last piece, else None; PipelineError for a piece out of order."""
        index, pieces = op.piece or (0, 1)
        name = unit.name
        if index == 0:
            if name in self.carries:
                raise PipelineError(f"rank {self.rank}: '{op}' starts {name}'s APPLY again before its last piece ran")
            x = start()
        else:
            expected = self.carries.pop(name, None)
            if expected is None or expected[:2] != (index, pieces):
                want = "piece 0" if expected is None else f"piece {expected[0]}/{expected[1]}"
                raise PipelineError(
                    f"rank {self.rank}: '{op}' runs out of order: {name}'s APPLY expects {want} next "
                    "(the pieces of a unit run in order on one rank)"
                )
            x = expected[2]
        out = family.apply_core(unit, x, index, pieces)
        if index == pieces - 1:
            return out
        self.carries[name] = (index + 1, pieces, out)
        return None

    def check_done(self, where: str) -> None:
        """PipelineError when a core still waits for pieces at `where` (the step's end)."""
        if self.carries:
            left = ", ".join(f"{n} piece {i}/{k}" for n, (i, k, _) in sorted(self.carries.items()))
            raise PipelineError(f"rank {self.rank}: {where} with APPLY pieces not run: {left}; the plan lacks them")

    def clear(self) -> None:
        """Drop what is in flight (a skipped step, or a new one)."""
        self.carries = {}
