"""Rank functions for the evaluation tests (importable by spawned ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions
from fxkfac.planner.problem.ir import LayerTiming
from tests.runtime.checkpoint_workers import same_snapshot, snapshot

__all__ = ["EvalConfig", "dropout_mlp", "evaluate_worker"]

KFAC = KFACConfig(damping=1e-2, factor_decay=0.9, kl_clip=1e-2)
DROPOUT = 0.3


@dataclass(frozen=True)
class EvalConfig:
    """One pipelined run to evaluate: schedule, D stages, N micro-batches per replica, W replicas, virtual stages."""

    schedule: str
    D: int
    N: int
    W: int
    v: int = 1

    @property
    def batch(self) -> int:
        return 2 * self.N * self.W


def dropout_mlp() -> nn.Module:
    """Four Linear blocks with dropout between them (train mode): eval() changes its loss."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for i in range(4):
        blocks += [nn.Linear(12, 12 if i < 3 else 5), nn.Tanh(), nn.Dropout(DROPOUT)]
    return nn.Sequential(*blocks[:-2])


def _batches(cfg: EvalConfig, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(cfg.batch, 12, generator=g), torch.randint(0, 5, (cfg.batch,), generator=g)) for _ in range(steps)
    ]


def _trainer(cfg: EvalConfig, example: torch.Tensor) -> Any:
    """K-FAC on the critical path, each layer's factors refreshed every 2 steps (captures at even steps)."""
    names = ["0", "3", "6", "9"]
    return fxkfac.compile(
        dropout_mlp(),
        (cfg.D, cfg.W),
        None,
        preconditioner=KFAC,
        example_inputs=(example,),
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        schedule=cfg.schedule,
        microbatches=cfg.N,
        layer_timing={n: LayerTiming(2, 0, 0, "fused") for n in names},
        backend=None,
        pipeline=PipelineOptions(virtual_stages=cfg.v, timeout=60),
    )


def _reference_loss(cfg: EvalConfig, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """The eager model in eval() with `params`: the mean over the run's N*W micro-batches of their loss."""
    with torch.random.fork_rng():  # dropout_mlp seeds its initialization: training's draws go on unchanged
        model = dropout_mlp().eval()
    model.load_state_dict(params)
    size = cfg.batch // (cfg.N * cfg.W)
    with torch.no_grad():
        losses = [F.cross_entropy(model(x[i : i + size]), y[i : i + size]) for i in range(0, cfg.batch, size)]
    return float(torch.stack(losses).double().mean())


def _all_params(trainer: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the pipelined model, gathered from the ranks that hold them (a test's reference only)."""
    mine = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for held in everyone for n, t in held.items()}


def evaluate_worker(rank: int, world: int, configs: list[EvalConfig]) -> list[dict[str, Any]]:
    """Per config: train a step, evaluate a held-out batch, train two more; and the same three steps without the
    evaluation. Returns the evaluation, its reference, what it changed and how the two runs' parameters differ."""
    out = []
    for cfg in configs:
        assert cfg.D * cfg.W == world
        batches = _batches(cfg, 3, seed=11)
        held_out = _batches(cfg, 1, seed=12)[0]
        evaluated = _trainer(cfg, batches[0][0])
        torch.manual_seed(5)  # the dropout masks training draws
        evaluated.step(*batches[0])
        before, rng = snapshot(evaluated), torch.get_rng_state()
        losses = [evaluated.evaluate(*held_out) for _ in range(2)]
        changed = same_snapshot(before, snapshot(evaluated)) + (
            [] if torch.equal(rng, torch.get_rng_state()) else ["rng"]
        )
        reference = _reference_loss(cfg, _all_params(evaluated), *held_out)
        for x, y in batches[1:]:
            evaluated.step(x, y)
        plain = _trainer(cfg, batches[0][0])
        torch.manual_seed(5)
        for x, y in batches:
            plain.step(x, y)
        mine = dict(plain.named_parameters())
        differ = [n for n, p in evaluated.named_parameters() if not torch.equal(p, mine[n])]
        out.append({"losses": losses, "reference": reference, "changed": changed, "differ": differ})
        dist.barrier()
    return out
