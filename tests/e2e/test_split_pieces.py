"""Split decompositions end to end: plan="auto" over gloo ranks places each inversion as pieces
(KFACConfig.split_inverse, "DECOMP s A i/n layer"; Shampoo's coupled-Newton roots, ShampooConfig.newton_pieces)
and trains as the single-device trainer given the plan's timings."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions, SplitInverse, SplitMethod
from fxkfac.planner.problem.costs import CostTable, LayerCost, PartCost, StageCost
from fxkfac.planner.problem.ir import OpKind
from fxkfac.shampoo import GraftType, RootInvMethod, ShampooConfig
from tests.e2e import workers as w
from tests.support.distributed import run_distributed
from tests.support.models import mlp, mlp_batches

pytestmark = pytest.mark.multiproc

CASE = w.Case("1f1b", 2, 2, 1)
SPLITS = {"blocks": SplitInverse(method=SplitMethod.BLOCKS, pieces=2), "newton-schulz": SplitInverse(pieces=2)}
SHAMPOO = ShampooConfig(
    root_inv_method=RootInvMethod.NEWTON,
    newton_pieces=4,
    newton_max_iterations=12,
    newton_tolerance=1e-2,
    precondition_frequency=2,
    max_preconditioner_dim=8,
    grafting_type=GraftType.ADAM,
    betas=(0.9, 0.99),
    epsilon=1e-4,
    momentum=0.5,
    preconditioner_dtype="float64",
)
"""Newton takes 3 to 10 iterations here, so its pieces of 3 hand unfinished pairs on; its loose tolerance sets its
roots visibly apart from the eigh fallback, so that a piece that lost its carry would show."""


def shampoo_costs(stage_layers: Mapping[int, Sequence[str]], layers: Mapping[str, Any]) -> CostTable:
    """Fixed costs of the MLP's parameters (1 ms forward, 2 ms backward per micro-batch; roots of L and R a
    little under a bubble), so that the plan puts Shampoo's root pieces into the bubbles on any machine."""

    def unit(name: str) -> LayerCost:
        parts = tuple(PartCost(part, OpKind.ALLREDUCE_GRAD, 1e-5, 3e-4, 0, 512) for part in ("L", "R"))
        return LayerCost(name, parts, 1e-5, 1024, 512)

    stages = tuple(
        StageCost(
            fwd=1e-3, bwd=2e-3, param_bytes=1 << 12, act_bytes=1 << 10, layers=tuple(unit(n) for n in stage_layers[s])
        )
        for s in sorted(stage_layers)
    )
    return CostTable(stages, 2, "synthetic:e2e-shampoo", "cpu")


def shampoo_sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Shampoo makes the whole direction: plain SGD."""
    return torch.optim.SGD(params, lr=0.05)


def shampoo_run(rank: int, case: w.Case, steps: int) -> tuple:
    """The MLP under Shampoo with newton_pieces, planned (rank 0 solves over `shampoo_costs`): as `split_worker`."""
    data = mlp_batches(steps)
    trainer = fxkfac.compile(
        mlp(),
        (case.D, case.W),
        "auto",
        example_inputs=(data[0][0],),
        loss_fn=F.mse_loss,
        optimizer=shampoo_sgd,
        backend=None,
        schedule=case.schedule,
        microbatches=case.N,
        preconditioner=SHAMPOO,
        pipeline=PipelineOptions(timeout=60.0),
        plan_options=PlanOptions(costs=shampoo_costs, time_limit_s=1.0),
    )
    losses = [float(trainer.step(x, y)) for x, y in data]
    pieces = sorted({op.piece for st in trainer.plan.programs[rank] for op in st if op.kind is OpKind.DECOMP}, key=str)
    return (
        {n: p.detach().clone() for n, p in trainer.named_parameters()},
        losses,
        dict(trainer.plan.layers),
        steps,
        pieces,
    )


def split_worker(rank: int, world: int, case: w.Case, kfacs: dict[str, KFACConfig]) -> dict[str, tuple]:
    """Per split: the planned run (rank 0 solves over the e2e synthetic costs) for two refresh periods: params,
    losses, the plan's layer timings, steps, and the DECOMP pieces in this rank's program; then the same of Shampoo
    (key "shampoo", `shampoo_run`) in the same spawn."""
    data = w.batches(case)
    options = PlanOptions(costs=w.synthetic_costs, time_limit_s=3.0, max_overhead=w.max_overhead(case))
    out = {}
    for name, kfac in kfacs.items():
        trainer = fxkfac.compile(
            w.make_model(),
            (case.D, case.W),
            "auto",
            preconditioner=kfac,
            example_inputs=(data[0][0],),
            loss_fn=w.loss_fn,
            optimizer=w.optimizer,
            schedule=case.schedule,
            backend=None,
            microbatches=case.N,
            pipeline=PipelineOptions(timeout=60.0),
            plan_options=options,
        )
        steps = 2 * max(t.period for t in trainer.plan.layers.values())
        losses = [float(trainer.step((ids,), y)) for ids, y in (data * steps)[:steps]]
        pieces = sorted(
            {op.piece for st in trainer.plan.programs[rank] for op in st if op.kind is OpKind.DECOMP}, key=str
        )
        out[name] = (
            {n: p.detach().clone() for n, p in trainer.named_parameters()},
            losses,
            dict(trainer.plan.layers),
            steps,
            pieces,
        )
    out["shampoo"] = shampoo_run(rank, case, 6)
    return out


def test_planned_pieces_equal_the_single_device_trainer() -> None:
    kfacs = {name: dataclasses.replace(w.KFAC, split_inverse=split) for name, split in SPLITS.items()}
    results = run_distributed(split_worker, 2, CASE, kfacs, timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for split, kfac in kfacs.items():
        ran = [r.value[split] for r in results]
        layers, steps = ran[0][2], ran[0][3]
        assert {p for value in ran for p in value[4]} == {(0, 2), (1, 2)}, f"{split}: no decomposition in pieces"
        data = (w.batches(CASE) * steps)[:steps]
        single = fxkfac.compile(
            w.make_model(),
            None,
            example_inputs=(data[0][0],),
            loss_fn=w.loss_fn,
            optimizer=w.optimizer,
            preconditioner=kfac,
            microbatches=CASE.N * CASE.W,
            backend=None,
            layer_timing=layers,
        )
        for ids, y in data:
            single.step((ids,), y)
        want = {n: p.detach().clone() for n, p in single.named_parameters()}
        for rank, value in enumerate(ran):
            bad = w.compare(value[0], want)
            assert not bad, f"{split}, rank {rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
        assert set().union(*(value[0] for value in ran)) == set(want)
        assert torch.isfinite(torch.tensor(ran[0][1])).all()
    check_shampoo([r.value["shampoo"] for r in results])


def check_shampoo(ran: list[tuple]) -> None:
    """Shampoo's roots ran as 4 pieces and the ranks trained as one device given the plan's timings (which
    makes each root in one `decompose`, the pieces' fold)."""
    layers, steps = ran[0][2], ran[0][3]
    assert {p for value in ran for p in value[4]} == {(i, 4) for i in range(4)}, "no Shampoo root in pieces"
    data = mlp_batches(steps)
    single = fxkfac.compile(
        mlp(),
        None,
        None,
        example_inputs=(data[0][0],),
        loss_fn=F.mse_loss,
        optimizer=shampoo_sgd,
        backend=None,
        microbatches=CASE.N * CASE.W,
        preconditioner=SHAMPOO,
        layer_timing=layers,
    )
    for x, y in data:
        single.step(x, y)
    want = {n: p.detach().clone() for n, p in single.named_parameters()}
    for rank, value in enumerate(ran):
        bad = w.compare(value[0], want)
        assert not bad, f"shampoo, rank {rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
    assert set().union(*(value[0] for value in ran)) == set(want)
    assert any(not torch.equal(p, dict(mlp().named_parameters())[n]) for n, p in want.items())
    assert torch.isfinite(torch.tensor(ran[0][1])).all()
