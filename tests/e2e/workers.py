"""Rank functions and single-device references for the PipeFisher end-to-end tests (importable by spawned ranks)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import fxkfac
from fxkfac.config import KFACConfig, KLClipScope, PipelineOptions, PlanOptions
from fxkfac.planner.problem.ir import LayerTiming
from tests.support import models

__all__ = [
    "Case",
    "KFAC",
    "timings_for",
    "batches",
    "loss_fn",
    "optimizer",
    "reference_params",
    "pipefisher_worker",
    "compare",
    "auto_worker",
    "reference_for_plan",
    "synthetic_costs",
    "max_overhead",
    "planned_worker",
    "compile_api_worker",
    "two_helpers_worker",
    "pipelined",
    "trained",
    "weighted_loss",
    "weighted_batches",
    "streamed_resume_worker",
    "streamed_worker",
    "reference_with_skip",
]

KFAC = KFACConfig(damping=1e-2, factor_decay=0.9, kl_clip=1e-2)
PERIOD = 2
STEPS = 2 * PERIOD  # two refresh periods


@dataclass(frozen=True)
class Case:
    """One pipelined PipeFisher run: schedule, D stages, N micro-batches per replica, W replicas."""

    schedule: str
    D: int
    N: int
    W: int
    scope: KLClipScope = KLClipScope.GLOBAL
    """The KL-clip scope (STAGE/STALE: no world barrier ends a step, and the planner plans so)."""
    fused: float | None = None
    """`StageCost.fused_fwd`/`fused_bwd` of every stage in `synthetic_costs` (None: not measured). Far below the
    statistics' time, where no bubble hides them, it makes the plan fuse every layer's curvature (`solve`'s own
    choice: with a forced `strategy`; the joint strategy search fuses nothing)."""
    strategy: str | None = None
    """`PlanOptions.strategy` (None: the planner chooses)."""
    max_grad_norm: float | None = None
    """`PipelineOptions.max_grad_norm` of the pipelined run and its single-device reference."""

    @property
    def kfac(self) -> KFACConfig:
        """KFAC with this case's KL-clip scope."""
        return dataclasses.replace(KFAC, kl_clip_scope=self.scope)

    @property
    def batch(self) -> int:
        """Global mini-batch: two samples per micro-batch per replica."""
        return 2 * self.N * self.W


def make_model() -> torch.nn.Module:
    """The small Hugging Face BERT (fixed seed) every run starts from."""
    return models.tiny_bert(layers=2)  # default config (use_cache=True): capture turns the cache off


def timings_for(names: list[str]) -> dict[str, LayerTiming]:
    """Mixed timings that exercise the plan semantics: fused at step 0 used at once, deferred at step 1 used
    a step later."""
    return {
        name: LayerTiming(PERIOD, 0, 0, "fused") if i % 2 == 0 else LayerTiming(PERIOD, 1, 1, "deferred")
        for i, name in enumerate(names)
    }


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS deterministic global mini-batches of token ids and targets."""
    return [models.token_batch(case.batch, seed=100 + step) for step in range(STEPS)]


def loss_fn(out, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary per token."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def optimizer(params):
    """SGD with momentum: sensitive to every bit of the preconditioned gradient."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference_params(case: Case, timings: dict[str, LayerTiming]) -> dict[str, torch.Tensor]:
    """The single-device trainer (the oracle) on the same mini-batches, N*W micro-batches, the same timings."""
    torch.manual_seed(0)
    return _trained_alone(case, batches(case), timings, KFAC)


def _trained_alone(
    case: Case,
    data: list[tuple[torch.Tensor, Any]],
    timings: dict[str, LayerTiming],
    kfac: KFACConfig,
    loss=None,
    stages: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """The parameters of the single-device trainer with `kfac` at `timings`, N*W micro-batches, after `data` (`loss`:
    `loss_fn` when None; `stages`: each layer's stage in the pipelined run, its KL-clip group under STAGE)."""
    trainer = fxkfac.compile(
        make_model(),
        None,
        example_inputs=(data[0][0],),
        loss_fn=loss or loss_fn,
        optimizer=optimizer,
        preconditioner=kfac,
        microbatches=case.N * case.W,
        backend=None,
        layer_timing=timings,
        pipeline=PipelineOptions(max_grad_norm=case.max_grad_norm),
    )
    if stages is not None:
        trainer.preconditioning.clip_groups = dict(stages)
        trainer.preconditioning.step_end.groups = 1 + max(stages.values())
    for ids, y in data:
        trainer.step((ids,), y)
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def pipefisher_worker(rank: int, world: int, cases: list[Case]) -> dict:
    """Run each case on this rank's share of the mesh; return {case index: (params, losses)}."""
    out = {}
    for i, case in enumerate(cases):
        if case.D * case.W != world:
            raise ValueError(f"case {case} needs {case.D * case.W} ranks, got {world}")
        data = batches(case)
        names = _names_for(case)
        trainer = fxkfac.compile(
            make_model(),
            (case.D, case.W),
            None,
            preconditioner=KFAC,
            example_inputs=(data[0][0],),
            loss_fn=loss_fn,
            optimizer=optimizer,
            schedule=case.schedule,
            backend=None,
            microbatches=case.N,
            layer_timing=timings_for(names),
            pipeline=PipelineOptions(timeout=60.0),
        )
        losses = [trainer.step((ids,), y) for ids, y in data]
        out[i] = ({n: p.detach().clone() for n, p in trainer.named_parameters()}, losses)
    return out


def _layer_names(case: Case, data) -> list[str]:
    from fxkfac.capture import capture

    micro = data[0][0][: case.batch // (case.N * case.W)]
    return [layer.name for layer in capture(make_model(), (micro,), KFAC).layers]


_NAMES: dict[int, list[str]] = {}


def _names_for(case: Case) -> list[str]:
    """`_layer_names` of the case's batches, captured once per N*W in this process (the captured micro-batch is
    the same for every case of a given N*W)."""
    if case.N * case.W not in _NAMES:
        _NAMES[case.N * case.W] = _layer_names(case, batches(case))
    return _NAMES[case.N * case.W]


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-5) -> list[str]:
    """Names of parameters (present on the rank) that differ from the reference by more than atol."""
    return [n for n, p in got.items() if not torch.allclose(p, want[n], atol=atol, rtol=0)]


def auto_worker(rank: int, world: int, case: Case, path: str) -> dict:
    """plan="auto" (profile, solve on rank 0, broadcast), save it; then train from the saved file and from the
    Plan object; also try a plan for another model. Returns params, losses, the plan's layers and the refusal."""
    import torch.distributed as dist

    from fxkfac.errors import PlanMismatchError

    data = batches(case)
    common = dict(
        preconditioner=KFAC,
        example_inputs=(data[0][0],),
        loss_fn=loss_fn,
        optimizer=optimizer,
        backend=None,
        schedule=case.schedule,
        microbatches=case.N,
        pipeline=PipelineOptions(timeout=60.0),
    )
    auto = fxkfac.compile(make_model(), (case.D, case.W), "auto", plan_options=PlanOptions(time_limit_s=5.0), **common)
    if rank == 0:
        auto.plan.save(path)
    dist.barrier()
    loaded = fxkfac.compile(make_model(), (case.D, case.W), path, **common)
    steps = 2 * max(t.period for t in loaded.plan.layers.values())
    losses = [loaded.step((ids,), y) for ids, y in (batches(case) * steps)[:steps]]
    refused = None
    try:
        fxkfac.compile(models.tiny_bert(layers=3), (case.D, case.W), path, **common)
    except PlanMismatchError as e:
        refused = str(e)
    return {
        "params": {n: p.detach().clone() for n, p in loaded.named_parameters()},
        "losses": losses,
        "layers": dict(loaded.plan.layers),
        "steps": steps,
        "refused": refused,
        "same_programs": auto.plan.programs == loaded.plan.programs,
        "kfac_ops": sum(
            op.kind.value in ("STATS", "DECOMP", "APPLY") for st in loaded.plan.programs[rank] for op in st
        ),
    }


def reference_for_plan(case: Case, layers: dict[str, LayerTiming], steps: int) -> dict[str, torch.Tensor]:
    """The single-device trainer given the plan's timings on the batches `auto_worker` trains on."""
    return _trained_alone(case, (batches(case) * steps)[:steps], layers, case.kfac)


def synthetic_costs(stage_layers, layers, fused=None):
    """A fixed cost table for the split (1 ms forward, 2 ms backward per micro-batch; K-FAC work a little
    over one bubble per stage: it grows with the stage count as the bubbles do), so that the planner's
    plans refresh every 2-3 steps and put curvature and inversion into the bubbles whatever this
    machine's speed."""
    from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost

    ms = 1e-3 * (len(stage_layers) - 1)
    stages = []
    for s in sorted(stage_layers):
        costs = tuple(
            LayerCost.kfac(
                name,
                curv_a=0.12 * ms,
                curv_b=0.12 * ms,
                inv_a=0.25 * ms,
                inv_b=0.2 * ms,
                prec=0.01 * ms,
                a_bytes=4096,
                e_bytes=4096,
                factor_a_bytes=layers[name].a_dim ** 2 * 4,
                factor_b_bytes=layers[name].b_dim ** 2 * 4,
            )
            for name in stage_layers[s]
        )
        stages.append(
            StageCost(
                fwd=1e-3,
                bwd=2e-3,
                param_bytes=1 << 20,
                act_bytes=1 << 16,
                layers=costs,
                fused_fwd=fused,
                fused_bwd=fused,
            )
        )
    return CostTable(tuple(stages), 2, "synthetic:e2e", "cpu")


def max_overhead(case: Case) -> float:
    """Chimera with D=2 has no bubble: its plan must stretch the step (the allowance); others use bubbles only."""
    return 1.0 if case.schedule == "chimera" and case.D == 2 else 0.0


def pipelined(case: Case, plan: Any, options: PlanOptions | None = None, loss: Any = None) -> Any:
    """`fxkfac.compile` of the case's model, eager, over its (D, W) mesh with `plan` ("auto" planned with `options`,
    a Plan, or a file) and `loss` (`loss_fn` when None)."""
    return fxkfac.compile(
        make_model(),
        (case.D, case.W),
        plan,
        preconditioner=case.kfac,
        example_inputs=(batches(case)[0][0],),
        loss_fn=loss_fn if loss is None else loss,
        optimizer=optimizer,
        schedule=case.schedule,
        backend=None,
        microbatches=case.N,
        pipeline=PipelineOptions(timeout=60.0, max_grad_norm=case.max_grad_norm),
        **({"plan_options": options} if options is not None else {}),
    )


def planned_worker(rank: int, world: int, cases: list[Case]) -> dict:
    """Each case with a CP-SAT plan (rank 0 solves over `synthetic_costs`, every rank runs it) for two
    refresh periods. Returns {case index: (params, losses, plan layers, steps, K-FAC ops on this rank)}."""
    out = {}
    for i, case in enumerate(cases):
        if case.D * case.W != world:
            raise ValueError(f"case {case} needs {case.D * case.W} ranks, got {world}")
        data = batches(case)
        costs = functools.partial(synthetic_costs, fused=case.fused)
        options = PlanOptions(costs=costs, time_limit_s=1.5, max_overhead=max_overhead(case), strategy=case.strategy)
        trainer = pipelined(case, "auto", options)
        if trainer.plan.problem.barrier is not case.scope.barrier:
            raise AssertionError(f"{case}: planned with the {trainer.plan.problem.barrier} barrier")
        steps = 2 * max(t.period for t in trainer.plan.layers.values())
        losses = [float(trainer.step((ids,), y)) for ids, y in (data * steps)[:steps]]
        kfac_ops = sum(op.kind.value in ("STATS", "DECOMP") for st in trainer.plan.programs[rank] for op in st)
        out[i] = (
            {n: p.detach().clone() for n, p in trainer.named_parameters()},
            losses,
            dict(trainer.plan.layers),
            steps,
            kfac_ops,
            trainer.plan.problem.streaming is not None,
        )
    return out


def compile_api_worker(rank: int, world: int, case: Case, backend: str | None) -> dict:
    """`fxkfac.compile(model, mesh, plan="auto")` over a ("pp", "dp") DeviceMesh with a torch.compile backend;
    returns params, losses, the plan's layers and steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (case.D, case.W), mesh_dim_names=("pp", "dp"))
    data = batches(case)
    trainer = fxkfac.compile(
        make_model(),
        mesh,
        plan="auto",
        example_inputs=(data[0][0],),
        loss_fn=loss_fn,
        optimizer=optimizer,
        preconditioner=KFAC,
        schedule=case.schedule,
        microbatches=case.N,
        backend=backend,
        pipeline=PipelineOptions(timeout=120.0),
        plan_options=PlanOptions(costs=synthetic_costs, time_limit_s=3.0),
    )
    return trained(trainer, data, 2 * max(t.period for t in trainer.plan.layers.values()))


def trained(trainer: Any, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> dict:
    """`trainer` run for `steps` steps over `data` (repeated): its params, losses, plan's layers, steps, streaming."""
    losses = [float(trainer.step((ids,), y)) for ids, y in (data * steps)[:steps]]
    return {
        "params": {n: p.detach().clone() for n, p in trainer.named_parameters()},
        "losses": losses,
        "layers": dict(trainer.plan.layers),
        "steps": steps,
        "streaming": trainer.plan.problem.streaming,
    }


def two_helpers_worker(rank: int, world: int, case: Case) -> dict:
    """The case's auto plan with its streamed layers shared between the two ranks that do not hold stage 0 (each
    its every other layer), placed by the planner's greedy rule (the same plan on every rank), run for two refresh
    periods of the streamed layers. Returns params, losses, the plan's layers and steps, and its streaming."""
    from fxkfac.planner.problem.lowering import Streaming
    from fxkfac.planner.problem.problem import SolverConfig
    from fxkfac.planner.search.attempt import solve

    data = batches(case)
    options = PlanOptions(costs=synthetic_costs, time_limit_s=1.5, max_overhead=max_overhead(case))
    problem = pipelined(case, "auto", options).plan.problem
    if problem.streaming is None or len(problem.streaming.layers) < 2:
        raise AssertionError(f"{case}: the auto plan streams {problem.streaming}, not two layers or more")
    others = [d for d in problem.devices if d not in problem.stream_owners]
    layers = problem.streaming.layers
    shared = Streaming(0, tuple(others[i % 2] for i in range(len(layers))), layers)
    run = pipelined(
        case, solve(dataclasses.replace(problem, streaming=shared), SolverConfig(time_limit_s=1.5), "greedy")
    )
    return trained(run, data, 2 * max(run.plan.layers[n].period for n in layers))  # two refreshes of each streamed


def streamed_worker(rank: int, world: int, case: Case) -> dict:
    """The case's auto plan, whose first stage streams its APPLY, run for two refresh periods (`trained`)."""
    options = PlanOptions(costs=synthetic_costs, time_limit_s=1.5, max_overhead=0.0)
    run = pipelined(case, "auto", options)
    return trained(run, batches(case), 2 * max(t.period for t in run.plan.layers.values()))


def weighted_loss(out, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`loss_fn` times the mean of per-sample weights: NaN weights make a step's loss and gradients NaN."""
    y, weights = target
    return loss_fn(out, y) * weights.mean()


def weighted_batches(
    case: Case, steps: int, nan_at: int
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    """`batches` repeated to `steps`, each target with weights 1, NaN at step `nan_at`."""
    data = (batches(case) * steps)[:steps]
    return [
        (ids, (y, torch.full((ids.shape[0],), float("nan") if t == nan_at else 1.0))) for t, (ids, y) in enumerate(data)
    ]


def streamed_resume_worker(rank: int, world: int, case: Case, ckpt: str) -> dict:
    """A planned run whose first stage streams its APPLY (`PlanOptions.stream_apply`): two refresh periods and two
    steps, one of them NaN (skipped), a checkpoint saved mid-run; then a fresh trainer of the same plan resumes from
    the checkpoint and trains the rest. Returns both runs' parameters, the plan's timings and streaming, the skips."""
    options = PlanOptions(costs=synthetic_costs, time_limit_s=1.5, max_overhead=0.0)
    first = pipelined(case, "auto", options, weighted_loss)
    period = max(t.period for t in first.plan.layers.values())
    steps, save_at = 2 * period + 2, period + 1
    data = weighted_batches(case, steps, nan_at=period)
    for t, (ids, target) in enumerate(data):
        if t == save_at:
            first.save_checkpoint(ckpt)
        first.step((ids,), target)
    second = pipelined(case, first.plan, loss=weighted_loss)
    second.load_checkpoint(ckpt)
    for ids, target in data[save_at:]:
        second.step((ids,), target)
    return {
        "streaming": first.plan.problem.streaming,
        "stages": {n: first.plan.problem.costs.stage_of(n) for n in first.plan.layers},
        "layers": dict(first.plan.layers),
        "steps": steps,
        "skipped": first.skipped_steps,
        "params": {n: p.detach().clone() for n, p in first.named_parameters()},
        "resumed": {n: p.detach().clone() for n, p in second.named_parameters()},
    }


def reference_with_skip(
    case: Case, layers: dict[str, LayerTiming], steps: int, nan_at: int, stages: dict[str, int]
) -> dict[str, torch.Tensor]:
    """The single-device trainer given the plan's timings and the layers' stages (`stages`) on
    `streamed_resume_worker`'s batches (the NaN step skipped)."""
    data = weighted_batches(case, steps, nan_at)
    return _trained_alone(case, data, layers, case.kfac, weighted_loss, stages)
