"""Streamed preconditioning in the planner (planner/problem/lowering.py): the hand-off ops, the step they make, the
choice of helper and layers, plans at their bound that the validator accepts, and the validator refusing broken
hand-offs."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import PlanError, PlanFormatError
from fxkfac.planner.problem.ir import LAYER_TRANSFER_KINDS, Op, OpKind, format_programs, parse_programs
from fxkfac.planner.problem.lowering import Streaming, ready_fractions, stream_step
from fxkfac.planner.problem.problem import Problem, SolverConfig, stage_groups
from fxkfac.planner.problem.profiles import load_cost_table
from fxkfac.planner.problem.step_timeline import (
    plain_step_time,
    reference_programs,
    refresh_lower_bound,
    simulate,
    static_bytes,
    step_timeline,
)
from fxkfac.planner.problem.strategy import LayerDistribution, Strategy, StrategyKind
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.plan_search import StreamApply, solve_streamed, with_streaming
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import parse_plan

ARTIFACTS = Path(__file__).parent / "artifacts"


def _paper(schedule: str = "1f1b", D: int = 4) -> CostTable:
    """BERT-Base's measured P100 profile, three blocks (the profile's layers) per stage."""
    return load_cost_table("paper:bert-base/p100", blocks_per_stage=3, n_stages=D, micro_batch_size=32)


@pytest.fixture(scope="module")
def streamed() -> Problem:
    return with_streaming(Problem("1f1b", 4, 4, _paper(), decomp_pieces=4))


@pytest.fixture(scope="module")
def plan(streamed: Problem) -> Plan:
    return solve(streamed, SolverConfig(time_limit_s=10))


def test_transfers_print_and_parse_back() -> None:
    for kind in LAYER_TRANSFER_KINDS:
        op = Op(kind, 0, peer=3, layer="bert.encoder.layer.0.output.dense")
        assert Op.parse(str(op)) == op
        with pytest.raises(PlanFormatError):
            Op(kind, 0, layer="fc")  # no peer
    assert str(Op(OpKind.SEND_LGRAD, 0, peer=1, layer="fc")) == "SEND_LGRAD s0 >r1 fc"


def test_ready_fractions_follow_the_backward_in_reverse() -> None:
    """Layers in forward order a (4 bytes of gradient), b (12): the backward makes b's gradient final three quarters
    of the way through, then a's at its end."""
    a = LayerCost.kfac("a", 0, 0, 0, 0, 0, 0, 0, 4, 4, grad_bytes=4)
    b = LayerCost.kfac("b", 0, 0, 0, 0, 0, 0, 0, 4, 4, grad_bytes=12)
    assert ready_fractions(StageCost(1.0, 2.0, 0, 0, (a, b))) == {"b": 0.75, "a": 1.0}


def test_profiled_readiness_replaces_the_estimate() -> None:
    """Where every layer of the stage has its profiled `grad_ready`, it gives the share (at most the whole
    backward); one layer without it and the estimate stands for all."""
    a = LayerCost.kfac("a", 0, 0, 0, 0, 0, 0, 0, 4, 4, grad_bytes=4)
    b = LayerCost.kfac("b", 0, 0, 0, 0, 0, 0, 0, 4, 4, grad_bytes=12)
    timed = (replace(a, grad_ready=2.5), replace(b, grad_ready=0.5))
    assert ready_fractions(StageCost(1.0, 2.0, 0, 0, timed)) == {"a": 1.0, "b": 0.25}
    assert ready_fractions(StageCost(1.0, 2.0, 0, 0, (timed[0], b))) == {"b": 0.75, "a": 1.0}


def test_stream_step_hands_off_after_the_last_backward() -> None:
    ops = {
        0: [Op(OpKind.FWD, 0, 0), Op(OpKind.BWD, 0, 0), Op(OpKind.APPLY, 0, layer="k"), Op(OpKind.OPT_STEP)],
        1: [Op(OpKind.FWD, 1, 0), Op(OpKind.BWD, 1, 0), Op(OpKind.OPT_STEP)],
    }
    out = stream_step(ops, Streaming(0, (1,), ("x",)), owners=(0,))
    assert out[0] == [
        Op(OpKind.FWD, 0, 0),
        Op(OpKind.BWD, 0, 0),
        Op(OpKind.SEND_LGRAD, 0, peer=1, layer="x"),
        Op(OpKind.APPLY, 0, layer="k"),
        Op(OpKind.RECV_PGRAD, 0, peer=1, layer="x"),
        Op(OpKind.OPT_STEP),
    ]
    assert out[1][2:] == [
        Op(OpKind.RECV_LGRAD, 0, peer=0, layer="x"),
        Op(OpKind.APPLY, 0, layer="x"),
        Op(OpKind.SEND_PGRAD, 0, peer=0, layer="x"),
        Op(OpKind.OPT_STEP),
    ]


def test_two_helpers_each_take_their_own_layers() -> None:
    """Layers x (to r1) and y (to r2): the owner sends each to its helper and takes it back from it; each helper
    receives, applies and returns its own layer only."""
    ops = {
        0: [Op(OpKind.BWD, 0, 0), Op(OpKind.OPT_STEP)],
        1: [Op(OpKind.BWD, 1, 0), Op(OpKind.OPT_STEP)],
        2: [Op(OpKind.BWD, 2, 0), Op(OpKind.OPT_STEP)],
    }
    streaming = Streaming(0, (1, 2), ("x", "y"))
    assert (streaming.ranks, streaming.layers_of(2), streaming.helper_of("x")) == ((1, 2), ("y",), 1)
    out = stream_step(ops, streaming, owners=(0,))
    assert out[0] == [
        Op(OpKind.BWD, 0, 0),
        Op(OpKind.SEND_LGRAD, 0, peer=1, layer="x"),
        Op(OpKind.SEND_LGRAD, 0, peer=2, layer="y"),
        Op(OpKind.RECV_PGRAD, 0, peer=1, layer="x"),
        Op(OpKind.RECV_PGRAD, 0, peer=2, layer="y"),
        Op(OpKind.OPT_STEP),
    ]
    for helper, layer in ((1, "x"), (2, "y")):
        assert out[helper][1:] == [
            Op(OpKind.RECV_LGRAD, 0, peer=0, layer=layer),
            Op(OpKind.APPLY, 0, layer=layer),
            Op(OpKind.SEND_PGRAD, 0, peer=0, layer=layer),
            Op(OpKind.OPT_STEP),
        ]


def test_streaming_reads_plans_of_one_helper_and_refuses_a_helper_short() -> None:
    """A plan written when streaming had one helper ({"helper": r}) reads as that helper for every layer; a helper
    missing for a layer is a format error."""
    old = {"stage": 0, "helper": 3, "layers": ["b", "a"]}
    assert Streaming.from_dict(old) == Streaming(0, (3, 3), ("b", "a"))
    with pytest.raises(PlanFormatError, match="a helper rank"):
        Streaming(0, (3,), ("b", "a"))


def test_a_streamed_send_leaves_its_lead_before_the_backward_ends() -> None:
    """B takes 1 s; the gradient leaves 0.3 s before it ends, the helper's APPLY (0.5 s) starts at 0.7."""
    programs = {
        0: [Op(OpKind.BWD, 0, 0), Op(OpKind.SEND_LGRAD, 0, peer=1, layer="x")],
        1: [Op(OpKind.RECV_LGRAD, 0, peer=0, layer="x"), Op(OpKind.APPLY, 0, layer="x")],
    }
    durations = {OpKind.BWD: 1.0, OpKind.APPLY: 0.5}
    timeline = simulate(
        programs,
        lambda _, op: durations.get(op.kind, 0.0),
        lead=lambda _, op: 0.3 if op.kind is OpKind.SEND_LGRAD else 0.0,
    )
    apply = next(iv for iv in timeline.of_rank(1) if iv.op.kind is OpKind.APPLY)
    assert (apply.start, apply.end) == pytest.approx((0.7, 1.2))


def test_streaming_takes_all_but_the_last_ready_block_off_the_cycle(streamed: Problem) -> None:
    """BERT-Base 1F1B D=4: stage 0's blocks 2 and 1 go to another rank; block 0's gradient is final only when the
    backward ends, so its APPLY stays on the cycle wherever it runs: the step is the plain one plus block 0's APPLY,
    where without streaming it is plus the whole stage's; no stage's least refresh period rises."""
    assert streamed.streaming is not None and streamed.streaming.layers == ("block2", "block1")
    assert 0 not in streamed.streaming.ranks
    plain = plain_step_time(streamed)
    stage = streamed.costs.stages[0]
    unstreamed = replace(streamed, streaming=None)
    assert math.isclose(step_timeline(unstreamed).length, plain + stage.prec, rel_tol=1e-9)
    assert math.isclose(step_timeline(streamed).length, plain + streamed.costs.layer("block0").prec, rel_tol=1e-9)
    groups = stage_groups(streamed)
    assert [refresh_lower_bound(streamed, g) for g in groups] == [refresh_lower_bound(unstreamed, g) for g in groups]


def test_the_streamed_plan_is_at_its_bound_valid_and_round_trips(streamed: Problem, plan: Plan) -> None:
    assert plan.metrics.refresh_steps == plan.metrics.lower_bound_steps
    assert validate(streamed, plan) == []
    assert parse_plan(plan.to_json()) == plan
    helper = plan.programs[streamed.streaming.helpers[0]]
    assert any(op.kind is OpKind.RECV_REPLICA for step in helper for op in step)
    assert any(op == Op(OpKind.APPLY, 0, layer="block2") for step in helper for op in step)


def _mutated(plan: Plan, rank: int, edit) -> Plan:
    """`plan` with rank's program steps edited by `edit(steps) -> steps` (through its text, as a file would be)."""
    programs = parse_programs(format_programs(plan.programs))
    programs[rank] = edit(programs[rank])
    return replace(plan, programs=programs)


def _without(kind: OpKind):
    return lambda steps: [[op for op in step if op.kind is not kind] for step in steps]


def _replica_after_apply(steps):
    """Every RECV_REPLICA moved to its step's end, after the APPLY it feeds."""
    out = []
    for step in steps:
        moved = [op for op in step if op.kind is OpKind.RECV_REPLICA]
        rest = [op for op in step if op.kind is not OpKind.RECV_REPLICA]
        out.append(rest[:-1] + moved + rest[-1:])
    return out


@pytest.mark.parametrize(
    ("rank", "edit", "says"),
    [
        (0, _without(OpKind.RECV_PGRAD), "RECV_PGRAD"),
        (0, _without(OpKind.SEND_LGRAD), "SEND_LGRAD"),
        (None, _without(OpKind.SEND_PGRAD), "received, applied and returned"),
        (None, _without(OpKind.RECV_REPLICA), "replicas"),
        (0, lambda steps: [step[:-1] + [Op(OpKind.APPLY, 0, layer="block2"), step[-1]] for step in steps], "applies"),
        (  # block2's helper also applies block1, which the other helper preconditions
            None,
            lambda steps: [step[:-1] + [Op(OpKind.APPLY, 0, layer="block1"), step[-1]] for step in steps],
            "which it does not precondition",
        ),
    ],
)
def test_the_validator_refuses_broken_hand_offs(plan: Plan, streamed: Problem, rank, edit, says: str) -> None:
    """Each edit of the owner's (0) or the helper's (None) program breaks the hand-off the validator names."""
    rank = streamed.streaming.helpers[0] if rank is None else rank
    errors = validate(streamed, _mutated(plan, rank, edit), run=False)
    assert any(says in e for e in errors), errors


def test_the_validator_refuses_a_replica_taken_after_its_first_use(plan: Plan, streamed: Problem) -> None:
    """Where a refresh is first used in the step that makes it, the helper must take the replica before its APPLY;
    taken at the step's end it is late (the runtime would refuse: PipelineError)."""
    mine = streamed.streaming.layers_of(streamed.streaming.helpers[0])
    same_step = [n for n in mine if plan.layers[n].use_offset == _made_step(plan, n)]
    broken = _mutated(plan, streamed.streaming.helpers[0], _replica_after_apply)
    errors = validate(streamed, broken, run=False)
    assert bool(same_step) == any("before the replica" in e for e in errors), (same_step, errors)


def _made_step(plan: Plan, layer: str) -> int:
    return max(p.step for p in plan.placements if p.op.kind is OpKind.DECOMP and p.op.layer == layer)


def test_the_helper_holds_the_replicas_and_the_gradients(streamed: Problem) -> None:
    """Two decompositions of each replica and two copies of each streamed gradient on the helper, one gradient
    buffer on the owner."""
    alone = replace(streamed, streaming=None)
    for helper in streamed.streaming.ranks:
        layers = [streamed.costs.layer(n) for n in streamed.streaming.layers_of(helper)]
        grads, factors = sum(x.gradient_bytes for x in layers), sum(x.factor_bytes for x in layers)
        assert static_bytes(streamed, helper) - static_bytes(alone, helper) == 2 * grads + 2 * factors
    grads = sum(streamed.costs.layer(n).gradient_bytes for n in streamed.streaming.layers)
    assert static_bytes(streamed, 0) - static_bytes(alone, 0) == grads
    others = [d for d in streamed.devices if d not in (0, *streamed.streaming.ranks)]
    assert [static_bytes(streamed, d) for d in others] == [static_bytes(alone, d) for d in others]


def test_streaming_needs_a_helper_without_the_stage_and_a_stateless_comm_opt_apply() -> None:
    costs = _paper()
    with pytest.raises(PlanError, match="holds no copy"):
        Problem("1f1b", 4, 4, costs, W=2, streaming=Streaming(0, (1,), ("block2",)))  # ranks 0 and 1 hold stage 0
    with pytest.raises(PlanError, match="holds no copy"):
        Problem("1f1b", 4, 4, costs, streaming=Streaming(0, (0,), ("block2",)))
    mem_opt = LayerDistribution(Strategy(StrategyKind.MEM_OPT), 0)
    spread = Problem("1f1b", 4, 4, costs, W=2).with_distributions({"block2": mem_opt})
    with pytest.raises(PlanError, match="COMM-OPT"):
        replace(spread, streaming=Streaming(0, (6,), ("block2",)))
    streamed = replace(Problem("1f1b", 4, 4, costs, W=2), streaming=Streaming(0, (6,), ("block2",)))
    assert streamed.with_distributions({"block2": mem_opt}).where("block2") == LayerDistribution()
    stateful = replace(
        costs,
        stages=(replace(costs.stages[0], layers=(replace(costs.stages[0].layers[0], state_bytes=8),)),)
        + costs.stages[1:],
    )
    with pytest.raises(PlanError, match="keeps state"):
        Problem("1f1b", 4, 4, stateful, streaming=Streaming(0, (3,), (stateful.stages[0].layers[0].name,)))


def test_nothing_streams_where_every_rank_holds_the_first_stage() -> None:
    one_stage_costs = CostTable((StageCost(1.0, 2.0, 0, 0, _paper().stages[0].layers),), 32, "t", "t")
    for problem in (Problem("gpipe", 1, 2, one_stage_costs), Problem("gpipe", 1, 2, one_stage_costs, W=2)):
        assert with_streaming(problem) is problem


def test_copies_of_the_first_stage_stream_to_one_helper_which_sums_them() -> None:
    """BERT-Base 1F1B D=4 W=2: stage 0's copies (ranks 0, 1) each send their own gradient of a streamed block; the
    helper receives both, applies once and returns to both; the plan is valid and the step shorter than without."""
    problem = Problem("1f1b", 4, 4, _paper(), W=2, decomp_pieces=4)
    streamed = with_streaming(problem)
    assert streamed.streaming is not None and streamed.stream_owners == (0, 1)
    assert step_timeline(streamed).length < step_timeline(problem).length
    helper = reference_programs(streamed)[streamed.streaming.helpers[0]]
    layer = streamed.streaming.layers[0]
    chain = [op for op in helper if op.layer == layer and op.kind is not OpKind.RECV_REPLICA]
    assert [(op.kind, op.peer) for op in chain] == [
        (OpKind.RECV_LGRAD, 0),
        (OpKind.RECV_LGRAD, 1),
        (OpKind.APPLY, None),
        (OpKind.SEND_PGRAD, 0),
        (OpKind.SEND_PGRAD, 1),
    ]
    plan = solve(streamed, SolverConfig(time_limit_s=10))
    assert validate(streamed, plan) == []


def test_a_problem_without_a_streamed_plan_is_planned_without_streaming(streamed: Problem) -> None:
    """`solve_streamed` solves the streamed problem first, searching no suggestions (its refusal is only logged);
    where that has no plan, the problem as given, whose refusal would be raised with its suggestions."""
    base = replace(streamed, streaming=None)
    tried: list[tuple[Streaming | None, bool]] = []

    def refuses_streaming(problem: Problem, budget: Budget, *, suggest: bool = True) -> str:
        tried.append((problem.streaming, suggest))
        if problem.streaming is not None:
            raise PlanError("no placement within 32 steps")
        return "planned"

    assert solve_streamed(base, refuses_streaming) == "planned"
    assert tried == [(streamed.streaming, False), (None, True)]
    tried.clear()
    assert solve_streamed(base, refuses_streaming, StreamApply.OFF) == "planned"
    assert tried == [(None, True)]


def _fake_plan(periods: tuple[int, ...], step: float) -> SimpleNamespace:
    """What `solve_streamed` reads of a plan: its metrics (`planner.plan.rank`)."""
    return SimpleNamespace(
        metrics=SimpleNamespace(refresh_steps=periods, step_time=step, peak_memory={0: 1}, step_time_reference=step)
    )


def test_a_streamed_plan_that_refreshes_less_often_loses_to_the_plan_without(streamed: Problem) -> None:
    """At the unstreamed bounds (3 3 3 3) the streamed plan is kept unsolved against; above them the problem is
    solved without streaming too, and the plan that refreshes more often wins, whatever its step; unless the user
    asked for the shortest step (StreamApply.SHORTEST_STEP), which keeps the streamed plan."""
    base = replace(streamed, streaming=None)
    cases = (
        ((3, 3, 3, 3), StreamApply.KEEP_REFRESH, "streamed", 1),
        ((3, 3, 4, 3), StreamApply.KEEP_REFRESH, "alone", 2),
        ((3, 3, 4, 3), StreamApply.SHORTEST_STEP, "streamed", 1),
    )
    for streamed_periods, policy, want, solves in cases:
        plans = {True: _fake_plan(streamed_periods, 0.55), False: _fake_plan((3, 3, 3, 3), 0.57)}
        calls: list[bool] = []

        def solve(
            problem: Problem, budget: Budget, *, suggest: bool = True, plans=plans, calls=calls
        ) -> SimpleNamespace:
            calls.append(problem.streaming is not None)
            return plans[calls[-1]]

        got = solve_streamed(base, solve, policy)
        assert got is plans[want == "streamed"] and len(calls) == solves, (streamed_periods, policy, calls)


def test_the_shortest_step_streams_chimera_at_the_cost_of_a_refresh() -> None:
    """BERT-Base Chimera D=4 (paper profiles): every streaming raises the inner stages' least refresh period, so
    KEEP_REFRESH streams nothing; SHORTEST_STEP streams and shortens the step."""
    problem = Problem("chimera", 4, 4, _paper(), decomp_pieces=4)
    assert with_streaming(problem) is problem
    shortest = with_streaming(problem, keep_bounds=False)
    assert shortest.streaming is not None
    assert step_timeline(shortest).length < step_timeline(problem).length


def test_a_compiled_stage_shares_its_apply_at_the_backwards_end() -> None:
    """Compiled stages make every gradient at the backward's end (`Streaming.whole_backward`): nothing overlaps the
    backward, and the helpers only apply their blocks beside the owner. BERT-Base 1F1B's three equal blocks: the
    owner keeps one and two helpers take one each, side by side, so the step is the plain one plus one block's APPLY
    and its two transfers, where one helper taking both is plus two blocks and the transfers, and no streaming plus
    three blocks."""
    problem = Problem("1f1b", 4, 4, _paper(), decomp_pieces=4)
    shared = with_streaming(problem, whole_backward=True)
    assert shared.streaming is not None and shared.streaming.whole_backward
    assert shared.streaming.layers == ("block2", "block1") and len(shared.streaming.ranks) == 2
    block = problem.costs.layer("block0").prec
    send = problem.costs.collective_seconds(Op(OpKind.SEND_LGRAD, 0, peer=1, layer="block0"), 2)
    assert math.isclose(step_timeline(shared).length, plain_step_time(problem) + block + 2 * send, rel_tol=1e-9)
    one = replace(shared, streaming=replace(shared.streaming, helpers=shared.streaming.helpers[:1] * 2))
    assert math.isclose(step_timeline(one).length, plain_step_time(problem) + 2 * block + 2 * send, rel_tol=1e-9)
    assert Streaming.from_dict(shared.streaming.to_dict()) == shared.streaming


def test_streamed_transfers_take_their_time_on_the_comm_model(streamed: Problem) -> None:
    """Streaming every block, the last (block 0) reaches the helper a transfer after the backward ends, is applied
    there and comes back a transfer later: the step is the plain one plus both transfers and its APPLY (the cost
    table's P100 comm model prices a 41 MB gradient at 0.516 ms)."""
    every = replace(
        streamed, streaming=Streaming(0, streamed.streaming.helpers[:1] * 3, ("block2", "block1", "block0"))
    )
    send = every.costs.collective_seconds(Op(OpKind.SEND_LGRAD, 0, peer=1, layer="block0"), 2)
    back = every.costs.collective_seconds(Op(OpKind.SEND_PGRAD, 0, peer=0, layer="block0"), 2)
    assert send > 0 and send == back
    want = plain_step_time(every) + send + every.costs.layer("block0").prec + back
    assert math.isclose(step_timeline(every).length, want, rel_tol=1e-9)


def test_the_owner_pays_its_hand_off_in_the_backward_and_its_take_back_when_the_result_lands(
    streamed: Problem,
) -> None:
    """With each streamed layer's owner-side work priced (1 ms making its message in the gradient hooks, 2 ms
    installing the result), the owner's backward ends its three hooks later, the last layer's message leaves after
    them, and its return costs the owner 2 ms more: the step grows by 3 x 1 ms + 2 ms over the same step unpriced."""
    every = replace(
        streamed, streaming=Streaming(0, streamed.streaming.helpers[:1] * 3, ("block2", "block1", "block0"))
    )
    first = every.costs.stages[0]
    layers = tuple(replace(x, hand_off=1e-3, take_back=2e-3) for x in first.layers)
    priced = replace(every, costs=replace(every.costs, stages=(replace(first, layers=layers), *every.costs.stages[1:])))
    timeline = step_timeline(priced)
    assert math.isclose(timeline.length, step_timeline(every).length + 3 * 1e-3 + 2e-3, rel_tol=1e-9)
    sends = [b - a for op, a, b in timeline.ops[0] if op.kind is OpKind.SEND_LGRAD]
    assert sends == pytest.approx([1e-3] * 3)
    assert plain_step_time(priced) == plain_step_time(every)  # the plain pipeline streams nothing


def test_a_plan_places_nothing_over_the_owners_hand_off(streamed: Problem) -> None:
    """With 20 ms of hand-off per streamed layer, the owner is busy in its SEND_LGRADs and after each result lands
    (its RECV_PGRAD's last `take_back`): the plan puts no curvature, decomposition or other task there (without
    pricing them, it filled that time with the stage's STATS and DECOMPs)."""
    every = replace(
        streamed, streaming=Streaming(0, streamed.streaming.helpers[:1] * 3, ("block2", "block1", "block0"))
    )
    first = every.costs.stages[0]
    layers = tuple(replace(x, hand_off=20e-3, take_back=20e-3) for x in first.layers)
    priced = replace(every, costs=replace(every.costs, stages=(replace(first, layers=layers), *every.costs.stages[1:])))
    ops = step_timeline(priced).ops[0]
    busy = [(a, b) for op, a, b in ops if op.kind is OpKind.SEND_LGRAD]
    busy += [(b - 20e-3, b) for op, _, b in ops if op.kind is OpKind.RECV_PGRAD]
    plan = solve(priced, SolverConfig(time_limit_s=10))
    assert validate(priced, plan) == []
    owner = [p for p in plan.placements if p.device == 0 and p.step == 0]
    assert owner, "nothing placed on the owner"
    assert not [p.op for p in owner if any(p.start < b - 1e-9 and p.end > a + 1e-9 for a, b in busy)]


def _two_stages() -> CostTable:
    """Two stages of two K-FAC layers each (1 ms F, 2 ms B, 0.1 ms APPLY a layer)."""
    layer = LayerCost.kfac("x", 1e-4, 1e-4, 1e-3, 1e-3, 1e-4, 0, 0, 64, 64)
    stages = tuple(
        StageCost(1e-3, 2e-3, 0, 0, (replace(layer, name=f"s{s}.a"), replace(layer, name=f"s{s}.b"))) for s in (0, 1)
    )
    return CostTable(stages, 1, "test", "test")


def test_the_streamed_reference_step_reads_as_its_golden_file() -> None:
    """1F1B D=2 N=2, stage 0's two layers applied on rank 1: the step's programs as text (the IR a plan holds)."""
    problem = Problem("1f1b", 2, 2, _two_stages(), streaming=Streaming(0, (1, 1), ("s0.b", "s0.a")))
    text = format_programs({r: [ops] for r, ops in reference_programs(problem).items()})
    assert text == (ARTIFACTS / "streamed_1f1b_D2_N2.txt").read_text()
    assert parse_programs(text) == {r: [ops] for r, ops in reference_programs(problem).items()}


def test_shampoo_streams_its_whole_per_step_work_and_decomposes_what_comes_back() -> None:
    """Shampoo on BERT-Base 1F1B D=4 (analytic P100 costs, blocks of 512): stage 0's parameters stream with their
    statistics folds (`streamed_stats`): the owner's reference step keeps neither their STATS nor their APPLY, the
    helper's APPLY takes both, each DECOMP of a streamed part starts once the refresh step's return has landed on
    its owner. The plan is valid and the step shorter
    than without streaming, at the same refresh periods."""
    from fxkfac.planner.problem.analytic import analytic_cost_table
    from fxkfac.planner.problem.costs import PreconditionerKind
    from fxkfac.planner.problem.problem import returned, streamed_seconds, streamed_stats

    costs = analytic_cost_table("bert-base", 4, 32, hardware="p100", kind=PreconditionerKind.SHAMPOO, max_dim=512)
    problem = Problem("1f1b", 4, 4, costs, max_period=32)
    streamed = with_streaming(problem)
    assert streamed.streaming is not None, "nothing streams"
    names = streamed.streaming.layers
    assert all(streamed_stats(streamed, n) for n in names)
    owner = reference_programs(streamed)[0]
    assert not [op for op in owner if op.kind in (OpKind.STATS, OpKind.APPLY) and op.layer in names]
    helper = streamed.streaming.helpers[0]
    timeline = step_timeline(streamed)
    applied = [(a, b) for op, a, b in timeline.ops[helper] if op.kind is OpKind.APPLY and op.layer == names[0]]
    seconds = streamed_seconds(streamed, Op(OpKind.APPLY, 0, layer=names[0]))
    assert len(applied) == 1 and math.isclose(applied[0][1] - applied[0][0], seconds)
    x = costs.layer(names[0])
    assert seconds == x.prec + sum(p.stats for p in x.parts)
    assert timeline.length < step_timeline(problem).length
    plan = solve(streamed, SolverConfig(time_limit_s=10))
    assert validate(streamed, plan) == []
    for p in plan.placements:
        if p.op.kind is OpKind.DECOMP and p.op.layer in names and p.step == 0:
            assert p.start >= timeline.end_of(p.device, returned(streamed, p.op.layer)) - 1e-9
    decomp = next(p for p in plan.placements if p.op.kind is OpKind.DECOMP and p.op.layer in names)
    early = replace(decomp, start=0.0, end=decomp.end - decomp.start)  # before the statistics return: refused
    placements = tuple(early if p is decomp else p for p in plan.placements)
    errors = validate(streamed, replace(plan, placements=placements), run=False)
    assert any(f"statistics of {decomp.op.layer} return from its helper" in e for e in errors), errors
    alone = solve(problem, SolverConfig(time_limit_s=10))
    assert plan.metrics.refresh_steps == alone.metrics.refresh_steps
    assert plan.metrics.step_time < alone.metrics.step_time
