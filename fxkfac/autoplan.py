"""Plans the runtime runs: plan="auto" | a plan file | a Plan, checked against the graph; and naive K-FAC programs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fxkfac.planner.costs import CostTable
from fxkfac.planner.errors import PlanMismatchError
from fxkfac.planner.ir import LayerTiming, Op, OpKind
from fxkfac.planner.lowering import add_send_recv, expand_dp
from fxkfac.planner.schedules import ScheduleKind, num_stages, schedule_programs, stage_rank

__all__ = ["naive_programs", "kfac_tail", "ranks_of_stages", "Target", "solve_for", "check_matches", "check_costs",
           "load_plan", "share_plan", "startup_program"]


def ranks_of_stages(kind: ScheduleKind | str, D: int, W: int, S: int, v: int = 1) -> dict[int, tuple[int, ...]]:
    """Stage -> the sorted global ranks holding a copy of it (dp replicas, both Chimera pipelines)."""
    kind = ScheduleKind(kind)
    pipes = (0, 1) if kind is ScheduleKind.CHIMERA else (0,)
    return {s: tuple(sorted({stage_rank(kind, D, s, p, v=v) * W + w for p in pipes for w in range(W)}))
            for s in range(S)}


def _refreshing(timings: Mapping[str, LayerTiming], names: Sequence[str], step: int) -> list[str]:
    return [n for n in names if step % timings[n].period == timings[n].curv_step]


def kfac_tail(rank: int, copies: Sequence[tuple[int, int]], step: int, timings: Mapping[str, LayerTiming],
              stage_layers: Mapping[int, Sequence[str]], holders: Mapping[int, tuple[int, ...]]) -> list[Op]:
    """The K-FAC ops a rank runs between its last ALLREDUCE_GRAD and OPT_STEP at one step of the period.

    Every collective is emitted in (stage, layer, factor) order by every holder, so no two ranks wait
    on each other; the inversions of a stage are dealt round-robin over its holders (inversion
    parallelism) and broadcast from there. `copies` are the (stage, pipe) pairs the rank holds.
    """
    stages = sorted({s for s, _ in copies})
    syncs: list[Op] = []
    invs: list[Op] = []
    bcasts: list[Op] = []
    for s in stages:
        ranks = holders[s]
        for i, name in enumerate(_refreshing(timings, stage_layers[s], step)):
            if len(ranks) > 1:
                syncs.append(Op(OpKind.SYNC_CURV, stage=s, layer=name))
            for j, side in enumerate(("A", "B")):
                root = ranks[(2 * i + j) % len(ranks)]
                if root == rank:
                    invs.append(Op(OpKind.INV, stage=s, factor=side, layer=name))
                if len(ranks) > 1:
                    bcasts.append(Op(OpKind.BCAST_INV, stage=s, factor=side, peer=root, layer=name))
    precs = [Op(OpKind.PREC, stage=s, pipe=p) for s, p in sorted(set(copies))]
    return syncs + invs + bcasts + precs


def naive_programs(kind: ScheduleKind | str, D: int, N: int, W: int, timings: Mapping[str, LayerTiming],
                   stage_layers: Mapping[int, Sequence[str]], *, v: int = 1) -> dict[int, list[list[Op]]]:
    """K-FAC on the critical path: the base schedule with curvature right after each BWD of a refreshing
    layer, and sync, inversion, broadcast and precondition before OPT_STEP.

    One list per step of the period (the lcm of the layers' periods). With refresh period 1 this is
    "naive K-FAC" of the PipeFisher paper; with period k it is "K-FAC+skip". The correctness of a plan
    does not depend on where its ops sit, so this is also the reference layout for tests.
    """
    kind = ScheduleKind(kind)
    S = num_stages(kind, D, v)
    base = expand_dp(add_send_recv(schedule_programs(kind, D, N, v=v), kind, D, v), W)
    holders = ranks_of_stages(kind, D, W, S, v)
    period = math.lcm(*(t.period for t in timings.values())) if timings else 1
    out: dict[int, list[list[Op]]] = {}
    for rank, ops in base.items():
        copies = sorted({(op.stage, op.pipe) for op in ops if op.kind is OpKind.FWD})
        steps = []
        for step in range(period):
            body: list[Op] = []
            for op in ops:
                if op.kind is OpKind.OPT_STEP:
                    body.extend(kfac_tail(rank, copies, step, timings, stage_layers, holders))
                body.append(op)
                if op.kind is OpKind.BWD:
                    for name in _refreshing(timings, stage_layers[op.stage], step):  # type: ignore[index]
                        body.extend(Op(OpKind.CURV, stage=op.stage, mb=op.mb, pipe=op.pipe, factor=side, layer=name)
                                    for side in ("A", "B"))
            steps.append(body)
        out[rank] = steps
    return out


class Target:
    """What a plan must be made for: the graph fingerprint, schedule, D, N, W and v of the run."""

    def __init__(self, fingerprint: str, schedule: str, D: int, N: int, W: int, v: int = 1) -> None:
        self.fingerprint, self.schedule = fingerprint, str(ScheduleKind(schedule).value)
        self.D, self.N, self.W, self.v = D, N, W, v

    def describe(self) -> str:
        """The run in words, for error messages."""
        return f"{self.schedule} D={self.D} N={self.N} W={self.W} v={self.v}, graph {self.fingerprint}"


def solve_for(target: Target, costs: CostTable, *, memory_budget: int | None = None, max_overhead: float = 0.0,
              time_limit_s: float = 10.0) -> Any:
    """Plan `target` with CP-SAT over `costs` (the planner's `solve`), stamped with the target's fingerprint."""
    from fxkfac.planner.plan import solve
    from fxkfac.planner.problem import Problem, SolverConfig

    problem = Problem(target.schedule, target.D, target.N, costs, W=target.W, v=target.v,
                      memory_budget=memory_budget, max_overhead=max_overhead, fingerprint=target.fingerprint)
    return solve(problem, SolverConfig(time_limit_s=time_limit_s))


def check_matches(plan: Any, target: Target, where: str = "the plan") -> None:
    """PlanMismatchError unless `plan` was made for `target` (mesh and schedule first: the clearer message)."""
    p = plan.problem
    made = (str(p.schedule), p.D, p.N, p.W, p.v)
    want = (target.schedule, target.D, target.N, target.W, target.v)
    if made != want:
        raise PlanMismatchError(f"{where} was made for {made[0]} D={made[1]} N={made[2]} W={made[3]} v={made[4]}, "
                                f"but this run is {target.describe()}; make a plan for this mesh and schedule "
                                "(fxkfac plan ... --export) or pass plan='auto'")
    if plan.fingerprint != target.fingerprint:
        raise PlanMismatchError(f"{where} was made for graph {plan.fingerprint!r}, not this model's "
                                f"{target.fingerprint!r} (other layers, widths or stage split); make a new plan "
                                "for this model or pass plan='auto'")


def check_costs(costs: CostTable, stage_layers: Mapping[int, Sequence[str]]) -> None:
    """PlanMismatchError unless `costs` has one stage per stage graph with exactly that stage's K-FAC layers."""
    if len(costs.stages) != len(stage_layers):
        raise PlanMismatchError(f"the cost table has {len(costs.stages)} stages, the split model has "
                                f"{len(stage_layers)}; make the cost table for this split")
    for s, stage in enumerate(costs.stages):
        have, want = sorted(x.name for x in stage.layers), sorted(stage_layers[s])
        if have != want:
            raise PlanMismatchError(f"stage {s} of the cost table has K-FAC layers {have}, the split model "
                                    f"{want}; make the cost table for this model and split")


def load_plan(path: str | Path, target: Target) -> Any:
    """Read a plan file once, refuse one made for another graph/mesh/schedule, then validate it."""
    from fxkfac.planner.plan import Plan
    from fxkfac.planner.validate import check_plan

    plan = Plan.read(path)
    check_matches(plan, target, str(path))
    check_plan(plan.problem, plan)
    return plan


def share_plan(plan: Any, src: int = 0) -> Any:
    """Every rank gets rank `src`'s plan (its JSON broadcast over the default group; collective)."""
    import torch.distributed as dist

    from fxkfac.planner.plan import Plan

    box = [plan.to_json(indent=None) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    text = box[0]
    if not isinstance(text, str):
        raise AssertionError("plan broadcast delivered no JSON text")
    return Plan.from_json(text)


_REFRESH_KINDS = (OpKind.CURV, OpKind.SYNC_CURV, OpKind.INV, OpKind.BCAST_INV)


def startup_program(plan: Any, rank: int, step: int) -> list[Op] | None:
    """Global step `step`'s program on `rank` without the K-FAC work of refreshes from before step 0.

    A plan is a modulo schedule: in steady state, step t also runs the late curvature and inversions
    of the refresh of step t - s (a placement's window step s may reach 2k - 1). In the first steps
    that refresh never happened, so its ops have nothing to consume. Returns None when `step` drops
    nothing (every step from the longest placement step on)."""
    program = plan.programs[rank]
    unborn = {p.op for p in plan.placements if p.device == rank and p.step > step and p.op.kind in _REFRESH_KINDS}
    if not unborn:
        return None
    return [op for op in program[step % len(program)] if op not in unborn]
