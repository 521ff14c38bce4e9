"""What the Muon tests share: the models, the compile call, hand-edited programs (streamed and piecewise APPLY)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac import compile_api
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.muon import MuonConfig
from fxkfac.planner.problem.ir import Op, Programs
from tests.support.models import VOCAB, mlp, mlp_batches, tiny_llama, token_batch

LR = 0.02
STEPS = 5
MATRICES = ("0.weight", "2.weight")
"""mlp()'s hidden matrices: its last Linear (4) is the output head, which goes to AdamW with the biases."""


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def mlp6(*, seed: int = 0) -> nn.Module:
    """Six Linear layers (four stages of interleaved D=2 v=2 each get at least one)."""
    torch.manual_seed(seed)
    widths = [12, 16, 16, 16, 16, 16, 5]
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(widths[i], widths[i + 1]), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def llama_loss(out: Any, y: Tensor) -> Tensor:
    """Token cross-entropy of a Hugging Face causal LM's output."""
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def llama_batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    """`steps` deterministic token batches for `tiny_llama()`."""
    return [token_batch(4, seed=s) for s in range(steps)]


DATA: dict[str, tuple[Callable[[int], list[tuple[Tensor, Tensor]]], Callable[[Any, Tensor], Tensor]]] = {
    "mlp": (mlp_batches, F.mse_loss),
    "mlp6": (mlp_batches, F.mse_loss),
    "llama": (llama_batches, llama_loss),
}
"""Each model's batches and loss."""
MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "mlp6": lambda: mlp6(), "llama": tiny_llama}


def train(
    cfg: MuonConfig,
    mesh: tuple[int, int] | None,
    *,
    schedule: str = "1f1b",
    model: str = "mlp",
    microbatches: int = 2,
    v: int = 1,
    strategy: str | None = None,
) -> dict[str, Tensor]:
    """The parameters after STEPS steps of `model` under Muon (plan=None: each stage's APPLY on its own rank; how a
    stage's copies share its units' APPLYs by `strategy`, planner/problem/strategy.py)."""
    batches, loss = DATA[model]
    trainer = fxkfac.compile(
        MODELS[model](),
        mesh,
        None,
        example_inputs=(batches(1)[0][0],),
        loss_fn=loss,
        optimizer=sgd,
        backend=None,
        schedule=schedule,
        microbatches=microbatches,
        preconditioner=cfg,
        pipeline=PipelineOptions(timeout=60.0, virtual_stages=v),
        plan_options=PlanOptions(strategy=strategy),
    )
    for x, y in batches(STEPS):
        trainer.step(x, y)
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


@contextmanager
def edited_programs(edit: Callable[[Programs], Programs]) -> Iterator[None]:
    """Within the block, `compile(..., plan=None)` runs `edit` of the programs it would run (hand-made plans)."""
    original = compile_api._critical_path_programs

    def patched(*args: Any, **kwargs: Any) -> Programs:
        return edit(original(*args, **kwargs))

    compile_api._critical_path_programs = patched
    try:
        yield
    finally:
        compile_api._critical_path_programs = original


def replace_apply(programs: Programs, rank: int, stage: int, ops: Callable[[Op], list[Op]]) -> Programs:
    """`programs` with each ``APPLY s<stage>`` of `rank` replaced by `ops(apply)`."""
    out = dict(programs)
    out[rank] = [
        [new for op in step for new in (ops(op) if op.kind.value == "APPLY" and op.stage == stage else [op])]
        for step in programs[rank]
    ]
    return out
