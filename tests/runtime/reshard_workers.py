"""Rank functions of the resharding tests (importable by spawned ranks): K-FAC MLP runs whose global batch of 8
is always split into the same 4 micro-batches of 2 (W x N = 4), so any layout computes the same step."""

from __future__ import annotations

from typing import Any

import torch

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.planner.problem.ir import LayerTiming
from tests.runtime import checkpoint_workers as cw
from tests.support import models

__all__ = [
    "STEPS",
    "TIMINGS",
    "mlp_run",
    "train",
    "params",
    "unit_states",
    "write_worker",
    "widen_worker",
    "narrow_worker",
]

STEPS = 6
MICROBATCHES_TOTAL = 4  # W x N of every layout here
TIMINGS = {
    n: LayerTiming(2, 0, 0, "fused") if i % 2 == 0 else LayerTiming(2, 1, 1, "deferred")
    for i, n in enumerate(cw.MLP_LAYERS)
}
"""Refreshes at even and odd steps; the odd ones used a step later: a checkpoint at step 2 holds pending inverses."""


def mlp_run(D: int, W: int, strategy: str = "comm-opt") -> Any:
    """This rank's trainer of the K-FAC MLP on a D x W mesh (critical-path programs, TIMINGS, `strategy`)."""
    return fxkfac.compile(
        models.mlp(),
        (D, W),
        None,
        preconditioner=cw.KFAC,
        example_inputs=(cw.mlp_batches(1)[0][0],),
        loss_fn=cw.mlp_loss,
        optimizer=cw._sgd,
        schedule="1f1b",
        microbatches=MICROBATCHES_TOTAL // W,
        backend=None,
        layer_timing=TIMINGS,
        pipeline=PipelineOptions(timeout=30.0),
        plan_options=PlanOptions(strategy=strategy),
    )


def train(trainer: Any, until: int) -> None:
    """Step `trainer` from its step to step `until` on the fixed batches."""
    for x, y in cw.mlp_batches(STEPS)[trainer.steps : until]:
        trainer.step(x, y)


def params(trainer: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters by FQN (copies)."""
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def unit_states(trainer: Any) -> dict[str, dict[str, Any]]:
    """The `state_dict` (copies) of each unit whose statistics this rank holds: under DP-KFAC only the owner's."""
    return {
        n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.state_dict().items()}
        for n, s in trainer.layer_states.items()
        if s.A is not None
    }


def _dp_kfac_resumes_exactly(ckpt: str) -> dict:
    """DP-KFAC at W=2 saved at step 2 (pending inverses) and trained on to the end, and the same layout resumed
    from the checkpoint to the end: the owners' saved unit states and what differs between the two final states."""
    local = mlp_run(1, 2, "dp-kfac")
    train(local, 2)
    local.save_checkpoint(ckpt)
    saved = unit_states(local)
    train(local, STEPS)
    again = mlp_run(1, 2, "dp-kfac")
    again.load_checkpoint(ckpt)
    train(again, STEPS)
    return {"dp_kfac_saved": saved, "dp_kfac_resumed": cw.same_snapshot(cw.snapshot(local), cw.snapshot(again))}


def _loads_owners_states(ckpt: str, W: int, strategy: str) -> dict[str, dict[str, Any]]:
    """DP-KFAC's W=2 checkpoint loaded at W under `strategy`: the unit states this rank holds then (it trains one
    step after, to show the loaded state runs; the algorithm changed, so no reference to compare with)."""
    trainer = mlp_run(1, W, strategy)
    trainer.load_checkpoint(ckpt)
    held = unit_states(trainer)
    train(trainer, trainer.steps + 1)
    return held


def write_worker(rank: int, world: int, dp_ckpt: str, pp_ckpt: str, mem_ckpt: str, dp_kfac_ckpt: str) -> dict:
    """2 ranks: data parallel W=2 saved at step 2 under COMM-OPT and MEM-OPT, and a 2-stage pipeline saved at step
    3, trained on to the end uninterrupted (the references); whether step 2's checkpoint holds pending inverses;
    DP-KFAC's checkpoint and same-layout resume (`_dp_kfac_resumes_exactly`)."""
    mem = mlp_run(1, 2, "mem-opt")
    train(mem, 2)
    mem.save_checkpoint(mem_ckpt)
    dp = mlp_run(1, 2)
    train(dp, 2)
    dp.save_checkpoint(dp_ckpt)
    pending = sorted(n for n, s in dp.layer_states.items() if s.pending)
    train(dp, STEPS)
    pp = mlp_run(2, 1)
    train(pp, 3)
    pp.save_checkpoint(pp_ckpt)
    train(pp, STEPS)
    return {"dp": params(dp), "pp": params(pp), "pending": pending, **_dp_kfac_resumes_exactly(dp_kfac_ckpt)}


def widen_worker(
    rank: int,
    world: int,
    dp_ckpt: str,
    pp_ckpt: str,
    mem_ckpt: str,
    wide_ckpt: str,
    hybrid_ckpt: str,
    dp_kfac_ckpt: str,
) -> dict:
    """4 ranks: W=2's checkpoints resumed at W=4 (COMM-OPT's under COMM-OPT, MEM-OPT's under HYBRID 0.5), trained
    to step 4 and saved; the pipeline's (pp=2, W=1) resumed at pp=1, W=4 and trained to the end; DP-KFAC's loaded
    under DP-KFAC at W=4."""
    wide = mlp_run(1, 4)
    wide.load_checkpoint(dp_ckpt)
    loaded = wide.steps
    pending = sorted(n for n, s in wide.layer_states.items() if s.pending)
    train(wide, 4)
    wide.save_checkpoint(wide_ckpt)
    hybrid = mlp_run(1, 4, "hybrid:0.5")
    hybrid.load_checkpoint(mem_ckpt)
    train(hybrid, 4)
    hybrid.save_checkpoint(hybrid_ckpt)
    flat = mlp_run(1, 4)
    flat.load_checkpoint(pp_ckpt)
    from_pp = flat.steps
    train(flat, STEPS)
    return {
        "loaded": loaded,
        "pending": pending,
        "from_pp": from_pp,
        "pp": params(flat),
        "dp_kfac": _loads_owners_states(dp_kfac_ckpt, 4, "dp-kfac"),
    }


def narrow_worker(rank: int, world: int, wide_ckpt: str, hybrid_ckpt: str, dp_kfac_ckpt: str) -> dict:
    """2 ranks: W=4's checkpoints resumed at W=2 (HYBRID's under MEM-OPT) and trained to the end; DP-KFAC's W=2
    checkpoint loaded under COMM-OPT."""
    dp = mlp_run(1, 2)
    dp.load_checkpoint(wide_ckpt)
    loaded = dp.steps
    train(dp, STEPS)
    mem = mlp_run(1, 2, "mem-opt")
    mem.load_checkpoint(hybrid_ckpt)
    train(mem, STEPS)
    return {
        "loaded": loaded,
        "dp": params(dp),
        "mem": params(mem),
        "dp_kfac": _loads_owners_states(dp_kfac_ckpt, 2, "comm-opt"),
    }
