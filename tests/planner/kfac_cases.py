"""Small planning problems for the planner tests: hand-sized cost tables and a hypothesis strategy."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from fxkfac.planner.problem.costs import CostTable, LayerCost, PartCost, StageCost
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.schedules import num_stages

__all__ = ["CLASSIC", "ZERO_BUBBLE", "layer", "gradient_layer", "table", "problem", "problems"]


def layer(
    name: str, curv: float = 0.5, inv: float = 1.0, prec: float = 0.25, keep: int = 10, factor: int = 100
) -> LayerCost:
    """A layer with the same cost for both sides (curv/inv per factor, keep = a_bytes = e_bytes)."""
    return LayerCost.kfac(name, curv, curv, inv, inv, prec, keep, keep, factor, factor)


def gradient_layer(
    name: str,
    stats: float = 0.25,
    decomp: float = 1.0,
    prec: float = 0.25,
    factor: int = 100,
    optimizer: int = 0,
    captured: bool = False,
) -> LayerCost:
    """A Shampoo-like layer: parts L and R fed by the reduced gradient (stats per step, decomp per refresh,
    `factor` bytes each) and `optimizer` bytes of other optimizer state; `captured` adds K-FAC's B (fed by BWD)."""
    parts = tuple(PartCost(side, OpKind.ALLREDUCE_GRAD, stats, decomp, 0, factor) for side in "LR")
    if captured:
        parts += (PartCost("B", OpKind.BWD, stats, decomp, 10, factor),)
    return LayerCost(name, parts, prec, optimizer)


def table(
    stages: int,
    fwd: float = 1.0,
    bwd: float = 2.0,
    layers: int = 1,
    act: int = 50,
    params: int = 1000,
    **layer_kw: float,
) -> CostTable:
    """Uniform stages with `layers` identical layers each (names l{stage}_{i})."""
    return CostTable(
        tuple(
            StageCost(
                fwd,
                bwd,
                params,
                act,
                tuple(
                    layer(f"l{s}_{i}", **layer_kw)  # type: ignore[arg-type]  # layer_kw are float costs of layer(); a test helper
                    for i in range(layers)
                ),
            )
            for s in range(stages)
        ),
        1,
        "test",
        "cpu",
    )


def problem(schedule: str, D: int, N: int, W: int = 1, v: int = 1, **kw: object) -> Problem:
    """A Problem over a uniform `table` (keyword arguments of `table` and of Problem mixed)."""
    table_kw = {
        k: kw.pop(k)
        for k in list(kw)
        if k in ("fwd", "bwd", "layers", "act", "params", "curv", "inv", "prec", "keep", "factor")
    }
    return Problem(schedule, D, N, table(num_stages(schedule, D, v), **table_kw), W=W, v=v, **kw)  # type: ignore[arg-type]  # kw mixes Problem's keyword arguments; a test helper


CLASSIC = ("gpipe", "1f1b", "interleaved", "chimera")
ZERO_BUBBLE = ("zb-h1", "zb-v", "zb-1p")


@st.composite
def problems(draw: st.DrawFn, schedules: Sequence[str] = CLASSIC) -> Problem:
    """Random small problems: a schedule of `schedules` (`CLASSIC` or `ZERO_BUBBLE`), D in {2, 4}, small N, a few
    layers with random costs, W in {1, 2}, sometimes a memory budget, sometimes warm-started decompositions. Times
    are multiples of 0.25 s (an exact time grid)."""
    schedule = draw(st.sampled_from(list(schedules)))
    D = draw(st.sampled_from([2, 4]))
    v = 2 if schedule in ("interleaved", "zb-v", "zb-1p") else 1
    N = D * draw(st.integers(1, 2)) if schedule in ("interleaved", "chimera", "zb-1p") else draw(st.integers(1, 4))
    W = draw(st.sampled_from([1, 2]))
    quarter = st.integers(1, 8).map(lambda q: q / 4)
    stages = []
    for s in range(num_stages(schedule, D, v)):
        layers = tuple(
            LayerCost.kfac(
                f"s{s}.l{i}",
                draw(quarter) / 8,
                draw(quarter) / 8,
                draw(quarter) / 4,
                draw(quarter) / 4,
                draw(quarter) / 8,
                draw(st.integers(0, 40)),
                draw(st.integers(0, 40)),
                100,
                100,
            )
            for i in range(draw(st.integers(1, 2)))
        )
        stages.append(StageCost(draw(quarter), draw(quarter) * 2, 1000, draw(st.integers(10, 60)), layers))
    costs = CostTable(tuple(stages), 1, "hypothesis", "cpu")
    warm = draw(st.booleans())
    base = Problem(schedule, D, N, costs, W=W, v=v, max_period=12, warm_start=warm)
    budget = draw(st.one_of(st.none(), st.integers(0, 400)))
    if budget is None:
        return base
    from fxkfac.planner.problem.step_timeline import min_memory_bytes

    return Problem(
        schedule,
        D,
        N,
        costs,
        W=W,
        v=v,
        max_period=12,
        warm_start=warm,
        memory_budget=min_memory_bytes(base) + budget,
        max_overhead=draw(st.sampled_from([0.0, 0.5])),
    )


EXHAUSTIVE = "schedule,N,fwd,bwd,curv,inv"
"""The fields of the small 2-stage problems (`problem(schedule, 2, N, ..., prec=1, max_period=6)`) whose least
refresh period `tests/planner/brute_force.py` finds exhaustively."""
EXHAUSTIVE_AT_BOUND = [
    ("1f1b", 1, 1, 2, 1, 2),
    ("1f1b", 2, 1, 1, 1, 1),
    ("gpipe", 2, 1, 2, 1, 2),
    ("gpipe", 1, 2, 2, 1, 2),
    ("1f1b", 2, 2, 3, 1, 3),
]
"""Problems of `EXHAUSTIVE` fields CP-SAT solves optimally at once."""
EXHAUSTIVE_ABOVE_GREEDY = [
    ("gpipe", 2, 1, 3, 1, 2),
    ("gpipe", 2, 2, 3, 2, 1),
    ("gpipe", 3, 1, 3, 1, 2),
]
"""Problems of `EXHAUSTIVE` fields where first-fit plans some stage above its least period, which is above the fluid
lower bound."""
