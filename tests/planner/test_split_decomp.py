"""Decompositions in pieces (Problem.decomp_pieces, KFACConfig.split_inverse): placed in order on one rank by
both solvers, where a whole inversion fits no bubble; the validator checks the chain; plans keep the count.
Warm-started decompositions (Problem.warm_start: SOAP's QR basis): each refresh is made before the next one
decomposes, by both solvers and in the validator's eyes."""

from __future__ import annotations

import dataclasses

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import SolverConfig
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import parse_plan
from tests.planner.kfac_cases import problem

FAST = SolverConfig(time_limit_s=4.0, num_workers=2)
LONG = problem("1f1b", 2, 2, fwd=1, bwd=2, curv=0.5, inv=3, prec=0.5, max_period=8)
"""An inversion (3 s) longer than every bubble of its 1F1B step."""


def test_a_whole_inversion_longer_than_every_bubble_cannot_be_placed() -> None:
    with pytest.raises(PlanError, match="cannot fit any bubble"):
        solve(LONG, FAST, method="greedy")


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_pieces_are_placed_in_order_on_one_rank(method: str) -> None:
    split = dataclasses.replace(LONG, decomp_pieces=3)
    plan = solve(split, FAST, method=method)
    assert validate(split, plan) == []
    decomps = [p for p in plan.placements if p.op.kind is OpKind.DECOMP]
    assert len(decomps) == 3 * 2 * 2  # 3 pieces of A and B of one layer per stage
    for layer in {p.op.layer for p in decomps}:
        for part in "AB":
            chain = sorted((p for p in decomps if (p.op.layer, p.op.part) == (layer, part)), key=lambda p: p.op.piece)
            assert [p.op.piece for p in chain] == [(0, 3), (1, 3), (2, 3)]
            assert len({p.device for p in chain}) == 1
            assert all(a.end <= b.start + 1e-9 for a, b in zip(chain, chain[1:]))
            assert all(p.end - p.start == pytest.approx(1.0) for p in chain)
    assert parse_plan(plan.to_json()).problem.decomp_pieces == 3


def test_the_validator_refuses_pieces_out_of_order_or_apart() -> None:
    split = dataclasses.replace(LONG, decomp_pieces=3)
    plan = solve(split, FAST, method="greedy")
    placements = list(plan.placements)
    first, second = (
        next(
            i
            for i, p in enumerate(placements)
            if p.op.kind is OpKind.DECOMP and p.op.layer == "l0_0" and p.op.part == "A" and p.op.piece == (j, 3)
        )
        for j in (0, 1)
    )
    a, b = placements[first], placements[second]
    swapped = list(placements)
    swapped[first] = dataclasses.replace(a, op=b.op)
    swapped[second] = dataclasses.replace(b, op=a.op)
    errors = validate(split, dataclasses.replace(plan, placements=tuple(swapped)))
    assert any("DECOMP s0 A 1/3 l0_0 starts at" in e and "before DECOMP s0 A 0/3 l0_0 ends" in e for e in errors)
    other = next(d for d in split.devices if d != b.device)
    apart = list(placements)
    apart[second] = dataclasses.replace(b, device=other)
    errors = validate(split, dataclasses.replace(plan, placements=tuple(apart)))
    assert any("the pieces of a decomposition run on one rank" in e for e in errors), errors


def test_the_validator_refuses_a_refresh_unfinished_when_the_next_one_starts_its_pieces() -> None:
    split = dataclasses.replace(LONG, decomp_pieces=3)
    plan = solve(split, FAST, method="cpsat")
    placements = list(plan.placements)
    last_b = next(
        i
        for i, p in enumerate(placements)
        if p.op.kind is OpKind.DECOMP and p.op.layer == "l0_0" and p.op.part == "B" and p.op.piece == (2, 3)
    )
    late = placements[last_b]
    placements[last_b] = dataclasses.replace(late, start=late.start + 1000.0, end=late.end + 1000.0)
    errors = validate(split, dataclasses.replace(plan, placements=tuple(placements)))
    assert any("DECOMP s0 B 2/3 l0_0 is done after the next refresh of l0_0 starts decomposing" in e for e in errors), (
        errors
    )


WARM = problem("gpipe", 2, 2, W=2, fwd=1, bwd=2, curv=0.25, inv=1.5, prec=0.25, max_period=8, warm_start=True)
"""Whole decompositions that start from the layer's previous preconditioner (SOAP's QR basis), on two copies of
each stage (so each part is broadcast)."""


def _unfinished_at_next_start(plan: Plan) -> list[str]:
    """Each DECOMP or BCAST of a refresh done after the next refresh (one window later) starts decomposing its
    layer, read from the placements alone."""
    length = {s: plan.metrics.step_time * k for s, k in enumerate(plan.metrics.refresh_steps)}
    stage = {x.name: s for s, st in enumerate(plan.problem.costs.stages) for x in st.layers}
    work = [p for p in plan.placements if p.op.kind in (OpKind.DECOMP, OpKind.BCAST)]
    late = []
    for layer in {p.op.layer for p in work}:
        mine = [p for p in work if p.op.layer == layer]
        next_start = min(p.start for p in mine if p.op.kind is OpKind.DECOMP) + length[stage[layer]]
        late += [str(p.op) for p in mine if (p.end if p.op.kind is OpKind.DECOMP else p.start) > next_start + 1e-6]
    return late


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_a_warm_started_refresh_is_made_before_the_next_one_decomposes(method: str) -> None:
    plan = solve(WARM, FAST, method=method)
    assert validate(WARM, plan) == []
    assert _unfinished_at_next_start(plan) == []
    assert any(p.op.kind is OpKind.BCAST for p in plan.placements)
    assert parse_plan(plan.to_json()).problem.warm_start


def test_the_validator_refuses_a_warm_started_refresh_unfinished_when_the_next_one_decomposes() -> None:
    plan = solve(WARM, FAST, method="cpsat")
    placements = list(plan.placements)
    i = next(n for n, p in enumerate(placements) if p.op.kind is OpKind.DECOMP and p.op.part == "B")
    late = placements[i]
    placements[i] = dataclasses.replace(late, start=late.start + 1000.0, end=late.end + 1000.0)
    moved = dataclasses.replace(plan, placements=tuple(placements))
    message = f"{late.op} is done after the next refresh of {late.op.layer} starts decomposing"
    assert any(message in e for e in validate(WARM, moved))
    cold = dataclasses.replace(WARM, warm_start=False)
    assert not any(message in e for e in validate(cold, dataclasses.replace(moved, problem=cold)))
