"""compile(schedule="auto") on a mesh that allows two stages per rank: the model is cut and profiled once per stage
count the candidates run, each candidate planned on its own cut, and the chosen schedule trains on its cut (no
re-capture) equal to one device to 1e-5 for a few steps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from tests.e2e import workers as kfac
from tests.support.distributed import run_distributed

CASES = ((kfac.Case("auto", 2, 3, 1), 1, True), (kfac.Case("auto", 2, 2, 1), 2, False))
"""(case, virtual_stages, relaunched): N=3 allows gpipe, 1f1b and zb-h1 on the 2-stage cut and zb-v on the 4-stage one
(both cut and profiled); virtual_stages=2 at N=2 keeps interleaved, zb-v and zb-1p, so the run is on the 4-stage cut.
The second is not relaunched (the first covers adoption; its cut leaves stage 0 without a K-FAC layer, whose plan
file tests/planner/test_stage_without_layers.py reloads)."""
STEPS = 4
"""Steps each run trains and its single-device reference repeats (a few: the plans here refresh every 4-14 steps)."""


class _Said(logging.Handler):
    """The messages of one logger, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def auto_schedule_worker(
    rank: int, world: int, cases: tuple[tuple[kfac.Case, int, bool], ...], root: str
) -> list[dict]:
    """Each case's schedule="auto" planned from the ranks' profile, trained for `STEPS` steps, checkpointed under
    `root`, and where asked relaunched from the checkpoint."""
    return [_auto_schedule(case, v, f"{root}/case{i}", again) for i, (case, v, again) in enumerate(cases)]


def _compiled(case: kfac.Case, v: int, ckpt: str) -> fxkfac.Trainer:
    data = kfac.batches(case)
    return fxkfac.compile(
        kfac.make_model(),
        (case.D, case.W),
        "auto",
        preconditioner=case.kfac,
        example_inputs=(data[0][0],),
        loss_fn=kfac.loss_fn,
        optimizer=kfac.optimizer,
        schedule="auto",
        backend=None,
        microbatches=case.N,
        pipeline=PipelineOptions(timeout=60.0, virtual_stages=v),
        plan_options=PlanOptions(time_limit_s=0.5),
        resume_from=ckpt,
    )


def _auto_schedule(case: kfac.Case, v: int, ckpt: str, relaunch: bool) -> dict:
    """The chosen schedule, its plan's layers, the params and what rank 0 logged of the choice; then whether the
    relaunch from the checkpoint adopted the plan (no choice logged) and holds the same parameters."""
    said = _Said()
    logging.getLogger("fxkfac.autoplan").addHandler(said)
    try:
        trainer = _compiled(case, v, ckpt)
        for ids, y in (kfac.batches(case) * STEPS)[:STEPS]:
            trainer.step((ids,), y)
        chose = [m for m in said.messages if m.startswith("schedule='auto'")]
        if relaunch:
            trainer.save_checkpoint(ckpt)
        logged = len(said.messages)  # the first compile may also log its max_overhead fallback, load permitting
        relaunched = _compiled(case, v, ckpt) if relaunch else None
    finally:
        logging.getLogger("fxkfac.autoplan").removeHandler(said)
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    again = dict(relaunched.named_parameters()) if relaunched is not None else {}
    return {
        "params": params,
        "schedule": (trainer.plan.problem.schedule, trainer.plan.problem.v, trainer.plan.problem.num_stages),
        "layers": dict(trainer.plan.layers),
        "said": chose,
        "relaunch": None
        if relaunched is None
        else (
            relaunched.steps == STEPS,
            relaunched.plan.to_json() == trainer.plan.to_json(),
            not said.messages[logged:] or said.messages[logged:],
            all(torch.equal(again[n], p) for n, p in params.items()),
        ),
    }


@pytest.mark.multiproc
def test_schedule_auto_plans_every_cut_and_trains_the_chosen_one_as_one_device(tmp_path: Path) -> None:
    """Each case chooses among its candidates (every one named in the choice), trains the chosen schedule on its cut
    equal to one device, and a relaunch from its checkpoint adopts the chosen schedule's plan (no profile, no
    choice) with the same parameters."""
    results = run_distributed(auto_schedule_worker, 2, CASES, str(tmp_path), timeout=600)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for i, ((case, v, again), tried) in enumerate(zip(CASES, TRIED, strict=True)):
        first = results[0].value[i]
        kind, planned_v, stages = first["schedule"]
        assert stages == 2 * planned_v and (v == 1 or planned_v == v), first["schedule"]
        (said,) = first["said"]  # rank 0 chose, every candidate named with its step or why it is out
        chosen = kind if planned_v == 1 else f"{kind} v={planned_v}"
        assert said.startswith(f"schedule='auto': {chosen}: the least step") and all(t in said for t in tried), said
        want = kfac.reference_for_plan(case, first["layers"], STEPS)
        for r in results:
            assert r.value[i]["schedule"] == first["schedule"]
            assert r.value[i]["relaunch"] == ((True, True, True, True) if again else None), r.value[i]["relaunch"]
            bad = kfac.compare(r.value[i]["params"], want)
            assert not bad, f"{case} v={v} rank {r.rank}: {bad[:4]} differ from the single-device trainer by > 1e-5"


TRIED = (("gpipe", "1f1b", "zb-h1", "zb-v v=2"), ("interleaved v=2", "zb-v v=2", "zb-1p v=2"))
"""The candidates each case's choice names."""
