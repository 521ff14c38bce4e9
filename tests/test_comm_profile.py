"""fxkfac.comm_profile: the communication model measured over gloo ranks, the same on every rank, and carried by
the cost table plan="auto" plans with."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fxkfac.comm_profile import measure_comm
from fxkfac.planner.problem.hardware import Collective, CommModel
from tests.support import models
from tests.support.distributed import run_distributed


def _measure(rank: int, world: int) -> str:
    model = measure_comm()
    assert model is not None, "measure_comm returned no model inside a process group"
    return model.to_json()


def _measure_and_plan(rank: int, world: int) -> tuple[str, str | None]:
    """The model measured here, and the one plan="auto" plans with on pure data parallelism (1 x world), which
    measures it again."""
    import fxkfac
    from fxkfac.config import PlanOptions

    measured = _measure(rank, world)
    torch.manual_seed(0)
    x = torch.randn(8, 12)
    trainer = fxkfac.compile(
        models.mlp(),
        (1, world),
        "auto",
        example_inputs=(x,),
        loss_fn=F.mse_loss,
        backend=None,
        schedule="gpipe",
        microbatches=2,
        plan_options=PlanOptions(time_limit_s=2.0),
    )
    comm = trainer.plan.problem.costs.comm if trainer.plan is not None else None
    return measured, comm.to_json() if comm is not None else None


def _check_ok(results: list) -> None:
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def test_without_a_process_group_there_is_no_model() -> None:
    assert measure_comm() is None


@pytest.mark.multiproc
def test_two_gloo_ranks_measure_one_positive_finite_model_and_auto_plans_with_it() -> None:
    results = run_distributed(_measure_and_plan, 2, timeout=300)
    _check_ok(results)
    measured, planned = ({r.value[i] for r in results} for i in (0, 1))
    assert len(measured) == 1, "the ranks measured different models"
    model = CommModel.from_json(measured.pop())
    assert model.source == "measured:gloo:2 ranks" and model.devices_per_node == 2
    for kind in Collective:
        ab = model.intra.of(kind)
        assert math.isfinite(ab.alpha) and math.isfinite(ab.beta) and ab.alpha >= 0 and ab.beta >= 0
        assert model.seconds(kind, 1 << 20, 2) > 0, f"{kind} of 1 MiB measured as free"
    assert len(planned) == 1 and None not in planned, f"the ranks planned with {planned}"
    assert CommModel.from_json(planned.pop()).source == "measured:gloo:2 ranks"


@pytest.mark.multiproc
def test_one_rank_measures_free_communication() -> None:
    results = run_distributed(_measure, 1, timeout=60)
    _check_ok(results)
    model = CommModel.from_json(results[0].value)
    assert all(model.seconds(kind, 1 << 30, 1) == 0 and model.intra.of(kind).alpha == 0 for kind in Collective)
