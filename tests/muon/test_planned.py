"""Muon planned by the planner end to end: `compile(..., preconditioner=MuonConfig(), plan="auto")` on 2 ranks (1F1B,
eager stages) profiles every unit (Muon's matrices and the AdamW parameters), plans them as Muon's (the cost table's
family) and trains equal to one device to 1e-5; and so does a plan the planner streams stage 0's matrices in (to the
idle rank, its transfers and the helper's APPLYs placed by the planner, not by hand), made from a cost table that
prices stage 0's Newton-Schulz long enough that keeping it on the owner would lengthen the step. GPipe, interleaved
and Chimera (whose stages have copies: never streamed) plan and train equal to one device too.

Newton-Schulz runs in float32, as in tests/muon/test_pipelined.py (why there)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.muon import MuonConfig
from fxkfac.planner.problem.costs import CostTable, LayerCost, PreconditionerKind, StageCost
from fxkfac.planner.problem.ir import OpKind
from tests.muon.support import DATA, MODELS, STEPS, sgd, train
from tests.support.distributed import run_distributed

CFG = MuonConfig(ns_dtype="float32", momentum=0.9)
MS = 1e-3
SLOW = frozenset({"0.weight", "2.weight", "4.weight"})
"""mlp6's hidden matrices on stage 0 of D=2 (its layers 0, 2 and 4; the last Linear, 10, is the head)."""


def _slow_stage0(stage_layers: Mapping[int, Sequence[str]], layers: Mapping[str, Any]) -> CostTable:
    """A Muon cost table of the split: F 1 ms, B 2 ms per stage; each of stage 0's matrices' APPLY 20 ms (longer than
    any bubble, so the planner streams), every other unit's 10 us."""

    def unit(name: str) -> LayerCost:
        return LayerCost(name, (), 20 * MS if name in SLOW else 0.01 * MS, state_bytes=1024, grad_bytes=1024)

    stages = tuple(
        StageCost(fwd=MS, bwd=2 * MS, param_bytes=4096, act_bytes=4096, layers=tuple(map(unit, stage_layers[s])))
        for s in sorted(stage_layers)
    )
    return CostTable(stages, 4, "muon:test", "cpu", family=PreconditionerKind.MUON)


def _planned(
    rank: int, model: str, costs: Any = None, schedule: str = "1f1b", v: int = 1
) -> tuple[list[str], dict[str, Tensor], str]:
    """`model` trained STEPS steps under plan="auto" on (2, 1) by `schedule` (`v` virtual stages per rank): `rank`'s
    program (one step, as strings), its parameters and the plan's cost table family."""
    batches, loss = DATA[model]
    trainer = fxkfac.compile(
        MODELS[model](),
        (2, 1),
        "auto",
        example_inputs=(batches(1)[0][0],),
        loss_fn=loss,
        optimizer=sgd,
        backend=None,
        schedule=schedule,
        microbatches=2,
        preconditioner=CFG,
        pipeline=PipelineOptions(timeout=60.0, virtual_stages=v),
        plan_options=PlanOptions(time_limit_s=5.0, costs=costs),
    )
    for x, y in batches(STEPS):
        trainer.step(x, y)
    plan = trainer.plan
    assert plan is not None, "plan='auto' made a plan"
    program = [str(op) for step in plan.programs[rank] for op in step]
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return program, params, plan.problem.costs.family.value


CASES = ["mlp 1f1b", "mlp6 1f1b streamed", "mlp gpipe", "mlp6 interleaved", "mlp chimera"]


def _worker(rank: int, world: int) -> list[tuple[list[str], dict[str, Tensor], str]]:
    return [
        _planned(rank, "mlp"),
        _planned(rank, "mlp6", _slow_stage0),
        _planned(rank, "mlp", schedule="gpipe"),
        _planned(rank, "mlp6", schedule="interleaved", v=2),
        _planned(rank, "mlp", schedule="chimera"),
    ]


@pytest.mark.multiproc
def test_muon_planned_and_planner_streamed_equal_one_device() -> None:
    results = run_distributed(_worker, 2, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = {name: train(CFG, None, model=name, microbatches=2) for name in ("mlp", "mlp6")}
    by_rank = {r.rank: r.value for r in results}
    for r, runs in by_rank.items():
        for model, (_program, params, family) in zip(CASES, runs, strict=True):
            assert family == PreconditionerKind.MUON.value, f"{model}: planned as {family}"
            assert params, f"{model}: rank {r} holds no parameter"
            for name, p in params.items():
                torch.testing.assert_close(
                    p, want[model.split()[0]][name], rtol=0, atol=1e-5, msg=f"{model} rank {r} {name}"
                )
    streamed_program = by_rank[1][1][0]
    helped = [op for op in streamed_program if op.startswith(f"{OpKind.APPLY.value} s0 ")]
    assert any(op.split()[-1] in SLOW for op in helped), f"the planner streamed no matrix of stage 0: {helped}"
