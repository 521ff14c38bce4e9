"""`solve` finds every stage group's refresh period before it refines any group's stretch and staleness, so time a
group found at its bound does not need goes to the groups still searching."""

from __future__ import annotations

from typing import Any

import pytest

from fxkfac.planner.problem.problem import Problem, SolverConfig, StepBarrier
from fxkfac.planner.problem.profiles import load_cost_table
from fxkfac.planner.search import group_search
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problem


def test_every_group_gets_its_period_before_any_is_refined(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple[int, ...]]] = []
    least, refine = group_search.least_group_period, group_search.refine_group

    def period(shape: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(("period", shape.group.stages))
        return least(shape, *args, **kwargs)

    def refined(period: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(("refine", period.shape.group.stages))
        return refine(period, *args, **kwargs)

    monkeypatch.setattr(group_search, "least_group_period", period)
    monkeypatch.setattr(group_search, "refine_group", refined)
    p = problem("1f1b", 2, 2, fwd=1, bwd=2, curv=1, inv=2, prec=1, max_period=6)
    plan = solve(p, SolverConfig(time_limit_s=2.0))
    assert validate(p, plan) == []
    assert calls == [("period", (0,)), ("period", (1,)), ("refine", (0,)), ("refine", (1,))]


def test_the_paper_bert_base_chimera_inner_stages_get_the_time_the_outer_ones_leave() -> None:
    """On the paper's BERT-Base Chimera D=4 profiles (4 pieces, no world barrier) the outer stages' period is found
    at its bound at once; with their staleness refined after every period, the inner stages' search has the time
    to reach 9 in the default 10 s (10 while each group refined before the next searched)."""
    costs = load_cost_table("paper:bert-base/p100", blocks_per_stage=3, n_stages=4, micro_batch_size=32)
    p = Problem("chimera", 4, 4, costs, decomp_pieces=4, barrier=StepBarrier.AGREEMENT_SET)
    plan = solve(p, SolverConfig(time_limit_s=10.0))
    assert validate(p, plan) == []
    assert plan.metrics.refresh_steps[0] == plan.metrics.refresh_steps[3] == plan.metrics.lower_bound_steps[0] == 8
    assert plan.metrics.refresh_steps[1] == plan.metrics.refresh_steps[2] <= 9
