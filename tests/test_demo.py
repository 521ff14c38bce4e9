"""The demo's core over 2 local processes (tiny sizes), the launcher's error path, the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from fxkfac.cli_demo import render_result
from fxkfac.config import KFACConfig
from fxkfac.data import NextByteData, stdlib_corpus
from fxkfac.demo import BaseOptimizer, DemoConfig, RunSpec, lr_at, run_demo
from fxkfac.errors import ConfigError, PipelineError
from fxkfac.launch import RankContext, launch
from fxkfac.models import ByteGPT2Config, TinyBertConfig, next_byte_loss
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.validate.plan_file import parse_plan

TINY = DemoConfig(
    steps=3,
    eval_every=2,
    batch_size=8,
    seq_len=16,
    microbatches=2,
    eval_batches=1,
    corpus_bytes=50_000,
    plan_time_limit_s=2.0,
    plan_max_overhead=1.0,
    timeout_s=240.0,
    model=TinyBertConfig(hidden=32, heads=2, ffn=64, layers=2, max_len=16),
)


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
    plan = parse_plan(pipefisher.plan_json)
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


@pytest.mark.multiproc
def test_runs_of_one_preconditioner_share_the_first_runs_plan_and_unplanned_runs_have_none() -> None:
    kfac = KFACConfig(damping=1e-2)
    cfg = replace(
        TINY,
        steps=2,
        runs=(
            RunSpec(name="a", lr=1e-3, preconditioner=kfac),
            RunSpec(name="b", lr=3e-3, preconditioner=kfac, seed=1, warmup_steps=1, cosine=True),
            RunSpec(name="c", lr=1e-3, preconditioner=kfac, planned=False),
        ),
    )
    a, b, c = run_demo(cfg, Console(record=True, width=120)).curves
    assert a.plan_json is not None and a.plan_json == b.plan_json
    assert a.train_losses != b.train_losses  # another seed and learning rate
    assert c.plan_json is None and all(math.isfinite(x) for x in c.train_losses)  # K-FAC inline, no plan


def _single_process_next_byte(cfg: DemoConfig, spec: RunSpec) -> list[float]:
    """The run trained on one process in plain PyTorch: its validation losses before and after each step."""
    train, val = stdlib_corpus(cfg.corpus_bytes)
    held_out = NextByteData(val, seq_len=cfg.seq_len, seed=10_000 + cfg.seed)
    val_batches = [held_out.batch(cfg.batch_size) for _ in range(cfg.eval_batches)]
    data = NextByteData(train, seq_len=cfg.seq_len, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = cfg.model.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)

    def validation() -> float:
        with torch.no_grad():
            return sum(next_byte_loss(model(x), y).item() for x, y in val_batches) / len(val_batches)

    losses = [validation()]
    for step in range(cfg.steps):
        x, y = data.batch(cfg.batch_size)
        optimizer.param_groups[0]["lr"] = spec.lr_at(step, cfg.steps)
        optimizer.zero_grad()
        next_byte_loss(model(x), y).backward()
        optimizer.step()
        losses.append(validation())
    return losses


@pytest.mark.multiproc
def test_gpt2_next_byte_run_equals_single_process_training() -> None:
    spec = RunSpec(name="AdamW", lr=3e-3, warmup_steps=1, cosine=True)
    cfg = replace(
        TINY,
        steps=2,
        eval_every=1,
        model=ByteGPT2Config(hidden=32, heads=2, ffn=64, layers=2, max_len=16),
        runs=(spec,),
    )
    (curve,) = run_demo(cfg, Console(record=True, width=120)).curves
    reference = _single_process_next_byte(cfg, spec)
    assert reference[-1] < reference[0]  # it learns
    assert [v for _, _, v in curve.points] == pytest.approx(reference, rel=1e-5, abs=1e-5)


def test_lr_at_warms_up_linearly_then_decays_by_cosine_to_zero() -> None:
    assert [lr_at(s, 1.0, steps=10, warmup=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = [lr_at(s, 2.0, steps=10, warmup=2, cosine=True) for s in range(10)]
    assert cosine[:3] == [1.0, 2.0, 2.0]
    assert cosine[6] == pytest.approx(1.0)  # halfway through the decay
    assert all(x > y for x, y in zip(cosine[2:], cosine[3:]))
    assert lr_at(10, 2.0, steps=10, warmup=2, cosine=True) == pytest.approx(0.0)


def test_base_optimizer_follows_the_family_and_cosine_needs_steps() -> None:
    assert RunSpec(name="plain").base is BaseOptimizer.ADAMW
    assert RunSpec(name="k", preconditioner=KFACConfig()).base is BaseOptimizer.ADAMW
    assert RunSpec(name="m", optimizer="sgd").base is BaseOptimizer.SGD  # type: ignore[arg-type]  # text accepted
    with pytest.raises(ConfigError, match="optimizer must be one of 'adamw', 'sgd', 'plain-sgd'"):
        RunSpec(name="l", optimizer="lbfgs")  # type: ignore[arg-type]  # the wrong value is the point
    with pytest.raises(ConfigError, match="cosine"):
        DemoConfig(seconds=5.0, runs=(RunSpec(name="c", cosine=True),))
    with pytest.raises(ConfigError, match="planned=False"):
        RunSpec(name="p", preconditioner=KFACConfig(), plan="plan.json", planned=False)
