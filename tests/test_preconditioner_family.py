"""A second preconditioner family (tests/support/diagonal.py) runs through the same compile path and runtime as
K-FAC: on one device it equals a hand-written eager reference; pipelined it equals one device; it checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.kfac.factors import e_rows, running_average
from fxkfac.planner.problem.costs import CostTable, LayerCost, PartCost, StageCost
from fxkfac.planner.problem.ir import LayerTiming, OpKind
from tests.passes.reference import hook_a_e
from tests.support.diagonal import DiagonalFamily
from tests.support.distributed import run_distributed
from tests.support.models import mlp, mlp_batches

LR, N, STEPS = 0.1, 2, 4


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _timings() -> dict[str, LayerTiming]:
    """Layer 0 refreshes every step, layer 2 every other step and uses it a step late, layer 4 fused."""
    return {
        "0": LayerTiming(1, 0, 0, "deferred"),
        "2": LayerTiming(2, 0, 1, "deferred"),
        "4": LayerTiming(1, 0, 0, "fused"),
    }


def _reference(batches: list[tuple[Tensor, Tensor]], family: DiagonalFamily) -> dict[str, Tensor]:
    """Eager training with hooks: D from squared per-sample output gradients, rows of G scaled by (D + eps)^-1/2."""
    model = mlp()
    opt = _sgd(list(model.parameters()))
    timings = _timings()
    layers = _compiled(batches[0][0]).units
    D: dict[str, Tensor | None] = {layer.name: None for layer in layers}
    queue: dict[str, list[tuple[int, Tensor]]] = {layer.name: [] for layer in layers}
    active: dict[str, Tensor | None] = {layer.name: None for layer in layers}
    for t, (x, y) in enumerate(batches):
        refresh = [layer for layer in layers if t % timings[layer.name].period == 0]
        sums: dict[str, Tensor] = {layer.name: torch.zeros(layer.d_out) for layer in refresh}
        for xm, ym in zip(x.chunk(N), y.chunk(N)):
            captured = hook_a_e(model, refresh, lambda xm=xm, ym=ym: F.mse_loss(model(xm), ym) / N)
            for layer in refresh:
                sums[layer.name] += (e_rows(captured[layer.name][1], layer, x.shape[0]) ** 2).mean(0)
        for layer in refresh:
            D[layer.name] = running_average(D[layer.name], sums[layer.name] / N, family.decay)
            queue[layer.name].append((t + timings[layer.name].use_offset, (D[layer.name] + family.eps).rsqrt()))
        for name, q in queue.items():
            while q and q[0][0] <= t:
                active[name] = q.pop(0)[1]
        params = dict(model.named_parameters())
        for layer in layers:
            scale = active[layer.name]
            if scale is not None:
                params[layer.weight].grad.mul_(scale[:, None])
                if layer.bias is not None:
                    params[layer.bias].grad.mul_(scale)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _compiled(
    example: Tensor, timings: dict[str, LayerTiming] | None = None, model: nn.Module | None = None
) -> fxkfac.runtime.trainer.Trainer:
    """A single-device trainer of `model` (default `mlp()`) with the diagonal family at `timings` (default
    `_timings()`) and SGD."""
    return fxkfac.compile(
        mlp() if model is None else model,
        None,
        None,
        example_inputs=(example,),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        microbatches=N,
        preconditioner=DiagonalFamily(),
        layer_timing=_timings() if timings is None else timings,
    )


def _one_device(
    batches: list[tuple[Tensor, Tensor]], timings: dict[str, LayerTiming] | None = None
) -> fxkfac.runtime.trainer.Trainer:
    """The single-device trainer (`_compiled`) after `batches`."""
    trainer = _compiled(batches[0][0], timings)
    for x, y in batches:
        trainer.step(x, y)
    return trainer


def test_diagonal_family_on_one_device_equals_the_eager_reference() -> None:
    batches = mlp_batches(STEPS)
    trainer = _one_device(batches)
    want = _reference(batches, DiagonalFamily())
    moved = 0.0
    for name, p in trainer.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, float((p.detach() - mlp().get_parameter(name)).abs().max()))
    assert moved > 1e-3, "training did not move the parameters: the comparison would be vacuous"
    assert {type(s).__name__ for s in trainer.layer_states.values()} == {"DiagonalState"}
    kinds = {op.kind.value for step in trainer.spec.programs[0] for op in step}
    assert {"STATS", "DECOMP", "APPLY"} <= kinds


def test_diagonal_family_checkpoint_resumes_exactly(tmp_path) -> None:
    batches = mlp_batches(STEPS)
    a = _one_device(batches[:2])
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = _compiled(batches[0][0], model=mlp(seed=5))
    b.load_checkpoint(str(tmp_path / "ckpt"))
    for x, y in batches[2:]:
        a.step(x, y)
        b.step(x, y)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def _pipelined_worker(rank: int, world: int, meshes: list[tuple[int, int, str]]) -> list[dict[str, Tensor]]:
    """Each (D, W, schedule) with the diagonal family, K-FAC's naive programs for its one part."""
    out = []
    for D, W, schedule in meshes:
        batches = mlp_batches(STEPS)
        trainer = fxkfac.compile(
            mlp(),
            (D, W),
            None,
            example_inputs=(batches[0][0],),
            loss_fn=F.mse_loss,
            optimizer=_sgd,
            backend=None,
            schedule=schedule,
            microbatches=N // W,
            preconditioner=DiagonalFamily(),
            layer_timing=_timings(),
            pipeline=PipelineOptions(timeout=60.0),
        )
        for x, y in batches:
            trainer.step(x, y)
        out.append({n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()})
        dist.barrier()
    return out


@pytest.mark.multiproc
def test_diagonal_family_pipelined_equals_one_device() -> None:
    meshes = [(2, 1, "1f1b"), (1, 2, "gpipe")]
    results = run_distributed(_pipelined_worker, 2, meshes, timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    want = dict(_one_device(mlp_batches(STEPS)).named_parameters())
    for r in results:
        for case, params in zip(meshes, r.value):
            for name, p in params.items():
                torch.testing.assert_close(
                    p, want[name].detach(), rtol=0, atol=1e-5, msg=f"{case} rank {r.rank} {name}"
                )


def diagonal_costs(stage_layers: dict[int, list[str]], layers: dict) -> CostTable:
    """The diagonal family's costs for the split: one part D per layer, made after BWD; F 1 ms, B 2 ms, and
    decompositions long enough that the plan must refresh less often than every step."""
    stages = tuple(
        StageCost(
            1e-3,
            2e-3,
            1 << 20,
            1 << 16,
            tuple(LayerCost(name, (PartCost("D", OpKind.BWD, 2e-4, 1e-3, 64, 64),), 1e-5) for name in stage_layers[s]),
        )
        for s in sorted(stage_layers)
    )
    return CostTable(stages, 4, "test:diagonal", "cpu")


def _auto_planned(plan_options: PlanOptions) -> fxkfac.Trainer:
    """The MLP with the diagonal family over 2 ranks of 1F1B, plan="auto" under `plan_options`."""
    return fxkfac.compile(
        mlp(),
        (2, 1),
        "auto",
        example_inputs=(mlp_batches(1)[0][0],),
        loss_fn=F.mse_loss,
        optimizer=_sgd,
        backend=None,
        schedule="1f1b",
        microbatches=N,
        preconditioner=DiagonalFamily(),
        pipeline=PipelineOptions(timeout=60.0),
        plan_options=plan_options,
    )


def _planned_worker(rank: int, world: int) -> dict:
    """plan="auto" places the diagonal family's work (CP-SAT over `diagonal_costs`) and the ranks run it."""
    batches = mlp_batches(STEPS) * 2
    trainer = _auto_planned(PlanOptions(costs=diagonal_costs, time_limit_s=3.0))
    for x, y in batches:
        trainer.step(x, y)
    assert trainer.plan is not None
    placed = {p.op.kind.value for p in trainer.plan.placements}
    return {
        "params": {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()},
        "layers": dict(trainer.plan.layers),
        "placed": placed,
    }


@pytest.mark.multiproc
def test_the_planner_places_the_diagonal_family_and_the_runtime_runs_its_plan() -> None:
    results = run_distributed(_planned_worker, 2, timeout=300)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    layers = results[0].value["layers"]
    assert {"STATS", "DECOMP", "APPLY"} <= results[0].value["placed"] | results[1].value["placed"]
    assert max(t.period for t in layers.values()) > 1, "the plan should refresh less often than every step"
    want = dict(_one_device(mlp_batches(STEPS) * 2, layers).named_parameters())
    for r in results:
        for name, p in r.value["params"].items():
            torch.testing.assert_close(p, want[name].detach(), rtol=0, atol=1e-5, msg=f"rank {r.rank} {name}")


def _unprofiled_worker(rank: int, world: int) -> None:
    """plan="auto" without costs for a family whose part is fed by captures (the profiler times only K-FAC's and
    gradient-fed parts)."""
    _auto_planned(PlanOptions())


@pytest.mark.multiproc
def test_auto_plan_refuses_to_profile_a_captured_family_and_says_what_to_pass() -> None:
    results = run_distributed(_unprofiled_worker, 2, timeout=300)
    for r in results:
        assert r.error_type == "ConfigError", (r.rank, r.error_type, r.error, r.traceback)
        assert "cannot profile diagonal" in r.error and "PlanOptions(costs=...)" in r.error, r.error
