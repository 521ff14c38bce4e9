"""The communication model (planner/problem/hardware.py): formulas by hand, links, JSON, the least-squares fit, the cost
sources that carry it, and the planner pricing collectives with it against the independent validator."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from fxkfac.planner.problem.analytic import analytic_cost_table
from fxkfac.planner.problem.costs import COUNT_BYTES, CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import CostModelError
from fxkfac.planner.problem.hardware import (
    HARDWARE,
    ZERO,
    AlphaBeta,
    Collective,
    CommModel,
    LinkCosts,
    fit_alpha_beta,
    latency_steps,
    seconds,
    wire_bytes,
)
from fxkfac.planner.problem.ir import Op, OpKind, Placement
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.profiles import load_cost_table
from fxkfac.planner.problem.step_timeline import plain_step_time, stage_comm, step_timeline
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import parse_plan

A, B = 2e-5, 1e-9  # 20 us per step, 1 GB/s
LINK = AlphaBeta(A, B)
MODEL = CommModel(LinkCosts.uniform(LINK), LinkCosts.uniform(AlphaBeta(1e-4, 1e-8)), 4, "test")


@pytest.mark.parametrize(
    ("kind", "p", "n", "want"),
    [
        (Collective.ALL_REDUCE, 4, 1e6, 2 * 3 * A + 2 * 3 / 4 * 1e6 * B),
        (Collective.ALL_REDUCE, 2, 1e6, 2 * A + 1e6 * B),
        (Collective.BROADCAST, 4, 1e6, (2 + 3) * A + 2 * 3 / 4 * 1e6 * B),
        (Collective.BROADCAST, 5, 1e6, (3 + 4) * A + 2 * 4 / 5 * 1e6 * B),
        (Collective.ALL_GATHER, 4, 1e6, 3 * A + 3 / 4 * 1e6 * B),
        (Collective.SEND, 2, 1e6, A + 1e6 * B),
    ],
)
def test_formulas_by_hand(kind: Collective, p: int, n: float, want: float) -> None:
    assert LINK.seconds(kind, n, p) == pytest.approx(want, rel=1e-12)
    if p <= MODEL.devices_per_node:
        assert MODEL.seconds(kind, n, p) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", list(Collective))
def test_one_rank_is_free(kind: Collective) -> None:
    assert latency_steps(kind, 1) == wire_bytes(kind, 1e9, 1) == 0
    assert MODEL.seconds(kind, 1e9, 1) == 0
    assert seconds(None, kind, 1e9, 8) == 0 == ZERO.seconds(kind, 1e9, 8)


def test_groups_larger_than_a_node_use_the_inter_node_link() -> None:
    assert MODEL.link(4) is MODEL.intra and MODEL.link(5) is MODEL.inter
    assert MODEL.seconds(Collective.ALL_REDUCE, 1e6, 5) == pytest.approx(8 * 1e-4 + 2 * 4 / 5 * 1e6 * 1e-8)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(CostModelError, match="int >= 1"):
        MODEL.seconds(Collective.ALL_REDUCE, 10, 0)
    with pytest.raises(CostModelError, match="bytes"):
        MODEL.seconds(Collective.ALL_REDUCE, -1, 2)
    with pytest.raises(CostModelError, match="alpha"):
        AlphaBeta(-1.0, 0.0)
    with pytest.raises(CostModelError, match="bandwidth"):
        AlphaBeta.of_link(1e-6, 0.0)


def test_json_round_trip() -> None:
    measured = CommModel.single_link(
        LinkCosts(AlphaBeta(1e-4, 1e-9), AlphaBeta(2e-4, 2e-9), AlphaBeta(3e-4, 3e-9), AlphaBeta(4e-4, 4e-9)),
        2,
        "measured:gloo:2 ranks",
    )
    for model in (MODEL, measured, HARDWARE["a100"].comm):
        assert CommModel.from_json(model.to_json()) == model
    with pytest.raises(CostModelError, match="missing the key 'inter'"):
        CommModel.from_dict({"intra": MODEL.to_dict()["intra"], "devices_per_node": 1, "source": ""})


@pytest.mark.parametrize("kind", list(Collective))
def test_fit_recovers_alpha_and_beta(kind: Collective) -> None:
    p = 2 if kind is Collective.SEND else 4
    samples = [(p, n, LINK.seconds(kind, n, p)) for n in (4096, 65536, 1 << 20, 4 << 20)]
    got = fit_alpha_beta(kind, samples)
    assert got.alpha == pytest.approx(A, rel=1e-9) and got.beta == pytest.approx(B, rel=1e-9)


def test_fit_is_non_negative_and_needs_two_sizes() -> None:
    shrinking = [(2, n, 1e-3 - 1e-10 * n) for n in (1e3, 1e5, 1e6)]  # noise that slopes downwards
    got = fit_alpha_beta(Collective.ALL_REDUCE, shrinking)
    assert got.beta == 0 and got.alpha == pytest.approx(sum(t for _, _, t in shrinking) / 3 / 2)
    with pytest.raises(CostModelError, match="two or more"):
        fit_alpha_beta(Collective.ALL_REDUCE, [(2, 1000, 1e-3), (2, 1000, 2e-3)])


def _table(param_bytes: int = 4 << 20, state_bytes: int = 1 << 20, comm: CommModel | None = MODEL) -> CostTable:
    layer = LayerCost.kfac("fc", 0.001, 0.001, 0.004, 0.004, 0.001, 1024, 1024, state_bytes, state_bytes)
    stage = StageCost(fwd=0.01, bwd=0.02, param_bytes=param_bytes, act_bytes=1 << 20, layers=(layer,))
    return CostTable((stage,), 8, "hand", "test", comm)


def test_cost_table_prices_its_collectives_in_whole_microseconds() -> None:
    costs = _table()
    grad = Op(OpKind.ALLREDUCE_GRAD, 0)
    assert costs.collective_seconds(grad, 2) == math.ceil((2 * A + (4 << 20) * B) * 1e6) / 1e6
    sync = Op(OpKind.SYNC_STATS, 0, layer="fc", part="A")
    assert costs.collective_seconds(sync, 2) == math.ceil((2 * A + ((1 << 20) + COUNT_BYTES) * B) * 1e6) / 1e6
    both = Op(OpKind.BCAST, 0, layer="fc", root=0)  # every part of the layer: one broadcast each
    assert costs.collective_seconds(both, 2) == math.ceil(2 * (2 * A + (1 << 20) * B) * 1e6) / 1e6
    assert costs.collective_seconds(grad, 1) == 0 == replace(costs, comm=None).collective_seconds(grad, 2)


def test_cost_table_json_keeps_the_model_and_reads_older_files() -> None:
    costs = _table()
    assert CostTable.from_json(costs.to_json()) == costs
    older = json.loads(costs.to_json())
    del older["comm"]
    assert CostTable.from_json(json.dumps(older)) == replace(costs, comm=None)
    assert "comm" not in replace(costs, comm=None).to_dict()
    assert costs.scale_times(2.0).comm == costs.with_micro_batch_size(16).comm == MODEL


def test_presets_and_paper_profiles_carry_their_hardware_links() -> None:
    for name in ("p100", "v100", "a100", "h100", "cpu"):
        assert analytic_cost_table("bert-base", 4, 8, hardware=name).comm == HARDWARE[name].comm is not None
    paper = load_cost_table("paper:bert-base/v100", blocks_per_stage=3, micro_batch_size=32, n_stages=4)
    assert paper.comm == HARDWARE["v100"].comm
    rtx = load_cost_table("paper:bert-base/rtx3090", blocks_per_stage=3, micro_batch_size=32, n_stages=4)
    assert rtx.comm is None  # no preset for it: collectives planned as free


def test_faster_links_make_cheaper_collectives() -> None:
    n = 1 << 30
    times = [HARDWARE[h].comm.seconds(Collective.ALL_REDUCE, n, 8) for h in ("p100", "v100", "a100", "h100")]
    assert times == sorted(times, reverse=True)
    a100 = HARDWARE["a100"].comm
    assert a100.seconds(Collective.ALL_REDUCE, n, 16) > 5 * a100.seconds(Collective.ALL_REDUCE, n, 8)  # InfiniBand


def _problem(comm: CommModel | None, W: int = 2, param_bytes: int = 40 << 20) -> Problem:
    return Problem("gpipe", 1, 2, _table(param_bytes=param_bytes, comm=comm), W=W, max_overhead=0.5)


def test_the_gradient_all_reduce_moves_the_step_by_exactly_its_seconds() -> None:
    """D=1: the step is N*(F+B), then the all-reduce; 40 MiB over 1 GB/s is 42 ms on top of 60 ms."""
    free, priced = _problem(None), _problem(MODEL)
    allreduce = math.ceil((2 * A + (40 << 20) * B) * 1e6) / 1e6
    assert stage_comm(priced, 0).allreduce == allreduce > 0.04
    assert plain_step_time(free) == pytest.approx(0.06)
    assert plain_step_time(priced) == pytest.approx(0.06 + allreduce, abs=1e-12)
    assert step_timeline(priced).length - step_timeline(free).length == pytest.approx(allreduce, abs=1e-12)
    assert plain_step_time(_problem(MODEL, W=1)) == pytest.approx(0.06)  # one copy: nothing to reduce


@pytest.mark.parametrize("method", ["cpsat", "greedy"])
def test_plans_price_collectives_and_the_validator_checks_them(method: str) -> None:
    problem = _problem(MODEL)
    plan = solve(problem, SolverConfig(time_limit_s=5.0), method=method)
    assert validate(problem, plan) == []
    assert plan.metrics.step_time >= plain_step_time(problem)
    for p in plan.placements:
        if p.op.kind in (OpKind.SYNC_STATS, OpKind.BCAST):
            priced = problem.costs.collective_seconds(p.op, 2)
            assert p.end - p.start == pytest.approx(priced, abs=1e-12) and priced > 1e-3
    bcast = next(i for i, p in enumerate(plan.placements) if p.op.kind is OpKind.BCAST)
    short = list(plan.placements)
    short[bcast] = replace(short[bcast], end=short[bcast].start + 1e-6)  # a broadcast priced as free
    errors = validate(problem, replace(plan, placements=tuple(short)), run=False)
    assert any("lasts" in e and "BCAST" in e for e in errors), errors


def test_work_placed_inside_the_gradient_all_reduce_is_refused() -> None:
    problem = _problem(MODEL)
    plan = solve(problem, SolverConfig(time_limit_s=5.0))
    start, end = next((a, b) for op, a, b in step_timeline(problem).ops[0] if op.kind is OpKind.ALLREDUCE_GRAD)
    i = next(i for i, p in enumerate(plan.placements) if p.op.kind is OpKind.DECOMP and p.device == 0)
    moved = list(plan.placements)
    p = moved[i]
    moved[i] = Placement(p.op, p.device, 0, start, start + (p.end - p.start))
    errors = validate(problem, replace(plan, placements=tuple(moved)), run=False)
    assert any("overlaps" in e and "ALLREDUCE_GRAD" in e for e in errors), errors
    assert end - start > 0.04


def test_plan_files_keep_the_comm_model() -> None:
    problem = _problem(MODEL)
    plan = solve(problem, SolverConfig(time_limit_s=5.0))
    again = parse_plan(plan.to_json())
    assert again.problem.costs.comm == MODEL and validate(again.problem, again) == []


def test_explain_prints_the_model_and_the_collective_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    from fxkfac.cli import build_parser, main
    from fxkfac.cli_costs import cost_table
    from fxkfac.cli_plan import problem_of

    argv = ["plan", "bert-base", "-D", "2", "-N", "2", "--dp", "2", "--hardware", "a100", "--method", "greedy"]
    assert main(argv + ["--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Communication (analytic:a100 NVLink 3.0 / IB HDR;" in out
    assert "within a node (groups of <= 8 ranks): every kind alpha 3.4 us, beta 3.33e-12 s/B (300 GB/s)" in out
    assert "across nodes (groups of > 8 ranks): every kind alpha 9.6 us, beta 4e-11 s/B (25 GB/s)" in out
    args = build_parser().parse_args(argv)
    problem = problem_of(args, cost_table(args, 2))
    for s in (0, 1):
        c = stage_comm(problem, s)
        assert c.allreduce > 0 and c.sync > 0 and c.bcast > 0
        assert (
            f"s{s}: 2 ranks, gradient all-reduce {c.allreduce * 1e3:.3f} ms per step, "
            f"SYNC_STATS + BCAST {(c.sync + c.bcast) * 1e3:.3f} ms per refresh"
        ) in out
    assert "Collectives of the plan per step" in out
