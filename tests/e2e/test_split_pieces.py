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


def split_worker(rank: int, world: int, case: w.Case, kfac: KFACConfig) -> tuple:
    """The planned run (rank 0 solves over the e2e synthetic costs) for two refresh periods: params, losses, the
    plan's layer timings, steps, and the DECOMP pieces in this rank's program."""
    data = w.batches(case)
    options = PlanOptions(costs=w.synthetic_costs, time_limit_s=3.0, max_overhead=w.max_overhead(case))
    trainer = fxkfac.compile(w.make_model(), (case.D, case.W), "auto", kfac=kfac, example_inputs=(data[0][0],),
                             loss_fn=w.loss_fn, optimizer=w.optimizer, schedule=case.schedule, backend=None,
                             microbatches=case.N, pipeline=PipelineOptions(timeout=60.0), plan_options=options)
    steps = 2 * max(t.period for t in trainer.plan.layers.values())
    losses = [float(trainer.step((ids,), y)) for ids, y in (data * steps)[:steps]]
    pieces = sorted({op.piece for st in trainer.plan.programs[rank] for op in st if op.kind is OpKind.DECOMP},
                    key=str)
    return ({n: p.detach().clone() for n, p in trainer.named_parameters()}, losses, dict(trainer.plan.layers),
            steps, pieces)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_planned_pieces_equal_the_single_device_trainer(split: str) -> None:
    kfac = dataclasses.replace(w.KFAC, split_inverse=SPLITS[split])
    results = run_distributed(split_worker, 2, CASE, kfac, timeout=400)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    layers, steps = results[0].value[2], results[0].value[3]
    assert {p for r in results for p in r.value[4]} == {(0, 2), (1, 2)}, "the plan runs no decomposition in pieces"
    data = (w.batches(CASE) * steps)[:steps]
    single = fxkfac.compile(w.make_model(), None, example_inputs=(data[0][0],), loss_fn=w.loss_fn,
                            optimizer=w.optimizer, kfac=kfac, microbatches=CASE.N * CASE.W, backend=None,
                            layer_timing=layers)
    for ids, y in data:
        single.step((ids,), y)
    want = {n: p.detach().clone() for n, p in single.named_parameters()}
    for r in results:
        bad = w.compare(r.value[0], want)
        assert not bad, f"rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"
    assert set().union(*(r.value[0] for r in results)) == set(want)
    assert torch.isfinite(torch.tensor(results[0].value[1])).all()
