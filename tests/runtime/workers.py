"""Rank functions and single-process references for the pipeline runtime tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxkfac
from fxkfac.config import PipelineOptions, StepAgreement
from fxkfac.runtime.step_end import StepLoss
from tests.support import models

__all__ = [
    "Config",
    "make_model",
    "make_batches",
    "make_optimizer",
    "loss_for",
    "reference_run",
    "parity_worker",
    "failure_worker",
    "timeline_worker",
    "tied_overflow_worker",
]

STEPS = 3


@dataclass(frozen=True)
class Config:
    """One pipelined run: schedule, D stages, N micro-batches, W replicas, model and optimizer names, virtual
    stages, and which ranks agree on a step's end."""

    schedule: str
    D: int
    N: int
    W: int
    model: str
    opt: str
    v: int = 1
    agreement: StepAgreement = StepAgreement.WORLD

    @property
    def batch(self) -> int:
        """Global batch: one sample per micro-batch per replica, twice."""
        return 2 * self.N * self.W


def make_model(name: str) -> torch.nn.Module:
    """A fresh model (fixed seed) by name: mlp, mlp6 (6 Linear blocks), bert, gpt2."""
    if name == "mlp":
        return models.mlp()
    if name == "mlp6":
        torch.manual_seed(0)
        layers = [torch.nn.Linear(12, 12) if i % 2 == 0 else torch.nn.Tanh() for i in range(11)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(12, 5))
    return models.tiny_bert(layers=2) if name == "bert" else models.tiny_gpt2(layers=2)  # default configs


def make_batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global mini-batches for the model of `cfg`."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for step in range(STEPS):
        if cfg.model.startswith("mlp"):
            out.append((torch.randn(cfg.batch, 12, generator=g), torch.randint(0, 5, (cfg.batch,), generator=g)))
        else:
            out.append(models.token_batch(cfg.batch, seed=step))
    return out


def loss_for(model: str):
    """The loss function of `model`: cross-entropy over classes or over the vocabulary per token."""
    if model.startswith("mlp"):
        return lambda out, y: F.cross_entropy(out, y)
    return lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def make_optimizer(name: str):
    """An optimizer factory: SGD with momentum or AdamW.

    AdamW uses eps=1e-6: attention key biases have a mathematically zero gradient (softmax is
    shift-invariant), so their float gradient is pure rounding noise of ~1e-10, which eps=1e-8
    would amplify into O(lr) updates that no two summation orders reproduce.
    """
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-6)


def reference_run(cfg: Config) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process training of the eager model on the same mini-batches: its parameters and losses."""
    model = make_model(cfg.model)
    opt = make_optimizer(cfg.opt)(list(model.parameters()))
    loss_fn = loss_for(cfg.model)
    losses = []
    for x, y in make_batches(cfg):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def parity_worker(rank: int, world: int, configs: list[Config]) -> list[dict]:
    """Run each config whose mesh fits `world`; return per config this rank's params and losses."""
    results = []
    for cfg in configs:
        assert cfg.D * cfg.W == world
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
            pipeline=PipelineOptions(virtual_stages=cfg.v, timeout=60, step_agreement=cfg.agreement),
        )
        returned = [trainer.step(x, y) for x, y in batches]
        params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
        results.append(
            {
                "params": params,
                "losses": [float(loss) for loss in returned],
                "summed_in_flight": [isinstance(loss, StepLoss) for loss in returned],
                "aliases": trainer.spec.split.param_aliases,
            }
        )
        dist.barrier()
    return results


def failure_worker(rank: int, world: int, mode: str, victim: int) -> str:
    """Train a 2-stage 1F1B MLP; on step 1 the victim rank dies (os._exit) or stalls (sleeps)."""
    cfg = Config("1f1b", world, 2, 1, "mlp", "sgd")
    batches = make_batches(cfg)
    trainer = fxkfac.compile(
        make_model("mlp"),
        (world,),
        None,
        example_inputs=(batches[0][0],),
        loss_fn=loss_for("mlp"),
        optimizer=make_optimizer("sgd"),
        preconditioner=None,
        backend=None,
        schedule="1f1b",
        microbatches=2,
        pipeline=PipelineOptions(timeout=5),
    )
    trainer.step(*batches[0])
    if rank == victim:
        if mode == "die":
            os._exit(3)
        time.sleep(8)  # longer than the peers' 5 s timeout
        return "stalled"
    trainer.step(*batches[1])
    return "finished"


def timeline_worker(rank: int, world: int, path: str) -> dict:
    """Two recorded 1F1B steps on a 2-stage MLP; rank 0 writes the merged Chrome trace to `path`."""
    from fxkfac.runtime.timeline import gather_timelines, utilization

    cfg = Config("1f1b", world, 4, 1, "mlp", "sgd")
    batches = make_batches(cfg)
    trainer = fxkfac.compile(
        make_model("mlp"),
        (world,),
        None,
        example_inputs=(batches[0][0],),
        loss_fn=loss_for("mlp"),
        optimizer=make_optimizer("sgd"),
        preconditioner=None,
        backend=None,
        schedule="1f1b",
        microbatches=4,
        pipeline=PipelineOptions(record_timeline=True),
    )
    for x, y in batches[:2]:
        trainer.step(x, y)
    local = [(e.op, e.step, e.start_ns, e.end_ns) for e in trainer.timeline.events]
    waits = [(e.kind, e.end_ns - e.start_ns, e.wait_ns, e.cpu_ns) for e in trainer.timeline.events]
    events = gather_timelines(trainer.timeline, world)
    trainer.trace(path if rank == 0 else None)
    return {
        "local": local,
        "waits": waits,
        "program": [str(op) for op in trainer.ops_at(0)],
        "utilization": utilization(events) if events is not None else None,
    }


def tied_overflow_worker(rank: int, world: int) -> dict:
    """GPT-2 (tied wte/lm_head on stages 0 and 1), 1F1B D=2, without a preconditioner and with K-FAC on the
    critical path. At step 1 each micro-batch's gradient of the tied weight is 1e38, so each stage's part is 2e38
    (finite) and their sum overflows. Returns per run this rank's params before and after that step, and its
    skipped-step count."""
    from fxkfac.config import KFACConfig

    cfg = Config("1f1b", world, 2, 1, "gpt2", "sgd")
    batches = make_batches(cfg)
    out = {}
    for kfac in (None, KFACConfig()):
        trainer = fxkfac.compile(
            make_model("gpt2"),
            (world,),
            None,
            example_inputs=(batches[0][0],),
            loss_fn=loss_for("gpt2"),
            optimizer=make_optimizer("sgd"),
            preconditioner=kfac,
            schedule="1f1b",
            microbatches=2,
            backend=None,
            pipeline=PipelineOptions(timeout=60),
        )
        tied = set(trainer.spec.split.shared_params)
        overflow = {"on": False}
        for runner in trainer.runners.values():
            for name, param in runner.module.named_parameters():
                if name in tied:
                    param.register_hook(lambda g, o=overflow: torch.full_like(g, 1e38) if o["on"] else g)
        trainer.step(*batches[0])
        before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
        overflow["on"] = True
        trainer.step(*batches[1])
        after = {n: p.detach().clone() for n, p in trainer.named_parameters()}
        out["kfac" if kfac else "plain"] = {
            "tied": sorted(tied),
            "before": before,
            "after": after,
            "skipped": trainer.skipped_steps,
            "steps": trainer.steps,
        }
    return out
