"""fxkfac.comm_profile: the communication model measured over gloo ranks, the same on every rank, and carried by
the cost table plan="auto" plans with."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fxkfac.comm_profile import measure_comm
from fxkfac.planner.comm import Collective, CommModel
from tests.support import models
from tests.support.distributed import run_distributed


def _measure(rank: int, world: int) -> str:
    model = measure_comm()
    assert model is not None, "measure_comm returned no model inside a process group"
    return model.to_json()


def _auto_plan(rank: int, world: int) -> str | None:
    """plan="auto" on pure data parallelism (1x2): the plan's cost table carries what was measured."""
    import fxkfac
    from fxkfac.config import PlanOptions

    torch.manual_seed(0)
    x = torch.randn(8, 12)
    trainer = fxkfac.compile(models.mlp(), (1, world), "auto", example_inputs=(x,), loss_fn=F.mse_loss, backend=None,
                             schedule="gpipe", microbatches=2, plan_options=PlanOptions(time_limit_s=2.0))
    comm = trainer.plan.problem.costs.comm if trainer.plan is not None else None
    return comm.to_json() if comm is not None else None


def _check_ok(results: list) -> None:
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def test_without_a_process_group_there_is_no_model() -> None:
    assert measure_comm() is None


def test_two_gloo_ranks_measure_one_positive_finite_model() -> None:
    results = run_distributed(_measure, 2, timeout=120)
    _check_ok(results)
    texts = {r.value for r in results}
    assert len(texts) == 1, "the ranks measured different models"
    model = CommModel.from_json(texts.pop())
    assert model.source == "measured:gloo:2 ranks" and model.devices_per_node == 2
    for kind in Collective:
        ab = model.intra.of(kind)
        assert math.isfinite(ab.alpha) and math.isfinite(ab.beta) and ab.alpha >= 0 and ab.beta >= 0
        assert model.seconds(kind, 1 << 20, 2) > 0, f"{kind} of 1 MiB measured as free"


def test_one_rank_measures_free_communication() -> None:
    results = run_distributed(_measure, 1, timeout=60)
    _check_ok(results)
    model = CommModel.from_json(results[0].value)
    assert all(model.seconds(kind, 1 << 30, 1) == 0 and model.intra.of(kind).alpha == 0 for kind in Collective)


def test_auto_plan_carries_the_measured_model() -> None:
    results = run_distributed(_auto_plan, 2, timeout=300)
    _check_ok(results)
    texts = {r.value for r in results}
    assert len(texts) == 1 and None not in texts, texts
    assert CommModel.from_json(texts.pop()).source == "measured:gloo:2 ranks"
