"""Strategies as data: parsing, KAISA's grid of grad-worker columns and receiver rows, LPT columns, holdings."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fxkfac.planner.problem.errors import ConfigError
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.lowering import naive_programs
from fxkfac.planner.problem.strategy import (
    COMM_OPT,
    LayerDistribution,
    Strategy,
    StrategyKind,
    grad_workers,
    holding,
    least_loaded,
    parse_strategy,
    receivers,
)

HOLDERS = tuple(range(8))


@pytest.mark.parametrize("text", ["comm-opt", "mem-opt", "dp-kfac", "hybrid:1/2", "hybrid:1/4"])
def test_text_round_trips(text: str) -> None:
    assert str(parse_strategy(text)) == text
    where = LayerDistribution(parse_strategy(text), 1)
    assert LayerDistribution.parse(str(where)) == where


def test_hybrid_takes_decimal_fractions_and_refuses_bad_ones() -> None:
    assert parse_strategy("hybrid:0.5") == Strategy(StrategyKind.HYBRID, Fraction(1, 2))
    for bad in ("hybrid", "hybrid:1", "hybrid:0", "fast", "hybrid:x"):
        with pytest.raises(ConfigError):
            parse_strategy(bad)
    with pytest.raises(ConfigError, match="divide"):
        parse_strategy("hybrid:0.375").workers(8)  # 3 grad workers of 8


def test_kaisas_grid_columns_are_grad_workers_and_rows_receivers() -> None:
    """kfac-pytorch's example: P=8, g=2 gives grad-worker columns [0,4], [1,5], [2,6], [3,7]."""
    half = parse_strategy("hybrid:0.25")
    assert [grad_workers(HOLDERS, LayerDistribution(half, c)) for c in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert receivers(HOLDERS, LayerDistribution(half, 2)) == [(2, (0, 1, 2, 3)), (6, (4, 5, 6, 7))]
    assert grad_workers(HOLDERS, LayerDistribution(COMM_OPT)) == HOLDERS
    assert receivers(HOLDERS, LayerDistribution(COMM_OPT)) == []
    mem = LayerDistribution(parse_strategy("mem-opt"), 5)
    assert grad_workers(HOLDERS, mem) == (5,)
    assert receivers(HOLDERS, mem) == [(5, HOLDERS)]
    with pytest.raises(ConfigError, match="column 8"):
        grad_workers(HOLDERS, LayerDistribution(parse_strategy("mem-opt"), 8))


def test_lpt_columns_balance_cost() -> None:
    costs = {"a": 8.0, "b": 5.0, "c": 4.0, "d": 3.0, "e": 1.0}
    assert least_loaded(costs, range(2)) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}  # loads 11 and 10


def test_holdings_per_strategy() -> None:
    holders = (0, 1, 2, 3)
    comm = holding(2, holders, LayerDistribution(COMM_OPT))
    assert (comm.statistics, comm.decompositions, comm.shares_gradient) == (True, True, False)
    mem = LayerDistribution(parse_strategy("mem-opt"), 1)
    assert [holding(r, holders, mem).decompositions for r in holders] == [False, True, False, False]
    assert all(holding(r, holders, mem).statistics for r in holders), "KAISA replicates the factors"
    dp = LayerDistribution(parse_strategy("dp-kfac"), 3)
    assert [holding(r, holders, dp).statistics for r in holders] == [False, False, False, True]
    assert [holding(r, holders, mem, gradient_fed=True).statistics for r in holders] == [False, True, False, False]


def test_mem_opt_tail_applies_own_layers_and_broadcasts_every_layer() -> None:
    from fxkfac.planner.problem.ir import LayerTiming

    timings = {n: LayerTiming(1, 0, 0, "deferred") for n in ("x", "y")}
    where = {"x": LayerDistribution(parse_strategy("mem-opt"), 0), "y": LayerDistribution(parse_strategy("mem-opt"), 1)}
    step = naive_programs("gpipe", 1, 1, 2, timings, {0: ["x", "y"]}, distributions=where)[1][0]
    tail = step[step.index(Op(OpKind.ALLREDUCE_GRAD, 0)) + 1 : -1]  # between the gradients' sync and OPT_STEP
    assert tail == [
        Op(OpKind.SYNC_STATS, 0, layer="x"),
        Op(OpKind.SYNC_STATS, 0, layer="y"),
        Op(OpKind.DECOMP, 0, layer="y", part="A"),
        Op(OpKind.DECOMP, 0, layer="y", part="B"),
        Op(OpKind.APPLY, 0, layer="y"),
        Op(OpKind.BCAST_PREC, 0, root=0, layer="x"),
        Op(OpKind.BCAST_PREC, 0, root=1, layer="y"),
    ]
