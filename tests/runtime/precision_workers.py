"""Rank functions and single-process references of the mixed-precision and gradient-clipping tests (importable by
spawned ranks): the references are plain PyTorch, `torch.autocast` with `torch.amp.GradScaler` and
`torch.nn.utils.clip_grad_norm_`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import KFACConfig, LossScaling, PipelineOptions
from fxkfac.planner.problem.ir import LayerTiming
from tests.runtime.workers import Config, loss_for, make_batches, make_model, make_optimizer
from tests.support.models import mlp

__all__ = [
    "DTYPES",
    "Case",
    "precision_worker",
    "precision_reference",
    "kfac_worker",
    "KFAC",
    "TIMINGS",
    "kfac_batches",
]

DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """One pipelined run of `workers.Config` with mixed precision `dtype` (None, "bf16", "fp16"), gradient
    clipping and float16's loss scaling."""

    cfg: Config
    dtype: str | None = None
    max_grad_norm: float | None = None
    scaling: LossScaling = LossScaling()

    def options(self) -> PipelineOptions:
        return PipelineOptions(
            virtual_stages=self.cfg.v,
            timeout=60,
            autocast_dtype=DTYPES[self.dtype],
            max_grad_norm=self.max_grad_norm,
            loss_scaling=self.scaling,
        )


def precision_worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Run each case; per case this rank's parameters, step losses, skipped steps and final loss scale."""
    results = []
    for case in cases:
        cfg = case.cfg
        batches = make_batches(cfg)
        trainer = fxkfac.compile(
            make_model(cfg.model),
            (cfg.D, cfg.W),
            None,
            example_inputs=(batches[0][0],),
            loss_fn=loss_for(cfg.model),
            optimizer=make_optimizer(cfg.opt),
            preconditioner=None,
            schedule=cfg.schedule,
            microbatches=cfg.N,
            backend=None,
            pipeline=case.options(),
        )
        losses = [float(trainer.step(x, y)) for x, y in batches]
        params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
        results.append(
            {
                "params": params,
                "losses": losses,
                "skipped": trainer.skipped_steps,
                "scale": trainer.loss_scale.scale,
                "state_scale": trainer.state_dict().get("loss_scale"),
            }
        )
        dist.barrier()
    return results


def precision_reference(case: Case) -> dict:
    """Single-process training of the eager model under `torch.autocast`, float16 with `torch.amp.GradScaler`,
    clipped by `clip_grad_norm_` after unscaling, its gradients accumulated over the run's micro-batches (a
    low-precision gradient rounds per backward): parameters, losses, skipped steps, final scale and the gradient
    norms before clipping."""
    cfg, dtype = case.cfg, DTYPES[case.dtype]
    model = make_model(cfg.model)
    opt = make_optimizer(cfg.opt)(list(model.parameters()))
    loss_fn = loss_for(cfg.model)
    s = case.scaling
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=s.init_scale,
        growth_factor=s.growth_factor,
        backoff_factor=s.backoff_factor,
        growth_interval=s.growth_interval,
        enabled=dtype is torch.float16,
    )
    losses, norms, skipped = [], [], 0
    parts = cfg.N * cfg.W
    for x, y in make_batches(cfg):
        loss = torch.zeros(())
        for xm, ym in zip(x.chunk(parts), y.chunk(parts), strict=True):  # accumulated over the micro-batches
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                part = loss_fn(model(xm), ym) / parts
            scaler.scale(part).backward()
            loss += part.detach().float()
        losses.append(float(loss))
        scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        if case.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += int(scaler.is_enabled() and scaler.get_scale() < before)
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    return {"params": params, "losses": losses, "skipped": skipped, "scale": scale, "norms": norms}


KFAC = KFACConfig(damping=0.01, kl_clip=0.01)
TIMINGS = {
    "0": LayerTiming(2, 0, 1, "fused"),
    "2": LayerTiming(1, 0, 0, "deferred"),
    "4": LayerTiming(2, 1, 1, "deferred"),
}
"""Layer 0 refreshes at even steps and uses its inverse a step later; layer 2 every step; layer 4 at odd steps."""
KFAC_BATCH, KFAC_LR = 8, 0.05


def kfac_batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(KFAC_BATCH, 12, generator=g), torch.randn(KFAC_BATCH, 5, generator=g)) for _ in range(4)]


def kfac_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=KFAC_LR, momentum=0.5)


def kfac_compile(
    mesh: tuple[int, int] | None, schedule: str, max_grad_norm: float | None, dtype: str | None = None
) -> fxkfac.Trainer:
    """K-FAC on the 3-layer MLP with fixed layer timings, clipped to `max_grad_norm`, under autocast of `dtype`."""
    return fxkfac.compile(
        mlp(seed=1),
        mesh,
        None,
        example_inputs=(kfac_batches()[0][0],),
        loss_fn=F.mse_loss,
        optimizer=kfac_sgd,
        backend=None,
        schedule=schedule,
        microbatches=2,
        preconditioner=KFAC,
        layer_timing=TIMINGS,
        pipeline=PipelineOptions(timeout=60.0, max_grad_norm=max_grad_norm, autocast_dtype=DTYPES[dtype]),
    )


def kfac_worker(rank: int, world: int, cases: list[tuple[str, float | None, str | None]]) -> list[dict[str, Tensor]]:
    """K-FAC pipelined over `world` stages per (schedule, max_grad_norm, dtype): this rank's parameters."""
    out = []
    for schedule, max_grad_norm, dtype in cases:
        trainer = kfac_compile((world, 1), schedule, max_grad_norm, dtype)
        for x, y in kfac_batches():
            trainer.step(x, y)
        out.append({n: p.detach().clone() for n, p in trainer.named_parameters()})
        dist.barrier()
    return out
