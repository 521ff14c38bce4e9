"""The README's save-and-relaunch as rank functions: one training script, launched twice (importable by spawned
ranks)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions
from tests.support import models

__all__ = ["STEPS", "SAVE_AT", "training_script"]

STEPS, SAVE_AT = 6, 3


class _Records(logging.Handler):
    """Keeps the messages of what plan="auto" showed (logger fxkfac.progress)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]


def training_script(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """A user's script, the same at every launch: compile with plan="auto" resuming from `ckpt` when it is there,
    train up to STEPS steps from where the trainer stands, save after step SAVE_AT. Returns the final parameters,
    where it started and what rank 0's plan="auto" showed."""
    records = _Records()
    progress = logging.getLogger("fxkfac.progress")
    progress.addHandler(records)
    progress.setLevel(logging.INFO)
    try:
        batches = _batches()
        torch.manual_seed(rank)  # the relaunch's RNG differs until the checkpoint restores the saved one
        trainer = fxkfac.compile(
            models.mlp(),
            (2, 1),
            "auto",
            example_inputs=(batches[0][0],),
            loss_fn=F.cross_entropy,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            preconditioner=KFACConfig(damping=1e-2, factor_decay=0.9, kl_clip=1e-2),
            schedule="1f1b",
            microbatches=2,
            backend=None,
            pipeline=PipelineOptions(timeout=60),
            plan_options=PlanOptions(time_limit_s=2.0, max_overhead=1.0),
            resume_from=ckpt,
        )
        started = trainer.steps
        for step in range(started, STEPS):
            trainer.step(*batches[step])
            if step + 1 == SAVE_AT:
                trainer.save_checkpoint(ckpt)
    finally:
        progress.removeHandler(records)
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return {"started": started, "params": params, "shown": records.messages}
