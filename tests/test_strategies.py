"""Distribution strategies on a mesh: KAISA's COMM-OPT, MEM-OPT and HYBRID move where inverses live and who
preconditions, and change no number (single-device K-FAC given the same layer timings, to 1e-5); DP-KFAC's
local factors equal single-device K-FAC whose factors come from each layer's owner's shard."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions
from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.hardware import HARDWARE
from fxkfac.planner.problem.ir import LayerTiming, OpKind
from fxkfac.planner.problem.lowering import ranks_of_stages
from fxkfac.planner.problem.strategy import grad_workers
from fxkfac.shampoo import GraftType, ShampooConfig
from tests.support.distributed import run_distributed
from tests.support.kfac_reference import KFACReference
from tests.support.models import mlp

N, STEPS, BATCH, LR = 2, 5, 16, 0.05
KFAC = KFACConfig(damping=0.01, kl_clip=0.01)
TIMINGS = {
    "0": LayerTiming(2, 0, 1, "fused"),
    "2": LayerTiming(1, 0, 0, "deferred"),
    "4": LayerTiming(2, 1, 1, "deferred"),
}
"""Layer 0 refreshes at even steps and uses its inverse a step later; layer 2 every step; layer 4 at odd steps."""


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.5)


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)) for _ in range(STEPS)]


def _compile(mesh: tuple[int, int] | None, strategy: str, microbatches: int = N) -> fxkfac.Trainer:
    return fxkfac.compile(
        mlp(seed=1),
        mesh,
        None,
        example_inputs=(_batches()[0][0],),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        schedule="gpipe",
        microbatches=microbatches,
        preconditioner=KFAC,
        layer_timing=TIMINGS,
        pipeline=PipelineOptions(timeout=60.0),
        plan_options=PlanOptions(strategy=strategy),
    )


def _train(trainer: fxkfac.Trainer) -> dict[str, Tensor]:
    for x, y in _batches():
        trainer.step(x, y)
    return {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()}


def _one_device() -> dict[str, Tensor]:
    return _train(_compile(None, "comm-opt"))


def _worker(rank: int, world: int, cases: list[tuple[int, str]]) -> list[dict]:
    out = []
    for D, strategy in cases:
        trainer = _compile((D, world // D), strategy)
        ops = {op.kind for step in trainer.spec.programs[rank] for op in step}
        params = _train(trainer)
        inverses = sum(state.active is not None for state in trainer.layer_states.values())
        out.append({"params": params, "ops": ops, "inverses": inverses, "held": len(trainer.layer_states)})
        dist.barrier()
    return out


STRATEGIES = ("comm-opt", "mem-opt", "hybrid:0.5")


@pytest.mark.multiproc
@pytest.mark.parametrize(("world", "stages"), [(2, (1,)), (4, (1, 2)), (8, (2,))])
def test_kaisa_strategies_equal_one_device_kfac(world: int, stages: tuple[int, ...]) -> None:
    """W = 2 and 4 with pp = 1, W = 2 and 4 with pp = 2 (8 ranks)."""
    cases = [(D, strategy) for D in stages for strategy in STRATEGIES]
    results = run_distributed(_worker, world, cases, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = _one_device()
    start = dict(mlp(seed=1).named_parameters())
    assert max(float((want[n] - p.detach()).abs().max()) for n, p in start.items()) > 1e-3
    for r in results:
        for (D, strategy), got in zip(cases, r.value):
            for name, p in got["params"].items():
                torch.testing.assert_close(
                    p, want[name], rtol=0, atol=1e-5, msg=f"D={D} W={world // D} {strategy} rank {r.rank} {name}"
                )
    by_case = {case: [r.value[i] for r in results] for i, case in enumerate(cases)}
    for D in {D for D, _ in cases}:
        W = world // D
        comm, mem = by_case[(D, "comm-opt")], by_case[(D, "mem-opt")]
        assert all(OpKind.BCAST_PREC not in c["ops"] for c in comm)
        assert all(OpKind.BCAST_PREC in m["ops"] for m in mem)
        assert all(c["inverses"] == c["held"] for c in comm), "COMM-OPT: every copy holds every inverse"
        assert sum(m["inverses"] for m in mem) == len(TIMINGS), "MEM-OPT keeps one copy of each layer's inverse"
        assert sum(m["held"] for m in mem) == W * len(TIMINGS)


def _dp_kfac_worker(rank: int, world: int, meshes: list[tuple[int, int]]) -> list[dict]:
    out = []
    for D, W in meshes:
        trainer = _compile((D, W), "dp-kfac")
        holders = ranks_of_stages(trainer.spec.kind, D, W)
        stage_of = {n: s for s, names in trainer.spec.stage_units.items() for n in names}
        owners = {n: grad_workers(holders[stage_of[n]], trainer.spec.distributions[n])[0] for n in TIMINGS}
        syncs = sum(op.kind is OpKind.SYNC_STATS for step in trainer.spec.programs[rank] for op in step)
        out.append(
            {
                "params": _train(trainer),
                "owners": owners,
                "syncs": syncs,
                "factors": sorted(n for n, s in trainer.layer_states.items() if s.A is not None),
            }
        )
        dist.barrier()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_dp_kfac_equals_one_device_kfac_with_each_layers_factors_from_its_owners_shard(world: int) -> None:
    meshes = [(D, world // D) for D in (1, 2) if world // D > 1]
    results = run_distributed(_dp_kfac_worker, world, meshes, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    for i, (D, W) in enumerate(meshes):
        owners = results[0].value[i]["owners"]
        assert len({owners[n] % W for n in TIMINGS}) > 1, "every layer on one replica: the test would not see DP-KFAC"
        model = mlp(seed=1)
        trainer = _compile(None, "comm-opt", microbatches=N * W)
        shard = {n: range((owners[n] % W) * N, (owners[n] % W + 1) * N) for n in TIMINGS}  # owner's micro-batches
        ref = KFACReference(model, trainer.units, KFAC, F.mse_loss, N * W, TIMINGS, _sgd, shard)
        for t, (x, y) in enumerate(_batches()):
            ref.step(t, x, y)
        want = dict(model.named_parameters())
        for r in results:
            got = r.value[i]
            assert got["syncs"] == 0, "DP-KFAC's factors stay local: no statistic all-reduce"
            assert all(owners[n] == r.rank for n in got["factors"]), "only a layer's owner keeps its factors"
            for name, p in got["params"].items():
                torch.testing.assert_close(
                    p, want[name].detach(), rtol=0, atol=1e-5, msg=f"D={D} W={W} dp-kfac rank {r.rank} {name}"
                )


def _costs(stage_layers: Mapping[int, Sequence[str]], layers: Mapping[str, Any]) -> CostTable:
    """Fixed costs (profiles vary with load): K-FAC work small against F/B, so refreshes are short."""

    def layer(name: str) -> LayerCost:
        return LayerCost.kfac(name, 1e-4, 1e-4, 1e-3, 1e-3, 1e-4, 1024, 1024, 4096, 4096, grad_bytes=1024)

    stages = tuple(
        StageCost(0.01, 0.02, 1 << 12, 1 << 12, tuple(layer(n) for n in stage_layers[s])) for s in sorted(stage_layers)
    )
    return CostTable(stages, BATCH // 4, "fixed", "cpu", HARDWARE["cpu"].comm)


def _planned_worker(rank: int, world: int, cases: list[tuple[int, str]]) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for D, strategy in cases:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)) if D == 1 else (D, world // D)
        trainer = fxkfac.compile(
            mlp(seed=1),
            mesh,
            "auto",
            example_inputs=(_batches()[0][0],),
            loss_fn=F.mse_loss,
            optimizer=_sgd,
            backend=None,
            schedule="gpipe",
            microbatches=N,
            preconditioner=KFAC,
            pipeline=PipelineOptions(timeout=60.0),
            plan_options=PlanOptions(costs=_costs, strategy=strategy, time_limit_s=3.0, max_overhead=1.0),
        )
        assert trainer.plan is not None
        holders = ranks_of_stages(trainer.spec.kind, D, world // D)
        stage_of = {n: s for s, names in trainer.spec.stage_units.items() for n in names}
        owners = {n: grad_workers(holders[stage_of[n]], trainer.plan.problem.where(n))[0] for n in stage_of}
        out.append(
            {
                "params": _train(trainer),
                "timings": dict(trainer.plan.layers),
                "owners": owners,
                "strategy": {str(trainer.plan.problem.where(n).strategy) for n in stage_of},
            }
        )
        dist.barrier()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "cases"), [(2, [(1, "mem-opt"), (1, "dp-kfac")]), (4, [(1, "hybrid:0.5"), (2, "mem-opt")])]
)
def test_planned_strategies_run_their_plan_and_equal_one_device_given_its_timings(
    world: int, cases: list[tuple[int, str]]
) -> None:
    """plan='auto' with a forced strategy: the planner places column broadcasts, per-layer APPLY and BCAST_PREC
    in the bubbles, and the run equals one-device K-FAC with the plan's layer timings (DP-KFAC: with each layer's
    factors from its owner's shard). Pure data parallelism is a ("dp",) DeviceMesh."""
    results = run_distributed(_planned_worker, world, cases, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    for i, (D, strategy) in enumerate(cases):
        W = world // D
        got = results[0].value[i]
        assert got["strategy"] == {strategy.replace("0.5", "1/2")}
        assert min(t.use_offset for t in got["timings"].values()) < STEPS, "no inverse used: a vacuous comparison"
        model = mlp(seed=1)
        units = _compile(None, "comm-opt", microbatches=N * W).units
        shard = (
            {n: range((got["owners"][n] % W) * N, (got["owners"][n] % W + 1) * N) for n in got["owners"]}
            if strategy == "dp-kfac"
            else None
        )
        ref = KFACReference(model, units, KFAC, F.mse_loss, N * W, got["timings"], _sgd, shard)
        for t, (x, y) in enumerate(_batches()):
            ref.step(t, x, y)
        want = dict(model.named_parameters())
        for r in results:
            for name, p in r.value[i]["params"].items():
                torch.testing.assert_close(
                    p,
                    want[name].detach(),
                    rtol=0,
                    atol=1e-5,
                    msg=f"planned D={D} W={W} {strategy} rank {r.rank} {name}",
                )


SHAMPOO = ShampooConfig(
    precondition_frequency=2,
    max_preconditioner_dim=8,
    grafting_type=GraftType.ADAM,
    betas=(0.9, 0.99),
    epsilon=1e-4,
    momentum=0.5,
    preconditioner_dtype="float64",
)


def _shampoo(mesh: tuple[int, int] | None, strategy: str) -> fxkfac.Trainer:
    return fxkfac.compile(
        mlp(seed=1),
        mesh,
        None,
        example_inputs=(_batches()[0][0],),
        loss_fn=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
        backend=None,
        schedule="gpipe",
        microbatches=N,
        preconditioner=SHAMPOO,
        pipeline=PipelineOptions(timeout=60.0),
        plan_options=PlanOptions(strategy=strategy),
    )


def _shampoo_worker(rank: int, world: int) -> dict:
    trainer = _shampoo((1, world), "mem-opt")
    ops = {op.kind for step in trainer.spec.programs[rank] for op in step}
    params = _train(trainer)
    roots = sorted(n for n, state in trainer.layer_states.items() if state.active is not None)
    return {"params": params, "ops": ops, "roots": roots}


@pytest.mark.multiproc
def test_shampoo_mem_opt_owns_each_parameter_once_and_equals_one_device() -> None:
    """Distributed Shampoo's ZeRO-1-like ownership: each parameter's statistics and roots live on one replica,
    which sends the search direction to the other; the parameters equal one-device Shampoo."""
    results = run_distributed(_shampoo_worker, 2, timeout=600)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = _train(_shampoo(None, "comm-opt"))
    mine = [set(r.value["roots"]) for r in results]
    assert mine[0] and mine[1] and not mine[0] & mine[1], f"each parameter's roots on one replica, got {mine}"
    for r in results:
        assert OpKind.BCAST_PREC in r.value["ops"]
        for name, p in r.value["params"].items():
            torch.testing.assert_close(p, want[name], rtol=0, atol=1e-5, msg=f"shampoo mem-opt rank {r.rank} {name}")
