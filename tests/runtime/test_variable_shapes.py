"""Variable input shapes: steps whose batch size or sequence length differ from example_inputs train pipelined
(2 ranks) as one process does, K-FAC statistics weighted by each step's own samples (fxkfac/shapes.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import fxkfac
from fxkfac.config import KFACConfig, PipelineOptions
from fxkfac.errors import ConfigError
from fxkfac.planner.problem.ir import LayerTiming
from tests.support.distributed import run_distributed
from tests.support.kfac_reference import KFACReference

VOCAB, N, LR = 11, 2, 0.05
SHAPES = [(8, 6), (8, 6), (8, 4), (4, 6), (8, 8), (8, 6), (4, 4)]
"""(batch, sequence) per step: the example's, a shorter sequence, a shorter last batch, a longer sequence (more
work than planned: logged), back to the example's, both shorter."""
KFAC = KFACConfig(damping=0.01, kl_clip=0.01, skip_vocab_head=False)
TIMINGS = {
    "1": LayerTiming(2, 0, 1, "fused"),
    "3": LayerTiming(1, 0, 0, "deferred"),
    "5": LayerTiming(2, 1, 1, "deferred"),
}
"""Fused and deferred captures, inverses used a step after their refresh (captured at one shape, used at another)."""


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Embedding(VOCAB, 16),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16, bias=False),
        nn.Tanh(),
        nn.Linear(16, VOCAB),
    )


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _batches(shapes: list[tuple[int, int]] = SHAPES) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, s, generator=g), torch.randint(0, VOCAB, s, generator=g)) for s in shapes]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.5)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _compile(mesh: tuple[int, int] | None, kfac: bool, schedule: str = "gpipe", **pipeline: int) -> fxkfac.Trainer:
    return fxkfac.compile(
        _model(),
        mesh,
        None,
        example_inputs=(_batches()[0][0],),
        loss_fn=_loss,
        optimizer=_sgd if kfac else _adamw,
        backend=None,
        schedule=schedule,
        microbatches=N,
        preconditioner=KFAC if kfac else None,
        layer_timing=TIMINGS if kfac else None,
        pipeline=PipelineOptions(timeout=60.0, **pipeline),
    )


def _train(trainer: fxkfac.Trainer) -> tuple[dict[str, Tensor], list[float]]:
    losses = [float(trainer.step(x, y)) for x, y in _batches()]
    return {n: copy.deepcopy(p.detach()) for n, p in trainer.named_parameters()}, losses


def _worker(
    rank: int, world: int, cases: list[tuple[bool, str, tuple[int, int]]]
) -> list[tuple[dict[str, Tensor], list[float], int]]:
    out = []
    for kfac, schedule, mesh in cases:
        trainer = _compile(mesh, kfac, schedule)
        params, losses = _train(trainer)
        out.append((params, losses, len(trainer.shapes)))
        dist.barrier()
    return out


def _kfac_reference() -> tuple[dict[str, Tensor], list[float]]:
    """Single-process K-FAC on the eager model, each step's statistics from that step's batch."""
    model = _model()
    ref = KFACReference(model, _compile(None, True).units, KFAC, _loss, N, TIMINGS, _sgd)
    losses = []
    for t, (x, y) in enumerate(_batches()):
        with torch.no_grad():
            losses.append(float(_loss(model(x), y)))
        ref.step(t, x, y)
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def _plain_reference() -> tuple[dict[str, Tensor], list[float]]:
    """Single-process AdamW on the eager model, each step's loss the mean of its micro-batches' losses."""
    model = _model()
    opt = _adamw(list(model.parameters()))
    losses = []
    for x, y in _batches():
        loss = sum(_loss(model(xm), ym) for xm, ym in zip(x.chunk(N), y.chunk(N), strict=True)) / N
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


@pytest.mark.multiproc
def test_shorter_batches_and_sequences_train_pipelined_as_one_process() -> None:
    """K-FAC (GPipe over 2 stages, and 2 replicas of one stage) and AdamW (1F1B; Chimera, whose ranks hold two stage
    copies each with its own weights), steps of five shapes, equal one process to 1e-5."""
    cases = [(True, "gpipe", (2, 1)), (True, "gpipe", (1, 2)), (False, "1f1b", (2, 1)), (False, "chimera", (2, 1))]
    results = run_distributed(_worker, 2, cases, timeout=400)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    start = dict(_model().named_parameters())
    wants = {True: _kfac_reference(), False: _plain_reference()}
    for i, (kfac, schedule, mesh) in enumerate(cases):
        want = wants[kfac]
        want_params, want_losses = want
        assert max(float((want_params[n] - p.detach()).abs().max()) for n, p in start.items()) > 1e-2
        for r in results:
            params, losses, shapes = r.value[i]
            assert shapes == len(set(SHAPES)) - 1, "each shape other than the example's is captured once"
            torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-5)
            for name, p in params.items():
                torch.testing.assert_close(p, want_params[name], rtol=0, atol=1e-5, msg=f"{schedule} {mesh} {name}")


def test_one_device_with_a_cache_of_one_shape_equals_reference(caplog: pytest.LogCaptureFixture) -> None:
    """Dropping shapes from the cache and capturing them again trains the same; more work than planned is logged
    once per capture."""
    trainer = _compile(None, True, shape_cache_size=1)
    with caplog.at_level(logging.INFO, logger="fxkfac.runtime.trainer"):
        params, losses = _train(trainer)
    assert len(trainer.shapes) == 1
    want_params, want_losses = _kfac_reference()
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-5)
    for name, p in params.items():
        torch.testing.assert_close(p, want_params[name], rtol=0, atol=1e-5)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "[8, 8]" in warned[0] and "133%" in warned[0], warned


def test_other_shapes_are_refused_with_a_message_the_user_can_act_on() -> None:
    trainer = _compile(None, False, shape_cache_size=0)
    x, y = _batches([(8, 4)])[0]
    with pytest.raises(ConfigError, match="shape_cache_size=0"):
        trainer.step(x, y)
    trainer = _compile(None, False)
    x, y = _batches([(7, 6)])[0]
    with pytest.raises(ConfigError, match=r"does not divide the mini-batch of 7 samples .*drop_last=True"):
        trainer.step(x, y)
    with pytest.raises(ConfigError, match="not the number, rank or dtype"):
        trainer.step(x[:6].float(), y[:6])
    with pytest.raises(ConfigError, match="shape_cache_size must be an int >= 0"):
        PipelineOptions(shape_cache_size=-1)
