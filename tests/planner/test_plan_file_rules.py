"""Each shape rule of the plan file reader refuses a file broken its way with a PlanFormatError naming what is wrong:
the validator assumes a well-formed plan, so these rules stand between a file and it."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from fxkfac.planner.problem.costs import CostTable, StageCost
from fxkfac.planner.problem.errors import PlanFormatError
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import parse_plan
from tests.planner.kfac_cases import gradient_layer, problem

Tree = dict[str, Any]


@cache
def _text(kind: str = "kfac") -> str:
    """kfac: a small plan with every kind of K-FAC op (W=2: curvature sync and inverse broadcast) and start-up steps;
    zb: zero bubble with placed W's; gradient: Shampoo-like layers (STATS of the reduced gradient)."""
    if kind == "zb":
        return solve(problem("zb-h1", 2, 2, curv=0.25, max_overhead=0.5, max_period=8), method="greedy").to_json()
    if kind == "gradient":
        stages = tuple(StageCost(1.0, 2.0, 1000, 50, (gradient_layer(f"l{s}_0"),)) for s in range(2))
        return solve(Problem("1f1b", 2, 2, CostTable(stages, 1, "test", "cpu")), method="greedy").to_json()
    return solve(problem("1f1b", 2, 2, W=2, layers=2, curv=0.25, inv=0.5), method="greedy").to_json()


def _placed(op: str | None = None, **fields: Any) -> Callable[[Tree], None]:
    """Set the first placement's op text and fields."""

    def edit(tree: Tree) -> None:
        tree["placements"][0].update(fields if op is None else {"op": op, **fields})

    return edit


def _set(*path: str | int, value: Any) -> Callable[[Tree], None]:
    def edit(tree: Tree) -> None:
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _renamed_rank(tree: Tree) -> None:
    tree["programs"]["7"] = tree["programs"].pop("3")


def _startup_swapped(tree: Tree) -> None:
    lines = tree["startup"]["0"][0].split("\n")
    lines[0], lines[1] = lines[1], lines[0]
    tree["startup"]["0"][0] = "\n".join(lines)


BROKEN: dict[str, tuple[Callable[[Tree], None], str]] = {
    "kind": (_placed("F s0 m0"), "only the preconditioner's ops are placed"),
    "stage": (_placed("DECOMP s9 A l0_0"), "DECOMP s9 A l0_0: no such stage"),
    "rank_of_stage": (_placed(device=2), "is placed on r2, which does not run its stage"),
    "part": (_placed("STATS s0 m0 C l0_0"), "stage 0 has no layer 'l0_0' or the layer has no such part"),
    "layer": (_placed("APPLY s0 BOGUS"), "stage 0 has no layer 'BOGUS'"),
    "micro_batch": (_placed("STATS s0 A l0_0"), "is fed by a capture, so its STATS names a micro-batch"),
    "no_micro_batch": (_placed("STATS s0 m7 A l0_0"), "r0 runs no such micro-batch of the stage"),
    "w": (_placed("W s0 m0"), "no such W of the schedule is placed"),
    "device": (_placed(device=9), "no rank 9"),
    "step": (_placed(step=-1), "step must be an int >= 0"),
    "span": (_placed(start=3.0, end=2.0), "start and end must be finite, start <= end"),
    "ranks": (_renamed_rank, "programs for ranks [0, 1, 2, 7], the mesh has [0, 1, 2, 3]"),
    "empty_program": (_set("programs", "0", value=[]), "every rank's program needs at least one step"),
    "program_op": (_set("programs", "0", 0, value="DECOMP s0 A BOGUS\n"), "stage 0 has no layer 'BOGUS'"),
    "metric": (_set("metrics", "step_time", value=-1.0), "metrics.step_time must be a finite number >= 0"),
    "per_stage": (_set("metrics", "refresh_steps", value=[2]), "metrics.refresh_steps needs one entry per stage"),
    "ints": (_set("metrics", "lower_bound_steps", value=[2, 2.5]), "metrics.lower_bound_steps must hold ints"),
    "peak": (_set("metrics", "peak_memory", "0", value=1.5), "metrics.peak_memory maps ranks to bytes"),
    "solver": (_set("metrics", "solver", "gap", value=float("nan")), "metrics.solver is malformed"),
    "quantum": (_set("metrics", "time_quantum", value=1.0), "coarser than 1% of the step"),
    "utilization": (_set("metrics", "utilization", value=1.5), "utilization above 100%"),
    "startup_rank": (_set("startup", "9", value=["OPT_STEP\n"]), "start-up steps for ranks that have no program"),
    "startup_count": (_set("startup", "0", value=[]), "rank 0 has 0 start-up steps, its placements call for 1"),
    "startup_steps": (_startup_swapped, "the start-up steps are not the programs' first steps"),
    "fingerprint": (_set("fingerprint", value=1), "fingerprint must be a string"),
    "mesh": (_set("problem", "N", value=True), "problem.D/N/v must be ints"),
    "layers": (_set("layers", value={}), "are not the cost table's"),
    "timing": (_set("layers", "l0_0", "period", value=0), "layer l0_0: period, curv_step and use_offset must be ints"),
    "zb/w_layer": (_placed("W s0 m0 BOGUS"), "no layer BOGUS there"),
    "gradient/fed": (
        _placed("STATS s0 m0 L l0_0"),
        "is fed by the reduced gradient, so its STATS names no micro-batch",
    ),
}


def test_the_plan_parses() -> None:
    assert parse_plan(_text()).to_json() == _text()


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_plan_file_is_refused_with_its_rule(case: str) -> None:
    edit, message = BROKEN[case]
    tree = json.loads(_text(case.split("/")[0] if "/" in case else "kfac"))
    edit(tree)
    with pytest.raises(PlanFormatError) as refused:
        parse_plan(json.dumps(tree))
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "text,message",
    [("{", "not valid JSON"), ("[]", "a plan must be a JSON object, got list"), ("{}", "unknown plan schema_version")],
)
def test_text_that_is_no_plan_is_refused(text: str, message: str) -> None:
    with pytest.raises(PlanFormatError, match=message):
        parse_plan(text)
