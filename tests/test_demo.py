"""The demo's core over 2 local processes (tiny sizes), the launcher's error path, and startup_program."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from fxkfac.demo import DemoConfig, render_result, run_demo
from fxkfac.errors import ConfigError, PipelineError
from fxkfac.launch import RankContext, launch
from fxkfac.models import TinyBertConfig
from fxkfac.planner.ir import OpKind
from fxkfac.planner.plan import Plan

TINY = DemoConfig(steps=3, eval_every=2, batch_size=8, seq_len=16, microbatches=2, eval_batches=1,
                  corpus_bytes=50_000, plan_time_limit_s=2.0, plan_max_overhead=1.0, timeout_s=240.0,
                  model=TinyBertConfig(hidden=32, heads=2, ffn=64, layers=2, max_len=16))


def _fail_on_rank_one(ctx: RankContext, message: str) -> int:
    if ctx.rank == 1:
        raise ValueError(message)
    return ctx.rank


@pytest.mark.multiproc
def test_demo_trains_both_runs_and_plans_kfac_ops() -> None:
    console = Console(record=True, width=120)
    result = run_demo(TINY, console)
    pipefisher, adamw = result.curves
    assert (pipefisher.name, adamw.name) == ("PipeFisher", "AdamW")
    for curve in result.curves:
        assert curve.steps == 3
        assert [s for s, _, _ in curve.points] == [0, 2, 3]
        assert all(math.isfinite(x) for x in curve.train_losses)
        assert all(math.isfinite(v) and t >= 0 for _, t, v in curve.points)
    assert adamw.plan_json is None
    plan = Plan.from_json(pipefisher.plan_json)
    kinds = {op.kind for program in plan.programs.values() for step in program for op in step}
    assert {OpKind.STATS, OpKind.DECOMP, OpKind.APPLY} <= kinds
    assert sorted(plan.programs) == [0, 1]
    # both runs start from the same weights on the same data: their losses before any step agree
    assert pipefisher.points[0][2] == pytest.approx(adamw.points[0][2], abs=1e-6)
    console.print(render_result(result, TINY))
    assert "PipeFisher" in console.export_text()


@pytest.mark.multiproc
def test_launch_reports_the_failing_rank_in_one_line() -> None:
    with pytest.raises(PipelineError, match=r"^rank 1 failed: ValueError: no data here$"):
        launch(_fail_on_rank_one, 2, "no data here", timeout=120.0)


def test_demo_config_refuses_a_batch_the_mesh_cannot_split() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        DemoConfig(batch_size=30, microbatches=4)
