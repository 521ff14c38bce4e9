"""An exhaustive reference for the planner's tests: can one stage's K-FAC work be placed with period k?

Independent of planner.plan.window, greedy and cpsat: it walks every start on the integer time grid.
"""

from __future__ import annotations

from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.step_timeline import step_timeline

__all__ = ["brute_feasible"]


def _fits(occupied: list[bool], start: int, length: int) -> bool:
    L = len(occupied)
    return start % L + length <= L and not any(occupied[(start + t) % L] for t in range(length))


def _mark(occupied: list[bool], start: int, length: int, value: bool) -> None:
    for t in range(length):
        occupied[(start + t) % len(occupied)] = value


def brute_feasible(p: Problem, stage: int, k: int, stretch: int = 0) -> bool:
    """Exhaustive search on the integer time grid (whole seconds) for one stage on one device, every
    step followed by `stretch` idle seconds: curvature after its F/B and within one window of it,
    inversions after all curvature of their factor and before the next refresh's curvature, APPLY
    between the all-reduce and the step's end, nothing on the fixed F/B or on the first unit of a
    step (steps end with a barrier over all ranks), no task across the window boundary."""
    st_ = step_timeline(p)
    P = round(st_.length) + stretch
    L, d = P * k, stage
    occupied = [False] * L
    for j in range(k):
        for _, a, b in st_.fixed(d):
            _mark(occupied, round(a) + j * P, round(b - a), True)
        occupied[j * P] = True
    layer = p.costs.stages[stage].layers[0]
    fixed_end = {(op.kind, op.mb): round(b) for op, _, b in st_.fixed(d)}
    precs = [(round(st_.allreduce_end[d, stage]) + j * P, (j + 1) * P) for j in range(k)]
    curv = {side: [fixed_end[kind, m] for m in range(p.N)] for side, kind in (("A", OpKind.FWD), ("B", OpKind.BWD))}
    dur = {p.part: (round(p.stats), round(p.decomp)) for p in layer.parts}
    prec = round(layer.prec)
    jobs = [("prec", lo, hi) for lo, hi in precs] + [("curv", side, rel) for side in "AB" for rel in curv[side]]
    jobs += [("inv", "A", 0), ("inv", "B", 0)]
    starts: dict[str, list[int]] = {"A": [], "B": []}
    if k * prec + p.N * (dur["A"][0] + dur["B"][0]) + dur["A"][1] + dur["B"][1] > occupied.count(False):
        return False

    def place(i: int) -> bool:
        if i == len(jobs):
            return True
        kind, a, b = jobs[i]
        if kind == "prec":
            choices, length = range(a, b - prec + 1), prec
        elif kind == "curv":
            length = dur[a][0]
            choices = range(b, min(2 * L, b + L) - length + 1)
        else:
            length = dur[a][1]
            ready = max(s + dur[a][0] for s in starts[a])
            choices = range(ready, min(2 * L, L + min(starts[a])) - length + 1)
        for s in choices:
            if _fits(occupied, s, length):
                _mark(occupied, s, length, True)
                if kind == "curv":
                    starts[a].append(s)
                if place(i + 1):
                    return True
                if kind == "curv":
                    starts[a].pop()
                _mark(occupied, s, length, False)
        return False

    return place(0)
