"""Split decompositions end to end: plan="auto" over gloo ranks places each inversion as pieces
(KFACConfig.split_inverse, "DECOMP s A i/n layer") and trains as the single-device trainer given the plan's timings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions, SplitInverse, SplitMethod
from fxkfac.planner.ir import OpKind
from tests.e2e import workers as w
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.multiproc

CASE = w.Case("1f1b", 2, 2, 1)
SPLITS = {"blocks": SplitInverse(method=SplitMethod.BLOCKS, pieces=2), "newton-schulz": SplitInverse(pieces=2)}


def split_worker(rank: int, world: int, case: w.Case, kfacs: dict[str, KFACConfig]) -> dict[str, tuple]:
    """Per split: the planned run (rank 0 solves over the e2e synthetic costs) for two refresh periods: params,
    losses, the plan's layer timings, steps, and the DECOMP pieces in this rank's program (one spawn for all)."""
    data = w.batches(case)
    options = PlanOptions(costs=w.synthetic_costs, time_limit_s=3.0, max_overhead=w.max_overhead(case))
    out = {}
    for name, kfac in kfacs.items():
        trainer = fxkfac.compile(w.make_model(), (case.D, case.W), "auto", kfac=kfac, example_inputs=(data[0][0],),
                                 loss_fn=w.loss_fn, optimizer=w.optimizer, schedule=case.schedule, backend=None,
                                 microbatches=case.N, pipeline=PipelineOptions(timeout=60.0), plan_options=options)
        steps = 2 * max(t.period for t in trainer.plan.layers.values())
        losses = [float(trainer.step((ids,), y)) for ids, y in (data * steps)[:steps]]
        pieces = sorted({op.piece for st in trainer.plan.programs[rank] for op in st if op.kind is OpKind.DECOMP},
                        key=str)
        out[name] = ({n: p.detach().clone() for n, p in trainer.named_parameters()}, losses,
                     dict(trainer.plan.layers), steps, pieces)
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
        single = fxkfac.compile(w.make_model(), None, example_inputs=(data[0][0],), loss_fn=w.loss_fn,
                                optimizer=w.optimizer, kfac=kfac, microbatches=CASE.N * CASE.W, backend=None,
                                layer_timing=layers)
        for ids, y in data:
            single.step((ids,), y)
        want = {n: p.detach().clone() for n, p in single.named_parameters()}
        for rank, value in enumerate(ran):
            bad = w.compare(value[0], want)
            assert not bad, f"{split}, rank {rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
        assert set().union(*(value[0] for value in ran)) == set(want)
        assert torch.isfinite(torch.tensor(ran[0][1])).all()
