"""Shampoo and SOAP through fxkfac.compile: pipelined runs (GPipe, 1F1B, Chimera, W=2) equal one device given
the same timing, plan="auto" profiles and places them and the ranks run the plan, a checkpoint resumes
exactly, and a bad base optimizer is refused."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.errors import ConfigError
from fxkfac.planner.problem.ir import LayerTiming, OpKind
from fxkfac.planner.validate.plan_file import parse_plan
from fxkfac.profiler import gradient_unit_cost
from fxkfac.shampoo import GraftType, ParamUnit, ShampooConfig, ShampooFamily, SOAPConfig
from tests.support.distributed import run_distributed
from tests.support.models import mlp, mlp_batches

N, STEPS, LR = 2, 6, 0.05
SHAMPOO = ShampooConfig(
    precondition_frequency=2,
    max_preconditioner_dim=8,
    grafting_type=GraftType.ADAM,
    betas=(0.9, 0.99),
    epsilon=1e-4,
    momentum=0.5,
    preconditioner_dtype="float64",
)
SOAP = SOAPConfig(precondition_frequency=2, max_preconditioner_dim=8, preconditioner_dtype="float64")
FAMILIES = {"shampoo": SHAMPOO, "soap": SOAP}


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _timings() -> dict[str, LayerTiming]:
    """The first layer's roots are used a step after their refresh (a planned run's staleness); the rest at once."""
    return {"0.weight": LayerTiming(2, 0, 1, "fused"), "0.bias": LayerTiming(2, 1, 1, "fused")}


def _compile(family: str, mesh: tuple[int, int] | None, schedule: str = "1f1b", seed: int = 0) -> fxkfac.Trainer:
    W = 1 if mesh is None else mesh[1]
    return fxkfac.compile(
        mlp(seed=seed),
        mesh,
        None,
        example_inputs=(mlp_batches(STEPS)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        schedule=schedule,
        microbatches=N // W,
        preconditioner=FAMILIES[family],
        layer_timing=_timings(),
        pipeline=PipelineOptions(timeout=60.0),
    )


def _one_device(family: str) -> dict[str, Tensor]:
    trainer = _compile(family, None)
    for x, y in mlp_batches(STEPS):
        trainer.step(x, y)
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def _pipelined_worker(rank: int, world: int, cases: list[tuple[str, int, int, str]]) -> list[dict[str, Tensor]]:
    out = []
    for family, D, W, schedule in cases:
        trainer = _compile(family, (D, W), schedule)
        for x, y in mlp_batches(STEPS):
            trainer.step(x, y)
        out.append({n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()})
        dist.barrier()
    return out


@pytest.mark.multiproc
def test_shampoo_and_soap_pipelined_equal_one_device() -> None:
    cases = [
        (family, D, W, schedule)
        for family in FAMILIES
        for D, W, schedule in ((2, 1, "gpipe"), (2, 1, "1f1b"), (2, 1, "chimera"), (1, 2, "gpipe"))
    ]
    results = run_distributed(_pipelined_worker, 2, cases, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = {family: _one_device(family) for family in FAMILIES}
    start = dict(mlp().named_parameters())
    for family in FAMILIES:
        moved = max(float((want[family][n] - p.detach()).abs().max()) for n, p in start.items())
        assert moved > 1e-3, f"{family} did not move the parameters: the comparison would be vacuous"
    for r in results:
        for case, params in zip(cases, r.value):
            for name, p in params.items():
                torch.testing.assert_close(
                    p, want[case[0]][name], rtol=0, atol=1e-5, msg=f"{case} rank {r.rank} {name}"
                )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_resumes_exactly_with_roots_pending(family: str, tmp_path) -> None:
    """Stopped after step 3, the first layer's root from step 2 is still pending (used from step 3 on)."""
    batches = mlp_batches(STEPS)
    a = _compile(family, None)
    for x, y in batches[:3]:
        a.step(x, y)
    assert a.layer_states["0.weight"].pending, "the test must checkpoint a pending root"
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = _compile(family, None, seed=5)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    for x, y in batches[3:]:
        assert a.step(x, y) == b.step(x, y)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_a_base_optimizer_with_momentum_is_refused() -> None:
    with pytest.raises(ConfigError, match="base optimizer must be torch.optim.SGD"):
        fxkfac.compile(
            mlp(),
            None,
            None,
            example_inputs=(mlp_batches(STEPS)[0][0],),
            loss_fn=F.mse_loss,
            backend=None,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            preconditioner=SHAMPOO,
        )


def _planned_worker(rank: int, world: int, family: str, mesh: tuple[int, int], schedule: str) -> dict:
    """plan="auto": rank 0 profiles the family through its own methods, CP-SAT places its work, the ranks run it."""
    trainer = fxkfac.compile(
        mlp(),
        mesh,
        "auto",
        example_inputs=(mlp_batches(STEPS)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        schedule=schedule,
        microbatches=N // mesh[1],
        preconditioner=FAMILIES[family],
        pipeline=PipelineOptions(timeout=60.0),
        plan_options=PlanOptions(time_limit_s=3.0),
    )
    for x, y in mlp_batches(STEPS):
        trainer.step(x, y)
    assert trainer.plan is not None
    return {
        "params": {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()},
        "layers": dict(trainer.plan.layers),
        "placed": {p.op.kind for p in trainer.plan.placements},
        "w_layers": {p.op.layer for p in trainer.plan.placements if p.op.kind is OpKind.BWD_W},
        "w_pieces": {x.name: x.wgrad for s in trainer.plan.problem.costs.stages for x in s.layers},
    }


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "family,mesh,schedule",
    [
        ("shampoo", (2, 1), "1f1b"),
        ("soap", (2, 1), "1f1b"),
        ("shampoo", (2, 1), "chimera"),
        ("soap", (1, 2), "gpipe"),
        ("shampoo", (2, 1), "zb-h1"),  # W profiled, and placed by the planner one per unit (planner/plan/window.py)
    ],
)
def test_planned_shampoo_and_soap_run_their_plan_and_equal_one_device_given_it(
    family: str, mesh: tuple[int, int], schedule: str
) -> None:
    results = run_distributed(_planned_worker, 2, family, mesh, schedule, timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    layers = results[0].value["layers"]
    assert set(layers) == {n for n, _ in mlp().named_parameters()}
    placed = results[0].value["placed"] | results[1].value["placed"]
    assert {OpKind.DECOMP, OpKind.APPLY} <= placed
    assert (OpKind.BWD_W in placed) == (schedule == "zb-h1")
    w_layers = results[0].value["w_layers"] | results[1].value["w_layers"]
    assert w_layers == (set(layers) if schedule == "zb-h1" else set()), "one W per unit ([Note: per-layer W])"
    pieces = results[0].value["w_pieces"]  # each unit's own W piece profiled where the schedule splits W
    assert all((t is not None and t > 0) if schedule == "zb-h1" else t is None for t in pieces.values()), pieces
    assert min(t.use_offset for t in layers.values()) >= 1, "a planned gradient part decomposes after its step"
    assert max(t.period for t in layers.values()) <= FAMILIES[family].precondition_frequency
    _assert_equal_one_device(results, family, layers)


def _assert_equal_one_device(results: list, family: str, layers: dict[str, LayerTiming]) -> None:
    """Every rank's parameters (`value["params"]`) equal the single-device trainer's given the plan's timings."""
    single = fxkfac.compile(
        mlp(),
        None,
        None,
        example_inputs=(mlp_batches(STEPS)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        microbatches=N,
        preconditioner=FAMILIES[family],
        layer_timing=layers,
    )
    for x, y in mlp_batches(STEPS):
        single.step(x, y)
    want = dict(single.named_parameters())
    for r in results:
        for name, p in r.value["params"].items():
            torch.testing.assert_close(p, want[name].detach(), rtol=0, atol=1e-5, msg=f"rank {r.rank} {name}")


SOAP_LATE_BROADCAST = Path(__file__).parent / "data" / "soap_broadcast_settled_after_snapshot_plan.json"
"""A plan="auto" plan of SOAP on mesh (1, 2) GPipe (costs profiled, then scaled at random): refresh every 2 steps,
each weight's L and R decomposed on different ranks the step after its refresh and broadcast two steps after it,
just before the next refresh's STATS, so the previous bases are still in flight when that refresh's statistic is
snapshot. The QR basis of the next refresh must start from them anyway, as on one device (a runtime that read
the warm start at the snapshot differed by 1.7e-2 from step 4 on)."""


SOAP_EARLY_DECOMP = Path(__file__).parent / "data" / "soap_decomposes_before_previous_refresh_plan.json"
"""A SOAP plan on mesh (1, 2) GPipe that says it was made for warm starts but decomposes 4.bias's refresh on r1 a
step before the previous refresh of 4.bias is made there (its R arrives by broadcast later): a plan="auto" plan of
before warm starts were planned, its problem marked warm-started by hand, which a run takes as given."""


def _replayed_worker(rank: int, world: int, text: str) -> dict:
    """The saved plan run for STEPS steps."""
    trainer = fxkfac.compile(
        mlp(),
        (1, 2),
        parse_plan(text),
        example_inputs=(mlp_batches(STEPS)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        schedule="gpipe",
        microbatches=N // 2,
        preconditioner=SOAP,
        pipeline=PipelineOptions(timeout=60.0),
    )
    for x, y in mlp_batches(STEPS):
        trainer.step(x, y)
    return {"params": {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()}}


@pytest.mark.multiproc
def test_a_soap_refresh_starts_from_the_previous_bases_however_late_they_land() -> None:
    text = SOAP_LATE_BROADCAST.read_text()
    results = run_distributed(_replayed_worker, 2, text, timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    _assert_equal_one_device(results, "soap", dict(parse_plan(text).layers))


@pytest.mark.multiproc
def test_a_plan_that_decomposes_before_the_previous_refresh_is_made_stops_the_run() -> None:
    """The runtime does not start a warm-started decomposition from an older preconditioner than one device would:
    a given Plan is not validated, so it checks the order itself."""
    results = run_distributed(_replayed_worker, 2, SOAP_EARLY_DECOMP.read_text(), timeout=300)
    failed = [r for r in results if not r.ok]
    assert failed and all(r.error_type in ("PipelineError", "PipelineTimeoutError") for r in failed), results
    assert any(
        r.error_type == "PipelineError"
        and "starts 4.bias's refresh of step" in r.error
        and "Problem.warm_start" in r.error
        for r in failed
    ), results


def test_profiling_times_the_decomposition_past_the_start_step() -> None:
    """A family declines to decompose before its start step; the profiler folds until it does, so a root inverse
    is not priced as free (a plan would then refresh every step)."""
    late = gradient_unit_cost(ShampooFamily(replace(SHAMPOO, start_preconditioning_step=7)), *_units(), repeats=1)
    cost = late("0.weight", 4)
    assert all(part.decomp > 0 for part in cost.parts)
    eager = gradient_unit_cost(ShampooFamily(SHAMPOO), *_units(), repeats=1)("0.weight", 4)
    assert min(p.decomp for p in cost.parts) > 0.1 * min(p.decomp for p in eager.parts)


def _units() -> tuple[dict, dict]:
    model = mlp()
    params = dict(model.named_parameters())
    return {n: ParamUnit(n, tuple(p.shape)) for n, p in params.items()}, params


def _resume_worker(rank: int, world: int, family: str, path: str) -> dict[str, dict[str, Tensor]]:
    """Planned 2-rank 1F1B: train 3 steps and checkpoint (decompositions may be in flight), resume in new trainers
    under the same plan, and train on; against the same 6 steps uninterrupted."""
    batches = mlp_batches(STEPS)

    def make(seed: int, plan: Any) -> fxkfac.Trainer:
        return fxkfac.compile(
            mlp(seed=seed),
            (2, 1),
            plan,
            example_inputs=(batches[0][0],),
            loss_fn=F.mse_loss,
            optimizer=_sgd,
            backend=None,
            schedule="1f1b",
            microbatches=N,
            preconditioner=FAMILIES[family],
            pipeline=PipelineOptions(timeout=60.0),
            plan_options=PlanOptions(time_limit_s=3.0),
        )

    whole = make(0, "auto")
    for x, y in batches:
        whole.step(x, y)
    first = make(0, whole.plan)
    for x, y in batches[:3]:
        first.step(x, y)
    first.save_checkpoint(path)
    resumed = make(5, whole.plan)
    resumed.load_checkpoint(path)
    for x, y in batches[3:]:
        resumed.step(x, y)
    return {
        name: {n: copy.deepcopy(p.detach()) for n, p in t.named_parameters()}
        for name, t in (("whole", whole), ("resumed", resumed))
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planned_pipeline_resumes_exactly_from_a_checkpoint(family: str, tmp_path) -> None:
    results = run_distributed(_resume_worker, 2, family, str(tmp_path / "ckpt"), timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    for r in results:
        for name, p in r.value["whole"].items():
            assert torch.equal(p, r.value["resumed"][name]), f"rank {r.rank} {name}"
